"""The regional relay (issue 15) as real processes on loopback: an origin, relays, subscribers.

Each test asserts what a region sees: versions through a relay byte-identical to the origin's,
the same numbers and lineage, each object crossing the upstream link once however many ask,
writes refused with the upstream named, reports reaching the origin's ledger.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from _client_util import Server, start_server, stop_server
from _relay_util import (
    Versions,
    metric,
    object_gets,
    start_relay,
    store_objects,
    tree,
    versions,
    wait_for,
    wait_head,
)

from weightsync import errors
from weightsync.client import Subscriber
from weightsync.client._http import Api
from weightsync.codec import Manifest


@pytest.fixture
def origin(tmp_path: Path) -> Iterator[Server]:
    srv = start_server(tmp_path / "origin")
    try:
        yield srv
    finally:
        stop_server(srv)


@pytest.fixture
def relays(tmp_path: Path) -> Iterator[list[Server]]:
    """Relays a test starts (append to the list); all stopped after it."""
    started: list[Server] = []
    try:
        yield started
    finally:
        for r in reversed(started):  # downstream first: an upstream waits for open event streams
            stop_server(r)


def pull(url: str, model: str, into: Path, version: int | None = None) -> dict[str, str]:
    Subscriber(url, model).pull(into, version)
    return tree(into)


def manifest_objects(url: str, model: str, number: int) -> dict[str, int]:
    data = httpx.get(f"{url}/v1/models/{model}/versions/{number}/manifest").content
    return Manifest.decode(data).objects()


def test_pulls_through_a_relay_are_the_origins_and_cross_the_link_once(
    origin: Server, relays: list[Server], tmp_path: Path
) -> None:
    model = "policy"
    pub = Versions(origin.url, model, tmp_path)
    for _ in range(3):
        pub.publish()
    relay = start_relay(tmp_path / "relay", origin.url)
    relays.append(relay)
    wait_head(relay.url, model, 3)

    # The same versions: numbers, lineage, manifests, commit times.
    assert versions(relay.url, model) == versions(origin.url, model)
    fetched = object_gets(origin.url)
    needed = {d for n in (1, 2, 3) for d in manifest_objects(origin.url, model, n)}
    assert fetched == len(needed)  # the chain was prefetched, each object once
    # The bytes that crossed the link are exactly the versions' manifests and objects, once.
    manifests = sum(len(httpx.get(f"{origin.url}/v1/models/{model}/versions/{n}/manifest").content) for n in (1, 2, 3))
    objects = sum(int(httpx.head(f"{origin.url}/v1/objects/{d}").headers["content-length"]) for d in needed)
    assert metric(relay.url, "weightsync_relay_upstream_bytes_total") == manifests + objects

    # Three subscribers in the region pull every version through the relay: byte-identical, and the
    # origin sees no object request from them.
    expected = {n: pull(origin.url, model, tmp_path / f"origin-v{n}", n) for n in (1, 3)}
    before = object_gets(origin.url)
    for i in range(3):
        assert pull(relay.url, model, tmp_path / f"sub{i}", 1) == expected[1]
        assert pull(relay.url, model, tmp_path / f"sub{i}", 3) == expected[3]
    assert object_gets(origin.url) == before
    assert metric(relay.url, "weightsync_relay_object_requests_total", result="miss") == 0

    # A new version reaches a watcher of the relay only once it is whole here: its pull needs nothing upstream.
    sub = Subscriber(relay.url, model)
    sub.pull(tmp_path / "follower")
    v4 = pub.publish()
    seen = next(iter(sub.watch(after=3, timeout=30)))
    assert seen.number == v4
    before = object_gets(origin.url)
    sub.pull(tmp_path / "follower")
    assert object_gets(origin.url) == before
    assert tree(tmp_path / "follower") == pull(origin.url, model, tmp_path / "origin-v4", v4)
    lag = metric(relay.url, "weightsync_relay_prefetch_lag_seconds_count")
    assert lag == 4

    # The CLI, unchanged, with --server pointing at the relay.
    def cli(*args: str) -> dict:
        done = subprocess.run(
            [sys.executable, "-m", "weightsync", *args, "--server", relay.url, "--json"],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        return json.loads(done.stdout)

    assert [v["number"] for v in cli("log", model)["versions"]] == [1, 2, 3, 4]
    assert cli("pull", model, str(tmp_path / "cli"))["version"] == 4
    assert tree(tmp_path / "cli") == tree(tmp_path / "follower")

    # The dashboard is served by the relay too (its own catalog: the versions it mirrored).
    page = httpx.get(f"{relay.url}/ui/models/{model}", headers={"accept": "text/html"}, timeout=30)
    assert page.status_code == 200 and f"<h1>{model}</h1>" in page.text and 'data-version="4"' in page.text
    assert httpx.get(f"{relay.url}/ui/static/ui.css", timeout=30).status_code == 200


def test_a_chained_relay_needs_no_special_case(origin: Server, relays: list[Server], tmp_path: Path) -> None:
    model = "Org/chained"
    pub = Versions(origin.url, model, tmp_path)
    pub.publish()
    region = start_relay(tmp_path / "region", origin.url, args=["--site", "region"])
    relays.append(region)
    rack = start_relay(tmp_path / "rack", region.url, args=["--site", "rack"])
    relays.append(rack)
    pub.publish()
    wait_head(rack.url, model, 2)
    assert versions(rack.url, model) == versions(origin.url, model)
    got = pull(rack.url, model, tmp_path / "rack-sub")
    # Every object crossed each link once: the origin served each to the region relay alone.
    needed = {d for n in (1, 2) for d in manifest_objects(origin.url, model, n)}
    assert object_gets(origin.url) == len(needed)
    assert metric(region.url, "weightsync_relay_upstream_fetches_total") == len(needed)
    assert metric(rack.url, "weightsync_relay_upstream_fetches_total") == len(needed)
    assert got == pull(origin.url, model, tmp_path / "origin-sub")

    # The origin lists both relays, the rack's heartbeat forwarded by the region's.
    def listed() -> dict[str, object]:
        with Api(origin.url) as api:
            found = {r.name: r for r in api.list_relays()}
        ok = {"relay@region", "relay@rack"} <= set(found) and all(
            r.models.get(model) is not None and r.models[model].version == 2 for r in found.values()
        )
        return found if ok else {}

    found = wait_for("both relays at the origin", listed)
    assert (found["relay@region"].site, found["relay@region"].upstream) == ("region", origin.url)
    assert (found["relay@rack"].site, found["relay@rack"].upstream) == ("rack", region.url)
    assert not found["relay@rack"].degraded and found["relay@rack"].age_s < 60
    listing = subprocess.run(
        [sys.executable, "-m", "weightsync", "relays", "--server", origin.url],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "relay@rack" in listing and "relay@region" in listing and f"{model} v2" in listing

    # A model deleted at the origin stops being served down the whole chain (its event streams end).
    with Api(origin.url) as api:
        api.delete_model(model)
    for relay in (region, rack):
        wait_for(
            f"{model} deleted on {relay.url}",
            lambda relay=relay: httpx.get(f"{relay.url}/v1/models/{model}", timeout=10).status_code == 404,
        )


def test_misses_are_fetched_once_for_any_number_of_concurrent_requests(
    origin: Server, relays: list[Server], tmp_path: Path
) -> None:
    model = "late-joiner"
    pub = Versions(origin.url, model, tmp_path)
    pub.publish()
    pub.publish()
    pub.publish(keyframe=True)  # v3 starts a new chain: v1 and v2 are history the relay does not prefetch
    relay = start_relay(tmp_path / "relay", origin.url)
    relays.append(relay)
    wait_head(relay.url, model, 3)
    old = manifest_objects(origin.url, model, 1)
    digest = max(old, key=old.get)
    whole = httpx.get(f"{origin.url}/v1/objects/{digest}").content
    assert hashlib.sha256(whole).hexdigest() == digest
    before = object_gets(origin.url)

    # A HEAD is answered from the relay's catalog, without fetching.
    assert int(httpx.head(f"{relay.url}/v1/objects/{digest}").headers["content-length"]) == len(whole)

    size = len(whole)
    ranges = [None, "bytes=0-99", f"bytes={size // 2}-", f"bytes=-{min(size, 10)}"] * 4

    def get(r: str | None) -> tuple[int, bytes]:
        resp = httpx.get(f"{relay.url}/v1/objects/{digest}", headers={"Range": r} if r else {}, timeout=60)
        return resp.status_code, resp.content

    with concurrent.futures.ThreadPoolExecutor(len(ranges)) as pool:
        answers = list(pool.map(get, ranges))
    for r, (code, body) in zip(ranges, answers, strict=True):
        if r is None:
            assert (code, body) == (200, whole)
        else:
            spec = r.removeprefix("bytes=")
            a, _, b = spec.partition("-")
            want = whole[-int(b) :] if a == "" else whole[int(a) : (int(b) + 1 if b else None)]
            assert (code, body) == (206, want)
    assert object_gets(origin.url) == before + 1  # one upstream fetch for 16 concurrent requests
    assert metric(relay.url, "weightsync_relay_upstream_fetches_total") >= 1
    # The old version pulls through the relay byte-identical; its other objects are fetched once each.
    assert pull(relay.url, model, tmp_path / "old", 1) == pull(origin.url, model, tmp_path / "origin-old", 1)
    again = object_gets(origin.url)
    pull(relay.url, model, tmp_path / "old-2", 1)
    assert object_gets(origin.url) == again
    # An object no mirrored version names is not fetched for anyone.
    stranger = "ab" * 32
    assert httpx.get(f"{relay.url}/v1/objects/{stranger}").status_code == 404


def test_writes_to_a_relay_are_refused_naming_the_upstream(
    origin: Server, relays: list[Server], tmp_path: Path
) -> None:
    model = "refused"
    Versions(origin.url, model, tmp_path).publish()
    relay = start_relay(tmp_path / "relay", origin.url)
    relays.append(relay)
    wait_head(relay.url, model, 1)

    with pytest.raises(errors.ReadOnly) as caught:
        Versions(relay.url, model, tmp_path / "via-relay").publish()
    assert caught.value.upstream == origin.url
    assert origin.url in str(caught.value)

    for method, path in [
        ("POST", f"/v1/models/{model}/publishes"),
        ("POST", f"/v1/models/{model}/versions"),
        ("POST", "/v1/models"),
        ("PATCH", f"/v1/models/{model}"),
        ("DELETE", f"/v1/models/{model}"),
        ("PUT", f"/v1/models/{model}/pin"),
        ("PUT", "/v1/objects/" + "0" * 64),
    ]:
        r = httpx.request(method, relay.url + path, json={})
        assert r.status_code == 405, (method, path, r.text)
        assert r.headers["content-type"].startswith("application/problem+json")
        assert r.json()["type"].endswith("/read-only")
        assert r.json()["upstream"] == origin.url
    # The SDK's one-request publish is told the same (not taken for an older server without the route).
    with Api(relay.url) as api, pytest.raises(errors.ReadOnly):
        api.publish_version(
            model,
            parent=1,
            step=None,
            metadata=None,
            keyframe=True,
            objects={"0" * 64: b""},
            manifest="0" * 64,
            idempotency_key="k",
        )
    assert versions(relay.url, model) == versions(origin.url, model)

    # The CLI: one line naming the upstream, a non-zero exit.
    src = tmp_path / "src-refused"
    cli = subprocess.run(
        [sys.executable, "-m", "weightsync", "push", model, str(src), "--server", relay.url],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode != 0
    assert origin.url in cli.stderr and len(cli.stderr.strip().splitlines()) == 1


def test_replica_reports_reach_the_origin_with_the_relays_site(
    origin: Server, relays: list[Server], tmp_path: Path
) -> None:
    model = "ledger"
    Versions(origin.url, model, tmp_path).publish()
    relay = start_relay(tmp_path / "relay", origin.url, args=["--site", "eu-west"])
    relays.append(relay)
    wait_head(relay.url, model, 1)
    Subscriber(relay.url, model, name="eu-node-1").pull(tmp_path / "sub")

    def at_origin() -> list[dict]:
        got = httpx.get(f"{origin.url}/v1/models/{model}/replicas").json()["replicas"]
        return [r for r in got if r["subscriber"] == "eu-node-1"]

    entry = wait_for("the report at the origin", at_origin)[0]
    assert entry["version"] == 1 and entry["site"] == "eu-west"
    assert entry["extra"]["relay"] == "eu-west"
    local = httpx.get(f"{relay.url}/v1/models/{model}/replicas").json()["replicas"]
    assert [r["subscriber"] for r in local] == ["eu-node-1"]
    # The relay itself is in the origin's ledger: its site, the version it holds, its prefetch lag.
    everyone = httpx.get(f"{origin.url}/v1/models/{model}/replicas").json()["replicas"]
    relay_entry = next(r for r in everyone if r["subscriber"] == "relay@eu-west")
    assert relay_entry["version"] == 1 and relay_entry["site"] == "eu-west" and relay_entry["lag"] == 0
    assert relay_entry["extra"]["role"] == "relay" and relay_entry["extra"]["prefetch_lag_s"] >= 0


def test_a_relay_keeps_serving_through_an_upstream_outage_and_catches_up(
    origin: Server, relays: list[Server], tmp_path: Path
) -> None:
    from _relay_util import restart_origin

    model = "outage"
    pub = Versions(origin.url, model, tmp_path)
    pub.publish()
    relay = start_relay(tmp_path / "relay", origin.url)
    relays.append(relay)
    wait_head(relay.url, model, 1)
    expected = pull(origin.url, model, tmp_path / "expected")
    assert httpx.get(f"{relay.url}/readyz").json()["degraded"] is False

    stop_server(origin)
    ready = wait_for(
        "readyz degraded", lambda: (r := httpx.get(f"{relay.url}/readyz")).json()["degraded"] and r, timeout=30
    )
    assert ready.status_code == 200 and ready.json()["upstream"] is False
    assert metric(relay.url, "weightsync_relay_upstream_up") == 0
    assert pull(relay.url, model, tmp_path / "during") == expected  # what it holds is served

    back = restart_origin(origin, tmp_path / "origin")
    origin.proc = back.proc  # the fixture stops the new process
    pub.publish()
    wait_head(relay.url, model, 2)
    wait_for("readyz not degraded", lambda: httpx.get(f"{relay.url}/readyz").json()["degraded"] is False)
    assert pull(relay.url, model, tmp_path / "after") == pull(origin.url, model, tmp_path / "expected-2")


def test_a_relay_killed_mid_prefetch_completes_after_a_restart(
    origin: Server, relays: list[Server], tmp_path: Path
) -> None:
    from _proxy import Proxy

    model = "killed"
    pub = Versions(origin.url, model, tmp_path, tensors=40)  # ~0.5 MB of incompressible bytes
    pub.publish()
    host, port = origin.url.removeprefix("http://").split(":")
    proxy = Proxy((host, int(port)), rate=64 << 10)  # 64 KiB/s: the prefetch takes seconds
    try:
        relay = start_relay(tmp_path / "relay", proxy.url)
        relays.append(relay)
        wait_for("the prefetch under way", lambda: proxy.down > 150_000, timeout=60)
        # Nothing of the version is visible before all of it is here.
        assert httpx.get(f"{relay.url}/v1/models/{model}/versions/latest").status_code == 404
        relay.proc.kill()  # SIGKILL in the middle of an object
        relay.proc.wait()
        # Whatever it wrote is whole and named by its bytes; the version is not in its catalog.
        for name, data in store_objects(relay.data).items():
            assert hashlib.sha256(data).hexdigest() == name
        proxy.rate = None
        again = start_relay(tmp_path / "relay", proxy.url)
        relays.append(again)
        wait_head(again.url, model, 1)
        assert pull(again.url, model, tmp_path / "sub") == pull(origin.url, model, tmp_path / "expected")
        for name, data in store_objects(again.data).items():
            assert hashlib.sha256(data).hexdigest() == name
    finally:
        proxy.close()


def test_a_chain_read_through_the_relay_is_leased_at_the_origin(
    origin: Server, relays: list[Server], tmp_path: Path
) -> None:
    # Two models alike; only "leased" has a reader on its old chain at the relay.
    for model in ("leased", "unleased"):
        pub = Versions(origin.url, model, tmp_path)
        pub.publish()
        pub.publish()
        pub.publish(keyframe=True)  # v1, v2: an old chain, history the relay has not fetched
        assert httpx.patch(f"{origin.url}/v1/models/{model}", json={"keep_last": 1}).status_code == 200
    relay = start_relay(tmp_path / "relay", origin.url)
    relays.append(relay)
    wait_head(relay.url, "leased", 3)
    wait_head(relay.url, "unleased", 3)
    plan = httpx.get(f"{relay.url}/v1/models/leased/plan", params={"want": 1, "holder": "late-joiner"})
    assert plan.status_code == 200 and plan.json()["target"] == 1
    wait_for("the upstream lease", lambda: metric(relay.url, "weightsync_relay_upstream_leases") == 1)
    # The origin's retention keeps the chain the relay's reader holds, and only that one.
    gc = httpx.post(f"{origin.url}/v1/admin/gc", json={"dry_run": False, "grace_s": 0}).json()
    assert gc["versions_deleted"] == {"unleased": [1, 2]}
    assert pull(relay.url, "leased", tmp_path / "old", 1) == pull(origin.url, "leased", tmp_path / "origin-old", 1)


def test_eviction_drops_old_chains_bytes_and_a_late_reader_gets_them_again(
    origin: Server, relays: list[Server], tmp_path: Path
) -> None:
    model = "evicted"
    relay = start_relay(
        tmp_path / "relay", origin.url, args=["--evict-keep", "1"], env={"WEIGHTSYNC_EVICT_INTERVAL_S": "0.5"}
    )
    relays.append(relay)
    pub = Versions(origin.url, model, tmp_path)
    pub.publish()
    pub.publish()
    wait_head(relay.url, model, 2)
    old = {d for n in (1, 2) for d in manifest_objects(origin.url, model, n)}
    assert old <= set(store_objects(relay.data))  # the chain followers read was prefetched
    pub.publish(keyframe=True)
    pub.publish()
    wait_head(relay.url, model, 4)
    new = {d for n in (3, 4) for d in manifest_objects(origin.url, model, n)}
    wait_for("old chain evicted", lambda: metric(relay.url, "weightsync_relay_evicted_bytes_total") > 0)
    held = set(store_objects(relay.data))
    assert new <= held and not (old - new) & held
    assert versions(relay.url, model) == versions(origin.url, model)  # rows stay, only bytes go
    before = object_gets(origin.url)
    assert pull(relay.url, model, tmp_path / "late", 1) == pull(origin.url, model, tmp_path / "origin-late", 1)
    assert object_gets(origin.url) > before  # fetched again, for the late reader


def test_an_upstream_outage_in_the_middle_of_a_prefetch(origin: Server, relays: list[Server], tmp_path: Path) -> None:
    from _proxy import Proxy

    model = "cut"
    pub = Versions(origin.url, model, tmp_path, tensors=40)
    host, port = origin.url.removeprefix("http://").split(":")
    proxy = Proxy((host, int(port)))
    try:
        relay = start_relay(tmp_path / "relay", proxy.url)
        relays.append(relay)
        pub.publish()
        wait_head(relay.url, model, 1)
        proxy.rate = 64 << 10
        start = proxy.down
        pub.publish(keyframe=True)  # ~0.5 MB to fetch at 64 KiB/s
        wait_for("the prefetch under way", lambda: proxy.down - start > 100_000, timeout=60)
        proxy.cut()  # the WAN link goes down in the middle of an object
        ready = wait_for("degraded", lambda: (r := httpx.get(f"{relay.url}/readyz")).json()["degraded"] and r)
        assert ready.status_code == 200
        assert httpx.get(f"{relay.url}/v1/models/{model}/versions/latest").json()["number"] == 1
        assert pull(relay.url, model, tmp_path / "during") == pull(origin.url, model, tmp_path / "v1", 1)
        for name, data in store_objects(relay.data).items():
            assert hashlib.sha256(data).hexdigest() == name
        proxy.rate = None
        proxy.mend()
        wait_head(relay.url, model, 2)
        wait_for("not degraded", lambda: httpx.get(f"{relay.url}/readyz").json()["degraded"] is False)
        assert pull(relay.url, model, tmp_path / "after") == pull(origin.url, model, tmp_path / "v2", 2)
    finally:
        proxy.close()


def _history_objects(
    origin: Server, relays: list[Server], tmp_path: Path, models: list[str], proxy_url: str
) -> tuple[Server, list[tuple[str, bytes]]]:
    """A relay behind ``proxy_url`` for which v1 of each model is history (not fetched); for each model
    the largest object of its v1 and its bytes."""
    for seed, model in enumerate(models):
        pub = Versions(origin.url, model, tmp_path, tensors=40, seed=seed)
        pub.publish()
        pub.publish(keyframe=True)
    relay = start_relay(tmp_path / "relay", proxy_url)
    relays.append(relay)
    found = []
    for model in models:
        wait_head(relay.url, model, 2)
        old = manifest_objects(origin.url, model, 1)
        digest = max(old, key=old.get)
        found.append((digest, httpx.get(f"{origin.url}/v1/objects/{digest}").content))
        assert digest not in store_objects(relay.data)
    return relay, found


def test_a_miss_is_streamed_while_it_arrives_and_the_last_byte_waits_for_the_check(
    origin: Server, relays: list[Server], tmp_path: Path
) -> None:
    from _proxy import Proxy

    host, port = origin.url.removeprefix("http://").split(":")
    proxy = Proxy((host, int(port)))
    try:
        relay, [(digest, whole), (bad, bad_whole)] = _history_objects(
            origin, relays, tmp_path, ["streamed", "corrupted"], proxy.url
        )
        proxy.budget = len(whole) // 4  # the link lets a quarter of the object through, then holds the rest
        with httpx.stream("GET", f"{relay.url}/v1/objects/{digest}", timeout=60) as resp:
            assert resp.status_code == 200 and int(resp.headers["content-length"]) == len(whole)
            chunks = resp.iter_bytes()
            first = next(chunks)
            # Bytes came out before the relay had the whole object (it is not in its store yet).
            assert first and digest not in store_objects(relay.data)
            proxy.budget = None
            body = first + b"".join(chunks)
        assert body == whole
        assert digest in store_objects(relay.data)

        # A byte flipped on the way: the store refuses the object, and no reader receives it whole.
        proxy.corrupt = bad
        got = b""
        with pytest.raises(httpx.HTTPError):
            with httpx.stream("GET", f"{relay.url}/v1/objects/{bad}", timeout=60) as resp:
                for chunk in resp.iter_bytes():
                    got += chunk
        assert len(got) < len(bad_whole)
        assert bad not in store_objects(relay.data)
        proxy.corrupt = None
        assert httpx.get(f"{relay.url}/v1/objects/{bad}", timeout=60).content == bad_whole  # fetched again
    finally:
        proxy.close()


def test_relay_replicas_sharing_a_catalog_and_a_store_fetch_each_object_once(
    origin: Server, relays: list[Server], tmp_path: Path
) -> None:
    from _proxy import Proxy

    host, port = origin.url.removeprefix("http://").split(":")
    proxy = Proxy((host, int(port)))
    shared = tmp_path / "shared"
    shared.mkdir()
    region = ["--catalog", f"sqlite:///{shared / 'catalog.db'}", "--store", str(shared / "store")]
    try:
        a = start_relay(tmp_path / "a", proxy.url, args=[*region, "--site", "a"])
        relays.append(a)
        b = start_relay(tmp_path / "b", proxy.url, args=[*region, "--site", "b"])
        relays.append(b)
        model = "shared"
        pub = Versions(origin.url, model, tmp_path, tensors=40)
        # The link holds the first replica's fetch part-way, so the other necessarily meets it in flight.
        proxy.budget = 150_000
        pub.publish()
        wait_for(
            "a replica waiting for the other's fetch",
            lambda: (
                metric(a.url, "weightsync_relay_fetches_deferred_total")
                + metric(b.url, "weightsync_relay_fetches_deferred_total")
                >= 1
            ),
        )
        proxy.budget = None
        wait_head(a.url, model, 1)
        wait_head(b.url, model, 1)
        needed = manifest_objects(origin.url, model, 1)
        assert object_gets(origin.url) == len(needed)  # each object crossed once for the region
        fetched = metric(a.url, "weightsync_relay_upstream_fetches_total") + metric(
            b.url, "weightsync_relay_upstream_fetches_total"
        )
        assert fetched == len(needed)
        expected = pull(origin.url, model, tmp_path / "expected")
        assert pull(a.url, model, tmp_path / "via-a") == expected
        assert pull(b.url, model, tmp_path / "via-b") == expected
    finally:
        proxy.close()
