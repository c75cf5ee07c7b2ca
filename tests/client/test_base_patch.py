"""The publisher's next base made by applying the published delta's own frames into the held base.

`client/base.py`: `patchable` says when a format 2 delta's frames, applied into the held base's
buffers, give the published files; `patch_jobs` applies them. Nothing checks the patched bytes
then: the next encode sums every base byte and compares with the manifest, and a base that does
not match costs a keyframe. Both halves are tested here: the patch is exact (a property over
random tensors, changes and frame cuts), it refuses what it cannot do, and a wrong base is caught.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightsync.client import Publisher, Subscriber
from weightsync.client.base import _in_memory, patch_jobs, patchable
from weightsync.codec.checkpoint import Checkpoint
from weightsync.codec.encoder import Encoder
from weightsync.codec.pack import pack

DTYPES = {"bf16": (np.uint16, "BF16"), "f32": (np.float32, "F32"), "u8": (np.uint8, "U8"), "i64": (np.int64, "I64")}


def _safetensors(tensors: dict[str, np.ndarray], dtypes: dict[str, str]) -> bytes:
    """A safetensors file of raw arrays (bf16 given as uint16 bits), tensors in name order."""
    import json
    import struct

    header, at, blobs = {}, 0, []
    for name in sorted(tensors):
        raw = tensors[name].tobytes()
        header[name] = {"dtype": dtypes[name], "shape": [tensors[name].size], "data_offsets": [at, at + len(raw)]}
        at += len(raw)
        blobs.append(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(blobs)


def _encode(base: Checkpoint, new: Checkpoint, *, chunk_bytes: int = 4096, version: int = 2):
    enc = Encoder(threads=2, chunk_bytes=chunk_bytes, format_version=version)
    manifest, objects = pack(enc.encode(new, base), target_bytes=8192)
    return manifest, {o.digest: o.data for o in objects}


@st.composite
def versions(draw: st.DrawFn) -> tuple[Checkpoint, Checkpoint]:
    """Two versions of the same layout: 1-3 tensors of random dtypes and sizes, a random share of elements
    changed (none to all), and a raw side file whose bytes may change too."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n = draw(st.integers(1, 3))
    tensors, changed, dtypes = {}, {}, {}
    for i in range(n):
        kind = draw(st.sampled_from(sorted(DTYPES)))
        np_dtype, st_dtype = DTYPES[kind]
        size = draw(st.integers(1, 6000))
        t = rng.integers(0, 255, size * np.dtype(np_dtype).itemsize, dtype=np.uint8).view(np_dtype)
        c = t.copy()
        density = draw(st.sampled_from([0.0, 0.001, 0.02, 0.3, 1.0]))
        where = rng.random(size) < density
        c.view(np.uint8).reshape(size, -1)[where] ^= rng.integers(1, 255, (int(where.sum()), 1), dtype=np.uint8)
        tensors[f"t{i}"], changed[f"t{i}"], dtypes[f"t{i}"] = t, c, st_dtype
    side = rng.integers(0, 255, draw(st.integers(0, 300)), dtype=np.uint8).tobytes()
    side2 = bytes(b ^ 1 for b in side) if draw(st.booleans()) else side
    base = Checkpoint.from_bytes({"model.safetensors": _safetensors(tensors, dtypes), "notes.bin": side})
    new = Checkpoint.from_bytes({"model.safetensors": _safetensors(changed, dtypes), "notes.bin": side2})
    return base, new


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pair=versions(), chunk=st.sampled_from([1024, 4096, 1 << 20]))
def test_patching_the_base_with_the_delta_s_frames_gives_the_new_bytes(pair, chunk: int) -> None:
    base, new = pair
    manifest, objects = _encode(base, new, chunk_bytes=chunk)
    assert manifest.kind == "delta"
    held = _in_memory(base)
    assert patchable(held, new, manifest)
    jobs = patch_jobs(held, manifest, objects)
    assert jobs is not None
    for job in jobs:
        job()
    for got, want in zip(held.files, new.files, strict=True):
        assert got.data.tobytes() == want.data.tobytes(), got.layout.path


