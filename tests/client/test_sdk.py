"""The SDK against a running server: push/pull byte-identical, deltas small, resume, repair, watch."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from _client_util import FaultyTransport, Killed, TinyTrainer, dir_size, tree_bytes, write_version

from weightsync import errors
from weightsync.client import Publisher, Subscriber
from weightsync.client.checkout import Checkout
from weightsync.client.models import Replica

SMALL = {"chunk_bytes": 16 << 10, "object_bytes": 48 << 10}  # several frames per tensor, several objects


def _versions(tmp: Path, n: int, *, seed: int = 0) -> list[Path]:
    trainer = TinyTrainer(seed=seed)
    out = []
    for i in range(n):
        trainer.step()
        out.append(write_version(tmp / f"src{i + 1}", trainer.export()))
    return out


def test_push_pull_end_to_end(server, model, tmp_path: Path) -> None:
    sources = _versions(tmp_path, 4)
    full = dir_size(sources[0])
    follow = tmp_path / "follow"
    with Publisher(server.url, model, **SMALL) as pub, Subscriber(server.url, model, name="follower") as sub:
        for i, src in enumerate(sources, start=1):
            pushed = pub.publish(src, step=i, metadata={"run": "e2e"})
            assert pushed.version == i
            assert pushed.kind == ("keyframe" if i == 1 else "delta")
            if i > 1:
                assert pushed.bytes_sent < full * 0.3, "a delta push sends a small fraction"
            pulled = sub.pull(follow)
            assert pulled.version == i and sub.version == i
            assert pulled.mode == ("full" if i == 1 else "delta")
            assert tree_bytes(follow) == tree_bytes(src)
            if i > 1:
                assert 0 < pulled.bytes_received < full * 0.3, "a delta pull moves a small fraction"
            with Subscriber(server.url, model, name=f"fresh{i}") as fresh:
                got = fresh.pull(tmp_path / f"fresh{i}")
            assert tree_bytes(tmp_path / f"fresh{i}") == tree_bytes(src)
            assert got.mode == "full"
            assert got.bytes_received > pulled.bytes_received or i == 1
        again = sub.pull(follow)
        assert again.mode == "current" and again.bytes_received == 0
        replicas = {r.subscriber: r for r in _replicas(server.url, model)}
        follower = replicas["follower"]
        assert follower.version == 4 and follower.bytes is not None and follower.bytes > 0
        assert (follower.status, follower.mode, follower.engine) == ("applied", "pull", None)
        assert follower.extra["transfer"] == "delta" and follower.host  # what the subscriber reported with it
        # An older version on request, from a directory at a newer one: a full rebuild, byte-identical.
        old = sub.pull(tmp_path / "old", version=2)
        assert old.version == 2 and tree_bytes(tmp_path / "old") == tree_bytes(sources[1])
        back = sub.pull(follow, version=3)  # back in the same directory: rebuilt from the chain's keyframe
        assert back.mode == "full" and tree_bytes(follow) == tree_bytes(sources[2])


def _replicas(url: str, model: str) -> list[Replica]:
    from weightsync.client._http import Api

    with Api(url) as api:
        return api.list_replicas(model, all=True)


def _requests_by_route(url: str) -> dict[str, float]:
    """The server's request counters (its /metrics), summed per "METHOD route"."""
    import httpx

    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("weightsync_http_requests_total{"):
            labels, value = line[len("weightsync_http_requests_total{") :].rsplit("} ", 1)
            fields = dict(kv.split("=", 1) for kv in labels.split(","))
            key = f"{fields['method'].strip(chr(34))} {fields['route'].strip(chr(34))}"
            out[key] = out.get(key, 0.0) + float(value)
    return out


