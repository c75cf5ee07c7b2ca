"""frames_apply.fetch: the frames of a one-step update that change touched tensors, read and checked; small
updates by the calling thread, large ones on the pool, with the same result."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from _ckpt import mutate, safetensors_file

from weightsync.client import frames_apply
from weightsync.client.inplace import _touched
from weightsync.codec import Checkpoint, Encoder
from weightsync.errors import CorruptData


class NoPool(ThreadPoolExecutor):
    def submit(self, *args, **kwargs):  # noqa: ANN002, ANN003 - the test fails if a job reaches the pool
        raise AssertionError("a small update's frames went to the pool")


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


def test_a_small_update_is_fetched_by_the_calling_thread_and_a_large_one_on_the_pool(monkeypatch) -> None:
    manifest, blobs = _update(np.random.default_rng(3))
    names, touched = _touched(manifest, {}, None)
    reads: list[int] = []

    def read_frame(ref):
        i = manifest.frames.index(ref)
        reads.append(i)
        return blobs[i]

    with NoPool(1) as no_pool:
        inline = frames_apply.fetch(manifest, names, touched, read_frame, no_pool)
    inline_reads = sorted(reads)
    assert inline and [f.ref for f in inline] == [r for r in manifest.frames if manifest.frames.index(r) in reads]
    assert all(any(n is not None for n in f.names) for f in inline)  # only frames that change a touched tensor
    reads.clear()
    monkeypatch.setattr(frames_apply, "INLINE_FETCH_BYTES", 0)
    with ThreadPoolExecutor(2) as pool:
        pooled = frames_apply.fetch(manifest, names, touched, read_frame, pool)
    assert sorted(reads) == inline_reads
    assert [(f.ref, bytes(f.blob), f.names, f.changes) for f in pooled] == [
        (f.ref, bytes(f.blob), f.names, f.changes) for f in inline
    ]


@pytest.mark.parametrize("inline_bytes", [frames_apply.INLINE_FETCH_BYTES, 0])
def test_a_frame_whose_header_disagrees_with_the_manifest_is_corrupt_either_way(monkeypatch, inline_bytes) -> None:
    manifest, blobs = _update(np.random.default_rng(4))
    names, touched = _touched(manifest, {}, None)
    first = next(
        i for i, r in enumerate(manifest.frames) if any(names.get((p.file, p.seg)) in touched for p in r.pieces)
    )
    bad = bytearray(blobs[first])
    bad[4] ^= 0xFF  # a byte of its header: the frame no longer checks
    blobs[first] = bytes(bad)
    monkeypatch.setattr(frames_apply, "INLINE_FETCH_BYTES", inline_bytes)
    with ThreadPoolExecutor(2) as pool, pytest.raises(CorruptData):
        frames_apply.fetch(manifest, names, touched, lambda ref: blobs[manifest.frames.index(ref)], pool)