def _pair() -> tuple[Checkpoint, Checkpoint]:
    rng = np.random.default_rng(1)
    a = rng.integers(0, 255, 8000, dtype=np.uint8).view(np.uint16)
    b = rng.integers(0, 255, 4000, dtype=np.uint8)
    a2 = a.copy()
    a2[::97] ^= 3
    dt = {"a": "BF16", "b": "U8"}
    return (
        Checkpoint.from_bytes({"model.safetensors": _safetensors({"a": a, "b": b}, dt)}),
        Checkpoint.from_bytes({"model.safetensors": _safetensors({"a": a2, "b": b}, dt)}),
    )


def test_what_the_frames_cannot_make_is_refused() -> None:
    base, new = _pair()
    manifest, objects = _encode(base, new)
    assert patchable(base, new, manifest)
    # A keyframe, or a format 1 delta, is not applied into a base.
    keyframe, _ = pack(Encoder().encode(new, None), target_bytes=8192)
    assert not patchable(base, new, keyframe)
    v1, _ = _encode(base, new, version=1)
    assert v1.kind == "delta" and not patchable(base, new, v1)
    # Another file set or size.
    assert not patchable(Checkpoint.from_bytes({"other.safetensors": base.files[0].data}), new, manifest)
    bigger = Checkpoint.from_bytes({"model.safetensors": np.concatenate([new.files[0].data, np.zeros(8, np.uint8)])})
    assert not patchable(base, bigger, manifest)
    # A tensor that moved in the file (the other renamed, so it sorts after it now): copied, not patched.
    rng = np.random.default_rng(2)
    x, y = rng.integers(0, 255, 800, dtype=np.uint8), rng.integers(0, 255, 800, dtype=np.uint8)
    moved_base = Checkpoint.from_bytes({"m.safetensors": _safetensors({"b": x, "c": y}, {"b": "U8", "c": "U8"})})
    moved_new = Checkpoint.from_bytes({"m.safetensors": _safetensors({"a": y, "b": x}, {"a": "U8", "b": "U8"})})
    moved, _ = _encode(moved_base, moved_new)
    assert moved.kind == "delta" and not patchable(moved_base, moved_new, moved)
    # A frame whose object is not at hand: no jobs.
    assert patch_jobs(base, manifest, {}) is None
    assert patch_jobs(base, manifest, objects) is not None


def test_a_base_that_does_not_hold_the_version_costs_a_keyframe_not_a_wrong_delta(
    server, model, tmp_path: Path, caplog
) -> None:
    """The patched base is not checked when it is made: the next encode sums every base byte against the
    last manifest, so a base that went wrong in between is caught there and the version goes as a keyframe,
    exact at the subscriber."""
    from _client_util import TinyTrainer, tree_bytes, write_version

    trainer = TinyTrainer(seed=29)
    paths = []
    for i in range(4):
        paths.append(write_version(tmp_path / f"v{i}", trainer.export()))
        trainer.step()
    with Publisher(server.url, model) as pub:
        assert [pub.publish(p).kind for p in paths[:2]] == ["keyframe", "delta"]
        held = pub._base.held()
        assert held is not None
        weights = next(f for f in held.checkpoint.files if f.layout.path == "model.safetensors")
        weights.data[-1] ^= 0x40  # the base's last byte (a tensor's) no longer the version's
        with caplog.at_level(logging.WARNING, logger="weightsync.client"):
            r = pub.publish(paths[2])
        assert (r.version, r.parent, r.kind) == (3, 2, "keyframe")
        assert any("does not match v2" in rec.getMessage() for rec in caplog.records)
        assert pub.publish(paths[3]).kind == "delta"  # the keyframe's bytes are the next base
    with Subscriber(server.url, model, name="patch-check") as sub:
        sub.pull(tmp_path / "out")
    assert tree_bytes(tmp_path / "out") == tree_bytes(paths[3])