@pytest.mark.parametrize("inline_bytes", [0, None])
def test_a_delta_publish_is_three_sequential_requests_or_one(server, model, tmp_path: Path, inline_bytes) -> None:
    """Holding the parent, the publisher encodes first and begins with its objects: no checkObjects call.
    A version within ``inline_bytes`` (the default) is one publishVersion request; with 0, three requests."""
    # bytes no other test stores: every object is new
    sources = _versions(tmp_path, 2, seed=7 if inline_bytes is None else 8)
    options = {} if inline_bytes is None else {"inline_bytes": inline_bytes}
    with Publisher(server.url, model, **SMALL, **options) as pub:
        pub.publish(sources[0])
        before = _requests_by_route(server.url)
        result = pub.publish(sources[1])
        after = _requests_by_route(server.url)
    delta = {
        k: after[k] - before.get(k, 0.0)
        for k in after
        if after[k] != before.get(k, 0.0) and not k.startswith("GET /metrics")
    }
    assert result.kind == "delta" and result.objects_uploaded >= 2  # frames and the manifest
    if inline_bytes == 0:
        assert delta == {
            "POST /v1/models/{model}/publishes": 1,
            "PUT /v1/objects/{digest}": result.objects_uploaded,
            "POST /v1/models/{model}/publishes/{publish_id}/commit": 1,
        }
    else:
        assert delta == {"POST /v1/models/{model}/versions": 1}
    with Subscriber(server.url, model, name="three") as sub:
        sub.pull(tmp_path / "out")
    assert tree_bytes(tmp_path / "out") == tree_bytes(sources[1])


def test_a_keyframe_the_policy_asks_for_replaces_the_delta_encoded_first(server, model, tmp_path: Path) -> None:
    """The chain policy answers keyframe to a begin that listed a delta's objects: a keyframe is published."""
    import httpx

    httpx.post(f"{server.url}/v1/models", json={"name": model, "keyframe_interval": 2}).raise_for_status()
    sources = _versions(tmp_path, 3)
    with Publisher(server.url, model, **SMALL) as pub:
        kinds = [pub.publish(src).kind for src in sources]
    assert kinds == ["keyframe", "delta", "keyframe"]
    with Subscriber(server.url, model, name="policy") as sub:
        assert sub.pull(tmp_path / "out").version == 3
    assert tree_bytes(tmp_path / "out") == tree_bytes(sources[2])


def test_a_version_that_drops_files_is_refused_unless_allowed(server, model, tmp_path: Path) -> None:
    """A wrong path cannot wipe files off the fleet: RemovesContent, nothing committed, the replica untouched."""
    sources = _versions(tmp_path, 2, seed=11)
    weights_only = tmp_path / "weights-only"
    weights_only.mkdir()
    (weights_only / "model.safetensors").write_bytes((sources[1] / "model.safetensors").read_bytes())
    with Subscriber(server.url, model, name="kept") as sub:
        with Publisher(server.url, model, **SMALL) as pub:
            pub.publish(sources[0])
            sub.pull(tmp_path / "replica")
            with pytest.raises(errors.RemovesContent, match="config.json"):
                pub.publish(weights_only)  # refused by the publisher, which holds the parent: nothing uploaded
            assert pub.publish(sources[1]).version == 2  # the publisher goes on from the head
        with Publisher(server.url, model, **SMALL) as fresh:  # holds no base: the server refuses at commit
            with pytest.raises(errors.RemovesContent, match="config.json"):
                fresh.publish(weights_only, keyframe=True)
            assert sub.pull(tmp_path / "replica").version == 2
            assert tree_bytes(tmp_path / "replica") == tree_bytes(sources[1])
            assert fresh.publish(weights_only, allow_removals=True).version == 3
        sub.pull(tmp_path / "replica")
    assert tree_bytes(tmp_path / "replica") == tree_bytes(weights_only)


def test_pull_never_replaces_a_users_files_unless_adopting(server, model, tmp_path: Path) -> None:
    """An unmanaged directory with the model's files: refused untouched; adopted without a download when equal."""
    import shutil

    sources = _versions(tmp_path, 2, seed=13)
    pub = Publisher(server.url, model, **SMALL)
    pub.publish(sources[0])
    user = tmp_path / "user"
    user.mkdir()
    (user / "config.json").write_bytes(b'{"mine": true}\n')
    (user / "notes.txt").write_bytes(b"keep me")
    with Subscriber(server.url, model, name="adopter") as sub:
        with pytest.raises(errors.UnmanagedFiles, match="config.json"):
            sub.pull(user)
        assert (user / "config.json").read_bytes() == b'{"mine": true}\n' and not (user / ".weightsync").exists()
        # A plain copy of the very version: adopted as it is, nothing downloaded.
        copy = tmp_path / "copy"
        shutil.copytree(sources[0], copy)
        adopted = sub.pull(copy, adopt=True)
        assert adopted.mode == "adopted" and adopted.version == 1
        assert adopted.bytes_received < 20_000  # the target's manifest only, no frames
        assert tree_bytes(copy) == tree_bytes(sources[0])
        # Adopting different files replaces the model's files and leaves the others.
        replaced = sub.pull(user, adopt=True)
        assert replaced.mode == "full" and (user / "notes.txt").read_bytes() == b"keep me"
        assert (user / "config.json").read_bytes() == (sources[0] / "config.json").read_bytes()
        pub.publish(sources[1])
        pub.close()
        assert sub.pull(copy).mode == "delta"  # the adopted directory is managed from now on
        assert tree_bytes(copy) == tree_bytes(sources[1])


