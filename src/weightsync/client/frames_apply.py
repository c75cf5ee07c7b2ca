"""Host tensors updated straight from a delta's frames, base and result checked in the same pass.

The general in-place path (client/inplace.py) decodes every frame into per-tensor
changes during `prepare`, checks each base in a pass of its own, writes the changed
elements and checks the result from them: what tensors on a GPU need, where only small
staged arrays may cross. Tensors in host memory need none of that: the C kernels apply a
FORMAT v2 frame into the tensor's own bytes, checksum every block right before patching
it, while it is in cache, and move that checksum by each change as they write it (the
checksum is linear, FORMAT §10), which gives the result's (``codec.frame.apply_frame_sums``). So for
a one-step delta into host tensors `prepare` only fetches and checks the frames, and
`apply` is one pass over the touched tensors that both verifies the base and the result
(FORMAT §10.2: a tensor's checksum is the sum of its pieces'). When a base or a result
does not match, every frame is undone (XOR and ADD invert exactly:
``codec.frame.undo_frame``), so the tensors hold what they held before.
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from weightsync import errors
from weightsync.client._pool import helping_pool, run_all, threads_of
from weightsync.codec import kernels
from weightsync.codec.checksum import MASK, lanes_of, wire_form
from weightsync.codec.decoder import check_frame
from weightsync.codec.frame import HEADER_SIZE, METHOD_SPARSE, FrameHeader, apply_frame_lanes, undo_frame
from weightsync.codec.manifest import VERSION_2, FrameRef, Manifest

FUSED = "fused-frames"
"""Path name: host tensors patched from the frames, base and result summed in the patching pass."""


@dataclass(frozen=True)
class Frame:
    """A frame of the update, fetched and its header checked: what `apply` patches with."""

    ref: FrameRef
    blob: Any
    names: tuple[str | None, ...]
    """The tensor of each of the frame's pieces (None: a piece of no tensor this update touches)."""
    changes: int
    """Elements the frame changes (sparse frames), or covers (dense ones)."""


def change_count(blob: Any, head: FrameHeader) -> int:
    """Elements a frame (`head`: its parsed header) changes: a sparse frame's count (the u64 that opens its
    payload, FORMAT §4.3), else every element it covers (a dense frame may change any)."""
    if head.method == METHOD_SPARSE:
        (count,) = struct.unpack_from("<Q", blob, HEADER_SIZE)
        return int(count)
    return head.raw_len // head.dtype.width


def eligible(manifests: list[Manifest]) -> bool:
    """Whether an update of `manifests` can be applied from its frames: one FORMAT v2 step, every change a delta."""
    if len(manifests) != 1 or manifests[0].version != VERSION_2:
        return False
    return all(
        e.base_offset is not None
        for f in manifests[0].files
        for e in f.segments
        if e.segment.kind == "tensor" and not e.unchanged
    )


def fetch(
    manifest: Manifest,
    names: dict[tuple[int, int], str],
    touched: set[str],
    read_frame: Callable[[FrameRef], Any],
) -> list[Frame]:
    """Every frame that changes a touched tensor, read and its header checked against the manifest, in order.

    The calling thread does it all: a frame's read is a slice of an object in memory (or a map of the
    cache's file), its check a header parse, ~20 µs of Python that holds the GIL, so other threads could
    only take turns at it, and handing one to a pool's thread costs more than it does. On the 2-core
    VM the 436 MB update's 35 frames (10.7 MB) took 0.8 ms less so than on the pool (run AS), the 45 MB
    update's 12 frames 0.3 ms less (run W).
    """
    out = []
    for ref in manifest.frames:
        pieces = tuple(names.get((p.file, p.seg)) for p in ref.pieces)
        if not any(n in touched for n in pieces):
            continue
        blob = read_frame(ref)
        head = check_frame(manifest, ref, blob)
        out.append(Frame(ref, blob, tuple(n if n in touched else None for n in pieces), change_count(blob, head)))
    return out


