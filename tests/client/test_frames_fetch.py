"""frames_apply.fetch: the frames of a one-step update that change touched tensors, read and checked by the
calling thread, in the manifest's order."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from _ckpt import mutate, safetensors_file

from weightsync.client import frames_apply
from weightsync.client.inplace import _touched
from weightsync.codec import Checkpoint, Encoder
from weightsync.errors import CorruptData


def _update(rng: np.random.Generator):
    """A one-step v2 delta of three tensors (one unchanged) in frames of 4 KiB: its manifest and frame bytes."""
    shapes = {"a": (4096,), "b": (3000,), "c": (1500,)}
    old = {n: rng.integers(0, 256, 2 * s[0], dtype=np.uint8) for n, s in shapes.items()}
    new = {n: (mutate(rng, d, 2, 40) if n != "c" else d.copy()) for n, d in old.items()}

    def ckpt(data):
        body = safetensors_file({n: ("BF16", shapes[n], d) for n, d in data.items()})
        return Checkpoint.from_bytes({"model.safetensors": body})

    encoded = Encoder(threads=1, chunk_bytes=4096).encode(ckpt(new), ckpt(old))
    blobs = {i: fr.data for i, fr in enumerate(encoded.frames)}
    return encoded.manifest, blobs


def test_the_frames_that_change_touched_tensors_are_read_in_order_by_the_calling_thread() -> None:
    manifest, blobs = _update(np.random.default_rng(3))
    names, touched = _touched(manifest, {}, lambda name: name != "b")  # a caller holding all but "b"
    reads: list[tuple[int, threading.Thread]] = []

    def read_frame(ref):
        i = manifest.frames.index(ref)
        reads.append((i, threading.current_thread()))
        return blobs[i]

    fetched = frames_apply.fetch(manifest, names, touched, read_frame)
    wanted = [i for i, r in enumerate(manifest.frames) if any(names.get((p.file, p.seg)) in touched for p in r.pieces)]
    assert wanted and len(wanted) < len(manifest.frames)  # the frames of "b" alone are not read
    assert [i for i, _ in reads] == wanted
    assert {t for _, t in reads} == {threading.current_thread()}
    assert [f.ref for f in fetched] == [manifest.frames[i] for i in wanted]
    assert [bytes(f.blob) for f in fetched] == [bytes(blobs[i]) for i in wanted]
    assert all(any(n is not None for n in f.names) for f in fetched)  # only frames that change a touched tensor
    assert all(f.changes > 0 for f in fetched)


def test_a_frame_whose_header_disagrees_with_the_manifest_is_corrupt() -> None:
    manifest, blobs = _update(np.random.default_rng(4))
    names, touched = _touched(manifest, {}, None)
    first = next(
        i for i, r in enumerate(manifest.frames) if any(names.get((p.file, p.seg)) in touched for p in r.pieces)
    )
    bad = bytearray(blobs[first])
    bad[4] ^= 0xFF  # a byte of its header: the frame no longer checks
    blobs[first] = bytes(bad)
    with pytest.raises(CorruptData):
        frames_apply.fetch(manifest, names, touched, lambda ref: blobs[manifest.frames.index(ref)])
