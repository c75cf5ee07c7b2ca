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
            pub.publish(v0)
        assert len(jobs) == 1 and len(added) < frames  # no second upload: the encode stopped
        assert pub._base.held() is None and pub._base._early is None
        assert pub.api.head(model) is None
        rec.refuse = False
        r = pub.publish(v0)
        assert (r.version, r.kind) == (1, "keyframe")
        assert held_bytes(pub) == tree_bytes(v0)
    follow(server.url, model, sd, name="early-copy-check")