def test_one_publisher_at_a_time_per_cache_directory(server, model, tmp_path: Path) -> None:
    """Two publishers sharing a base cache would overwrite each other's base: the second is refused."""
    sources = _versions(tmp_path, 2, seed=17)
    cache = tmp_path / "cache"
    with Publisher(server.url, model, cache_dir=cache, **SMALL) as first:
        first.publish(sources[0])
        with pytest.raises(errors.Conflict, match="another publisher"):
            Publisher(server.url, model, cache_dir=cache, **SMALL)
    with Publisher(server.url, model, cache_dir=cache, **SMALL) as again:  # released on close
        assert again.publish(sources[1]).kind == "delta"  # on the base the first one left


def test_the_publisher_encodes_in_a_format_the_server_reads(server, model, tmp_path: Path) -> None:
    """Format 2 with a server that reads it; a chain keeps its format; format 1 for a server that predates 2."""
    import httpx

    from weightsync.client.models import PublishBegin
    from weightsync.codec.manifest import Manifest

    def stored_format(number: int) -> int:
        digest = httpx.get(f"{server.url}/v1/models/{model}/versions/{number}").json()["manifest"]
        return Manifest.decode(httpx.get(f"{server.url}/v1/objects/{digest}").content).version

    sources = _versions(tmp_path, 2, seed=19)
    with Publisher(server.url, model, **SMALL) as pub:
        assert [pub.publish(s).kind for s in sources] == ["keyframe", "delta"]
        assert stored_format(1) == stored_format(2) == 2
        held = pub._base.held()
        assert held is not None and pub._format_for(held) == 2
        # What an older server answers: no "formats" member, so format 1 only; the held base is format 2.
        old = PublishBegin.from_json(
            {
                **pub.api.begin_publish(model, parent=2, step=None, metadata=None, keyframe=False).to_dict(),
                "formats": None,
            }
        )
        pub._formats = tuple(old.formats or [1])
        assert pub._format_for(held) == 1 and pub._format_for(None) == 1


def test_publish_state_dict_async_in_order(server, model, tmp_path: Path) -> None:
    trainer = TinyTrainer(seed=3)
    futures = []
    expected = []
    with Publisher(server.url, model, **SMALL) as pub:
        for step in range(1, 5):
            trainer.step()
            sd = trainer.export()
            from weightsync.client.tensors import serialize_state_dict

            expected.append(serialize_state_dict(sd).tobytes())
            futures.append(pub.publish_async(sd, step=step))
            trainer.step()  # the loop goes on while the publish runs: the snapshot was taken already
        results = [f.result(timeout=60) for f in futures]
    assert [r.version for r in results] == [1, 2, 3, 4]
    assert [r.kind for r in results] == ["keyframe", "delta", "delta", "delta"]
    with Subscriber(server.url, model) as sub:
        for v in (4, 2):
            sub.pull(tmp_path / f"v{v}", version=v)
            assert (tmp_path / f"v{v}" / "model.safetensors").read_bytes() == expected[v - 1]


def test_push_resumes_after_crash(server, model, tmp_path: Path) -> None:
    sources = _versions(tmp_path, 2)
    faulty = FaultyTransport("PUT", "/v1/objects/")
    with Publisher(
        server.url, model, transport=faulty, concurrency=1, chunk_bytes=16 << 10, object_bytes=8 << 10
    ) as pub:
        pub.publish(sources[0])
        faulty.limit, faulty.count = 2, 0
        with pytest.raises(Killed):
            pub.publish(sources[1], keyframe=True)  # a keyframe: many objects to upload
        faulty.limit, faulty.count = None, 0
        resumed = pub.publish(sources[1], keyframe=True)
    assert resumed.version == 2
    assert resumed.objects_uploaded == resumed.objects_total - 2, "only the objects the crash left out"
    assert faulty.count == resumed.objects_uploaded
    assert resumed.bytes_sent < resumed.stored_bytes
    with Subscriber(server.url, model) as sub:
        sub.pull(tmp_path / "out")
    assert tree_bytes(tmp_path / "out") == tree_bytes(sources[1])


