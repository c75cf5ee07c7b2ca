"""One encode's work: the frame plan, the frames, and each segment's digests (docs/FORMAT.md §4.5, §5).

Each byte is digested once, in the pass that codes it, while it is in cache. Version 1
(xxh3-128) streams: a segment cut across frames is hashed by its chunks' tasks in order
(`XxhChain`). Version 2 (the tensor checksum, FORMAT §10) adds the checksums of a
segment's pieces, each taken at its position, so chunks need no order; and a delta-coded
segment whose bytes equal its base's gets no frame at all (FORMAT §5.3): a small one is found
first (a compare that stops at the first change), a segment cut into frames of its own when
none of its frames holds a change. `weightsync.codec.encoder` drives these.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np
import xxhash

from weightsync.codec import kernels
from weightsync.codec.checksum import PieceSums, TensorSum
from weightsync.codec.decoder import base_offset
from weightsync.codec.dtypes import DType
from weightsync.codec.frame import changed_elements, encode_delta_pieces, encode_key, xxh3_128
from weightsync.codec.manifest import VERSION_2, Piece, SegmentEntry

_COMPARE_GROUP = 4 << 20
"""Bytes of small segments compared per pool task: one task each cost more than the compare."""
GROUP_BYTES = 4 << 20
"""Small segments share frames of at most this many bytes (or `chunk_bytes`, when smaller), whatever
`chunk_bytes` cuts large ones into: a reader that takes some tensors of a model (one rank's experts)
fetches every frame holding one of them, so a frame of many small tensors is read for any of them
(with 16 MiB groups a rank of 8 read 89 % of an MoE step's bytes for its eighth of the experts,
40 % with 4 MiB: benchmarks/slice_bench.py)."""


@dataclass
class EncodedFrame:
    """A frame's bytes plus what it decodes into (the manifest entry lacks only its location)."""

    data: bytes
    delta: bool
    dtype: str
    raw_len: int
    pieces: tuple[Piece, ...]


@dataclass
class Plan:
    delta: bool
    dtype: DType
    pieces: list[Piece]

    @property
    def raw_len(self) -> int:
        return sum(p.length for p in self.pieces)


def plan_frames(
    entries: list[list[SegmentEntry]], chunk_bytes: int, skip: set[tuple[int, int]], *, per_file: bool = False
) -> list[Plan]:
    """Frames for every segment with bytes, but those in `skip` (FORMAT §4.5).

    Segments of `chunk_bytes` or more are cut into frames of that size. Smaller ones of one dtype
    share frames of up to GROUP_BYTES (at most `chunk_bytes`); with `per_file` only those of one
    file do (no frame straddles files: what a part of a multi-part publish needs, codec/parts.py).
    """
    group_bytes = min(chunk_bytes, GROUP_BYTES)
    plans: list[Plan] = []
    open_groups: dict[tuple[bool, str, int], Plan] = {}
    filled: dict[tuple[bool, str, int], int] = {}  # each open group's bytes, kept as it grows (not re-summed)
    for fi, segs in enumerate(entries):
        for si, entry in enumerate(segs):
            seg = entry.segment
            if seg.length == 0 or (fi, si) in skip:
                continue
            delta = entry.base_offset is not None
            step = max(seg.dtype.width, chunk_bytes - chunk_bytes % seg.dtype.width)
            if seg.length >= chunk_bytes:
                for off in range(0, seg.length, step):
                    plans.append(Plan(delta, seg.dtype, [Piece(fi, si, off, min(step, seg.length - off))]))
                continue
            key = (delta, seg.dtype.name, fi if per_file else -1)
            group = open_groups.get(key)
            if group is not None and filled[key] + seg.length > group_bytes:
                plans.append(group)
                group = None
            if group is None:
                group = open_groups[key] = Plan(delta, seg.dtype, [])
                filled[key] = 0
            group.pieces.append(Piece(fi, si, 0, seg.length))
            filled[key] += seg.length
    plans.extend(g for g in open_groups.values() if g.pieces)
    return plans


class XxhChain:
    """Version 1: the xxh3-128 of a segment cut into several frames, fed by the frames' tasks in chunk order.

    Each task feeds its chunk right after coding it (the bytes are still in cache) once
    the previous chunk has been fed; `feed` always releases the next chunk, even on error.
    """

    def __init__(self, *, base: bool) -> None:
        self.new = xxhash.xxh3_128()
        self.base = xxhash.xxh3_128() if base else None
        self._fed: list[threading.Event] = []

    def add_link(self) -> int:
        """Reserve the next chunk's turn; returns its index."""
        self._fed.append(threading.Event())
        return len(self._fed) - 1

    def feed(self, i: int, new: np.ndarray, base: np.ndarray | None) -> None:
        """Hash chunk `i` after chunk i-1."""
        try:
            if i:
                self._fed[i - 1].wait()
            self.new.update(new.data)
            if self.base is not None and base is not None:
                self.base.update(base.data)
        finally:
            self._fed[i].set()


def same_bytes(base: np.ndarray, new: np.ndarray, width: int, want_sum: bool) -> tuple[bool, TensorSum | None]:
    """Whether `new` equals `base`, stopping at the first element that differs; and, if equal and
    `want_sum`, the checksum of the bytes, from the same pass (the fused coder with room for no change)."""
    found = kernels.active().encode_sparse_sums([base], [new], [0], width, False, 0, before=False, after=want_sum)
    if found is None:
        return False, None
    if not want_sum:
        return True, None
    lanes = found[2][0].after
    assert lanes is not None, "asked for"
    return True, TensorSum(width, len(new) // width, tuple(lanes))


@dataclass
class Digested:
    """What the frame tasks learned of one segment: its digest and, for delta-coded ones, its base's."""

    new: dict[tuple[int, int], str]
    base: dict[tuple[int, int], str]
    same: set[tuple[int, int]]
    """Delta-coded segments whose bytes equal their base's (v1: whose digests do: xxh3-128 is no linear sum)."""


class Job:
    """One encode: the segments, their bytes, and the frame coding both versions share."""

    def __init__(
        self,
        entries: list[list[SegmentEntry]],
        new: list[np.ndarray],
        base: list[np.ndarray],
        *,
        level: int,
        chunk_bytes: int,
        per_file: bool = False,
        keep: bool = False,
        on_frame: Callable[[EncodedFrame], None] | None = None,
    ) -> None:
        self.on_frame = on_frame
        """Called with each frame, in order, as soon as it and those before it are made and it is final (V2Job)."""
        self.level = level
        self.chunk_bytes = chunk_bytes
        self.per_file = per_file
        self.keep = keep
        """Delta frames write each change into the base too (V2Job; `Encoder.encode` keep_base)."""
        self.entries = entries
        self.new_arrays = new
        self.base_arrays = base

    def new_bytes(self, fi: int, si: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Bytes of segment `si` of file `fi` in the new version (a view), from `offset`."""
        seg = self.entries[fi][si].segment
        n = seg.length - offset if length is None else length
        return self.new_arrays[fi][seg.offset + offset :][:n]

    def base_bytes(self, fi: int, si: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Bytes of a delta-coded segment's base (a view), from `offset`."""
        e = self.entries[fi][si]
        n = e.segment.length - offset if length is None else length
        return self.base_arrays[fi][base_offset(e) + offset :][:n]

    def _same(
        self, items: list[tuple[int, int, SegmentEntry]], pool: Executor
    ) -> tuple[list[tuple[int, int, SegmentEntry]], list[tuple[int, int, SegmentEntry]]]:
        """Which delta-coded segments of `items` equal their base, compared by address in a few native
        calls on `pool`; and the items whose spans do not lie within their files' arrays (left for the
        caller's per-segment compare, which never reads out of bounds)."""
        # Addresses are only meaningful for plain byte arrays; a file held otherwise gets no span (length -1).
        new_at = [_span_of(a) for a in self.new_arrays]
        base_at = [_span_of(a) for a in self.base_arrays]
        spans: list[tuple[int, int, int]] = []
        inside: list[tuple[int, int, SegmentEntry]] = []
        left: list[tuple[int, int, SegmentEntry]] = []
        for item in items:
            fi, _, e = item
            seg, at = e.segment, base_offset(e)
            (new, new_len), (base, base_len) = new_at[fi], base_at[fi]
            if seg.offset + seg.length <= new_len and at >= 0 and at + seg.length <= base_len:
                spans.append((base + at, new + seg.offset, seg.length))
                inside.append(item)
            else:
                left.append(item)
        if not spans:
            return [], left
        table = np.array(spans, dtype=np.uint64).reshape(-1, 3)
        same_spans = kernels.active().same_spans

        def compare(part: slice) -> np.ndarray:
            return same_spans(table[part, 0], table[part, 1], table[part, 2])

        equal = np.concatenate(list(pool.map(compare, _split(len(spans), 2))))
        return [item for item, eq in zip(inside, equal.tolist(), strict=True) if eq], left

    def _own_segment(self, plan: Plan) -> tuple[int, int] | None:
        """The segment of a delta frame of a segment cut into frames of its own (FORMAT §5.3: such frames are
        dropped together when none holds a change), else None."""
        p = plan.pieces[0]
        if plan.delta and self.entries[p.file][p.seg].segment.length >= self.chunk_bytes:
            return p.file, p.seg
        return None

    def frame(self, plan: Plan, data: bytes) -> EncodedFrame:
        """The encoded frame of `plan`."""
        return EncodedFrame(data, plan.delta, plan.dtype.name, plan.raw_len, tuple(plan.pieces))

    def whole(self, p: Piece) -> bool:
        """Whether `p` covers its segment entirely."""
        return p.offset == 0 and p.length == self.entries[p.file][p.seg].segment.length


class InOrder:
    """Hands `count` results, made on any threads in any order, to `hand_on` in their order, each as soon as it
    and every one before it are in. A result given as None is in but not handed on (a dropped frame). One
    thread at a time hands on (the one whose result completed a run; results that come meanwhile are
    handed on by it), so `hand_on` is never called twice at once. A `hand_on` that raises stops the
    handing on (the encode it belongs to fails)."""

    def __init__(self, count: int, hand_on: Callable[[EncodedFrame], None]) -> None:
        self._ready: dict[int, EncodedFrame | None] = {}
        self._next = 0
        self._count = count
        self._handing = False
        self._hand_on = hand_on
        self._lock = threading.Lock()

    def done(self, k: int, result: EncodedFrame | None) -> None:
        """Result `k` is made (None: dropped); hand on what is in order, unless another thread is handing on."""
        with self._lock:
            self._ready[k] = result
            if self._handing:
                return
            self._handing = True
        try:
            while True:
                with self._lock:
                    run = []
                    while self._next in self._ready:
                        run.append(self._ready.pop(self._next))
                        self._next += 1
                    if not run:
                        self._handing = False
                        return
                for item in run:
                    if item is not None:
                        self._hand_on(item)
        except BaseException:
            with self._lock:
                self._ready.clear()
                self._next = self._count + 1  # nothing more is handed on
                self._handing = False
            raise


class V1Job(Job):
    """Version 1 (FORMAT §5.2): every segment in frames; xxh3-128 of whole segments from the frame coder,
    of segments cut across frames chained chunk by chunk (`XxhChain`)."""

    def run(self, pool: Executor) -> tuple[list[EncodedFrame], Digested]:
        plans = plan_frames(self.entries, self.chunk_bytes, set(), per_file=self.per_file)
        in_frame = {(p.file, p.seg) for plan in plans for p in plan.pieces if self.whole(p)}
        chains: dict[tuple[int, int], XxhChain] = {}
        links: list[tuple[XxhChain, int] | None] = []
        for plan in plans:
            p = plan.pieces[0]
            key = (p.file, p.seg)
            if key in in_frame:
                links.append(None)
                continue
            chain = chains.get(key)
            if chain is None:
                e = self.entries[p.file][p.seg]
                chain = chains[key] = XxhChain(base=e.base_offset is not None and e.base_digest is None)
            links.append((chain, chain.add_link()))
        level = self.level

        def run(index: int) -> tuple[EncodedFrame, list[tuple[int, int, str, str | None]]]:
            plan = plans[index]
            # Pieces are coded where they lie (no scratch copy of a grouped frame's tensors).
            news = [self.new_bytes(p.file, p.seg, p.offset, p.length) for p in plan.pieces]
            olds = [self.base_bytes(p.file, p.seg, p.offset, p.length) for p in plan.pieces] if plan.delta else None
            if olds is not None:
                piece_hashes: list[tuple[bytes, bytes]] = []
                blob = encode_delta_pieces(olds, news, plan.dtype, level=level, piece_hashes=piece_hashes, version=1)
            else:
                piece_hashes = [(xxh3_128(x), b"") for x in news]
                data = news[0] if len(news) == 1 else np.concatenate(news)
                known = piece_hashes[0][0] if len(news) == 1 else None
                blob = encode_key(data, plan.dtype, level=level, result_hash=known, version=1)
            hashed: list[tuple[int, int, str, str | None]] = []
            for p, (h, bh) in zip(plan.pieces, piece_hashes, strict=True):
                if (p.file, p.seg) in in_frame:
                    e = self.entries[p.file][p.seg]
                    known_base = e.base_digest if e.base_digest is not None else (bh.hex() if olds else None)
                    hashed.append((p.file, p.seg, h.hex(), known_base))
            link = links[index]
            if link is not None:
                link[0].feed(link[1], news[0], olds[0] if olds is not None else None)
            return self.frame(plan, blob), hashed

        # map() queues the frames in plan order and workers take them in that order, so a
        # chunk waiting for its predecessor's hash update waits only on a running task.
        results = list(pool.map(run, range(len(plans))))
        out = Digested({}, {}, set())
        for fi, si, h, bh in (x for _, hs in results for x in hs):
            out.new[fi, si] = h
            if bh is not None:
                out.base[fi, si] = bh
        for (fi, si), chain in chains.items():
            out.new[fi, si] = chain.new.hexdigest()
            e = self.entries[fi][si]
            if e.base_digest is not None:
                out.base[fi, si] = e.base_digest
            elif chain.base is not None:
                out.base[fi, si] = chain.base.hexdigest()
        empty = xxh3_128(b"").hex()
        for fi, row in enumerate(self.entries):  # empty segments: in no frame
            for si, e in enumerate(row):
                if (fi, si) not in out.new:
                    out.new[fi, si] = empty
                    if e.base_offset is not None:
                        out.base[fi, si] = e.base_digest or empty
        out.same = {key for key, b in out.base.items() if out.new[key] == b}
        return [fr for fr, _ in results], out


class _Kept:
    """Which delta frames are final as they are made, for :class:`InOrder`: a segment cut into frames of its own is
    kept whole when any of its frames holds a change and dropped whole when none does (FORMAT §5.3), so a frame
    of one that holds no change waits until a sibling shows a change (kept) or all are made (dropped). Any
    other frame is final when made. `done` gives `in_order` each frame once it is decided (None: dropped)."""

    def __init__(self, segment_of: list[tuple[int, int] | None], in_order: InOrder) -> None:
        self._segment_of = segment_of  # per frame: its segment when it is one cut into frames of its own
        self._left: dict[tuple[int, int], int] = {}  # frames of that segment not made yet
        for key in segment_of:
            if key is not None:
                self._left[key] = self._left.get(key, 0) + 1
        self._changed: set[tuple[int, int]] = set()
        self._waiting: dict[tuple[int, int], list[tuple[int, EncodedFrame]]] = {}
        self._in_order = in_order
        self._lock = threading.Lock()

    def done(self, k: int, frame: EncodedFrame, unchanged: bool) -> None:
        key = self._segment_of[k]
        if key is None:
            self._in_order.done(k, frame)
            return
        decided: list[tuple[int, EncodedFrame | None]] = []
        with self._lock:
            self._left[key] -= 1
            if key in self._changed:
                decided.append((k, frame))
            elif not unchanged:
                self._changed.add(key)
                decided.extend([*self._waiting.pop(key, []), (k, frame)])
            elif self._left[key] == 0:  # the last of a segment that holds no change: none is kept
                decided.extend((j, None) for j, _ in [*self._waiting.pop(key, []), (k, frame)])
            else:
                self._waiting.setdefault(key, []).append((k, frame))
        for j, fr in sorted(decided, key=lambda x: x[0]):
            self._in_order.done(j, fr)


class V2Job(Job):
    """Version 2 (FORMAT §5.3): segments equal to their base get no frame; the others' checksums are
    added from their pieces' checksums, each summed by the frame coder at the piece's position."""

    def run(self, pool: Executor) -> tuple[list[EncodedFrame], Digested]:
        out = Digested({}, {}, set())
        # Whether a small segment equals its base decides how frames group (FORMAT §4.5), so those are
        # compared first, a few per task. A segment cut into frames of its own is not: its frames are
        # coded, and dropped when none holds a change (a compare would read it up to its first change
        # twice, and a large tensor of an RL step changes somewhere in almost every chunk).
        small = [
            (fi, si, e)
            for fi, row in enumerate(self.entries)
            for si, e in enumerate(row)
            if e.base_offset is not None and e.segment.length < self.chunk_bytes
        ]

        def compare(group: list[tuple[int, int, SegmentEntry]]) -> list[tuple[bool, TensorSum | None]]:
            found = []
            for fi, si, e in group:
                base, new = self.base_bytes(fi, si), self.new_bytes(fi, si)
                found.append(same_bytes(base, new, e.segment.dtype.width, e.base_digest is None))
            return found

        # All are compared first in a few native calls (a memcmp each, by address). Most differ at an
        # RL step and are done; an equal one whose base checksum is not known yet goes on to the fused
        # coder, which sums its bytes (the base's checksum, for the caller's check of the base).
        equal, left = self._same(small, pool)
        for fi, si, e in equal:
            if e.base_digest is not None:
                out.new[fi, si] = out.base[fi, si] = e.base_digest
                out.same.add((fi, si))
        groups = _by_bytes([x for x in equal if x[2].base_digest is None] + left, _COMPARE_GROUP)
        for group, found in zip(groups, pool.map(compare, groups), strict=True):
            for (fi, si, e), (same, total) in zip(group, found, strict=True):
                if same:
                    digest = e.base_digest if e.base_digest is not None else _hex(total)
                    out.new[fi, si] = out.base[fi, si] = digest
                    out.same.add((fi, si))
        plans = plan_frames(self.entries, self.chunk_bytes, out.same, per_file=self.per_file)
        level = self.level

        def run(plan: Plan) -> tuple[EncodedFrame, PieceSums, bool]:
            """The frame, its pieces' checksums, and whether it is a delta without a change."""
            width = plan.dtype.width
            starts = [p.offset // width for p in plan.pieces]
            news = [self.new_bytes(p.file, p.seg, p.offset, p.length) for p in plan.pieces]
            if plan.delta:
                wants = [self.entries[p.file][p.seg].base_digest is None for p in plan.pieces]
                sums = PieceSums(width, starts, wants)
                olds = [self.base_bytes(p.file, p.seg, p.offset, p.length) for p in plan.pieces]
                blob = encode_delta_pieces(
                    olds, news, plan.dtype, level=level, version=VERSION_2, piece_sums=sums, keep_base=self.keep
                )
                return self.frame(plan, blob), sums, changed_elements(blob) == 0
            sums = PieceSums(width, starts, [False] * len(news))
            for i, x in enumerate(news):
                sums.update(i, x, x)
            data = news[0] if len(news) == 1 else np.concatenate(news)
            blob = encode_key(data, plan.dtype, level=level, version=VERSION_2)
            return self.frame(plan, blob), sums, False

        # A segment in frames of its own whose frames hold no change equals its base: no frame (FORMAT §5.3).
        own = [self._own_segment(plan) for plan in plans]
        if self.on_frame is None:
            results = list(pool.map(run, plans))
        else:
            kept = _Kept(own, InOrder(len(plans), self.on_frame))

            def run_handing_on(k: int) -> tuple[EncodedFrame, PieceSums, bool]:
                got = run(plans[k])
                kept.done(k, got[0], got[2])
                return got

            results = list(pool.map(run_handing_on, range(len(plans))))
        unchanged: dict[tuple[int, int], bool] = {}
        for key, (_, _, none) in zip(own, results, strict=True):
            if key is not None:
                unchanged[key] = unchanged.get(key, True) and none
        same_large = {key for key, none in unchanged.items() if none}
        new_sums: dict[tuple[int, int], TensorSum] = {}
        base_sums: dict[tuple[int, int], TensorSum] = {}
        frames: list[EncodedFrame] = []
        for plan, (frame, sums, _) in zip(plans, results, strict=True):
            first = plan.pieces[0]
            if (first.file, first.seg) not in same_large:
                frames.append(frame)
            for i, p in enumerate(plan.pieces):
                key = (p.file, p.seg)
                new_sums[key] = new_sums[key] + sums.new[i] if key in new_sums else sums.new[i]
                b = sums.base[i]
                if b is not None:
                    base_sums[key] = base_sums[key] + b if key in base_sums else b
        for fi, si in same_large:
            e = self.entries[fi][si]
            out.new[fi, si] = out.base[fi, si] = e.base_digest if e.base_digest is not None else new_sums[fi, si].hex()
            out.same.add((fi, si))
        for fi, row in enumerate(self.entries):
            for si, e in enumerate(row):
                key = (fi, si)
                if key in out.new:
                    continue
                total = new_sums.get(key)
                if total is None:  # an empty segment: in no frame
                    total = TensorSum.empty(e.segment.dtype.width)
                out.new[key] = total.hex()
                if e.base_offset is None:
                    continue
                base_total = base_sums.get(key)
                if e.base_digest is not None:
                    out.base[key] = e.base_digest
                else:
                    out.base[key] = (base_total if base_total is not None else TensorSum.empty(total.width)).hex()
        return frames, out


def _span_of(a: np.ndarray) -> tuple[int, int]:
    """(address, length) of a 1-D contiguous byte array; (0, -1) for any other (no span lies within it)."""
    if a.ndim != 1 or a.dtype != np.uint8 or not a.flags.c_contiguous:
        return 0, -1
    return int(a.ctypes.data), len(a)


def _split(n: int, parts: int) -> list[slice]:
    """`range(n)` cut into at most `parts` runs of about equal length (none empty)."""
    step = max(1, -(-n // max(1, parts)))
    return [slice(i, min(n, i + step)) for i in range(0, n, step)]


def _by_bytes(items: list[tuple[int, int, SegmentEntry]], size: int) -> list[list[tuple[int, int, SegmentEntry]]]:
    """`items` in order, cut into runs of about `size` bytes of segments (at least one item each)."""
    groups: list[list[tuple[int, int, SegmentEntry]]] = []
    run: list[tuple[int, int, SegmentEntry]] = []
    total = 0
    for item in items:
        run.append(item)
        total += item[2].segment.length
        if total >= size:
            groups.append(run)
            run, total = [], 0
    if run:
        groups.append(run)
    return groups


def _hex(total: TensorSum | None) -> str:
    assert total is not None, "a checksum was asked for"
    return total.hex()
