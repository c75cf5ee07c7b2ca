"""`prepare`'s host memory is bounded by the update, not by the model (issue 11; docs/DESIGN.md "What `prepare`
holds").

The same number of changed elements in a model 16 times larger must not cost `prepare` more memory: for host
tensors it keeps the update's frames (fetched already) and decodes nothing; for a device it holds the frames'
sections and their staged form (or, on the reference path, the decoded changes), a fixed number of bytes per
changed element. Measured with tracemalloc, which numpy's allocations report to.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
import torch

from weightsync.client import inplace
from weightsync.client.tensors import serialize_state_dict
from weightsync.codec.checkpoint import Checkpoint
from weightsync.codec.encoder import Encoder

CHANGES = 20_000
"""Elements changed per version, whatever the model's size."""

PER_CHANGE = 24
"""Bytes a device's `prepare` may hold at its peak per changed bf16 element (docs/DESIGN.md: 9-16 measured staged
from the frames, ~21 on the reference path, at this size)."""


def _step(elements: int, seed: int) -> tuple[Checkpoint, Checkpoint]:
    """A bf16 model of `elements` elements in 4 tensors and a next version changing CHANGES of them."""
    rng = np.random.default_rng(seed)
    words = rng.integers(0, 1 << 16, elements, dtype=np.uint16)
    new = words.copy()
    at = rng.choice(elements, CHANGES, replace=False)
    new[at] ^= rng.integers(1, 1 << 16, CHANGES, dtype=np.uint16)

    def ck(w: np.ndarray) -> Checkpoint:
        parts = np.array_split(w, 4)
        sd = {
            f"layer{i}.weight": torch.from_numpy(p.view(np.int16).copy()).view(torch.bfloat16)
            for i, p in enumerate(parts)
        }
        return Checkpoint.from_bytes({"model.safetensors": serialize_state_dict(sd).tobytes()})

    return ck(words), ck(new)


def _peak(base: Checkpoint, new: Checkpoint, device: str | None) -> tuple[int, int]:
    """(tracemalloc's peak during `prepare`, the update's frame bytes)."""
    encoded = Encoder(chunk_bytes=1 << 20, threads=2).encode(new, base)
    area = b"".join(fr.data for fr in encoded.frames)
    starts = np.cumsum([0] + [len(fr.data) for fr in encoded.frames])
    manifest = encoded.with_locations(lambda i, fr: (None, int(starts[i])))

    def prepare():
        return inplace.prepare(
            [manifest],
            lambda ref: memoryview(area)[ref.offset : ref.offset + ref.length],
            model="m",
            base=1,
            target=2,
            threads=2,
            device=device,
        )

    warm = prepare()  # pools and per-thread scratch exist before the measured call
    assert warm.changed_elements == CHANGES
    del warm
    tracemalloc.start()
    try:
        prepared = prepare()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert prepared.changed_elements == CHANGES
    return peak, len(area)


STAGED_PER_CHANGE = 8
"""The same for a device's update staged straight from its frames, beside STAGED_FIXED (client/stage_frames.py:
the frames' sections and the staged form; measured 180 and 322 KB in all at the two sizes below, where the
reference path holds 335 and 431)."""
STAGED_FIXED = 192 << 10


@pytest.mark.parametrize("device,staged", [(None, "0"), ("cpu", "0"), ("cpu", "1")], ids=["host", "ref", "staged"])
def test_prepare_holds_what_the_update_needs_whatever_the_model_size(device, staged, monkeypatch) -> None:
    monkeypatch.setenv("WEIGHTSYNC_STAGE_FRAMES", staged)  # "1": staged from the frames even "on" the CPU
    small = _peak(*_step(1 << 20, seed=1), device)  # 2 MiB of bf16
    large = _peak(*_step(1 << 24, seed=2), device)  # 32 MiB, the same number of changes
    for peak, frames in (small, large):
        if device is None:  # host tensors: the frames are patched from at apply; nothing decoded
            assert peak <= frames + (256 << 10), (peak, frames)
        else:  # a device: the decoded changes (or the frames' sections), a few bytes each, staged there
            bound = STAGED_PER_CHANGE * CHANGES + STAGED_FIXED if staged == "1" else PER_CHANGE * CHANGES + (256 << 10)
            assert peak <= bound, (peak, CHANGES)
    # 16x the model, the same changes: not 16x the memory
    assert large[0] <= 2 * small[0] + (256 << 10), (small, large)
