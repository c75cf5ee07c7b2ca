"""Encode a checkpoint against a base into frames and a manifest, and decode it back.

Chunking (docs/FORMAT.md §4.5): a tensor larger than ``chunk_bytes`` is cut into
independently decodable frames; smaller segments of one dtype are grouped into a
frame so thousands of tiny tensors do not make thousands of frames. Frames are
encoded and decoded on a thread pool: zstd, xxhash (above 64 KiB, python-xxhash
>= 4) and the C kernels (codec/kernels.py) release the GIL, so this scales with cores.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import xxhash

from weightsync.codec.checkpoint import Checkpoint, CheckpointFile, Segment
from weightsync.codec.dtypes import DType
from weightsync.codec.frame import (
    DEFAULT_LEVEL,
    apply_frame,
    apply_frame_pieces,
    encode_delta_pieces,
    encode_key,
    xxh3_128,
)
from weightsync.codec.manifest import FileEntry, FrameRef, Manifest, Piece, SegmentEntry
from weightsync.errors import BaseMismatch, ChecksumMismatch, LimitExceeded

DEFAULT_CHUNK = 4 << 20


def default_threads() -> int:
    return os.cpu_count() or 1


def _base_offset(entry: SegmentEntry) -> int:
    """Where a delta-coded segment's base bytes start in the base file (FORMAT §5.2)."""
    if entry.base_offset is None:
        raise AssertionError(f"segment {entry.segment.name!r} is not delta-coded")
    return entry.base_offset


@dataclass
class EncodedFrame:
    """A frame's bytes plus what it decodes into (the manifest entry lacks only its location)."""

    data: bytes
    delta: bool
    dtype: str
    raw_len: int
    pieces: tuple[Piece, ...]


@dataclass
class Encoded:
    """The result of encoding: a manifest whose frame refs point into `frames` by index."""

    manifest: Manifest
    frames: list[EncodedFrame]

    def with_locations(self, locate: Callable[[int, EncodedFrame], tuple[str | None, int]]) -> Manifest:
        """The manifest with each frame's (object, offset) set by `locate(index, frame)`."""
        refs = []
        for i, fr in enumerate(self.frames):
            obj, off = locate(i, fr)
            refs.append(FrameRef(obj, off, len(fr.data), fr.delta, fr.dtype, fr.raw_len, fr.pieces))
        m = self.manifest
        return Manifest(
            kind=m.kind,
            single_file=m.single_file,
            files=m.files,
            frames=refs,
            model=m.model,
            number=m.number,
            parent=m.parent,
            step=m.step,
            metadata=m.metadata,
        )


@dataclass
class _Plan:
    delta: bool
    dtype: DType
    pieces: list[Piece]

    @property
    def raw_len(self) -> int:
        return sum(p.length for p in self.pieces)


def _plan(entries: list[list[tuple[SegmentEntry, bool]]], chunk_bytes: int) -> list[_Plan]:
    plans: list[_Plan] = []
    open_groups: dict[tuple[bool, str], _Plan] = {}
    for fi, segs in enumerate(entries):
        for si, (entry, delta) in enumerate(segs):
            seg = entry.segment
            if seg.length == 0:
                continue
            step = max(seg.dtype.width, chunk_bytes - chunk_bytes % seg.dtype.width)
            if seg.length >= chunk_bytes:
                for off in range(0, seg.length, step):
                    plans.append(_Plan(delta, seg.dtype, [Piece(fi, si, off, min(step, seg.length - off))]))
                continue
            key = (delta, seg.dtype.name)
            group = open_groups.get(key)
            if group is not None and group.raw_len + seg.length > chunk_bytes:
                plans.append(group)
                group = None
            if group is None:
                group = open_groups[key] = _Plan(delta, seg.dtype, [])
            group.pieces.append(Piece(fi, si, 0, seg.length))
    plans.extend(g for g in open_groups.values() if g.pieces)
    return plans


