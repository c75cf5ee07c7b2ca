"""Concurrency over HTTP against a real `weightsync serve` subprocess, on SQLite and on PostgreSQL.

Racing publishers (DESIGN invariant 3): P SDK Publishers publish M items each. Each round
starts on a barrier, so all P begin on the same head; an httpx transport holds every
first commit of the round at a second barrier, so all P commits reach the server
together. Exactly one gets 201 and the other P-1 get 409 stale-parent; the losers then
retry on the new head (the SDK catches up by an incremental pull and publishes a delta)
until they land. Afterwards the versions are 1..P*M without gaps, each version's parent
is the one before it (exactly one winner per parent), every item landed exactly once,
and every version pulls byte-identically to the item it carries.

Pullers: while one publisher keeps publishing (and, with --long, an admin GC with zero
grace and keep_last=2 runs in a loop), K Subscribers pull into separate directories,
each waiting on the watch long-poll for the next head. Every pull must leave its
directory byte-identical to the committed version it reports, versions never go
backwards, and every puller ends on the final version.
"""

from __future__ import annotations

import hashlib
import threading
from collections import Counter

import httpx
import pytest
from _ckpt import safetensors_file
from _crash_util import FATAL, Served, checkout_files
from _versions import model_files, next_step

from weightsync import errors
from weightsync.client import Publisher, Subscriber
from weightsync.codec import Checkpoint

MODEL = "race"
BARRIER_TIMEOUT = 120.0


def _digest(files: dict[str, bytes]) -> str:
    h = hashlib.sha256()
    for p in sorted(files):
        h.update(p.encode() + b"\0" + hashlib.sha256(files[p]).digest())
    return h.hexdigest()


def _checkpoint(tensors) -> tuple[Checkpoint, str]:
    files = {"model.safetensors": safetensors_file(tensors), "config.json": b'{"hidden": 96}'}
    return Checkpoint.from_bytes(files), _digest(files)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def service(request, tmp_path):
    """A `weightsync serve` subprocess (SQLite in its data dir, or a fresh PostgreSQL database)."""
    ctx = None
    catalog = None
    if request.param == "postgres":
        from _pg import fresh_database

        ctx = fresh_database("ws_conc")
        catalog = ctx.__enter__()
    server = Served(tmp_path / "data", catalog=catalog, log_path=tmp_path / "serve.log")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()
        if ctx is not None:
            ctx.__exit__(None, None, None)


def _commits(request: httpx.Request) -> bool:
    """A request that commits: commitPublish, or publishVersion (a whole publish in one request)."""
    path = request.url.path
    return request.method == "POST" and (path.endswith("/commit") or path.endswith("/versions"))


