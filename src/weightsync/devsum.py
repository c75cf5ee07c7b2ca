"""The tensor checksum (docs/FORMAT.md §10) computed by torch on the tensors' own device.

`apply` checks base and result where the tensors live: a GPU tensor is summed on the
GPU, in chunks, so nothing is copied to the host and scratch memory stays bounded by
the chunk size. The value equals `weightsync.codec.checksum.tensor_sum` of the tensor's
raw bytes, bit for bit (tests/codec/test_checksum.py).

How, without a 64-bit multiply per word: with S0 = Σ u_i and S1 = Σ u_i·i over a lane's
words (i the element's index), the lane is 2·S1 + (2·start + 1)·S0 + C·((start+n)² − start²)
mod 2^64. Words go to int32 in blocks of ROWS elements; within a block u·r < 2^16·2^14 fits
int32, so the block's Σ u·r is one int32 product and an int64 sum, and its offset adds
(block start)·Σ u. About 30 bytes of memory traffic per 16-bit word, a few kernels per
chunk; the host finishes each lane with Python integers (one synchronisation per call).

torch is imported here only: the codec never imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from weightsync.codec.checksum import CONSTANT, MASK, TensorSum, lanes_of
from weightsync.errors import InvalidArgument

DEFAULT_CHUNK = 1 << 22
"""Elements summed per step: scratch is about 8 bytes per word (~64 MB for 4 M 2-byte elements)."""
ROWS = 1 << 14
"""Elements per block: a word (< 2^16) times its row (< 2^14) fits an int32."""


def tensor_sum(tensor: torch.Tensor, *, start: int = 0, chunk: int = DEFAULT_CHUNK) -> TensorSum:
    """The checksum of `tensor`'s elements (row-major), its first element at position `start`.

    Any dtype and device; a non-contiguous tensor is summed from a contiguous copy.
    Sub-byte dtypes count bytes as elements, as the codec does (FORMAT §3).
    """
    return tensor_sums([tensor], starts=[start], chunk=chunk)[0]


def tensor_sums(
    tensors: Sequence[torch.Tensor], *, starts: Sequence[int] | None = None, chunk: int = DEFAULT_CHUNK
) -> list[TensorSum]:
    """The checksum of each tensor (at its start, default 0), summed on its own device.

    Every sum is queued before any result is read back: one synchronisation per device
    for the whole batch, not one per tensor.
    """
    if chunk < 1:
        raise InvalidArgument("chunk must be positive")
    starts = [0] * len(tensors) if starts is None else list(starts)
    if len(starts) != len(tensors):
        raise InvalidArgument("one start per tensor")
    for s in starts:
        if not 0 <= s < (1 << 64):
            raise InvalidArgument(f"start must be in [0, 2^64), got {s}")
    moments = [_moments(t.detach(), chunk) for t in tensors]
    host = [m.cpu().tolist() if m is not None else None for m in moments]
    out = []
    for t, start, m in zip(tensors, starts, host, strict=True):
        width, n = t.element_size(), t.numel()
        if m is None:
            out.append(TensorSum.empty(width))
            continue
        weights = (start + n) ** 2 - start**2
        lanes = tuple((2 * s1 + (2 * start + 1) * s0 + CONSTANT * weights) & MASK for s0, s1 in m)
        out.append(TensorSum(width, n, lanes))
    return out


def change_lanes(before: torch.Tensor, after: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """How a tensor's checksum lanes move when its elements at `positions` go from `before` to `after`.

    `codec.checksum.change_lanes` on the tensors' device: (lanes,) int64 there, mod 2^64
    (:func:`lanes_to_ints` reads it back). `before` and `after` hold the elements (any
    dtype of the tensor's width), one per position; work is proportional to them.
    """
    width = before.element_size()
    lanes_n = lanes_of(width)
    if before.numel() == 0:
        return torch.zeros(lanes_n, dtype=torch.int64, device=before.device)

    def words(t: torch.Tensor) -> torch.Tensor:
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        if width == 1:
            return raw.to(torch.int64).view(-1, 1)
        return (raw.view(torch.int16).to(torch.int64) & 0xFFFF).view(-1, lanes_n)

    weights = positions.to(torch.int64) * 2 + 1
    return ((words(after) - words(before)) * weights.view(-1, 1)).sum(dim=0)


def lanes_to_ints(lanes: torch.Tensor) -> tuple[int, ...]:
    """int64 lanes (from any device) as unsigned 64-bit Python ints."""
    return tuple(int(x) & MASK for x in lanes.cpu().tolist())


def _moments(t: torch.Tensor, chunk: int) -> torch.Tensor | None:
    """(lanes, 2) int64 on the tensor's device: Σ u and Σ u·i of each lane's words (mod 2^64); None if empty."""
    width = t.element_size()
    lanes_n = lanes_of(width)
    n = t.numel()
    if n == 0:
        return None
    raw = t.contiguous().reshape(-1).view(torch.uint8)
    words = (raw if width == 1 else raw.view(torch.int16)).view(n, lanes_n)
    device = t.device
    rows = min(ROWS, chunk)
    step = max(rows, chunk - chunk % rows)
    full = n - n % rows
    acc = torch.zeros(lanes_n, 2, dtype=torch.int64, device=device)
    r = torch.arange(rows, dtype=torch.int32, device=device).view(1, rows, 1)
    for lo in range(0, full, step):
        hi = min(full, lo + step)
        u = words[lo:hi].to(torch.int32)
        if width > 1:
            u.bitwise_and_(0xFFFF)  # int16 sign-extends: the checksum's words are unsigned
        u = u.view(-1, rows, lanes_n)
        s0 = u.sum(dim=1, dtype=torch.int64)  # (blocks, lanes)
        s1 = (u * r).sum(dim=1, dtype=torch.int64)
        first = torch.arange(lo, hi, rows, dtype=torch.int64, device=device).view(-1, 1)
        acc[:, 0] += s0.sum(dim=0)
        acc[:, 1] += (s1 + first * s0).sum(dim=0)
    if full < n:
        u = words[full:].to(torch.int64)
        if width > 1:
            u = u & 0xFFFF
        idx = torch.arange(full, n, dtype=torch.int64, device=device).view(-1, 1)
        acc[:, 0] += u.sum(dim=0)
        acc[:, 1] += (u * idx).sum(dim=0)
    return acc