def test_a_patch_that_fails_leaves_a_base_copied_afresh(server, model, tmp_path: Path, monkeypatch, caplog) -> None:
    """A patch of the next base that fails part way (its bytes unknown) is not kept: the published files are
    copied afresh instead, so the next publish is still a delta, exact at the subscriber. (Patches are what
    a base gets when its encode did not write the version into it: forced here.)"""
    from _client_util import TinyTrainer, tree_bytes, write_version

    from weightsync.client import base as base_mod

    trainer = TinyTrainer(seed=31)
    paths = []
    for i in range(5):
        paths.append(write_version(tmp_path / f"v{i}", trainer.export()))
        trainer.step()
    calls = {"n": 0}
    real = base_mod.apply_frame_pieces

    def flaky(blob, targets, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            raise MemoryError("no memory for the planes")
        return real(blob, targets, **kw)

    monkeypatch.setattr(base_mod.BaseKeeper, "may_keep", lambda self, checkpoint, owned: False)
    with Publisher(server.url, model) as pub:
        assert [pub.publish(p).kind for p in paths[:3]] == ["keyframe", "delta", "delta"]
        monkeypatch.setattr(base_mod, "apply_frame_pieces", flaky)
        with caplog.at_level(logging.WARNING, logger="weightsync.client"):
            assert pub.publish(paths[3]).kind == "delta"  # the patch of its base fails on the second frame
        assert calls["n"] >= 2
        held = pub._base.held()
        assert held is not None and held.state.number == 4
        assert {f.layout.path: bytes(f.data) for f in held.checkpoint.files} == tree_bytes(paths[3])
        monkeypatch.setattr(base_mod, "apply_frame_pieces", real)
        assert pub.publish(paths[4]).kind == "delta"
    with Subscriber(server.url, model, name="patch-fails") as sub:
        sub.pull(tmp_path / "out")
    assert tree_bytes(tmp_path / "out") == tree_bytes(paths[4])
    assert "failed" in caplog.text


def test_an_encode_that_fails_while_writing_into_the_base_forgets_it(
    server, model, tmp_path: Path, monkeypatch, caplog
) -> None:
    """An encode that writes the version into the held base (keep_base) and fails part way leaves bytes of
    neither version there: the base is forgotten, nothing is published, and the next publish is a keyframe,
    exact at the subscriber; the one after it keeps its base in the encode again."""
    from _client_util import TinyTrainer, tree_bytes, write_version

    from weightsync.codec import encode_jobs

    trainer = TinyTrainer(seed=37)
    paths = []
    for i in range(5):
        paths.append(write_version(tmp_path / f"v{i}", trainer.export()))
        trainer.step()
    real = encode_jobs.encode_delta_pieces
    calls = {"n": 0, "kept": 0}

    def flaky(*args, **kw):
        calls["n"] += 1
        calls["kept"] += bool(kw.get("keep_base"))
        if kw.get("keep_base") and calls["n"] == 2:
            real(*args, **kw)  # the frame's changes are written into the base, then the encode fails
            raise MemoryError("no memory for the next frame")
        return real(*args, **kw)

    with Publisher(server.url, model) as pub:
        assert [pub.publish(p).kind for p in paths[:3]] == ["keyframe", "delta", "delta"]
        assert pub._base.held() is not None
        monkeypatch.setattr(encode_jobs, "encode_delta_pieces", flaky)
        with pytest.raises(MemoryError):
            pub.publish(paths[3])
        assert calls["kept"] >= 2 and pub._base.held() is None
        assert pub.api.head(model).number == 3  # nothing was published
        calls["n"] = -100  # no more failures
        assert pub.publish(paths[3]).kind == "keyframe"
        r = pub.publish(paths[4])
        assert r.kind == "delta"
    with Subscriber(server.url, model, name="keep-fails") as sub:
        sub.pull(tmp_path / "out")
    assert tree_bytes(tmp_path / "out") == tree_bytes(paths[4])
