"""Decode a manifest's frames onto a base version, checking bases and results (docs/FORMAT.md §5).

Version 1 manifests are checked with xxh3-128: each segment's base before anything is
written, each frame's result by the frame itself. Version 2 manifests are checked with
the tensor checksum (FORMAT §10) in the pass that applies the frames: each block of a
target is summed right before it is patched and right after, while in cache, and a
segment's base and result checksums are the sums of its pieces' (the piecewise rule,
§10.2, so a segment cut across frames needs no ordering). Only the delta segments no frame
covers (those equal to their base, copied or left in place) get a pass of their own, before
anything is written.

An output may be the base's own buffer (decoding in place): after any failure once writing
has started, every frame applied to it is undone (XOR by XOR, ADD by SUB; keyframe pieces
from a copy) before the error is raised, so it holds its base again. Any other output holds
partial bytes after a failure: discard it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np

from weightsync.codec.checkpoint import Checkpoint
from weightsync.codec.checksum import TensorSum, tensor_sum
from weightsync.codec.frame import (
    FrameHeader,
    TargetSums,
    apply_frame,
    apply_frame_pieces,
    apply_frame_sums,
    parse_header,
    undo_frame,
    xxh3_128,
)
from weightsync.codec.manifest import VERSION_2, FrameRef, Manifest, Piece, SegmentEntry
from weightsync.errors import BaseMismatch, ChecksumMismatch, CorruptData, LimitExceeded

PART_BYTES = 8 << 20
"""Segments larger than this are checksummed in parts on several threads (FORMAT §10.2)."""


def default_threads() -> int:
    return os.cpu_count() or 1


def base_offset(entry: SegmentEntry) -> int:
    """Where a delta-coded segment's base bytes start in the base file (FORMAT §5.2)."""
    if entry.base_offset is None:
        raise AssertionError(f"segment {entry.segment.name!r} is not delta-coded")
    return entry.base_offset


def describe(entry: SegmentEntry) -> str:
    """How errors name a segment: "header", or its kind and name."""
    return "header" if entry.segment.kind == "header" else f"{entry.segment.kind} {entry.segment.name!r}"


def check_frame(manifest: Manifest, ref: FrameRef, blob: bytes | memoryview | np.ndarray) -> FrameHeader:
    """The frame's header, which must agree with its manifest entry: version, kind, dtype and length."""
    head = parse_header(blob)
    if (head.version, head.delta, head.dtype.name, head.raw_len) != (
        manifest.version,
        ref.delta,
        ref.dtype,
        ref.raw_len,
    ):
        raise CorruptData("frame header disagrees with its manifest entry")
    return head


