"""Encode a checkpoint against a base into frames and a manifest (docs/FORMAT.md §4, §5).

Chunking (FORMAT §4.5): a tensor larger than ``chunk_bytes`` is cut into independently
decodable frames; smaller segments of one dtype are grouped into a frame so thousands of
tiny tensors do not make thousands of frames. Frames are encoded on a thread pool: zstd,
xxhash (above 64 KiB, python-xxhash >= 4) and the C kernels (codec/kernels.py) release
the GIL, so this scales with cores. What one encode does, per format version, is in
`encode_jobs`; :class:`~weightsync.codec.decoder.Decoder` (re-exported here) does the reverse.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from weightsync.codec.checkpoint import Checkpoint, CheckpointFile, Segment
from weightsync.codec.checksum import lanes_of
from weightsync.codec.decoder import Decoder as Decoder  # re-exported: the codec's two halves live side by side
from weightsync.codec.decoder import default_threads
from weightsync.codec.encode_jobs import EncodedFrame as EncodedFrame  # re-exported: part of the API
from weightsync.codec.encode_jobs import V1Job, V2Job
from weightsync.codec.frame import DEFAULT_LEVEL
from weightsync.codec.manifest import (
    DIGEST_KINDS,
    LATEST,
    VERSION,
    VERSION_2,
    FileEntry,
    FrameRef,
    Manifest,
    SegmentEntry,
)
from weightsync.errors import BaseMismatch, InvalidArgument

DEFAULT_CHUNK = 16 << 20
"""Frame size target (FORMAT §4.5). Each frame costs Python around its kernels (its sections, its
checksums, a pool job) in the encode and the decode, which holds the GIL; on a 1 GB Llama step
(286 frames at 4 MiB, 110 at 16 MiB with small tensors grouped to 4 MiB) the encode took 20-35 %
and `prepare` for a device 30-38 % less time at 16 MiB, frames and manifest came out smaller, and
the 45 MB and 436 MB corpus models encoded and applied as fast (docs/SCALE-RUNS.md, run Z). A frame is
also the unit a reader fetches for a slice of a tensor: a larger one reads more around the slice."""
DEFAULT_FORMAT = LATEST
"""Encoders write FORMAT v2 unless told otherwise (v1 stays readable; a chain never mixes them)."""


@dataclass
class Encoded:
    """The result of encoding: a manifest whose frame refs point into `frames` by index."""

    manifest: Manifest
    frames: list[EncodedFrame]
    kept: bool = False
    """The base's buffers hold the new version's bytes (`Encoder.encode` with keep_base, where it could)."""

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
            version=m.version,
        )


class Encoder:
    """Reusable encoder. Thread-safe: one instance may serve concurrent `encode` calls.

    ``threads`` sets the pool size (default: all cores), ``level`` the zstd level,
    ``chunk_bytes`` the frame size target, ``format_version`` what it writes: 2 (the
    default: tensor checksums, compact manifests, FORMAT §5.3) or 1 (xxh3-128, §5.2).
    ``frames_per_file``: no frame holds pieces of two files (a part of a multi-part publish
    encodes so, codec/parts.py: a file several parts carry is then kept once by dropping frames).
    ``pool``: run on this executor (its size, not ``threads``, sets the parallelism) instead of
    starting a pool of its own for each `encode`; its jobs never wait on each other, so a pool
    whose jobs must not (the client's process-wide CPU pool) is fine, as long as `encode` is
    not called from one of its own jobs.
    """

    def __init__(
        self,
        *,
        threads: int | None = None,
        level: int = DEFAULT_LEVEL,
        chunk_bytes: int = DEFAULT_CHUNK,
        format_version: int = DEFAULT_FORMAT,
        frames_per_file: bool = False,
        pool: Executor | None = None,
    ) -> None:
        if chunk_bytes < 1024:
            raise ValueError("chunk_bytes must be at least 1024")
        if format_version not in DIGEST_KINDS:
            raise ValueError(f"format_version must be one of {sorted(DIGEST_KINDS)}")
        self.threads = threads or default_threads()
        self.level = level
        self.chunk_bytes = chunk_bytes
        self.format_version = format_version
        self.frames_per_file = frames_per_file
        self.pool = pool

    @property
    def digest_kind(self) -> str:
        """The digest kind of what this encoder writes ("xxh3-128" or "sum64x16")."""
        return DIGEST_KINDS[self.format_version]

    def encode(
        self,
        new: Checkpoint,
        base: Checkpoint | None = None,
        *,
        base_digests: dict[tuple[str, str, str], str] | None = None,
        base_kind: str | None = None,
        keyframe: bool = False,
        keep_base: bool = False,
        on_frame: Callable[[EncodedFrame], None] | None = None,
    ) -> Encoded:
        """Encode `new`, as deltas against `base` wherever a segment has a counterpart.

        A counterpart is the segment of the same kind and name, dtype and shape in
        the base file of the same path (the only base file in single-file mode).
        Segments without one are coded whole. ``keyframe=True`` ignores `base`.
        ``base_digests`` maps (path, kind, name) to known digests of base segments
        (of this encoder's digest kind: the base is not digested again).
        ``base_kind``, the digest kind of the base version's manifest when the caller
        knows it, must be this encoder's: a chain never mixes formats (FORMAT §5.3), so
        a delta on a version of the other format is refused with BaseMismatch before
        any work (publish a keyframe instead).

        ``keep_base`` (the base's buffers writable and nobody else's): where every segment of
        `new` is delta-coded on a base segment at the same offset of a base file of the same
        size (the same layout: an optimizer step), the coding pass also writes each change into
        the base, so its buffers hold `new`'s bytes afterwards (``Encoded.kept``; FORMAT v2
        only). A publisher keeps its next base so, with no second pass and no copy. Elsewhere
        the base is left alone (``kept`` False). After an exception the base may hold either.

        ``on_frame``: called with each frame as soon as it and every frame before it are made and it
        is final, in their order, from the encode's threads (never twice at once): the frames of
        ``Encoded.frames``, so a caller can pack and upload them while the rest encode
        (``pack.Packer``). A delta frame of a tensor cut into frames of its own is final once one of
        that tensor's frames holds a change (the tensor's frames are dropped together when none
        does, FORMAT §5.3). Only in format 2: ValueError otherwise, before any work. An exception
        it raises fails the encode.
        """
        if keyframe:
            base = None
        if base is not None and base_kind is not None and base_kind != self.digest_kind:
            raise BaseMismatch(
                f"the base version's manifest has {base_kind} digests, this encoder writes {self.digest_kind}: "
                "a chain never mixes formats, publish a keyframe"
            )
        if on_frame is not None and self.format_version != VERSION_2:
            raise ValueError("on_frame: frames are handed on as they are made only in a format 2 encode")
        base_files = self._match_files(new, base)
        entries = self._entries(new, base_files, base_digests or {})
        new_arrays = [f.data for f in new.files]
        base_arrays = [b.data if b is not None else np.zeros(0, dtype=np.uint8) for b in base_files]
        keep = keep_base and self.format_version == VERSION_2 and _in_place(new, base_files, entries)
        job = (V2Job if self.format_version == VERSION_2 else V1Job)(
            entries,
            new_arrays,
            base_arrays,
            level=self.level,
            chunk_bytes=self.chunk_bytes,
            per_file=self.frames_per_file,
            keep=keep,
            on_frame=on_frame,
        )
        if self.pool is not None:
            frames, digested = job.run(self.pool)
        else:
            with ThreadPoolExecutor(self.threads) as pool:
                frames, digested = job.run(pool)
        files = []
        for fi, (f, row) in enumerate(zip(new.files, entries, strict=True)):
            segs = tuple(
                SegmentEntry(
                    e.segment,
                    digested.new[fi, si],
                    e.base_offset,
                    digested.base.get((fi, si)),
                    (fi, si) in digested.same,
                )
                for si, e in enumerate(row)
            )
            files.append(FileEntry(f.layout.path, f.layout.size, segs))
        kind = "delta" if any(e.base_offset is not None for row in entries for e in row) else "keyframe"
        manifest = Manifest(
            kind=kind,
            single_file=new.single_file,
            files=files,
            frames=[FrameRef(None, 0, len(fr.data), fr.delta, fr.dtype, fr.raw_len, fr.pieces) for fr in frames],
            version=self.format_version,
        )
        return Encoded(manifest, frames, kept=keep)

    def _entries(
        self, new: Checkpoint, base_files: list[CheckpointFile | None], known: dict[tuple[str, str, str], str]
    ) -> list[list[SegmentEntry]]:
        """Each segment of `new` with its base offset (None: coded whole) and known base digest (else None)."""
        rows: list[list[SegmentEntry]] = []
        for f, b in zip(new.files, base_files, strict=True):
            counterpart = {s.key: s for s in b.layout.segments} if b is not None else {}
            row = []
            for seg in f.layout.segments:
                other = counterpart.get(seg.key)
                if b is not None and other is not None and _same_layout(seg, other):
                    digest = known.get((b.layout.path, other.kind, other.name))
                    if digest is not None:
                        self._check_known(digest, seg)
                    row.append(SegmentEntry(seg, "", other.offset, digest))
                else:
                    row.append(SegmentEntry(seg, ""))
            rows.append(row)
        return rows

    def _check_known(self, digest: str, seg: Segment) -> None:
        hexlen = 32 if self.format_version == VERSION else 16 * (1 + lanes_of(seg.dtype.width))
        if len(digest) != hexlen:
            raise InvalidArgument(f"known base digest of {seg.name!r} is not a {self.digest_kind} digest")

    @staticmethod
    def _match_files(new: Checkpoint, base: Checkpoint | None) -> list[CheckpointFile | None]:
        if base is None:
            return [None] * len(new.files)
        if new.single_file and base.single_file and len(base.files) == 1:
            return [base.files[0]]
        by_path = base.by_path()
        return [by_path.get(f.layout.path) for f in new.files]


def _in_place(new: Checkpoint, base_files: list[CheckpointFile | None], entries: list[list[SegmentEntry]]) -> bool:
    """Whether coding `new` on `base_files` can leave each base file holding its new file's bytes: every new
    file has a base file of its size (distinct ones, writable), and every segment a counterpart at its own offset
    (the segments cover the file, FileLayout), so the frames' changes are all there is to write."""
    seen: set[int] = set()
    for f, b, row in zip(new.files, base_files, entries, strict=True):
        if b is None or b.data.size != f.data.size or id(b) in seen or not b.data.flags.writeable:
            return False
        seen.add(id(b))
        if any(e.base_offset != e.segment.offset for e in row):
            return False
    return True


def _same_layout(seg: Segment, other: Segment) -> bool:
    return other.dtype is seg.dtype and other.shape == seg.shape and other.length == seg.length
