"""The tensor checksum's moments (devsum.py) in one Triton kernel per tensor, for CUDA tensors.

devsum.py's torch path runs about ten kernels per 4 M-element chunk and moves ~30 bytes of
memory per 16-bit word: 30-40 GB/s of model bytes on an H100 (docs/SCALE-RUNS.md, run A and Y).
Here each program reads its block of words once and writes two int64 numbers per lane
(Σ u and Σ u·i over its block); torch adds the blocks' numbers up. Same moments, bit for bit:
integer arithmetic only, wrapping mod 2^64 like the torch path's int64 (the checksum is
defined mod 2^64, FORMAT §10). devsum.py checks this kernel against its torch path on
first use and keeps the torch path if they differ.

Triton is optional (the GPU image has it; CPU installs need not): :func:`available` says
whether it imports; :func:`checked_once` remembers, per kernel kind and device, whether a kernel
(this one, client/staged_triton.py's) agreed with its torch path. ``TRITON_INTERPRET=1`` runs
the kernel on CPU tensors through Triton's interpreter (the tests do, in a subprocess).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch

BLOCK = 1 << 12
"""Elements per program: u·r < 2^16·2^12 and a block's Σ u·r < 2^40, computed in int64 all the same."""


@functools.cache
def available() -> bool:
    """Whether Triton imports here."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # noqa: BLE001 - an import of a GPU toolkit can fail in many ways: all mean "not here"
        return False
    return True


_checked: dict[tuple[Any, ...], bool] = {}
_checked_lock = threading.Lock()


def checked_once(key: tuple[Any, ...], check: Callable[[], bool]) -> bool:
    """`check()`'s answer for `key` (a kernel's kind on a device: :func:`device_key` in it), computed the first
    time the key is asked for and remembered. The checks run one at a time (each may compile a kernel);
    a known answer is read without the lock (the apply asks once per touched tensor, inside the pause)."""
    known = _checked.get(key)
    if known is not None:
        return known
    with _checked_lock:
        if key not in _checked:
            _checked[key] = check()
        return _checked[key]


def device_key(device: Any) -> str:
    """`device` named with its index ("cuda" → "cuda:0" while 0 is the current device): one name per device."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return str(d)


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["n"])  # one kernel whatever the tensor's length (compiled before the pause)
    def moments(words, out, n, LANES: tl.constexpr, MASK: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        first = pid.to(tl.int64) * BLOCK
        r = tl.arange(0, BLOCK)
        idx = first + r  # element index (int64)
        lane = tl.arange(0, LANES)
        offs = idx[:, None] * LANES + lane[None, :]
        ok = (idx < n)[:, None] & (lane[None, :] < LANES)
        u = tl.load(words + offs, mask=ok, other=0).to(tl.int64) & MASK  # unsigned words
        s0 = tl.sum(u, axis=0)  # (LANES,)
        s1 = tl.sum(u * r[:, None].to(tl.int64), axis=0) + first * s0
        base = pid.to(tl.int64) * (2 * LANES)
        tl.store(out + base + lane * 2, s0)
        tl.store(out + base + lane * 2 + 1, s1)

    return moments


def moments(t: torch.Tensor, lanes: int) -> torch.Tensor:
    """(lanes, 2) int64 on `t`'s device: Σ u and Σ u·i of each lane's words, mod 2^64 (devsum._moments)."""
    width = t.element_size()
    n = t.numel()
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    words = raw if width == 1 else raw.view(torch.int16)
    blocks = -(-n // BLOCK)
    out = torch.empty(blocks * lanes * 2, dtype=torch.int64, device=t.device)
    _kernel()[(blocks,)](words, out, n, LANES=lanes, MASK=0xFF if width == 1 else 0xFFFF, BLOCK=BLOCK)
    return out.view(blocks, lanes, 2).sum(dim=0)
