"""Decode a manifest's frames onto a base version, checking bases and results (docs/FORMAT.md §5).

Version 1 manifests are checked with xxh3-128: each segment's base before anything is
written, each frame's result by the frame itself. Version 2 manifests are checked with
the tensor checksum (FORMAT §10): bases before anything is written, and every segment's
result from the checksums of its pieces, each summed right after its frame applied it
(the piecewise rule, §10.2, so a segment cut across frames needs no ordering). A v2
segment equal to its base has no frames: it is copied from the base.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from weightsync.codec.checkpoint import Checkpoint
from weightsync.codec.checksum import TensorSum, tensor_sum
from weightsync.codec.frame import (
    FrameHeader,
    apply_frame,
    apply_frame_pieces,
    apply_frame_sums,
    parse_header,
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
    """The checksum of each (bytes, width), on `pool`; large ones in parts of PART_BYTES, added (§10.2)."""
    jobs = []
    for data, width in items:
        step = max(width, PART_BYTES - PART_BYTES % width)
        parts = [
            pool.submit(tensor_sum, data[off : off + step], width, start=off // width)
            for off in range(0, len(data), step)
        ]
        jobs.append((width, parts))
    out = []
    for width, parts in jobs:
        total = TensorSum.empty(width)
        for fut in parts:
            total = total + fut.result()
        out.append(total)
    return out


def apply_summed(
    blob: bytes | memoryview | np.ndarray, pieces: Sequence[Piece], targets: Sequence[np.ndarray]
) -> list[tuple[Piece, TensorSum]]:
    """Apply a version 2 frame into its pieces' targets; (piece, checksum of its result) of each, from the same pass."""
    width = parse_header(blob).dtype.width
    _, sums = apply_frame_sums(blob, targets, [p.offset // width for p in pieces])
    return list(zip(pieces, sums, strict=True))


def check_results(manifest: Manifest, sums: Iterable[tuple[Piece, TensorSum]]) -> None:
    """ChecksumMismatch naming the first segment whose pieces' checksums do not add up to its digest.

    Segments equal to their base (no pieces) are not checked here: their base was.
    """
    totals: dict[tuple[int, int], TensorSum] = {}
    for p, s in sums:
        key = (p.file, p.seg)
        totals[key] = totals[key] + s if key in totals else s
    for fi, f in enumerate(manifest.files):
        for si, e in enumerate(f.segments):
            total = totals.get((fi, si))
            if total is None:
                if e.unchanged or e.segment.length == 0:
                    continue
                raise ChecksumMismatch(f"{f.path}: no frame decoded {describe(e)}")
            if total.hex() != e.digest:
                raise ChecksumMismatch(f"{f.path}: decoded {describe(e)} fails its checksum")


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
        checked first (BaseMismatch naming the tensor, nothing written). Every output
        byte's result is checked as it decodes: by each frame's own xxh3 (version 1)
        or by each segment's checksum (version 2, ChecksumMismatch naming the
        segment); ``verify_segments`` also re-digests every output segment at the end.

        An output may be the base file's own buffer (apply in place, no copy) when
        every delta segment of that file sits at its base offset. A version 1 frame
        whose result fails restores its base; after a version 2 result failure an
        in-place output holds neither version and must be discarded (FORMAT §5.3).
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
        with ThreadPoolExecutor(self.threads) as pool:
            if verify_base:
                self._check_base(pool, manifest, base_arrays)

            def targets_of(ref: FrameRef) -> list[np.ndarray]:
                targets = []
                for p in ref.pieces:
                    entry = manifest.files[p.file].segments[p.seg]
                    start = entry.segment.offset + p.offset
                    target = outputs[p.file][start : start + p.length]
                    if ref.delta and not in_place[p.file]:
                        b0 = base_offset(entry) + p.offset
                        target[:] = base_arrays[p.file][b0 : b0 + p.length]
                    targets.append(target)
                return targets

            def run(ref: FrameRef) -> list[tuple[Piece, TensorSum]]:
                blob = read_frame(ref)
                check_frame(manifest, ref, blob)
                targets = targets_of(ref)  # a grouped frame applies straight into each tensor's bytes
                if v2:  # results summed by the apply pass itself, checked per segment below
                    return apply_summed(blob, ref.pieces, targets)
                # The segment-level check above already covered these base bytes.
                if len(targets) == 1:
                    apply_frame(blob, targets[0], verify_base=False)
                else:
                    apply_frame_pieces(blob, targets, verify_base=False)
                return []

            results = list(pool.map(run, manifest.frames))
            if v2:
                self._copy_unchanged(pool, manifest, outputs, base_arrays, in_place)
                check_results(manifest, (x for r in results for x in r))
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
    def _check_base(pool: ThreadPoolExecutor, manifest: Manifest, base_arrays: list[np.ndarray]) -> None:
        checked = []
        for fi, f in enumerate(manifest.files):
            for e in f.segments:
                if e.base_offset is None:
                    continue
                end = e.base_offset + e.segment.length
                if end > len(base_arrays[fi]):
                    raise BaseMismatch(f"{f.path}: base is too short for {describe(e)}")
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
