"""A real vLLM server with weightsync's worker extension, and what the in-process tests count in checkpoints.

``_vllm.VllmServer`` builds its command in its constructor; :class:`InProcessServer` is the same
server with ``--worker-extension-cls`` added, and without its ``ONEDNN_MAX_CPU_ISA=AVX2`` cap: on a
CPU with AVX-512 BF16 vLLM then packs the Linear layers for oneDNN, and the in-process tests cover the
layer-wise reload of packed modules as well as the element update (test_vllm_inprocess.py docstring).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from _vllm import VllmServer

from weightsync.engines.vllm_inprocess import WORKER_EXTENSION


class InProcessServer(VllmServer):
    """``_vllm.VllmServer`` plus ``--worker-extension-cls weightsync.engines.vllm_worker.Worker``, oneDNN uncapped."""

    def __init__(self, python: Path, model_dir: Path, log_path: Path) -> None:  # noqa: D107
        super().__init__(
            python, model_dir, log_path, extra_args=["--worker-extension-cls", WORKER_EXTENSION], cap_onednn=False
        )


def tensors(directory: Path) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint directory's ``model.safetensors`` as raw 16-bit words (bf16 bits)."""
    raw = (directory / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        assert entry["dtype"] == "BF16", entry
        start, end = entry["data_offsets"]
        out[name] = np.frombuffer(raw[8 + n + start : 8 + n + end], dtype=np.uint16)
    return out


def changed_elements(old: Path, new: Path) -> dict[str, int]:
    """Per checkpoint tensor, how many elements differ between two versions (bit for bit); only those > 0."""
    a, b = tensors(old), tensors(new)
    assert a.keys() == b.keys()
    counts = {name: int(np.count_nonzero(a[name] != b[name])) for name in a}
    return {k: v for k, v in counts.items() if v}
