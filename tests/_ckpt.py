"""Helpers that build test checkpoints: random tensors of every dtype, written as safetensors."""

from __future__ import annotations

import numpy as np

from weightsync.codec.dtypes import BY_NAME
from weightsync.codec.safetensors import serialize

ALL_DTYPES = sorted(BY_NAME)


def random_bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, 256, n, dtype=np.uint8)


def element_count(dtype: str, shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def mutate(rng: np.random.Generator, data: np.ndarray, width: int, changed: int) -> np.ndarray:
    """A copy of `data` with exactly `changed` elements (of `width` bytes) altered."""
    out = data.copy()
    n = len(data) // width
    if changed == 0 or n == 0:
        return out
    idx = rng.choice(n, size=min(changed, n), replace=False)
    view = out.reshape(n, width)
    flip = rng.integers(1, 256, size=len(idx), dtype=np.uint8)
    view[idx, rng.integers(0, width, size=len(idx))] ^= flip
    return out


def safetensors_file(
    tensors: dict[str, tuple[str, tuple[int, ...], np.ndarray]], metadata: dict[str, str] | None = None
) -> bytes:
    return serialize([(name, dt, shape, data.tobytes()) for name, (dt, shape, data) in tensors.items()], metadata)