def sums_of(pool: ThreadPoolExecutor, items: Sequence[tuple[np.ndarray, int]]) -> list[TensorSum]:
    """The checksum of each (bytes, width), on `pool`; large ones in parts of PART_BYTES, added (§10.2).

    Small items go to the pool together, about PART_BYTES per task: handing a task to a
    thread costs ~50 µs, about what summing a 1 MiB tensor does (measured on one thread,
    272 unchanged experts of 1 MiB: a third of the pass was handoffs).
    """
    tasks = []
    batch: list[tuple[int, np.ndarray, int, int]] = []
    held = 0
    for i, (data, width) in enumerate(items):
        step = max(width, PART_BYTES - PART_BYTES % width)
        for off in range(0, len(data), step):
            part = data[off : off + step]
            batch.append((i, part, width, off // width))
            held += len(part)
            if held >= PART_BYTES:
                tasks.append(pool.submit(_sum_parts, batch))
                batch, held = [], 0
    if batch:
        tasks.append(pool.submit(_sum_parts, batch))
    out = [TensorSum.empty(width) for _, width in items]
    for task in tasks:
        for i, s in task.result():
            out[i] = out[i] + s
    return out


def _sum_parts(parts: Sequence[tuple[int, np.ndarray, int, int]]) -> list[tuple[int, TensorSum]]:
    """(item, checksum) of each (item, bytes, width, start)."""
    return [(i, tensor_sum(data, width, start=start)) for i, data, width, start in parts]


def apply_summed(
    blob: bytes | memoryview | np.ndarray, pieces: Sequence[Piece], targets: Sequence[np.ndarray]
) -> list[tuple[Piece, TensorSum]]:
    """Apply a version 2 frame into its pieces' targets; (piece, checksum of its result) of each, from the same pass."""
    width = parse_header(blob).dtype.width
    _, sums = apply_frame_sums(blob, targets, [p.offset // width for p in pieces])
    return [(p, s.after) for p, s in zip(pieces, sums, strict=True)]


def _totals(sums: Iterable[tuple[Piece, TensorSum]]) -> dict[tuple[int, int], TensorSum]:
    """The checksum of each (file, segment) from its pieces' (FORMAT §10.2)."""
    totals: dict[tuple[int, int], TensorSum] = {}
    for p, s in sums:
        key = (p.file, p.seg)
        totals[key] = totals[key] + s if key in totals else s
    return totals


def check_results(manifest: Manifest, sums: Iterable[tuple[Piece, TensorSum]]) -> None:
    """ChecksumMismatch naming the first segment whose pieces' checksums do not add up to its digest.

    Segments equal to their base (no pieces) are not checked here: their base was.
    """
    totals = _totals(sums)
    for fi, f in enumerate(manifest.files):
        for si, e in enumerate(f.segments):
            total = totals.get((fi, si))
            if total is None:
                if e.unchanged or e.segment.length == 0:
                    continue
                raise ChecksumMismatch(f"{f.path}: no frame decoded {describe(e)}")
            if total.hex() != e.digest:
                raise ChecksumMismatch(f"{f.path}: decoded {describe(e)} fails its checksum")


def covered_segments(manifest: Manifest) -> frozenset[tuple[int, int]]:
    """The (file, segment) of every delta segment whose bytes the delta frames' pieces cover whole.

    Their base checksums can come from the pass that applies those frames (the sum of
    their pieces' before-checksums, FORMAT §10.2); any other delta segment (equal to its
    base, or empty) needs a pass of its own.
    """
    covered: dict[tuple[int, int], int] = {}
    for ref in manifest.frames:
        if ref.delta:
            for p in ref.pieces:
                covered[(p.file, p.seg)] = covered.get((p.file, p.seg), 0) + p.length
    out = set()
    for (fi, si), n in covered.items():
        e = manifest.files[fi].segments[si]
        if e.base_offset is not None and not e.unchanged and n == e.segment.length:
            out.add((fi, si))
    return frozenset(out)


def check_bases(
    manifest: Manifest, sums: Iterable[tuple[Piece, TensorSum]], segments: Collection[tuple[int, int]]
) -> None:
    """BaseMismatch naming the first of `segments` whose pieces' base checksums do not add up to its base digest."""
    totals = _totals(sums)
    for fi, si in sorted(segments):
        f, e = manifest.files[fi], manifest.files[fi].segments[si]
        total = totals.get((fi, si))
        if total is None or total.hex() != e.base_digest:
            raise BaseMismatch(f"{f.path}: base {describe(e)} is not the one this delta was made against")


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

        `read_frame` returns a frame's bytes given its ref; after a failure it is called
        again for each frame to undo in an in-place output, and must return the same bytes.
        For a delta manifest `base` holds the parent version and every delta segment's base
        is checked (BaseMismatch naming the segment): version 1 before anything is written;
        version 2 in the pass that applies the frames, except segments no frame covers
        (equal to their base), which are checked before anything is written. Every output
        byte's result is checked as it decodes: by each frame's own xxh3 (version 1) or by
        each segment's checksum (version 2, ChecksumMismatch naming the segment);
        ``verify_segments`` also re-digests every output segment at the end.

        An output may be the base file's own buffer (apply in place, no copy) when every
        delta segment of that file sits at its base offset. Whatever fails once writing has
        started (a base or result mismatch, a damaged frame), such an output holds its base's
        bytes again when the error is raised: every frame applied to it is undone (FORMAT
        §5.3); should that fail too, the error carries a note saying the output holds neither
        version. Any other output holds partial bytes after a failure and must be discarded.
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
        v2 = manifest.version == VERSION_2
        fused = covered_segments(manifest) if v2 and verify_base else frozenset()
        saved: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}  # keyframe pieces overwritten in place

        def views_of(ref: FrameRef) -> list[np.ndarray]:
            out = []
            for p in ref.pieces:
                start = manifest.files[p.file].segments[p.seg].segment.offset + p.offset
                out.append(outputs[p.file][start : start + p.length])
            return out

        def run(i: int, ref: FrameRef) -> list[tuple[Piece, TargetSums]]:
            blob = read_frame(ref)
            head = check_frame(manifest, ref, blob)
            targets = views_of(ref)  # a grouped frame applies straight into each tensor's bytes
            for p, target in zip(ref.pieces, targets, strict=True):
                if ref.delta and not in_place[p.file]:
                    b0 = base_offset(manifest.files[p.file].segments[p.seg]) + p.offset
                    target[:] = base_arrays[p.file][b0 : b0 + p.length]
            if not ref.delta and any(in_place[p.file] for p in ref.pieces):
                saved[i] = [(t, t.copy()) for p, t in zip(ref.pieces, targets, strict=True) if in_place[p.file]]
            if v2:  # bases (when asked) and results summed by the apply pass itself, checked per segment below
                starts = [p.offset // head.dtype.width for p in ref.pieces]
                _, sums = apply_frame_sums(blob, targets, starts, before=ref.delta and bool(fused))
                return list(zip(ref.pieces, sums, strict=True))
            # The segment-level check above already covered these base bytes.
            if len(targets) == 1:
                apply_frame(blob, targets[0], verify_base=False)
            else:
                apply_frame_pieces(blob, targets, verify_base=False)
            return []

        with ThreadPoolExecutor(self.threads) as pool:
            if verify_base:  # nothing is written before these
                self._check_base(pool, manifest, base_arrays, skip=fused)
            futures: list[Future[list[tuple[Piece, TargetSums]]]] = []
            try:
                for i, ref in enumerate(manifest.frames):
                    futures.append(pool.submit(run, i, ref))
                results = [fut.result() for fut in futures]
                if v2:
                    self._copy_unchanged(pool, manifest, outputs, base_arrays, in_place)
                    summed = [x for r in results for x in r]
                    check_bases(manifest, ((p, s.before) for p, s in summed if s.before is not None), fused)
                    check_results(manifest, ((p, s.after) for p, s in summed))
                if verify_segments:
                    self._check_result(pool, manifest, outputs)
            except BaseException as exc:
                for fut in futures:  # frames not started yet never will be; those running finish
                    fut.cancel()
                wait(futures)
                if any(in_place):
                    failed = _restore(pool, manifest, read_frame, futures, saved, views_of, in_place)
                    if failed is not None:
                        exc.add_note(f"the in-place output holds neither version: undoing the frames failed ({failed})")
                raise

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
    def _copy_unchanged(
        pool: ThreadPoolExecutor,
        manifest: Manifest,
        outputs: list[np.ndarray],
        base_arrays: list[np.ndarray],
        in_place: list[bool],
    ) -> None:
        """Version 2: segments equal to their base have no frames; outputs that are not the base get a copy."""
        jobs = []
        for fi, f in enumerate(manifest.files):
            if in_place[fi]:
                continue
            for e in f.segments:
                if e.unchanged and e.segment.length:
                    dst = outputs[fi][e.segment.offset : e.segment.offset + e.segment.length]
                    src = base_arrays[fi][base_offset(e) : base_offset(e) + e.segment.length]
                    jobs.append(pool.submit(np.copyto, dst, src))
        for job in jobs:
            job.result()

    @staticmethod
    def _check_base(
        pool: ThreadPoolExecutor,
        manifest: Manifest,
        base_arrays: list[np.ndarray],
        skip: Collection[tuple[int, int]] = (),
    ) -> None:
        """BaseMismatch unless every delta segment's base is there, and those not in `skip` have their digests."""
        checked = []
        for fi, f in enumerate(manifest.files):
            for si, e in enumerate(f.segments):
                if e.base_offset is None:
                    continue
                end = e.base_offset + e.segment.length
                if end > len(base_arrays[fi]):
                    raise BaseMismatch(f"{f.path}: base is too short for {describe(e)}")
                if (fi, si) not in skip:
                    checked.append((f.path, e, base_arrays[fi][e.base_offset : end]))
        digests = _digests(pool, manifest, [(e, data) for _, e, data in checked])
        for (path, e, _), digest in zip(checked, digests, strict=True):
            if digest != e.base_digest:
                raise BaseMismatch(f"{path}: base {describe(e)} is not the one this delta was made against")

    @staticmethod
    def _check_result(pool: ThreadPoolExecutor, manifest: Manifest, outputs: list[np.ndarray]) -> None:
        items = [
            (f.path, e, outputs[fi][e.segment.offset : e.segment.offset + e.segment.length])
            for fi, f in enumerate(manifest.files)
            for e in f.segments
        ]
        digests = _digests(pool, manifest, [(e, data) for _, e, data in items])
        for (path, e, _), digest in zip(items, digests, strict=True):
            if digest != e.digest:
                raise ChecksumMismatch(f"{path}: decoded {describe(e)} fails its checksum")


def _digests(pool: ThreadPoolExecutor, manifest: Manifest, items: list[tuple[SegmentEntry, np.ndarray]]) -> list[str]:
    """The digest of each segment's bytes, of the manifest's kind, computed on `pool`."""
    if manifest.version == VERSION_2:
        return [s.hex() for s in sums_of(pool, [(data, e.segment.dtype.width) for e, data in items])]
    futures = [pool.submit(xxh3_128, data) for _, data in items]
    return [fut.result().hex() for fut in futures]


def _restore(
    pool: ThreadPoolExecutor,
    manifest: Manifest,
    read_frame: Callable[[FrameRef], bytes | memoryview],
    futures: Sequence[Future[list[tuple[Piece, TargetSums]]]],
    saved: dict[int, list[tuple[np.ndarray, np.ndarray]]],
    views_of: Callable[[FrameRef], list[np.ndarray]],
    in_place: list[bool],
) -> str | None:
    """Undo every frame applied into an in-place output, after a failure; None, or why it could not.

    `futures` are the frames' applies, all settled: one that raised wrote nothing (or, a
    version 1 frame failing its result, undid itself). Delta frames are undone by their
    inverse (`undo_frame`), checked against the before-checksums of their apply when taken;
    keyframe pieces are put back from `saved`.
    """

    def undo(job: tuple[FrameRef, list[tuple[Piece, TargetSums]]]) -> None:
        ref, applied = job
        targets = views_of(ref)
        blob = read_frame(ref)
        befores = [s.before for _, s in applied]
        if applied and all(b is not None for b in befores):
            width = parse_header(blob).dtype.width
            now = undo_frame(blob, targets, [p.offset // width for p in ref.pieces])
            if now != befores:
                raise CorruptData("a frame read again undid to other bytes than its apply found")
        else:
            undo_frame(blob, targets)

    jobs = []
    for ref, fut in zip(manifest.frames, futures, strict=False):  # fewer futures: interrupted while submitting
        if ref.delta and any(in_place[p.file] for p in ref.pieces) and not fut.cancelled() and not fut.exception():
            jobs.append((ref, fut.result()))
    problems = []
    for undone in [pool.submit(undo, job) for job in jobs]:
        try:
            undone.result()
        except Exception as exc:  # noqa: BLE001 - the caller's read_frame may raise anything: a note, not a new error
            problems.append(f"{type(exc).__name__}: {exc}")
    for pieces in saved.values():
        for target, copy in pieces:
            target[:] = copy
    return "; ".join(problems[:3]) if problems else None
