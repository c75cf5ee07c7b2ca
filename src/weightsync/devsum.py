"""The tensor checksum (docs/FORMAT.md §10) computed by torch on the tensor's own device.

`apply` checks base and result where the tensors live: a GPU tensor is summed on the
GPU, in chunks, with plain int64 operations (they wrap mod 2^64 on CPU and CUDA, which
is the checksum's arithmetic), so nothing is copied to the host and scratch memory stays
bounded by the chunk size. The value equals `weightsync.codec.checksum.tensor_sum` of the
tensor's raw bytes, bit for bit (tests/codec/test_checksum.py).

torch is imported here only: the codec never imports torch.
"""

from __future__ import annotations

import torch

from weightsync.codec.checksum import CONSTANT, MASK, TensorSum, lanes_of
from weightsync.errors import InvalidArgument

DEFAULT_CHUNK = 1 << 22
"""Elements summed per step: scratch is about 24 bytes per element and lane (~100 MB for 2-byte elements)."""

_C_SIGNED = CONSTANT - (1 << 64) if CONSTANT >= 1 << 63 else CONSTANT  # the same 64 bits as an int64


def tensor_sum(tensor: torch.Tensor, *, start: int = 0, chunk: int = DEFAULT_CHUNK) -> TensorSum:
    """The checksum of `tensor`'s elements (row-major), its first element at position `start`.

    Any dtype and device; a non-contiguous tensor is summed from a contiguous copy.
    Sub-byte dtypes count bytes as elements, as the codec does (FORMAT §3). The
    result is read back to the host (one small synchronisation per call).
    """
    if chunk < 1:
        raise InvalidArgument("chunk must be positive")
    if not 0 <= start < (1 << 64):
        raise InvalidArgument(f"start must be in [0, 2^64), got {start}")
    width = tensor.element_size()
    lanes_n = lanes_of(width)
    count = tensor.numel()
    if count == 0:
        return TensorSum.empty(width)
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    words = raw if width == 1 else raw.view(torch.int16).view(-1, lanes_n)
    device = tensor.device
    lanes = torch.zeros(lanes_n, dtype=torch.int64, device=device)
    start_signed = start - (1 << 64) if start >= 1 << 63 else start
    for lo in range(0, count, chunk):
        hi = min(count, lo + chunk)
        part = words[lo:hi]
        u = part.to(torch.int64)
        if width > 1:
            u = u & 0xFFFF  # int16 sign-extends: the checksum's words are unsigned
        u = u.view(-1, lanes_n) + _C_SIGNED
        weights = torch.arange(lo, hi, dtype=torch.int64, device=device)
        weights = (weights + start_signed) * 2 + 1
        lanes += (u * weights[:, None]).sum(dim=0)
    return TensorSum(width, count, tuple(int(x) & MASK for x in lanes.tolist()))