def test_push_resumes_in_a_new_process_without_cache(server, model, tmp_path: Path) -> None:
    """A restarted publisher (no base held) publishes a keyframe: deterministic, so the retry reuses uploads."""
    sources = _versions(tmp_path, 2, seed=5)
    with Publisher(server.url, model, **SMALL) as pub:
        pub.publish(sources[0])
    faulty = FaultyTransport("PUT", "/v1/objects/", limit=1)
    with Publisher(server.url, model, transport=faulty, concurrency=1, **SMALL) as crashed, pytest.raises(Killed):
        crashed.publish(sources[1])
    with Publisher(server.url, model, **SMALL) as fresh:
        r = fresh.publish(sources[1])
    assert r.version == 2 and r.kind == "keyframe"
    assert r.objects_uploaded == r.objects_total - 1


def test_pull_resumes_after_crash_and_keeps_old_version(server, model, tmp_path: Path) -> None:
    sources = _versions(tmp_path, 2, seed=7)
    with Publisher(server.url, model, **SMALL) as pub:
        pub.publish(sources[0])
        pub.publish(sources[1], keyframe=True)  # v2 is a new chain: a full plan with many objects
    dest = tmp_path / "dest"
    with Subscriber(server.url, model) as sub:
        sub.pull(dest, version=1)
    before = tree_bytes(dest)
    faulty = FaultyTransport("GET", "/v1/objects/", limit=3)
    with (
        Subscriber(server.url, model, transport=faulty, concurrency=2, range_bytes=8 << 10) as crashing,
        pytest.raises(Killed),
    ):
        crashing.pull(dest, version=None)
    assert tree_bytes(dest) == before, "a failed pull leaves the old version intact"
    assert Checkout(dest).state().number == 1
    cached = sum(p.stat().st_size for p in (dest / ".weightsync" / "objects").rglob("*") if p.is_file())
    assert cached > 0
    with Subscriber(server.url, model) as sub:
        r = sub.pull(dest)
    assert r.version == 2 and tree_bytes(dest) == tree_bytes(sources[1])
    assert r.objects_cached > 0 or cached > 0
    assert r.bytes_received == r.plan_bytes - cached, "only what the crash left out is fetched again"
    assert not any((dest / ".weightsync" / "objects").iterdir()), "objects are dropped after success"


def test_directory_changed_behind_state_is_repaired(server, model, tmp_path: Path) -> None:
    sources = _versions(tmp_path, 3, seed=11)
    dest = tmp_path / "dest"
    with Publisher(server.url, model, **SMALL) as pub, Subscriber(server.url, model) as sub:
        pub.publish(sources[0])
        sub.pull(dest)
        pub.publish(sources[1])
        # Flip one byte in the middle of a tensor: same size, so only segment hashes notice.
        f = dest / "model.safetensors"
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0x40
        f.write_bytes(bytes(data))
        r = sub.pull(dest)
        assert r.repaired and r.mode == "full" and r.version == 2
        assert tree_bytes(dest) == tree_bytes(sources[1])
        pub.publish(sources[2])
        (dest / "config.json").unlink()  # a missing file is noticed by size alone
        (dest / "notes.txt").write_text("not part of the model")
        r = sub.pull(dest)
        assert r.repaired and r.version == 3
        assert (dest / "notes.txt").exists(), "files that are not the model's are left alone"
        got = tree_bytes(dest)
        del got["notes.txt"]
        assert got == tree_bytes(sources[2])