def apply(
    frames: list[Frame],
    held: Mapping[str, Any],
    digests: Mapping[str, tuple[str | None, str]],
    *,
    base: int | None,
    target: int,
    verify: bool,
    threads: int | None = None,
) -> float:
    """Patch the host tensors `held` (name → contiguous CPU torch tensor) with `frames`, checked in the same pass.

    `digests` maps each touched tensor to (base digest, result digest), of the FORMAT v2
    checksum. With `verify`: BaseMismatch naming the first tensor whose base differs, or
    ChecksumMismatch naming the first whose result differs, after every frame was
    undone (the tensors hold their bytes of before). Pieces of tensors not in `held`
    (a caller holding part of the model) are applied to scratch and not checked. Frames
    apply on `threads` threads in all (default: one per core), the calling thread one of them.

    Returns the pause: seconds from the first write until the result check passed (the
    pieces' targets, views of the tensors' memory by address, and what the check compares
    against are made before it).
    """
    k = kernels.active()
    spans = {name: (t.data_ptr(), t.nbytes) for name, t in held.items()}  # contiguous CPU tensors (inplace._held)
    jobs = []
    for fr in frames:
        width = _width(fr)
        pieces = fr.ref.pieces
        found = [spans.get(name) if name is not None else None for name in fr.names]
        if None not in found:
            # Every piece into a held tensor (the common case): whole lists, not steps per piece.
            into = cast(list[tuple[int, int]], found)
            if all(p.offset + p.length <= size for p, (_, size) in zip(pieces, into, strict=True)):
                at = [address + p.offset for p, (address, _) in zip(pieces, into, strict=True)]
                views = k.memory_views(at, [p.length for p in pieces])  # the held tensors' own bytes
                jobs.append((fr, views, [p.offset // width for p in pieces]))
                continue
        targets: list[Any] = []
        starts, mine, at, lengths = [], [], [], []
        for i, (p, name) in enumerate(zip(pieces, fr.names, strict=True)):
            span = spans.get(name) if name is not None else None
            if span is None:
                targets.append(np.zeros(p.length, np.uint8))  # scratch: a piece of a tensor not held
            else:
                address, size = span
                if p.offset + p.length > size:  # the views are raw memory: never past a tensor's end
                    raise errors.ReloadRequired(
                        f"tensor {name!r} holds {size} bytes; the update writes up to byte {p.offset + p.length}"
                    )
                targets.append(None)
                mine.append(i)
                at.append(address + p.offset)
                lengths.append(p.length)
            starts.append(p.offset // width)
        for i, view in zip(mine, k.memory_views(at, lengths), strict=True):  # the held tensors' own bytes
            targets[i] = view
        jobs.append((fr, targets, starts))
    sums: list[list[Any]] = [[] for _ in jobs]
    layout = _Layout.of(jobs, held, digests) if verify else None

    def run(i: int) -> None:
        fr, targets, starts = jobs[i]
        sums[i] = apply_frame_lanes(fr.blob, targets, starts, before=verify)[1]

    n = threads_of(threads)
    pool = helping_pool(n)  # the calling thread is one of the n (started once: client/_pool.py)
    # The largest frames first (the pool takes jobs from the front, the caller from the back): no large
    # one is left for last while the other thread idles.
    order = sorted(range(len(jobs)), key=lambda i: -_cost(jobs[i][0]))
    t0 = time.perf_counter()
    try:
        if n == 1 or len(jobs) == 1:
            for i in order:
                run(i)
        else:
            run_all(pool, run, order, caller_helps=True)  # starts at once (client/_pool.py)
    except BaseException:
        _undo(pool, jobs, [bool(s) for s in sums])  # frames that failed wrote nothing (CorruptData)
        raise
    if not verify:
        return time.perf_counter() - t0
    bad_base, bad_result = layout.check(sums) if layout is not None else _check(jobs, sums, held, digests)
    if bad_base is None and bad_result is None:
        return time.perf_counter() - t0
    _undo(pool, jobs, [True] * len(jobs))
    if bad_base is not None:
        raise errors.BaseMismatch(f"tensor {bad_base!r} does not hold v{base}'s bytes; nothing was changed")
    raise errors.ChecksumMismatch(
        f"tensor {bad_result!r} does not match v{target} after the update; every change was undone: "
        f"the tensors hold v{base} again"
    )


@dataclass(frozen=True)
class _Layout:
    """Where each piece's checksum lanes go when a tensor's pieces are added up, and what they must add up to.

    Built before the first write, so the check inside the pause is a few numpy operations over
    every tensor at once rather than Python per tensor (at tens of thousands of tensors that
    loop was most of the pause). The checksums of all checked tensors sit end to end in one
    u64 array in wire form (count, then lanes: FORMAT §10.1), in `digests`' order; the expected
    ones are the manifest's digests decoded in one go. A piece's lanes are added at its tensor's
    place mod 2^64 (u64 arithmetic wraps), counts come from the pieces' lengths. The result is
    the same as :func:`_check`'s (the reference), which runs when some digest is not the wire
    form's length (never, for a manifest that parsed: its digests are checked).
    """

    names: list[str]
    """The checked tensors, in `digests`' order."""
    at: np.ndarray
    """Where each tensor's wire form starts in the arrays (one more entry: their length)."""
    keep: list[list[int]]
    """Per frame, the pieces that are checked."""
    lanes_at: np.ndarray
    """Where each checked piece's lanes are added, in the order `check` flattens them."""
    counts: np.ndarray
    """The wire forms with only their element counts filled in."""
    want_base: np.ndarray
    want_result: np.ndarray

    @classmethod
    def of(
        cls,
        jobs: list[tuple[Frame, list[Any], list[int]]],
        held: Mapping[str, Any],
        digests: Mapping[str, tuple[str | None, str]],
    ) -> _Layout | None:
        # Whole lists per frame and per tensor rather than steps per piece: a large MoE's update has
        # tens of thousands of pieces, and this runs before the first write of every apply.
        checked = held.keys() & digests.keys()
        widths: dict[str, int] = {}  # checked tensor → its element width
        owner: list[str] = []  # per kept piece, in the order `check` flattens them: its tensor
        counts_of: list[int] = []  # per kept piece: its elements
        keep: list[list[int]] = []  # per frame: its pieces that are checked
        for fr, targets, _ in jobs:
            width = _width(fr)
            names_of = fr.names
            kept = [k for k, name in enumerate(names_of) if name in checked]
            mine = cast(list[str], [names_of[k] for k in kept])  # in `checked`: never None
            widths.update(dict.fromkeys(mine, width))
            owner += mine
            counts_of += [len(targets[k]) // width for k in kept]
            keep.append(kept)
        names = [n for n in digests if n in widths]
        index = {n: i for i, n in enumerate(names)}
        lanes_by_width = {w: lanes_of(w) for w in set(widths.values())}
        lanes = [lanes_by_width[widths[n]] for n in names]
        pairs = [digests[n] for n in names]
        if any(b is None for b, _ in pairs):
            return None  # a base without a digest: the reference check says which tensor
        hex_base = cast(list[str], [b for b, _ in pairs])
        hex_result = [r for _, r in pairs]
        wire = [16 * (count + 1) for count in lanes]
        if list(map(len, hex_base)) != wire or list(map(len, hex_result)) != wire:
            return None  # not a wire form: the reference check says which tensor
        try:
            want_base = np.frombuffer(bytes.fromhex("".join(hex_base)), dtype="<u8").astype(np.uint64)
            want_result = np.frombuffer(bytes.fromhex("".join(hex_result)), dtype="<u8").astype(np.uint64)
        except ValueError:
            return None
        per = np.array(lanes, dtype=np.int64)
        at = np.zeros(len(names) + 1, dtype=np.int64)  # where each tensor's wire form starts
        np.cumsum(per + 1, out=at[1:])
        tidx = np.fromiter(map(index.__getitem__, owner), dtype=np.int64, count=len(owner))
        counts = np.zeros(int(at[-1]), dtype=np.uint64)
        np.add.at(counts, at[tidx], np.array(counts_of, dtype=np.uint64))
        lp = per[tidx]  # lanes of each kept piece, flattened one after another by `check`
        starts = np.repeat(at[tidx] + 1, lp)
        within = np.arange(int(lp.sum()), dtype=np.int64) - np.repeat(np.cumsum(lp) - lp, lp)
        return cls(names, at, keep, starts + within, counts, want_base, want_result)

    def check(self, sums: list[list[Any]]) -> tuple[str | None, str | None]:
        """The first tensor whose base differs and the first whose result does (None: none), from the pieces'
        lanes as the kernels gave them (`sums[i][k]`: piece k of frame i, (before, after))."""
        pieces = [found[k] for found, kept in zip(sums, self.keep, strict=True) for k in kept]
        before = [x for b, _ in pieces for x in b]
        after = [x for _, a in pieces for x in a]
        return self._first(before, self.want_base), self._first(after, self.want_result)

    def _first(self, lanes: list[int], want: np.ndarray) -> str | None:
        got = self.counts.copy()
        np.add.at(got, self.lanes_at, np.array(lanes, dtype=np.uint64))
        bad = np.flatnonzero(got != want)
        if not len(bad):
            return None
        return self.names[int(np.searchsorted(self.at, bad[0], side="right")) - 1]


def _check(
    jobs: list[tuple[Frame, list[Any], list[int]]],
    sums: list[list[Any]],
    held: Mapping[str, Any],
    digests: Mapping[str, tuple[str | None, str]],
) -> tuple[str | None, str | None]:
    """The first tensor (in `digests`' order) whose base differs and the first whose result does (None: none).

    Each tensor's checksums are its pieces' added up (FORMAT §10.2), as bare lanes: most tensors are
    one piece, whose lanes are compared as they came. Digests are compared in their wire form.
    """
    totals: dict[str, list[Any]] = {}  # name -> [elements, before lanes, after lanes]
    for (fr, targets, _), found in zip(jobs, sums, strict=True):
        width = _width(fr)
        for name, t, (b, a) in zip(fr.names, targets, found, strict=True):
            if name is None or name not in held:
                continue
            assert b is not None and a is not None, "asked for"
            acc = totals.get(name)
            if acc is None:
                totals[name] = [len(t) // width, b, a]
            else:
                acc[0] += len(t) // width
                acc[1] = [(x + y) & MASK for x, y in zip(acc[1], b, strict=True)]
                acc[2] = [(x + y) & MASK for x, y in zip(acc[2], a, strict=True)]
    bad_base = bad_result = None
    for name, (want_base, want_result) in digests.items():
        acc = totals.get(name)
        if acc is None:
            continue
        count, b, a = acc
        if bad_base is None and wire_form(count, b) != bytes.fromhex(want_base or ""):
            bad_base = name
        if bad_result is None and wire_form(count, a) != bytes.fromhex(want_result):
            bad_result = name
        if bad_base is not None and bad_result is not None:
            break
    return bad_base, bad_result


def _undo(pool: ThreadPoolExecutor, jobs: list[tuple[Frame, list[Any], list[int]]], applied: list[bool]) -> None:
    """Undo the frames of `jobs` marked applied, in parallel."""
    run_all(pool, lambda i: undo_frame(jobs[i][0].blob, jobs[i][1]), [i for i, a in enumerate(applied) if a])


COST_PER_CHANGE = 100
"""What a frame's change costs its apply against a byte of its pieces, for the order frames are handed out in:
decompressing and writing a changed element took ~6 ns on the 2-core VM, the checksum's pass ~0.05 ns a byte."""


def _cost(fr: Frame) -> int:
    """A frame's apply, in bytes of its pieces passed over (an estimate, to hand the large ones out first)."""
    return sum(p.length for p in fr.ref.pieces) + COST_PER_CHANGE * fr.changes


def _width(fr: Frame) -> int:
    from weightsync.codec.dtypes import by_name

    return by_name(fr.ref.dtype).width


def on_host(tensors: Mapping[str, Any]) -> bool:
    """Whether every tensor lies in host memory (what :func:`apply` patches)."""
    return all(t.is_cpu for t in tensors.values())


__all__ = ["FUSED", "Frame", "apply", "eligible", "fetch", "on_host"]
