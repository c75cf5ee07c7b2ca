"""`apply_staged` (client/tensors.py) in one Triton kernel per change, for CUDA tensors.

The torch path expands positions, gathers, writes and (tracking) sums the checksum's move in
about fifteen kernels per step of APPLY_CHUNK changes: for a model of a few hundred tensors
the pause is kernel launches (docs/SCALE-RUNS.md, run Y). Here one program takes CHUNK changes,
finds their positions (block-coded: by a binary search of the blocks' first changes), reads,
writes, and sums the move of each checksum lane (FORMAT §10: Σ (new word − old word) ·
(2·position + 1), mod 2^64) into one int64 per lane; torch adds the programs' numbers up.

Same bytes and lanes as the torch path: integer arithmetic only, the element's integer
view wrapping like two's complement. tensors.py checks this kernel against the torch path
on first use per device and keeps the torch path if they differ. ``TRITON_INTERPRET=1``
runs it on CPU tensors (the tests do, in a subprocess).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

CHUNK = 1024
"""Changes per program. A block-coded change finds each change's block by a binary search of the blocks'
first changes (STEPS loads from a small array that stays in cache): no loop bound depends on the data."""


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    # One compiled kernel per kind of change (the constexprs): Triton would otherwise also specialise on
    # whether the counts are multiples of 16 and the arrays' addresses of 16 bytes, and a variant first met
    # by a real tensor would compile inside the pause instead of in `prepare` (5.8 s at first use).
    @triton.jit(
        do_not_specialize=["n", "nblocks"],
        do_not_specialize_on_alignment=["view", "operands", "positions", "low", "blocks", "starts", "moved"],
    )
    def apply_changes(
        view,
        operands,
        positions,
        low,
        blocks,
        starts,
        moved,
        n,
        nblocks,
        OP: tl.constexpr,  # 0 add, 1 subtract, 2 xor
        BLOCKED: tl.constexpr,
        STEPS: tl.constexpr,  # binary-search steps: 2^STEPS >= nblocks
        TRACK: tl.constexpr,
        LANES: tl.constexpr,
        WORD: tl.constexpr,  # the checksum word's mask: 0xFF for 1-byte elements, else 0xFFFF
        BLOCK_BITS: tl.constexpr,
        CHUNK: tl.constexpr,
    ):
        pid = tl.program_id(0)
        c = pid.to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
        ok = c < n
        if BLOCKED:
            # The block of change c: the last b with starts[b] <= c (starts ascend, starts[0] = 0).
            lo = tl.zeros((CHUNK,), dtype=tl.int64)
            hi = tl.zeros((CHUNK,), dtype=tl.int64) + nblocks
            for _ in tl.static_range(STEPS):
                mid = (lo + hi) >> 1
                go = tl.load(starts + mid, mask=ok & (mid < nblocks), other=n) <= c
                lo = tl.where(go, mid, lo)
                hi = tl.where(go, hi, mid)
            block = tl.load(blocks + lo, mask=ok, other=0).to(tl.int64) << BLOCK_BITS
            pos = block + (tl.load(low + c, mask=ok, other=0).to(tl.int64) & ((1 << BLOCK_BITS) - 1))
        else:
            pos = tl.load(positions + c, mask=ok, other=0).to(tl.int64)
        op = tl.load(operands + c, mask=ok, other=0)
        old = tl.load(view + pos, mask=ok, other=0)
        wide_old = old.to(tl.int64)
        if OP == 0:
            new = (wide_old + op.to(tl.int64)).to(old.dtype)
        elif OP == 1:
            new = (wide_old - op.to(tl.int64)).to(old.dtype)
        else:
            new = old ^ op
        tl.store(view + pos, new, mask=ok)
        if TRACK:
            weight = pos * 2 + 1
            wide_new = new.to(tl.int64)
            for j in tl.static_range(LANES):
                d = ((wide_new >> (16 * j)) & WORD) - ((wide_old >> (16 * j)) & WORD)
                tl.store(moved + pid * LANES + j, tl.sum(tl.where(ok, d * weight, 0), axis=0))

    return apply_changes


def block_starts(counts: torch.Tensor) -> torch.Tensor:
    """Each block's first change, from a block-coded change's per-block counts: their exclusive cumulative
    sum (int64; what the kernel's binary search reads). `prepare` makes it ahead (tensors.ready_to_apply)."""
    return torch.cumsum(counts, 0) - counts


def apply(view: torch.Tensor, staged: Any, *, track: bool, inverse: bool, block_bits: int, lanes: int) -> Any:
    """Apply `staged` (a StagedChange) to `view` (the tensor's flat signed-integer view) in place; with `track`,
    the move of its checksum lanes as (programs, lanes) int64 on the device whose rows add up (mod 2^64) to the
    move (``devsum.lanes_to_ints`` adds them on the host: no reduction kernel per tensor in the pause), else None.

    One kernel launch, nothing else queued on the device when `prepare` made the blocks' first changes
    (``StagedChange.starts``, tensors.ready_to_apply)."""
    width = view.element_size()
    op = 2 if not staged.add else (1 if inverse else 0)
    blocked = staged.positions is None
    n = int(staged.operands.numel())
    programs = -(-n // CHUNK)
    if programs == 0:
        return torch.zeros(lanes, dtype=torch.int64, device=view.device) if track else None
    nblocks = int(staged.counts.numel()) if blocked else 0
    if not blocked:
        starts = staged.operands
    else:
        starts = staged.starts if staged.starts is not None else block_starts(staged.counts)
    moved = torch.empty(programs * lanes if track else 1, dtype=torch.int64, device=view.device)
    _kernel()[(programs,)](
        view,
        staged.operands,
        staged.operands if blocked else staged.positions,
        staged.low if blocked else staged.operands,
        staged.blocks if blocked else staged.operands,
        starts,
        moved,
        n,
        nblocks,
        OP=op,
        BLOCKED=blocked,
        STEPS=16 if nblocks <= 1 << 16 else 32,
        TRACK=track,
        LANES=lanes,
        WORD=0xFF if width == 1 else 0xFFFF,
        BLOCK_BITS=block_bits,
        CHUNK=CHUNK,
    )
    return moved.view(programs, lanes) if track else None