def test_publisher_cache_dir_survives_restart(server, model, tmp_path: Path) -> None:
    sources = _versions(tmp_path, 4, seed=13)
    cache = tmp_path / "cache"
    with Publisher(server.url, model, cache_dir=cache, **SMALL) as pub:
        assert pub.publish(sources[0]).kind == "keyframe"
    with Publisher(server.url, model, cache_dir=cache, **SMALL) as pub:  # a restarted trainer
        r = pub.publish(sources[1])
        assert r.kind == "delta" and r.bytes_sent < dir_size(sources[1]) * 0.3
    # Another cache that is behind the head catches up by an incremental pull, then sends a delta.
    other = tmp_path / "other-cache"
    with Publisher(server.url, model, cache_dir=other, **SMALL) as pub:
        r = pub.publish(sources[2])
        assert r.kind == "delta"
    (cache / model / "model.safetensors").unlink()
    with Publisher(server.url, model, cache_dir=cache, **SMALL) as pub:  # a damaged cache is rebuilt
        r = pub.publish(sources[3])
        assert r.version == 4
    with Subscriber(server.url, model) as sub:
        sub.pull(tmp_path / "out")
    assert tree_bytes(tmp_path / "out") == tree_bytes(sources[3])


def test_publisher_base_survives_a_rewritten_source_and_reuses_its_buffers(server, model, tmp_path: Path) -> None:
    """The caller may rewrite its files after a publish: the base kept is a copy, refreshed in place after."""
    import numpy as np

    trainer = TinyTrainer(seed=5)
    work, follow = tmp_path / "work", tmp_path / "follow"
    with Publisher(server.url, model, **SMALL) as pub, Subscriber(server.url, model, name="f") as sub:
        first = None
        for i in range(1, 5):
            trainer.step()
            want = tree_bytes(write_version(work, trainer.export()))  # the same files, rewritten in place
            r = pub.publish(work)
            assert r.version == i and r.kind == ("keyframe" if i == 1 else "delta")
            assert sub.pull(follow).version == i
            assert tree_bytes(follow) == want
            held = pub._base.held()
            assert held is not None and held.state.number == i
            kept = {f.layout.path: bytes(f.data) for f in held.checkpoint.files}
            assert kept == want
            if first is None:
                first = held.checkpoint.files
            else:  # same sizes: the next base is copied into the previous one's buffers
                assert all(np.shares_memory(a.data, b.data) for a, b in zip(first, held.checkpoint.files, strict=True))


def test_stale_parent_is_named(server, model, tmp_path: Path) -> None:
    sources = _versions(tmp_path, 3, seed=17)
    with Publisher(server.url, model, **SMALL) as a, Publisher(server.url, model, **SMALL) as b:
        a.publish(sources[0])
        b.publish(sources[1])  # b holds no base matching the head: a keyframe on top of v1
        r = a.publish(sources[2])  # a's base (v1) is no longer the head: a keyframe on top of v2
        assert r.version == 3 and r.kind == "keyframe" and r.parent == 2
        from weightsync.client._http import Api

        api = Api(server.url)
        try:
            with pytest.raises(errors.StaleParent) as info:
                api.begin_publish(model, parent=1, step=None, metadata=None, keyframe=False)
            assert info.value.current_head == 3
            with pytest.raises(errors.VersionNotFound):
                api.get_version(model, 99)
            with pytest.raises(errors.ModelNotFound):
                api.get_model(model + "-missing")
        finally:
            api.close()


def test_watch_yields_new_versions(server, model, tmp_path: Path) -> None:
    sources = _versions(tmp_path, 3, seed=19)
    seen: list[int] = []
    stop = threading.Event()
    with Publisher(server.url, model, **SMALL) as pub:
        pub.publish(sources[0])
        sub = Subscriber(server.url, model)
        got_two = threading.Event()

        def consume() -> None:
            for v in sub.watch(after=1, timeout=2.0, stop=stop):
                seen.append(v.number)
                if v.number >= 3:
                    got_two.set()
                    return

        t = threading.Thread(target=consume)
        t.start()
        try:
            pub.publish(sources[1])
            pub.publish(sources[2])
            assert got_two.wait(30)
        finally:
            stop.set()
            t.join(30)
            sub.close()
    assert seen[-1] == 3 and seen == sorted(seen) and set(seen) <= {2, 3}


