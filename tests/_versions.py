"""Small consecutive test versions of a model: a safetensors file plus a config, in memory."""

from __future__ import annotations

import numpy as np
from _ckpt import safetensors_file

from weightsync.codec import Checkpoint


def model_files(seed: int = 0, n: int = 6) -> dict[str, tuple[str, tuple[int, ...], np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = {}
    for i in range(n):
        dt, shape = ("BF16", (128, 96)) if i % 2 == 0 else ("F32", (64,))
        nbytes = 2 * 128 * 96 if dt == "BF16" else 4 * 64
        out[f"layer.{i}.weight"] = (dt, shape, rng.integers(0, 256, nbytes, dtype=np.uint8))
    return out


def next_step(tensors, seed: int, fraction: float = 0.02):
    rng = np.random.default_rng(seed)
    out = {}
    for name, (dt, shape, data) in tensors.items():
        d = data.copy()
        idx = rng.choice(len(d), size=max(1, int(len(d) * fraction)), replace=False)
        d[idx] ^= 1
        out[name] = (dt, shape, d)
    return out


def checkpoint(tensors, step: int = 0) -> Checkpoint:
    return Checkpoint.from_bytes(
        {"model.safetensors": safetensors_file(tensors, {"step": str(step)}), "config.json": b'{"hidden": 96}'}
    )