class GateTransport(httpx.BaseTransport):
    """Holds the next commit request (commitPublish or publishVersion) at `gate` (a barrier), and records
    commit statuses."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.gate: threading.Barrier | None = None
        self.commits: list[tuple[bool, int]] = []  # (held at the gate, status)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        held = False
        if _commits(request) and self.gate is not None:
            gate, self.gate = self.gate, None
            gate.wait(BARRIER_TIMEOUT)
            held = True
        response = self.inner.handle_request(request)
        if _commits(request):
            self.commits.append((held, response.status_code))
        return response

    def close(self) -> None:
        self.inner.close()


def test_racing_publishers_one_winner_per_parent(service, tmp_path, capsys, long_run):
    publishers, items = (6, 5) if long_run else (4, 3)
    base = model_files(3, n=4)
    content = {(i, j): _checkpoint(next_step(base, 1000 * i + j + 1)) for i in range(publishers) for j in range(items)}
    start = threading.Barrier(publishers)
    commit = threading.Barrier(publishers)
    stale = Counter()
    gates = [GateTransport() for _ in range(publishers)]
    failures: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            with Publisher(
                service.url, MODEL, on_mismatch="download", transport=gates[i], concurrency=2, encoder_threads=1
            ) as pub:
                for j in range(items):
                    ck, _ = content[(i, j)]
                    start.wait(BARRIER_TIMEOUT)
                    gates[i].gate = commit
                    for _attempt in range(10 * publishers):
                        try:
                            pub.publish(ck, metadata={"publisher": str(i), "item": str(j)})
                            break
                        except errors.StaleParent:
                            stale[i] += 1
                    else:
                        raise AssertionError(f"publisher {i} item {j} never landed")
        except BaseException as exc:  # noqa: BLE001
            failures.append(exc)
            start.abort()
            commit.abort()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(publishers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures

    # Each round: all P commits held at the barrier, released together: one 201, P-1 409.
    held = [s for g in gates for h, s in g.commits if h]
    assert len(held) == publishers * items
    assert Counter(held) == {201: items, 409: (publishers - 1) * items}, Counter(held)
    with httpx.Client(base_url=service.url, timeout=30) as http:
        versions = http.get(f"/v1/models/{MODEL}/versions", params={"limit": 1000}).json()["versions"]
        report = http.post("/v1/admin/fsck", json={"read_data": True, "repair": False}).json()
    numbers = [v["number"] for v in versions]
    assert numbers == list(range(1, publishers * items + 1)), numbers  # no gaps
    assert [v["parent"] for v in versions] == [None] + numbers[:-1]  # exactly one winner per parent
    landed = Counter((v["metadata"]["publisher"], v["metadata"]["item"]) for v in versions)
    assert landed == Counter({(str(i), str(j)): 1 for i in range(publishers) for j in range(items)})
    assert not [p for p in report["problems"] if p["code"] in FATAL], report["problems"]

    # Every version pulls (incrementally, 1 → N in one directory) to exactly its item's bytes.
    kinds = Counter(v["kind"] for v in versions)
    with Subscriber(service.url, MODEL, name="verifier", report=False, decode_threads=1) as sub:
        for v in versions:
            sub.pull(tmp_path / "check", v["number"])
            want = content[(int(v["metadata"]["publisher"]), int(v["metadata"]["item"]))][1]
            assert _digest(checkout_files(tmp_path / "check")) == want, f"v{v['number']}"
    all_409 = sum(1 for g in gates for _, s in g.commits if s == 409)
    with capsys.disabled():
        print(
            f"\n[concurrency] {service_kind(service)}: {publishers} publishers x {items} items: "
            f"{len(versions)} versions, gapless, one winner per parent; {all_409} commits got 409 "
            f"({(publishers - 1) * items} at the barriers), StaleParent retries {sum(stale.values())}; "
            f"kinds {dict(kinds)}"
        )


def service_kind(service: Served) -> str:
    return "postgres" if "--catalog" in service.proc.args else "sqlite"


def test_concurrent_pullers_see_only_committed_versions(service, tmp_path, capsys, long_run):
    pullers, versions = (8, 16) if long_run else (8, 6)
    expected: dict[int, str] = {}
    publishing_done = threading.Event()
    failures: list[BaseException] = []
    seen: dict[int, list[tuple[int, str, str]]] = {k: [] for k in range(pullers)}
    gc_runs = Counter()

    with httpx.Client(base_url=service.url, timeout=60) as http:
        http.post(
            "/v1/models", json={"name": MODEL, "keyframe_interval": 4, "keep_last": 2 if long_run else None}
        ).raise_for_status()
    tensors = model_files(5, n=4)
    with Publisher(service.url, MODEL, encoder_threads=1) as pub:
        ck, digest = _checkpoint(tensors)
        expected[pub.publish(ck).version] = digest

        def puller(k: int) -> None:
            root = tmp_path / f"puller-{k}"
            try:
                with Subscriber(
                    service.url, MODEL, name=f"puller-{k}", concurrency=2, decode_threads=1, report=(k % 2 == 0)
                ) as sub:
                    while True:
                        r = sub.pull(root)
                        seen[k].append((r.version, r.mode, _digest(checkout_files(root))))
                        if publishing_done.is_set() and r.version == max(expected):
                            return
                        next(sub.watch(after=r.version, timeout=2, stop=publishing_done), None)
            except BaseException as exc:  # noqa: BLE001
                failures.append(exc)

        def collector() -> None:  # --long: GC with zero grace while everyone works
            with httpx.Client(base_url=service.url, timeout=60) as http:
                while not publishing_done.is_set():
                    r = http.post("/v1/admin/gc", json={"dry_run": False, "grace_s": 0})
                    gc_runs[r.status_code] += 1

        threads = [threading.Thread(target=puller, args=(k,)) for k in range(pullers)]
        if long_run:
            threads.append(threading.Thread(target=collector))
        for t in threads:
            t.start()
        try:
            for n in range(1, versions):
                tensors = next_step(tensors, 50 + n)
                ck, digest = _checkpoint(tensors)
                expected[pub.publish(ck).version] = digest
        finally:
            publishing_done.set()
            for t in threads:
                t.join()
    assert not failures, failures
    total = 0
    for k, records in seen.items():
        numbers = [v for v, _, _ in records]
        assert numbers == sorted(numbers), f"puller {k} went backwards: {numbers}"
        assert numbers[-1] == max(expected)
        for v, _, d in records:
            assert d == expected[v], f"puller {k}: its directory is not v{v} byte for byte"
        total += len(records)
    modes = Counter(m for records in seen.values() for _, m, _ in records)
    with httpx.Client(base_url=service.url, timeout=60) as http:
        report = http.post("/v1/admin/fsck", json={"read_data": True, "repair": False}).json()
    assert not [p for p in report["problems"] if p["code"] in FATAL], report["problems"]
    with capsys.disabled():
        print(
            f"\n[concurrency] {service_kind(service)}: {pullers} pullers x {len(expected)} versions: {total} "
            f"pulls ({dict(modes)}), all byte-identical to a committed version"
            + (f"; {sum(gc_runs.values())} concurrent GC runs {dict(gc_runs)}" if long_run else "")
        )