def test_bandwidth_cap_and_unknown_model(server, model, tmp_path: Path) -> None:
    sources = _versions(tmp_path, 1, seed=23)
    with Publisher(server.url, model, bandwidth=8 << 20, **SMALL) as pub:
        pub.publish(sources[0])
    with Subscriber(server.url, model, bandwidth=8 << 20) as sub:
        sub.pull(tmp_path / "out")
    assert tree_bytes(tmp_path / "out") == tree_bytes(sources[0])
    with Subscriber(server.url, model + "-nope") as sub, pytest.raises(errors.ModelNotFound):
        sub.pull(tmp_path / "nope")
    with Subscriber(server.url, model) as sub, pytest.raises(errors.VersionNotFound):
        sub.pull(tmp_path / "nope", version=42)


@pytest.mark.parametrize("keep", ["encode", "patch", "copy"])
def test_the_next_base_is_exactly_the_published_files(server, model, tmp_path: Path, monkeypatch, keep: str) -> None:
    """A path publisher keeps its next base in the previous one's buffers: written by the encode itself
    as it codes each change ("encode", Encoder keep_base: a delta in one request after one that went so),
    by applying each delta's own frames into them ("patch", what a format 2 delta on the held base gets
    otherwise, forced here), or where those cannot apply by copying only what changed ("copy", forced
    here: segments a format 2 delta states unchanged at the same place are left as they are). Either
    way, after every publish the base holds the files byte for byte, and a subscriber following the
    deltas stays exact."""
    import numpy as np
    import safetensors.numpy as stn

    from weightsync.client import base as base_mod

    rng = np.random.default_rng(5)
    frozen = rng.integers(0, 255, 40_000, dtype=np.uint8)  # never changes
    moving = rng.standard_normal(30_000).astype(np.float32)
    paths = []
    for i in range(4):
        moving = moving.copy()
        moving[rng.integers(0, moving.size, 500)] += 1.0
        d = tmp_path / f"v{i}"
        d.mkdir()
        stn.save_file(
            {"frozen": frozen, "moving": moving, "step": np.array([i], np.int64)}, str(d / "model.safetensors")
        )
        paths.append(d)
    skipped: list[dict] = []
    patched: list[int | None] = []
    real_ranges, real_patch = base_mod.same_ranges, base_mod.patch_jobs

    def spy_ranges(manifest, number):
        got = real_ranges(manifest, number)
        skipped.append(got)
        return got

    def spy_patch(old, manifest, objects, *, undo=False):
        if not undo:
            patched.append(manifest.parent)
        return real_patch(old, manifest, objects, undo=undo)

    monkeypatch.setattr(base_mod, "same_ranges", spy_ranges)
    monkeypatch.setattr(base_mod, "patch_jobs", spy_patch)
    if keep != "encode":
        monkeypatch.setattr(base_mod.BaseKeeper, "may_keep", lambda self, checkpoint, owned: False)
    if keep == "copy":
        monkeypatch.setattr(base_mod, "patchable", lambda old, checkpoint, manifest: False)
    buffers = None
    with Publisher(server.url, model, **SMALL) as pub, Subscriber(server.url, model, name="follower") as sub:
        for i, d in enumerate(paths):
            result = pub.publish(d)
            held = pub._base.held()
            assert held is not None and held.state.number == result.version
            want = (d / "model.safetensors").read_bytes()
            assert held.checkpoint.files[0].data.tobytes() == want, f"v{i + 1}: the base differs from the file"
            buffers = buffers if buffers is not None else held.checkpoint.files[0].data
            assert np.shares_memory(buffers, held.checkpoint.files[0].data)  # the same buffers all along
            sub.pull(tmp_path / "follow", result.version)
            assert (tmp_path / "follow" / "model.safetensors").read_bytes() == want
    if keep == "encode":  # v1 is a keyframe (three requests, nothing held); v2 patched in after its commit;
        assert patched == [1] and skipped == []  # v3 and v4 followed a publish in one request: their encodes
        return  # wrote them into the base
    if keep == "patch":  # v1 is a keyframe (nothing held); each delta's frames made the next base
        assert patched == [1, 2, 3] and skipped == []
        return
    # Each delta skipped exactly the frozen tensor's bytes and the safetensors header (the same in every version).
    header = 8 + int.from_bytes(want[:8], "little")
    meta = json.loads(want[8:header])
    a, b = meta["frozen"]["data_offsets"]
    assert patched == []
    assert skipped == [{"model.safetensors": [(0, header), (header + a, header + b)]}] * 3, skipped