class _Chain:
    """The xxh3-128 of a segment cut into several frames, fed by the frames' tasks in chunk order.

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


class Encoder:
    """Reusable encoder. Thread-safe: one instance may serve concurrent `encode` calls.

    ``threads`` sets the pool size (default: all cores), ``level`` the zstd level,
    ``chunk_bytes`` the frame size target.
    """

    def __init__(
        self, *, threads: int | None = None, level: int = DEFAULT_LEVEL, chunk_bytes: int = DEFAULT_CHUNK
    ) -> None:
        if chunk_bytes < 1024:
            raise ValueError("chunk_bytes must be at least 1024")
        self.threads = threads or default_threads()
        self.level = level
        self.chunk_bytes = chunk_bytes

    def encode(
        self,
        new: Checkpoint,
        base: Checkpoint | None = None,
        *,
        base_hashes: dict[tuple[str, str, str], str] | None = None,
        keyframe: bool = False,
    ) -> Encoded:
        """Encode `new`, as XOR deltas against `base` wherever a segment has a counterpart.

        A counterpart is the segment of the same kind and name, dtype and shape in
        the base file of the same path (the only base file in single-file mode).
        Segments without one are coded whole. ``keyframe=True`` ignores `base`.
        ``base_hashes`` maps (path, kind, name) to known xxh3 hex of base segments
        (skips hashing the base again).
        """
        if keyframe:
            base = None
        base_files = self._match_files(new, base)
        known = base_hashes or {}
        # Per segment: (segment, base offset or None, known base xxh3 or None).
        rows: list[list[tuple[Segment, int | None, str | None]]] = []
        base_arrays: list[np.ndarray] = []
        for fi, f in enumerate(new.files):
            b = base_files[fi]
            base_arrays.append(b.data if b is not None else np.zeros(0, dtype=np.uint8))
            counterpart = {s.key: s for s in b.layout.segments} if b is not None else {}
            row: list[tuple[Segment, int | None, str | None]] = []
            for seg in f.layout.segments:
                other = counterpart.get(seg.key)
                if (
                    b is not None
                    and other is not None
                    and other.dtype is seg.dtype
                    and other.shape == seg.shape
                    and other.length == seg.length
                ):
                    row.append((seg, other.offset, known.get((b.layout.path, other.kind, other.name))))
                else:
                    row.append((seg, None, None))
            rows.append(row)
        # Plans need offsets only; hashes are filled in below (placeholders until then).
        seg_entries = [[(SegmentEntry(seg, "", bo, bh), bo is not None) for seg, bo, bh in row] for row in rows]
        flat = [[e for e, _ in row] for row in seg_entries]
        plans = _plan(seg_entries, self.chunk_bytes)
        new_arrays = [f.data for f in new.files]
        # Each byte is hashed once, while it is in cache (DESIGN.md "Native core"): the frame
        # coder hashes what it codes, part by part, and hands back the hashes of the segments
        # it holds whole; a segment cut across frames is hashed by its chunks' tasks, in
        # order, each chunk right after it was coded (_Chain). Only empty segments are left.
        in_frame = {
            (p.file, p.seg)
            for plan in plans
            for p in plan.pieces
            if p.offset == 0 and p.length == flat[p.file][p.seg].segment.length
        }
        chains: dict[tuple[int, int], _Chain] = {}
        links: list[tuple[_Chain, int] | None] = []
        for plan in plans:
            p = plan.pieces[0]
            key = (p.file, p.seg)
            if key in in_frame:
                links.append(None)
                continue
            chain = chains.get(key)
            if chain is None:
                e = flat[p.file][p.seg]
                chain = chains[key] = _Chain(base=e.base_offset is not None and e.base_xxh3 is None)
            links.append((chain, chain.add_link()))
        new_hash: dict[tuple[int, int], str] = {}
        base_hash: dict[tuple[int, int], str] = {}

        def run(index: int) -> tuple[EncodedFrame, list[tuple[int, int, str, str | None]]]:
            plan = plans[index]
            # Pieces are coded where they lie (no scratch copy of a grouped frame's tensors).
            news = [
                new_arrays[p.file][flat[p.file][p.seg].segment.offset + p.offset :][: p.length] for p in plan.pieces
            ]
            olds = None
            if plan.delta:
                olds = [
                    base_arrays[p.file][_base_offset(flat[p.file][p.seg]) + p.offset :][: p.length] for p in plan.pieces
                ]
            if olds is not None:
                piece_hashes: list[tuple[bytes, bytes]] = []
                blob = encode_delta_pieces(olds, news, plan.dtype, level=self.level, piece_hashes=piece_hashes)
            else:
                piece_hashes = [(xxh3_128(x), b"") for x in news]
                data = news[0] if len(news) == 1 else np.concatenate(news)
                blob = encode_key(
                    data, plan.dtype, level=self.level, result_hash=piece_hashes[0][0] if len(news) == 1 else None
                )
            hashed: list[tuple[int, int, str, str | None]] = []
            for p, (h, bh) in zip(plan.pieces, piece_hashes, strict=True):
                if (p.file, p.seg) in in_frame:
                    e = flat[p.file][p.seg]
                    known = e.base_xxh3 if e.base_xxh3 is not None else (bh.hex() if olds is not None else None)
                    hashed.append((p.file, p.seg, h.hex(), known))
            link = links[index]
            if link is not None:
                link[0].feed(link[1], news[0], olds[0] if olds is not None else None)
            return EncodedFrame(blob, plan.delta, plan.dtype.name, plan.raw_len, tuple(plan.pieces)), hashed

        with ThreadPoolExecutor(self.threads) as pool:
            # map() queues the frames in plan order and workers take them in that order, so a
            # chunk waiting for its predecessor's hash update waits only on a running task.
            results = list(pool.map(run, range(len(plans))))
        frames = [fr for fr, _ in results]
        for fi, si, h, bh in [x for _, hs in results for x in hs]:
            new_hash[fi, si] = h
            if bh is not None:
                base_hash[fi, si] = bh
        for (fi, si), chain in chains.items():
            new_hash[fi, si] = chain.new.hexdigest()
            e = flat[fi][si]
            if e.base_xxh3 is not None:
                base_hash[fi, si] = e.base_xxh3
            elif chain.base is not None:
                base_hash[fi, si] = chain.base.hexdigest()
        for fi, entries in enumerate(flat):  # empty segments: in no frame
            for si, entry in enumerate(entries):
                if (fi, si) not in new_hash:
                    new_hash[fi, si] = xxh3_128(b"").hex()
                    if entry.base_offset is not None:
                        base_hash[fi, si] = entry.base_xxh3 or xxh3_128(b"").hex()
        flat = [
            [
                SegmentEntry(e.segment, new_hash[fi, si], e.base_offset, base_hash.get((fi, si)))
                for si, e in enumerate(row)
            ]
            for fi, row in enumerate(flat)
        ]
        files = [FileEntry(f.layout.path, f.layout.size, tuple(row)) for f, row in zip(new.files, flat, strict=True)]
        kind = "delta" if any(e.base_offset is not None for row in flat for e in row) else "keyframe"
        manifest = Manifest(
            kind=kind,
            single_file=new.single_file,
            files=files,
            frames=[FrameRef(None, 0, len(fr.data), fr.delta, fr.dtype, fr.raw_len, fr.pieces) for fr in frames],
        )
        return Encoded(manifest, frames)

    @staticmethod
    def _match_files(new: Checkpoint, base: Checkpoint | None) -> list[CheckpointFile | None]:
        if base is None:
            return [None] * len(new.files)
        if new.single_file and base.single_file and len(base.files) == 1:
            return [base.files[0]]
        by_path = base.by_path()
        return [by_path.get(f.layout.path) for f in new.files]


class Decoder:
    """Reusable decoder. Thread-safe; ``threads`` sets the pool size (default: all cores)."""

    def __init__(self, *, threads: int | None = None) -> None:
        self.threads = threads or default_threads()

    def decode(
        self,
        manifest: Manifest,
        read_frame: Callable[[FrameRef], bytes | memoryview],
        outputs: list[np.ndarray],
        base: Checkpoint | None = None,
        *,
        verify_base: bool = True,
        verify_segments: bool = False,
    ) -> None:
        """Write every file of `manifest` into `outputs` (writable uint8 arrays, one per file, in order).

        `read_frame` returns a frame's bytes given its ref. For a delta manifest
        `base` holds the parent version; every delta segment's base bytes are
        hash-checked first (BaseMismatch naming the tensor, nothing written). Each
        frame checks its result hash as it decodes, which covers every output byte;
        ``verify_segments`` also re-hashes every output segment (ChecksumMismatch).

        An output may be the base file's own buffer (apply in place, no copy) when
        every delta segment of that file sits at its base offset.
        """
        if len(outputs) != len(manifest.files):
            raise LimitExceeded("one output buffer per file is required")
        for f, out in zip(manifest.files, outputs, strict=True):
            if out.dtype != np.uint8 or out.ndim != 1 or len(out) != f.size:
                raise LimitExceeded(f"{f.path}: output buffer must hold {f.size} bytes")
        base_arrays = self._base_arrays(manifest, base)
        in_place = []
        for f, out, b in zip(manifest.files, outputs, base_arrays, strict=True):
            same = (
                len(b) == len(out)
                and len(out) > 0
                and b.__array_interface__["data"][0] == out.__array_interface__["data"][0]
            )
            if same and any(e.base_offset not in (None, e.segment.offset) for e in f.segments):
                raise LimitExceeded(f"{f.path}: layout changed, cannot apply in place")
            in_place.append(same)
        with ThreadPoolExecutor(self.threads) as pool:
            if verify_base:
                self._check_base(pool, manifest, base_arrays)

            def run(ref: FrameRef) -> None:
                blob = read_frame(ref)
                pieces = ref.pieces
                if len(pieces) == 1:
                    p = pieces[0]
                    entry = manifest.files[p.file].segments[p.seg]
                    start = entry.segment.offset + p.offset
                    target = outputs[p.file][start : start + p.length]
                    if ref.delta and not in_place[p.file]:
                        b0 = _base_offset(entry) + p.offset
                        target[:] = base_arrays[p.file][b0 : b0 + p.length]
                    # The segment-level check above already covered these base bytes.
                    apply_frame(blob, target, verify_base=False)
                    return
                # A grouped frame applies straight into each tensor's bytes (no scratch copy).
                targets = []
                for p in pieces:
                    entry = manifest.files[p.file].segments[p.seg]
                    start = entry.segment.offset + p.offset
                    target = outputs[p.file][start : start + p.length]
                    if ref.delta and not in_place[p.file]:
                        b0 = _base_offset(entry) + p.offset
                        target[:] = base_arrays[p.file][b0 : b0 + p.length]
                    targets.append(target)
                apply_frame_pieces(blob, targets, verify_base=False)

            for _ in pool.map(run, manifest.frames):
                pass
            if verify_segments:
                self._check_result(pool, manifest, outputs)

    @staticmethod
    def _base_arrays(manifest: Manifest, base: Checkpoint | None) -> list[np.ndarray]:
        needs = [any(e.base_offset is not None for e in f.segments) for f in manifest.files]
        if not any(needs):
            return [np.zeros(0, dtype=np.uint8)] * len(manifest.files)
        if base is None:
            raise BaseMismatch("this delta needs a base version")
        if manifest.single_file and len(base.files) == 1:
            return [base.files[0].data]
        by_path = base.by_path()
        out = []
        for f, need in zip(manifest.files, needs, strict=True):
            b = by_path.get(f.path)
            if need and b is None:
                raise BaseMismatch(f"base has no file {f.path!r}")
            out.append(b.data if b is not None else np.zeros(0, dtype=np.uint8))
        return out

    @staticmethod
    def _check_base(pool: ThreadPoolExecutor, manifest: Manifest, base_arrays: list[np.ndarray]) -> None:
        jobs = []
        for fi, f in enumerate(manifest.files):
            for e in f.segments:
                if e.base_offset is None:
                    continue
                end = e.base_offset + e.segment.length
                if end > len(base_arrays[fi]):
                    raise BaseMismatch(f"{f.path}: base is too short for {e.segment.kind} {e.segment.name!r}")
                jobs.append((f.path, e, pool.submit(xxh3_128, base_arrays[fi][e.base_offset : end])))
        for path, e, fut in jobs:
            if fut.result().hex() != e.base_xxh3:
                what = "header" if e.segment.kind == "header" else f"{e.segment.kind} {e.segment.name!r}"
                raise BaseMismatch(f"{path}: base {what} is not the one this delta was made against")

    @staticmethod
    def _check_result(pool: ThreadPoolExecutor, manifest: Manifest, outputs: list[np.ndarray]) -> None:
        jobs = [
            (f.path, e, pool.submit(xxh3_128, outputs[fi][e.segment.offset : e.segment.offset + e.segment.length]))
            for fi, f in enumerate(manifest.files)
            for e in f.segments
        ]
        for path, e, fut in jobs:
            if fut.result().hex() != e.xxh3:
                raise ChecksumMismatch(f"{path}: decoded {e.segment.kind} {e.segment.name!r} fails its checksum")
