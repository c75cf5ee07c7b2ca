"""A device's update staged straight from its frames: one pass per frame writes the staged form.

`inplace.prepare` for tensors on a device used to decode every frame into per-tensor
changes (int64 positions, operands: 10 bytes a change), compose a tensor's pieces, code
the positions compactly (client/tensors.py ``code_change``) and copy the result into one
host buffer for the device: four passes over every change after the decompression, three
of them on the calling thread. Here, for an update of one step, each sparse delta frame (what
an optimizer step gives) is read twice by native code with the GIL released (codec/_kernels.c):

1. ``piece_blocks``: per piece, its changes and the blocks of 2^16 elements of its tensor
   that hold them (frames decompressed once, on the pool);
2. a layout, on the calling thread, per tensor and not per change: how each tensor is coded
   (block-coded or int32/int64 positions, by ``code_change``'s rule on its totals), where its
   arrays lie in the one host buffer, and where each piece writes into them;
3. ``stage_pieces``: every piece's operands, positions (their low 16 bits, or whole) and block
   counts written where the layout says (on the pool); a block shared by two pieces of a tensor
   (a frame boundary inside it) is completed from the second piece's carry.

The staged arrays are then the views of that buffer that ``stage_changes`` would have
made, byte for byte (``tests/client/test_stage_frames.py`` checks this against the reference
path), and move to the device in one copy. The decoded changes are not kept: a tensor's
``ops`` makes its Change from the host copy (4 bytes a change for bf16) only when asked for
(``tensors.HostOps``). A tensor with a piece in a dense frame (every element of a norm changed),
with pieces out of order or of both kinds (XOR, ADD) is left to the reference path, in the same
update; updates of several steps (which compose) take it whole.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from weightsync import errors
from weightsync.client._pool import run_all
from weightsync.client.tensors import (
    BLOCK_BITS,
    HostOps,
    StagedChange,
    aligned,
    apply_spans,
    block_coded,
    index_dtype,
    move_staged,
    staging_buffer,
)
from weightsync.codec import kernels
from weightsync.codec.decoder import check_frame
from weightsync.codec.dtypes import by_name
from weightsync.codec.frame import METHOD_SPARSE, parse_header, sparse_sections
from weightsync.codec.manifest import FrameRef, Manifest
from weightsync.codec.values import keyframe_bytes

# Columns of a frame's table for stage_pieces (codec/_kernels_loops.h, T_*).
_BOUND, _OFFSET, _MODE, _MERGE, _OPS, _POS, _BLOCKS, _COUNTS, _CHANGES, _SLOTS = range(10)
_COLUMNS = 10
# Staging modes (STAGE_*).
_SKIP, _BLOCKS32, _BLOCKS64, _POS32, _POS64 = range(5)


class _NotStaged(Exception):  # noqa: N818 - an internal signal: this update takes the reference path
    """The update has a frame or a layout the native staging does not take."""


def available(device: Any) -> bool:
    """Whether `prepare` for tensors on `device` stages from the frames: the native kernels are the active ones
    (not the numpy reference) and the device is not the host. ``WEIGHTSYNC_STAGE_FRAMES=0`` selects the
    reference path, ``=1`` takes this one for the host too (measurements, tests: a host apply then decodes
    each change from its staged copy inside the pause, where the reference path decoded it ahead)."""
    ext = kernels.EXTENSION
    choice = os.environ.get("WEIGHTSYNC_STAGE_FRAMES")
    if choice == "0" or ext is None or kernels.active() is not kernels.NATIVE:
        return False
    if getattr(ext, "STAGE_BITS", None) != BLOCK_BITS or getattr(ext, "STAGE_COLUMNS", None) != _COLUMNS:
        return False
    return choice == "1" or str(device).split(":")[0] != "cpu"


@dataclass
class _Frame:
    """A sparse delta frame after the first pass: its sections, its pieces and what each holds."""

    ref: FrameRef
    add: bool
    width: int
    count: int
    gaps: list[np.ndarray]
    values: list[np.ndarray]
    names: list[str | None]
    """Per piece, the touched tensor it belongs to (None: a tensor this update does not change)."""
    table: np.ndarray
    """(pieces, _COLUMNS) int64: bounds and offsets now, the layout after the second step."""
    changes: np.ndarray
    blocks: np.ndarray
    first: np.ndarray
    last: np.ndarray


@dataclass
class _Layout:
    """One tensor's staged arrays in the host buffer: byte offsets (None: not this coding) and sizes."""

    add: bool
    changes: int
    slots: int
    mode: int
    ops: int
    pos: int
    blocks: int | None
    counts: int | None
    merged: list[tuple[_Frame, int, int]]
    """(frame, piece, slot): pieces whose first block continues the slot before theirs."""


