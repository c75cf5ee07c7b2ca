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
On CUDA, where Triton runs and agrees with this path, one kernel per tensor computes the
same moments reading each word once (devsum_triton.py).

torch is imported here and in devsum_triton.py only: the codec never imports torch.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from weightsync.codec.checksum import CONSTANT, MASK, TensorSum, lanes_of
from weightsync.errors import InvalidArgument

DEFAULT_CHUNK = 1 << 22
"""Elements summed per step: scratch is about 8 bytes per word (~64 MB for 4 M 2-byte elements)."""
log = logging.getLogger(__name__)

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
    host = read_back([_moments(t.detach(), chunk) for t in tensors])
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
    """int64 lanes (from any device) as unsigned 64-bit Python ints: a (lanes,) tensor, or (rows, lanes)
    whose rows add up (mod 2^64) to the lanes (the Triton apply's per-program moves)."""
    return lanes_to_ints_many([lanes])[0]


def lanes_to_ints_many(many: Sequence[torch.Tensor]) -> list[tuple[int, ...]]:
    """:func:`lanes_to_ints` of each, read back in one copy per device (:func:`read_back`)."""
    out = []
    for got in _copy_back(many):
        assert got is not None
        rows = got.reshape(-1, got.shape[-1]).view(np.uint64)
        out.append(tuple(int(x) for x in rows.sum(axis=0, dtype=np.uint64)))  # numpy's uint64 sum wraps mod 2^64
    return out


def read_back(tensors: Sequence[torch.Tensor | None]) -> list[Any]:
    """Each tensor's ``.tolist()`` (None stays None), with one device→host copy per device, not one per tensor.

    A read back of a small CUDA tensor is a copy and a synchronisation of its own (~10 µs on the H100
    box): at 184 tensors, most of the pause's result check when each was read alone (run Y4: 3.4 ms).
    """
    return [None if a is None else a.tolist() for a in _copy_back(tensors)]


def _copy_back(tensors: Sequence[torch.Tensor | None]) -> list[np.ndarray | None]:
    """Each tensor as a host numpy array of its shape (None stays None): the tensors of one device and dtype
    flattened into one, copied once, and cut back."""
    out: list[np.ndarray | None] = [None] * len(tensors)
    groups: dict[tuple[Any, Any], list[tuple[int, torch.Tensor]]] = {}
    for i, t in enumerate(tensors):
        if t is not None:
            groups.setdefault((t.device, t.dtype), []).append((i, t))
    for group in groups.values():
        parts = [t.detach().reshape(-1) for _, t in group]
        flat = (torch.cat(parts) if len(parts) > 1 else parts[0]).cpu().numpy()
        at = 0
        for i, t in group:
            n = t.numel()
            out[i] = flat[at : at + n].reshape(tuple(t.shape))
            at += n
    return out


def _moments(t: torch.Tensor, chunk: int) -> torch.Tensor | None:
    """(lanes, 2) int64 on the tensor's device: Σ u and Σ u·i of each lane's words (mod 2^64); None if empty.

    CUDA tensors go through one Triton kernel (devsum_triton.py) where it runs and agrees with
    the torch path below (checked once per device: :func:`_triton_agrees`); else the torch path.
    """
    if t.numel() == 0:
        return None
    if t.is_cuda and _triton_agrees(t.device, t.element_size()):
        from weightsync import devsum_triton

        return devsum_triton.moments(t, lanes_of(t.element_size()))
    return _torch_moments(t, chunk)


def _triton_agrees(device: torch.device, width: int) -> bool:
    """Whether the Triton kernel runs on `device` and gives the torch path's moments for `width`-byte elements
    on test tensors (a partial last block, words with the high bit set). Decided the first time a width is
    met on a device (each width is its own compiled kernel); a failure is logged and the torch path kept."""
    from weightsync import devsum_triton

    key = ("checksum", devsum_triton.device_key(device), width)
    return devsum_triton.checked_once(key, lambda: _check_triton(device, width))


def warm(device: torch.device | str, width: int) -> None:
    """Compile and check the checksum's kernel for `width`-byte elements on CUDA `device` now (not mid-apply)."""
    if torch.device(device).type == "cuda":
        _triton_agrees(torch.device(device), width)


def _check_triton(device: torch.device, width: int) -> bool:
    from weightsync import devsum_triton

    if not devsum_triton.available():
        return False
    dtype = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[width]
    gen = torch.Generator(device="cpu").manual_seed(11)
    try:
        for n in (1, devsum_triton.BLOCK + 3, 3 * devsum_triton.BLOCK):
            raw = torch.randint(0, 256, (n * width,), generator=gen, dtype=torch.uint8)
            t = raw.view(dtype).to(device)
            if not torch.equal(devsum_triton.moments(t, lanes_of(width)), _torch_moments(t, DEFAULT_CHUNK)):
                log.warning("the Triton checksum kernel disagrees with torch on %s: using torch", device)
                return False
    except Exception as exc:  # noqa: BLE001 - a kernel that cannot compile or launch here: torch serves
        log.warning("the Triton checksum kernel does not run on %s (%s): using torch", device, exc)
        return False
    return True


def _torch_moments(t: torch.Tensor, chunk: int) -> torch.Tensor:
    """:func:`_moments` with torch ops, chunk by chunk (the reference for the Triton kernel)."""
    width = t.element_size()
    lanes_n = lanes_of(width)
    n = t.numel()
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
