"""A publish in three requests overlaps its steps: a keyframe's objects upload while it encodes, and the
publisher's next base is copied while the objects upload.

Real server, real transport; the transport below records the requests and, where a test says so,
refuses object uploads (the server never sees them).
"""

from __future__ import annotations

import threading

import httpx
import pytest

torch = pytest.importorskip("torch")

from _client_util import TinyTrainer, follow, tree_bytes, write_version  # noqa: E402

from weightsync import errors  # noqa: E402
from weightsync.client import Publisher  # noqa: E402
from weightsync.client import base as base_mod  # noqa: E402
from weightsync.client.wire import Retry  # noqa: E402
from weightsync.codec import pack as pack_mod  # noqa: E402
from weightsync.codec.manifest import Manifest  # noqa: E402


class Uploads(httpx.BaseTransport):
    """Passes requests on, recording (method, path); while `refuse` is set, object uploads fail unsent."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.seen: list[tuple[str, str]] = []
        self.refuse = False
        self._lock = threading.Lock()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        with self._lock:
            self.seen.append((request.method, request.url.path))
        if self.refuse and request.method == "PUT" and request.url.path.startswith("/v1/objects/"):
            raise httpx.ConnectError("refused by the test")
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()

    def puts(self) -> int:
        with self._lock:
            return sum(1 for m, p in self.seen if m == "PUT" and p.startswith("/v1/objects/"))

    def checks(self) -> int:
        with self._lock:
            return sum(1 for m, p in self.seen if m == "POST" and p.endswith("/objects"))


def held_bytes(pub: Publisher) -> dict[str, bytes] | None:
    held = pub._base.held()
    return None if held is None else {f.layout.path: bytes(f.data) for f in held.checkpoint.files}


def test_a_first_keyframe_s_base_is_copied_while_it_uploads_and_owes_nothing_to_the_file(
    server, model, tmp_path
) -> None:
    """A fresh publisher's keyframe in three requests (one data object: nothing uploads while it encodes):
    the next base is copied into buffers of its own once it is encoded and before any upload, and the
    copy is what the publisher holds after (it copies nothing after the commit); once the publish
    returns, the file may be overwritten (a trainer saving its next step in place) and the next delta
    is still exact."""
    trainer, rec = TinyTrainer(seed=21), Uploads()
    calls: list[tuple[int, bool]] = []
    real = base_mod.BaseKeeper.overwrite_early

    def spy(self, *args, **kwargs):
        puts = rec.puts()
        calls.append((puts, real(self, *args, **kwargs)))
        return calls[-1][1]

    def no_copy_after(ck):
        raise AssertionError("the base was copied after the commit")

    path = write_version(tmp_path / "ckpt", trainer.export())
    with Publisher(server.url, model, transport=rec, inline_bytes=0) as pub:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(base_mod.BaseKeeper, "overwrite_early", spy)
            mp.setattr(base_mod, "_in_memory", no_copy_after)
            assert pub.publish(path).kind == "keyframe"
        assert calls == [(0, True)]  # started before the first upload
        held = pub._base.held()
        assert held is not None and held.own
        assert held_bytes(pub) == tree_bytes(path)
        trainer.step()
        write_version(tmp_path / "ckpt", trainer.export())  # the same files, rewritten in place
        r = pub.publish(path)
        assert (r.kind, r.parent) == ("delta", 1)
        assert held_bytes(pub) == tree_bytes(path)
    follow(server.url, model, trainer.export(), name="early-copy-check")


def test_an_upload_that_fails_drops_the_new_copy_and_keeps_the_base_held_before(server, model, tmp_path) -> None:
    """The next version has other sizes than the base (a tensor added): its copy goes into new buffers while
    it uploads, and an upload that fails drops only that copy; the base held before stays held, so the
    next publish is still a delta on it, exact to the bit."""
    trainer, rec = TinyTrainer(seed=22), Uploads()
    first = trainer.export()
    started: list[tuple[bool, bool]] = []
    real = base_mod.BaseKeeper.overwrite_early

    def spy(self, *args, **kwargs):
        got = real(self, *args, **kwargs)
        started.append((got, self._fresh))
        return got

    with Publisher(server.url, model, transport=rec, inline_bytes=0, retry=Retry(attempts=1)) as pub:
        v0 = write_version(tmp_path / "v0", first)
        pub.publish(v0)
        before = held_bytes(pub)
        trainer.step()
        grown = {**trainer.export(), "extra": torch.arange(64, dtype=torch.float32)}
        v1 = write_version(tmp_path / "v1", grown)
        rec.refuse = True
        with pytest.MonkeyPatch.context() as mp, pytest.raises(errors.ServerUnavailable):
            mp.setattr(base_mod.BaseKeeper, "overwrite_early", spy)
            pub.publish(v1)
        assert started == [(True, True)]  # a copy into new buffers was under way
        assert pub._base._early is None  # the copy was waited for and dropped
        assert held_bytes(pub) == before
        rec.refuse = False
        r = pub.publish(v1)
        assert (r.kind, r.parent) == ("delta", 1)
        assert held_bytes(pub) == tree_bytes(v1)
    follow(server.url, model, grown, name="early-copy-check")


def test_a_keyframe_copied_into_the_base_s_buffers_leaves_nothing_held_when_it_fails(server, model, tmp_path) -> None:
    """A keyframe of the base's sizes is copied into the base's own buffers while it uploads: an upload that
    fails leaves no half-copied base (nothing held: the next publish is a keyframe, exact to the bit)."""
    trainer, rec = TinyTrainer(seed=23), Uploads()
    with Publisher(server.url, model, transport=rec, inline_bytes=0, retry=Retry(attempts=1)) as pub:
        pub.publish(write_version(tmp_path / "v0", trainer.export()))
        trainer.step()
        v1 = write_version(tmp_path / "v1", trainer.export())
        rec.refuse = True
        with pytest.raises(errors.ServerUnavailable):
            pub.publish(v1, keyframe=True)
        assert pub._base.held() is None
        rec.refuse = False
        r = pub.publish(v1)
        assert (r.kind, r.parent) == ("keyframe", 1)
        assert held_bytes(pub) == tree_bytes(v1)
    follow(server.url, model, trainer.export(), name="early-copy-check")


def test_a_base_copied_afresh_is_every_byte_of_the_version(tmp_path) -> None:
    """The copy into new buffers is cut into pieces for the CPU pool: every file, every byte, in order,
    whatever its size against the pieces (empty, one byte, a piece and a bit)."""
    import numpy as np

    from weightsync.codec.checkpoint import Checkpoint

    rng = np.random.default_rng(5)
    root = tmp_path / "ck"
    root.mkdir()
    sizes = {"a.bin": 0, "b.bin": 1, "c.bin": base_mod._COPY_PIECE + 7, "d.bin": 3 * base_mod._COPY_PIECE}
    for name, n in sizes.items():
        (root / name).write_bytes(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
    ck = Checkpoint.open(root)
    copied = base_mod._in_memory(ck)
    assert [f.layout.path for f in copied.files] == [f.layout.path for f in ck.files]
    for mine, theirs in zip(copied.files, ck.files, strict=True):
        assert mine.data.tobytes() == theirs.data.tobytes()
        assert not np.shares_memory(mine.data, theirs.data)


def wide(seed: int) -> dict:
    """A state_dict of ~1.5 MB that changes little from step to step: many frames of 64 KiB."""
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(256, 768, generator=g).to(torch.bfloat16) for i in range(4)}


def test_a_keyframe_s_objects_upload_while_it_encodes_and_arrive_bit_identical(server, model, tmp_path) -> None:
    """Objects of 256 KiB, frames of 64 KiB: each object but the last is checked and uploaded as soon as it is
    packed. The last frame is held back until an upload has gone out, which only an upload made during the
    encode can satisfy; then the last object goes with the manifest, and a subscriber gets every bit."""
    rec = Uploads()
    sd = wide(31)
    went_early = threading.Event()
    real_add = pack_mod.Packer.add
    added = []

    def add(self, frame):
        added.append(frame)
        # A late frame (the count is a lower bound) waits for an upload made meanwhile.
        if len(added) == frames_expected and _wait(lambda: rec.puts() > 0):
            went_early.set()
        return real_add(self, frame)

    v0 = write_version(tmp_path / "v0", sd)
    frames_expected = (v0 / "model.safetensors").stat().st_size // (64 << 10)
    with Publisher(
        server.url, model, transport=rec, inline_bytes=0, chunk_bytes=64 << 10, object_bytes=256 << 10
    ) as pub:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(pack_mod.Packer, "add", add)
            r = pub.publish(v0)
    assert r.kind == "keyframe" and went_early.is_set()
    objects = r.objects_total - 1  # less the manifest
    assert objects >= 5
    assert rec.puts() == objects + 1  # each data object once, and the manifest
    assert rec.checks() == objects  # one per streamed object, then the last one with the manifest
    follow(server.url, model, sd, name="early-copy-check")


def _wait(cond, timeout: float = 20.0) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.005)
    return False


def publish_refused(pub: Publisher, rec: Uploads, source) -> tuple[list, list[int]]:
    """Publish `source` with every object upload refused, each frame after the first streamed object held back
    until that upload's refusal is in (so the encode cannot finish first); ServerUnavailable is expected. Returns
    the upload jobs submitted and, per frame packed, how many jobs had been submitted by then."""
    jobs: list = []
    submit = pub._pool.submit

    def recorded(*args, **kwargs):
        jobs.append(submit(*args, **kwargs))
        return jobs[-1]

    real_add = pack_mod.Packer.add
    added: list[int] = []

    def add(self, frame):
        real_add(self, frame)
        added.append(len(jobs))
        if added.count(1) == 1:  # the first object just went: wait for its refusal
            assert _wait(lambda: jobs[0].done() and jobs[0].exception() is not None)

    rec.refuse = True
    with pytest.MonkeyPatch.context() as mp, pytest.raises(errors.ServerUnavailable):
        mp.setattr(pub._pool, "submit", recorded)
        mp.setattr(pack_mod.Packer, "add", add)
        pub.publish(source)
    return jobs, added


def test_a_keyframe_whose_upload_fails_while_it_encodes_commits_nothing(server, model, tmp_path) -> None:
    """An object upload refused while the keyframe encodes fails the publish and stops the encode at its next
    object (the frames are held back until the refusal is in, so the encode cannot finish first): nothing
    is committed, the publisher holds no half-made base, and the same publish again goes through, exact
    to the bit."""
    rec = Uploads()
    sd = wide(32)
    v0 = write_version(tmp_path / "v0", sd)
    frames = (v0 / "model.safetensors").stat().st_size // (64 << 10)  # at least: frames of 64 KiB at most
    options = dict(transport=rec, inline_bytes=0, chunk_bytes=64 << 10, object_bytes=256 << 10)
    with Publisher(server.url, model, retry=Retry(attempts=1), **options) as pub:
        jobs, added = publish_refused(pub, rec, v0)
        assert len(jobs) == 1 and len(added) < frames  # no second upload: the encode stopped
        assert pub._base.held() is None and pub._base._early is None
        assert pub.api.head(model) is None
        rec.refuse = False
        r = pub.publish(v0)
        assert (r.version, r.kind) == (1, "keyframe")
        assert held_bytes(pub) == tree_bytes(v0)
    follow(server.url, model, sd, name="early-copy-check")


def stepped(sd: dict, seed: int, fraction: float = 0.5) -> dict:
    """`sd` after a step that moves `fraction` of the elements of w0's second half and of w1 and w2 (a delta of
    several 256 KiB objects). w3 stays as it was (its frames of 64 KiB are all dropped) and w0's first half too
    (its frames wait for a later one of w0 to show a change)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, t in sd.items():
        moved = torch.rand(t.shape, generator=g) < fraction
        if k == "w3":
            moved[:] = False
        elif k == "w0":
            moved[: t.shape[0] // 2] = False
        out[k] = torch.where(moved, torch.randn(t.shape, generator=g).to(t.dtype), t)
    return out


def test_a_delta_after_a_delta_of_several_objects_uploads_its_objects_while_it_encodes(server, model, tmp_path) -> None:
    """A delta that spans several objects is followed by deltas that begin first (no encode before the begin) and
    check and upload each object but the last as soon as it is packed, during the encode (the last frame is held
    back until an upload has gone out); a delta of one object goes back to encoding first. Every version arrives
    bit-identical."""
    rec = Uploads()
    sds = [wide(41)]
    for i in range(3):
        sds.append(stepped(sds[-1], 100 + i))
    sds.append(stepped(sds[-1], 200, fraction=0.0005))  # a small step: one object
    dirs = [write_version(tmp_path / f"v{i}", sd) for i, sd in enumerate(sds)]
    # Deltas of ~0.5 MB: above the one-request size (inline_bytes), so they stream once one spans several objects.
    options = dict(transport=rec, chunk_bytes=64 << 10, object_bytes=256 << 10, inline_bytes=128 << 10)
    went_early = threading.Event()
    real_add = pack_mod.Packer.add
    added: list = []
    frames_expected = [0]

    def add(self, frame):
        added.append(frame)
        if len(added) == frames_expected[0] and _wait(lambda: rec.puts() > puts_before[0]):
            went_early.set()
        return real_add(self, frame)

    puts_before = [0]
    with Publisher(server.url, model, **options) as pub:
        assert pub.publish(dirs[0]).kind == "keyframe"
        pub.api.update_model(model, max_chain_ratio=100.0)  # these steps' deltas are large: keep the chain going
        first = pub.publish(dirs[1])  # encoded before its begin (nothing says it will be large yet)
        assert first.kind == "delta" and first.objects_total - 1 >= 2
        assert pub._stream_deltas
        for i in (2, 3):
            start = len(rec.seen)
            added.clear()
            # The last frame (w0's, w1's and w2's 18 frames are kept, w3's dropped) waits for an upload made meanwhile.
            frames_expected[0] = 18
            puts_before[0] = rec.puts()
            went_early.clear()
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(pack_mod.Packer, "add", add)
                r = pub.publish(dirs[i])
            assert r.kind == "delta" and went_early.is_set(), i
            objects = r.objects_total - 1
            assert objects >= 2
            mine = rec.seen[start:]
            begin = mine.index(("POST", f"/v1/models/{model}/publishes"))
            first_put = next(j for j, (m, p) in enumerate(mine) if m == "PUT")
            assert begin < first_put  # begun before any object went
            assert sum(1 for m, p in mine if m == "POST" and p.endswith("/objects")) == objects
            assert sum(1 for m, p in mine if m == "PUT") == objects + 1
            follow(server.url, model, sds[i], name=f"stream-check-{i}")
        last = pub.publish(dirs[4])
        assert last.kind == "delta" and last.objects_total == 2 and not pub._stream_deltas
    follow(server.url, model, sds[4], name="stream-check-4")


def _streaming_publisher(
    server, model: str, tmp_path, rec: Uploads, seed: int, **options
) -> tuple[Publisher, list, list]:
    """A publisher that has published a keyframe and a delta of several objects (so its next delta streams), the
    state_dicts of five versions and their directories (`seed`: a test's own, so that the objects it uploads are
    not in the shared store already)."""
    sds = [wide(seed)]
    for i in range(4):
        sds.append(stepped(sds[-1], seed * 10 + i))
    dirs = [write_version(tmp_path / f"v{i}", sd) for i, sd in enumerate(sds)]
    pub = Publisher(
        server.url,
        model,
        transport=rec,
        chunk_bytes=64 << 10,
        object_bytes=128 << 10,
        inline_bytes=64 << 10,
        **options,
    )
    assert pub.publish(dirs[0]).kind == "keyframe"
    pub.api.update_model(model, max_chain_ratio=100.0)
    assert pub.publish(dirs[1]).kind == "delta" and pub._stream_deltas
    return pub, sds, dirs


def test_a_streamed_delta_whose_upload_fails_commits_nothing_and_keeps_the_base(server, model, tmp_path) -> None:
    """An object upload refused while a streamed delta encodes fails the publish and stops the encode at its next
    object (the frames are held back until the refusal is in, so the encode cannot finish first): nothing is
    committed, the base held is still the last version (the encode did not write into it), and the same publish
    again goes through as a delta, exact to the bit."""
    rec = Uploads()
    pub, sds, dirs = _streaming_publisher(server, model, tmp_path, rec, 51, retry=Retry(attempts=1))
    with pub:
        before = held_bytes(pub)
        jobs, added = publish_refused(pub, rec, dirs[2])
        # Streamed, then no second upload: the encode stopped before its 18th frame (w0's, w1's and w2's are kept).
        assert len(jobs) == 1 and 1 in added and len(added) < 18
        assert pub.api.head(model).number == 2
        assert before is not None and held_bytes(pub) == before
        assert before["model.safetensors"] == tree_bytes(dirs[1])["model.safetensors"]
        rec.refuse = False
        r = pub.publish(dirs[2])
        assert (r.version, r.kind) == (3, "delta")
    follow(server.url, model, sds[2], name="stream-fail-check")


def test_a_streamed_delta_on_a_base_that_went_wrong_costs_a_keyframe_not_a_wrong_delta(
    server, model, tmp_path, caplog
) -> None:
    """The held base's bytes are checked by the encode: a streamed delta on a base that no longer holds its
    version (its objects already uploaded) is packed again as a keyframe, which the subscriber gets exact; the
    next publish is a delta again."""
    import logging

    rec = Uploads()
    pub, sds, dirs = _streaming_publisher(server, model, tmp_path, rec, 52)
    with pub:
        held = pub._base.held()
        assert held is not None
        weights = next(f for f in held.checkpoint.files if f.layout.path == "model.safetensors")
        weights.data[-1] ^= 0x40  # the base's last byte (a tensor's) no longer the version's
        start = len(rec.seen)
        with caplog.at_level(logging.WARNING, logger="weightsync.client"):
            r = pub.publish(dirs[2])
        assert (r.version, r.parent, r.kind) == (3, 2, "keyframe")
        # The delta's objects went up as it encoded, before its base was found wrong; none of them is counted.
        put = [path.rsplit("/", 1)[1] for method, path in rec.seen[start:] if method == "PUT"]
        mine = set(Manifest.decode(pub.api.get_manifest(model, 3)).objects()) | {r.manifest}
        assert [d for d in put if d not in mine]
        assert r.objects_uploaded == sum(1 for d in put if d in mine) <= r.objects_total
        assert any("does not match v2" in rec_.getMessage() for rec_ in caplog.records)
        follow(server.url, model, sds[2], name="stream-wrong-base-check")
        assert pub.publish(dirs[3]).kind == "delta"
    follow(server.url, model, sds[3], name="stream-wrong-base-check-2")


def test_deltas_of_several_objects_small_enough_for_one_request_keep_going_in_one_request(
    server, model, tmp_path
) -> None:
    """With objects smaller than the one-request size, a delta of several objects still goes in one request
    (publishVersion), and so does the next: streaming is for deltas too large for one."""
    rec = Uploads()
    sds = [wide(61)]
    for i in range(2):
        sds.append(stepped(sds[-1], 400 + i))
    dirs = [write_version(tmp_path / f"v{i}", sd) for i, sd in enumerate(sds)]
    with Publisher(server.url, model, transport=rec, chunk_bytes=64 << 10, object_bytes=256 << 10) as pub:
        pub.publish(dirs[0])
        pub.api.update_model(model, max_chain_ratio=100.0)
        for d in dirs[1:]:
            start = len(rec.seen)
            r = pub.publish(d)
            assert r.kind == "delta" and r.objects_total - 1 >= 2 and not pub._stream_deltas
            assert rec.seen[start:] == [("POST", f"/v1/models/{model}/versions")]
    follow(server.url, model, sds[2], name="one-request-check")


def test_a_mapped_source_is_unmapped_on_the_release_thread_a_caller_s_checkpoint_left_alone(
    server, model, tmp_path, monkeypatch
) -> None:
    """A path's files, mapped by the publish, are dropped after it on the release thread (their unmapping is not in
    the caller's time); a Checkpoint the caller passed stays the caller's, usable after the publish. Both versions
    arrive bit-identical."""
    import weakref

    from weightsync.client import publisher as publisher_mod
    from weightsync.codec.checkpoint import Checkpoint

    ended: dict[int, str] = {}
    opened: list[int] = []
    real_snapshot = publisher_mod.snapshot

    def snapshot(source, **kwargs):
        checkpoint, owned = real_snapshot(source, **kwargs)
        key = len(opened)
        opened.append(key)
        weakref.finalize(checkpoint, lambda: ended.__setitem__(key, threading.current_thread().name))
        return checkpoint, owned

    monkeypatch.setattr(publisher_mod, "snapshot", snapshot)
    trainer = TinyTrainer(seed=7)
    first = write_version(tmp_path / "v1", trainer.export())
    trainer.step()
    sd2 = trainer.export()
    second = write_version(tmp_path / "v2", sd2)
    with Publisher(server.url, model) as pub:
        assert pub.publish(first).kind == "keyframe"
        assert _wait(lambda: 0 in ended)
        assert ended[0].startswith("weightsync-release")
        mine = Checkpoint.open(second)
        assert pub.publish(mine).kind == "delta"
        assert 1 not in ended  # the caller's: not released by the publish
        assert bytes(mine.files[0].data[:8]) == (second / mine.files[0].layout.path).read_bytes()[:8]
    follow(server.url, model, sd2)