def stage_step(
    manifest: Manifest,
    read_frame: Callable[[FrameRef], Any],
    pool: ThreadPoolExecutor,
    names: Mapping[tuple[int, int], str],
    touched: set[str],
    updates: Mapping[str, Any],
    device: Any,
    *,
    per_job: int = 1,
) -> set[str] | None:
    """Stage one step's changes of the `touched` tensors on `device` from its frames; the tensors it left for the
    reference path (None: all of them).

    `updates` are the step's TensorUpdates (``inplace._touched``): whole replacements get their bytes
    from keyframe frames, element updates their ``staged`` change (and ``ops`` made from it on demand).
    A tensor with a piece in a dense delta frame, with pieces out of order or of both kinds (XOR and
    ADD) is left as it is, for the caller to decode and stage the reference way; None when the whole
    update needs it (a delta piece of a tensor replaced whole, a zero operand): nothing is on `device`
    then, and the replacements' bytes may be partly written (the caller starts afresh). Bad frames
    raise as the reference path's decode does. Frames go `per_job` to a pool job
    (inplace._frames_per_job: a job per frame costs the pool's hand-over per frame).
    """
    ext = kernels.EXTENSION
    assert ext is not None
    left: set[str] = set()  # tensors for the reference path
    lock = threading.Lock()

    def first_pass(ref: FrameRef) -> _Frame | None:
        wanted = [names.get((p.file, p.seg)) for p in ref.pieces]
        wanted = [n if n is not None and n in touched else None for n in wanted]
        if all(n is None for n in wanted):
            return None
        blob = read_frame(ref)
        check_frame(manifest, ref, blob)
        width = by_name(ref.dtype).width
        if sum(p.length for p in ref.pieces) != ref.raw_len:
            raise errors.CorruptData(f"a frame of {ref.object}: its pieces do not cover its {ref.raw_len} bytes")
        if not ref.delta:
            data = keyframe_bytes(blob)
            pos = 0
            for p, name in zip(ref.pieces, wanted, strict=True):
                if name is not None:
                    u = updates[name]
                    if u.replace is None:  # a keyframe frame holds only tensors replaced whole
                        raise _NotStaged
                    u.replace[p.offset : p.offset + p.length] = data[pos : pos + p.length]
                pos += p.length
            return None
        head = parse_header(blob)
        if head.method != METHOD_SPARSE:  # a dense delta: its tensors the reference way (not decompressed here)
            with lock:
                left.update(n for n in wanted if n is not None)
            return None
        count, gaps, values = sparse_sections(blob, head)
        n = len(ref.pieces)
        table = np.zeros((n, _COLUMNS), dtype=np.int64)
        table[1:, _BOUND] = np.cumsum([p.length // width for p in ref.pieces[:-1]])
        table[:, _OFFSET] = [p.offset // width for p in ref.pieces]
        stats = [np.empty(n, dtype=np.int64) for _ in range(4)]
        bounds, offsets = np.ascontiguousarray(table[:, _BOUND]), np.ascontiguousarray(table[:, _OFFSET])
        end = ext.piece_blocks(count, gaps, bounds, offsets, *stats)
        if end > head.raw_len // width:
            raise errors.CorruptData("sparse frame position past the end of the chunk")
        table[:, _CHANGES] = stats[0]  # every piece's changes, those passed over too
        return _Frame(ref, head.add, width, count, gaps, values, wanted, table, *stats)

    refs = manifest.frames
    try:
        firsts = run_all(pool, lambda i: [first_pass(r) for r in refs[i : i + per_job]], range(0, len(refs), per_job))
        frames = [f for batch in firsts for f in batch if f is not None]
        host, layouts = _lay_out(frames, updates, left, device)
    except _NotStaged:
        return None

    def second_pass(f: _Frame) -> np.ndarray:
        carry = np.empty(len(f.table), dtype=np.int64)
        done = ext.stage_pieces(f.count, f.gaps, f.values, f.width, int(f.add), f.table, host, carry)
        if done == 0:
            raise errors.CorruptData(f"a frame of {f.ref.object} decoded differently on its second pass")
        if done == 2:
            raise _NotStaged  # a zero operand: the reference path drops such a change
        return carry

    try:
        seconds = run_all(
            pool, lambda i: [second_pass(f) for f in frames[i : i + per_job]], range(0, len(frames), per_job)
        )
    except _NotStaged:
        return None
    carries = [c for batch in seconds for c in batch]
    carried = {id(f): c for f, c in zip(frames, carries, strict=True)}
    laid: list[tuple[str, StagedChange]] = []
    for name, lay in layouts.items():
        staged = _staged(host, lay, updates[name], carried)
        laid.append((name, staged))
    moved = move_staged([s for _, s in laid], host, device)
    for (name, on_host), on_device in zip(laid, moved, strict=True):
        u = updates[name]
        u.staged = [on_device]
        u.ops = HostOps(on_host)
    for name in touched - left:
        u = updates[name]
        if u.replace is None and name not in layouts:
            u.ops, u.staged = (), []  # no change left: the caller drops the update
    return left


def _lay_out(
    frames: list[_Frame], updates: Mapping[str, Any], left: set[str], device: Any
) -> tuple[np.ndarray, dict[str, _Layout]]:
    """The host buffer for every touched tensor's staged arrays (``staging_buffer`` for `device`: page-locked
    for a CUDA one) and where each goes; each frame's table filled
    in (mode, merge, offsets, counts). Tensors in `left`, and those whose pieces do not ascend through
    them or mix XOR and ADD (added to `left`), are not laid out: their pieces stay skipped."""
    pieces: dict[str, list[tuple[_Frame, int]]] = {}
    for f in frames:
        for i, name in enumerate(f.names):
            if name is not None:
                pieces.setdefault(name, []).append((f, i))
    layouts: dict[str, _Layout] = {}
    total = 0
    for name, held in pieces.items():
        u = updates[name]
        if u.replace is not None:
            raise _NotStaged  # a tensor replaced whole and changed by a delta in one step: not from this codec
        if name in left:
            continue
        end = 0
        changes = slots = 0
        last_block = -1
        merged: list[tuple[_Frame, int, int]] = []
        ordered = True
        for f, i in held:
            offset = int(f.table[i, _OFFSET])
            if offset < end:
                ordered = False  # pieces out of order: the reference path composes them
                break
            end = offset + int(f.ref.pieces[i].length // f.width)
            if not f.changes[i]:
                continue
            joins = int(f.first[i]) == last_block
            if joins:
                merged.append((f, i, slots - 1))
            changes += int(f.changes[i])
            slots += int(f.blocks[i]) - joins
            last_block = int(f.last[i])
        adds = {f.add for f, i in held if f.changes[i]}
        if not ordered or len(adds) > 1:  # (XOR and ADD pieces in one tensor do not commute)
            left.add(name)
            continue
        if not changes:
            continue
        width = u.dtype.width
        index = index_dtype(int(np.prod(u.shape, dtype=np.int64)))  # code_change's rules, on the totals
        wide = index is np.int64
        blocked = block_coded(slots, changes)
        isz = 8 if wide else 4
        ops = total
        total += aligned(changes * width)
        pos = total
        total += aligned(changes * (2 if blocked else isz))
        blocks_at = counts_at = None
        if blocked:
            blocks_at = total
            total += aligned(slots * isz)
            counts_at = total
            total += aligned(slots * 8)
        mode = (_BLOCKS64 if wide else _BLOCKS32) if blocked else (_POS64 if wide else _POS32)
        layouts[name] = _Layout(adds.pop(), changes, slots, mode, ops, pos, blocks_at, counts_at, merged)
        done = done_slots = 0
        joined = {(id(f), i) for f, i, _ in merged}
        for f, i in held:
            n = int(f.changes[i])
            if not n:
                continue
            joins = (id(f), i) in joined
            row = f.table[i]
            row[_MODE], row[_MERGE] = mode, int(joins)
            row[_OPS] = ops + done * width
            row[_POS] = pos + done * (2 if blocked else isz)
            if blocked:
                assert blocks_at is not None and counts_at is not None
                row[_BLOCKS] = blocks_at + done_slots * isz
                row[_COUNTS] = counts_at + done_slots * 8
                row[_SLOTS] = int(f.blocks[i]) - joins
            done += n
            done_slots += int(f.blocks[i]) - joins
    return staging_buffer(total, device), layouts


def _staged(host: np.ndarray, lay: _Layout, u: Any, carried: Mapping[int, np.ndarray]) -> StagedChange:
    """A tensor's StagedChange as views of `host` (its merged blocks' counts completed), with its apply steps."""
    signed = u.dtype.numpy_int
    operands = host[lay.ops : lay.ops + lay.changes * u.dtype.width].view(signed)
    wide = lay.mode in (_BLOCKS64, _POS64)
    index = np.int64 if wide else np.int32
    if lay.mode in (_POS32, _POS64):
        positions = host[lay.pos : lay.pos + lay.changes * (8 if wide else 4)].view(index)
        return StagedChange(lay.add, operands, positions=positions)
    assert lay.blocks is not None and lay.counts is not None
    low = host[lay.pos : lay.pos + 2 * lay.changes].view(np.int16)
    blocks = host[lay.blocks : lay.blocks + lay.slots * (8 if wide else 4)].view(index)
    counts = host[lay.counts : lay.counts + 8 * lay.slots].view(np.int64)
    for f, i, slot in lay.merged:
        counts[slot] += carried[id(f)][i]
    starts = np.zeros(lay.slots, dtype=np.int64)
    np.cumsum(counts[:-1], out=starts[1:])
    spans = apply_spans(starts, lay.changes)
    return StagedChange(lay.add, operands, low=low, blocks=blocks, counts=counts, spans=spans)
