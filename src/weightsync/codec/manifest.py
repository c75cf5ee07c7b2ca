"""The manifest: JSON description of one encoded version (docs/FORMAT.md §5).

A manifest lists the version's files and their segments (with xxh3-128 of each
segment's bytes and, for delta-coded segments, of the base bytes they apply to)
and the frames that produce them, each naming where its bytes live and which
pieces of which segments it decodes into. ``Manifest.parse`` is the one strict
validator: every cap and cross-reference is checked there, before any decode
allocates anything.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field
from typing import Any

import xxhash
import zstandard

from weightsync.codec.checkpoint import FileLayout, Segment, check_path
from weightsync.codec.dtypes import by_name
from weightsync.codec.frame import MAX_FRAME_RAW
from weightsync.common import DIGEST_PATTERN, MODEL_NAME_PATTERN
from weightsync.errors import (
    BadMagic,
    CorruptData,
    FormatError,
    InvalidName,
    LimitExceeded,
    TruncatedInput,
    UnsupportedDtype,
    UnsupportedVersion,
)

FORMAT = "weightsync.manifest"
VERSION = 1
MAX_MANIFEST = 256 << 20
MAX_FILES = 100_000
MAX_SEGMENTS = 2_000_000
MAX_FRAMES = 4_000_000
MAX_FILE_SIZE = 1 << 44  # 16 TiB
_HEX32 = re.compile(r"[0-9a-f]{32}")
_KINDS = ("header", "tensor", "blob")
MAGIC = b"WSMF"
# FORMAT §5.1: magic, version, flags, reserved, JSON length, xxh3-64 of the JSON; then zstd(JSON).
_ENVELOPE = struct.Struct("<4sBBHQQ")
ENVELOPE_SIZE = _ENVELOPE.size  # 24


@dataclass(frozen=True)
class SegmentEntry:
    """A segment plus its checksums; `base_offset` set means delta-coded against the base file."""

    segment: Segment
    xxh3: str
    base_offset: int | None = None
    base_xxh3: str | None = None


@dataclass(frozen=True)
class FileEntry:
    path: str
    size: int
    segments: tuple[SegmentEntry, ...]

    @property
    def layout(self) -> FileLayout:
        return FileLayout(self.path, self.size, tuple(e.segment for e in self.segments))

    def spans(self) -> dict[tuple[int, int], str]:
        """Each segment's xxh3 hex by (offset, length): what a delta's base must hold at that place.

        Keyed by both, not the offset alone: a 0-element tensor shares its offset with the segment after it.
        """
        return {(e.segment.offset, e.segment.length): e.xxh3 for e in self.segments}


@dataclass(frozen=True)
class Piece:
    """`length` bytes at `offset` within segment `seg` of file `file` (indices into the manifest)."""

    file: int
    seg: int
    offset: int
    length: int


@dataclass(frozen=True)
class FrameRef:
    """Where a frame's bytes are and what it decodes into."""

    object: str | None
    """SHA-256 of the store object holding the frame; None inside a delta container."""
    offset: int
    length: int
    delta: bool
    dtype: str
    raw_len: int
    pieces: tuple[Piece, ...]


@dataclass
class Manifest:
    """One version's description. Build it with the encoder; read it with `parse`."""

    kind: str  # "keyframe" | "delta"
    single_file: bool
    files: list[FileEntry]
    frames: list[FrameRef]
    model: str | None = None
    number: int | None = None
    parent: int | None = None
    step: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def raw_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def stored_bytes(self) -> int:
        return sum(fr.length for fr in self.frames)

    def objects(self) -> dict[str, int]:
        """Digest → bytes used, of every store object the frames reference."""
        out: dict[str, int] = {}
        for fr in self.frames:
            if fr.object is not None:
                out[fr.object] = max(out.get(fr.object, 0), fr.offset + fr.length)
        return out

    def to_dict(self) -> dict[str, Any]:
        files = []
        for f in self.files:
            segs = []
            for e in f.segments:
                s = e.segment
                d: dict[str, Any] = {
                    "kind": s.kind,
                    "name": s.name,
                    "dtype": s.dtype.name,
                    "shape": list(s.shape),
                    "offset": s.offset,
                    "length": s.length,
                    "xxh3": e.xxh3,
                }
                if e.base_offset is not None:
                    d["base_offset"] = e.base_offset
                    d["base_xxh3"] = e.base_xxh3
                segs.append(d)
            files.append({"path": f.path, "size": f.size, "segments": segs})
        frames = [
            {
                "object": fr.object,
                "offset": fr.offset,
                "length": fr.length,
                "delta": fr.delta,
                "dtype": fr.dtype,
                "raw_len": fr.raw_len,
                "pieces": [[p.file, p.seg, p.offset, p.length] for p in fr.pieces],
            }
            for fr in self.frames
        ]
        return {
            "format": FORMAT,
            "version": VERSION,
            "kind": self.kind,
            "single_file": self.single_file,
            "model": self.model,
            "number": self.number,
            "parent": self.parent,
            "step": self.step,
            "metadata": self.metadata,
            "raw_bytes": self.raw_bytes,
            "stored_bytes": self.stored_bytes,
            "files": files,
            "frames": frames,
        }

    def to_json(self) -> bytes:
        """Canonical bytes: sorted keys, no whitespace, so equal manifests hash equal."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()

    def encode(self) -> bytes:
        """The manifest's stored form (FORMAT §5.1): a small envelope around zstd of the canonical JSON."""
        body = self.to_json()
        packed = zstandard.ZstdCompressor(level=9, write_content_size=True).compress(body)
        return _ENVELOPE.pack(MAGIC, VERSION, 0, 0, len(body), xxhash.xxh3_64_intdigest(body)) + packed

    @classmethod
    def decode(cls, data: bytes | memoryview) -> Manifest:
        """Parse the stored form written by `encode`; FormatError subclasses on anything wrong."""
        view = memoryview(data)
        if len(view) < ENVELOPE_SIZE:
            if len(view) >= 4 and bytes(view[:4]) != MAGIC:
                raise BadMagic("not a weightsync manifest")
            raise TruncatedInput("manifest is shorter than its envelope")
        magic, version, flags, reserved, length, check = _ENVELOPE.unpack(view[:ENVELOPE_SIZE])
        if magic != MAGIC:
            raise BadMagic("not a weightsync manifest")
        if version != VERSION or flags or reserved:
            raise UnsupportedVersion(f"manifest envelope version {version}, flags {flags}")
        if length > MAX_MANIFEST:
            raise LimitExceeded(f"manifest declares {length} bytes, cap is {MAX_MANIFEST}")
        packed = view[ENVELOPE_SIZE:]
        try:
            declared = zstandard.frame_content_size(packed)
        except zstandard.ZstdError as exc:
            raise CorruptData(f"manifest does not decode: {exc}") from None
        if declared != length:
            raise LimitExceeded(f"manifest body declares {declared} bytes, envelope says {length}")
        try:
            body = zstandard.ZstdDecompressor().decompress(packed, max_output_size=length, allow_extra_data=False)
        except zstandard.ZstdError as exc:
            raise CorruptData(f"manifest does not decode: {exc}") from None
        if len(body) != length or xxhash.xxh3_64_intdigest(body) != check:
            raise CorruptData("manifest checksum mismatch")
        return cls.parse(body)

    @classmethod
    def parse(cls, data: bytes) -> Manifest:
        """Parse and validate manifest bytes; FormatError subclasses (or InvalidName) on anything wrong."""
        if len(data) > MAX_MANIFEST:
            raise LimitExceeded(f"manifest of {len(data)} bytes exceeds {MAX_MANIFEST}")
        try:
            doc = json.loads(data)
        except (UnicodeDecodeError, ValueError) as exc:
            raise FormatError(f"manifest is not JSON: {exc}") from None
        except RecursionError:  # a few KB of "[[[[…" nest deeper than the parser's stack
            raise FormatError("manifest JSON nests too deeply") from None
        try:
            return _validate(doc)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise FormatError(f"malformed manifest: {type(exc).__name__}: {exc}") from None


def _int(v: Any, what: str, hi: int) -> int:
    if type(v) is not int or v < 0 or v > hi:
        raise LimitExceeded(f"{what}: {v!r} is not an integer in [0, {hi}]")
    return v


def _opt_int(v: Any, what: str) -> int | None:
    return None if v is None else _int(v, what, 1 << 62)


def _hex(v: Any, pattern: re.Pattern[str], what: str) -> str:
    if not isinstance(v, str) or not pattern.fullmatch(v):
        raise FormatError(f"{what}: not a lowercase hex digest")
    return v


def _validate(doc: Any) -> Manifest:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise FormatError("not a weightsync manifest")
    if doc.get("version") != VERSION:
        raise UnsupportedVersion(f"manifest version {doc.get('version')!r} (this reader knows {VERSION})")
    kind = doc["kind"]
    if kind not in ("keyframe", "delta"):
        raise FormatError(f"manifest kind {kind!r}")
    raw_files = doc["files"]
    raw_frames = doc["frames"]
    if not isinstance(raw_files, list) or len(raw_files) > MAX_FILES:
        raise LimitExceeded("manifest files: not a list or too many")
    if not isinstance(raw_frames, list) or len(raw_frames) > MAX_FRAMES:
        raise LimitExceeded("manifest frames: not a list or too many")
    files: list[FileEntry] = []
    seen_paths: set[str] = set()
    total_segments = 0
    for f in raw_files:
        path = check_path(f["path"])
        if path in seen_paths:
            raise FormatError(f"file {path!r} listed twice")
        seen_paths.add(path)
        size = _int(f["size"], f"{path}: size", MAX_FILE_SIZE)
        segs = []
        cursor = 0
        raw_segs = f["segments"]
        total_segments += len(raw_segs)
        if total_segments > MAX_SEGMENTS:
            raise LimitExceeded("too many segments")
        for s in raw_segs:
            if s["kind"] not in _KINDS or not isinstance(s["name"], str):
                raise FormatError(f"{path}: bad segment kind or name")
            try:
                dtype = by_name(s["dtype"])
            except UnsupportedDtype as exc:
                raise FormatError(f"{path}: {exc}") from None
            shape = tuple(_int(d, f"{path}: shape", 1 << 48) for d in s["shape"])
            offset = _int(s["offset"], f"{path}: offset", size)
            length = _int(s["length"], f"{path}: length", size)
            if offset != cursor:
                raise FormatError(f"{path}: segments do not tile the file at offset {cursor}")
            try:
                if dtype.nbytes(shape) != length:
                    raise FormatError(f"{path}: segment {s['name']!r} length disagrees with its shape")
            except UnsupportedDtype as exc:
                raise FormatError(f"{path}: {exc}") from None
            cursor += length
            base_offset = _opt_int(s.get("base_offset"), f"{path}: base_offset")
            base_xxh3 = None if base_offset is None else _hex(s["base_xxh3"], _HEX32, "base_xxh3")
            segs.append(
                SegmentEntry(
                    Segment(s["kind"], s["name"], dtype, shape, offset, length),
                    _hex(s["xxh3"], _HEX32, "xxh3"),
                    base_offset,
                    base_xxh3,
                )
            )
        if cursor != size:
            raise FormatError(f"{path}: segments cover {cursor} of {size} bytes")
        files.append(FileEntry(path, size, tuple(segs)))
    if doc.get("single_file") and len(files) != 1:
        raise FormatError("single-file manifest with other than one file")
    frames: list[FrameRef] = []
    covered: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for fr in raw_frames:
        obj = fr["object"]
        if obj is not None:
            _hex(obj, DIGEST_PATTERN, "frame object")
        try:
            dtype = by_name(fr["dtype"])
        except UnsupportedDtype:
            raise FormatError(f"frame dtype {fr['dtype']!r}") from None
        delta = fr["delta"]
        if type(delta) is not bool:
            raise FormatError("frame delta flag is not a boolean")
        raw_len = _int(fr["raw_len"], "frame raw_len", MAX_FRAME_RAW)
        pieces = []
        total = 0
        for p in fr["pieces"]:
            if not isinstance(p, list) or len(p) != 4:
                raise FormatError("frame piece is not [file, segment, offset, length]")
            fi = _int(p[0], "piece file", len(files) - 1)
            si = _int(p[1], "piece segment", len(files[fi].segments) - 1)
            entry = files[fi].segments[si]
            off = _int(p[2], "piece offset", entry.segment.length)
            ln = _int(p[3], "piece length", entry.segment.length - off)
            if entry.segment.dtype is not dtype:
                raise FormatError("frame dtype differs from a segment it decodes into")
            if off % dtype.width or ln % dtype.width:
                raise FormatError("piece not aligned to whole elements")
            if delta and entry.base_offset is None:
                raise FormatError("delta frame decodes into a segment with no base")
            pieces.append(Piece(fi, si, off, ln))
            covered.setdefault((fi, si), []).append((off, ln))
            total += ln
        if total != raw_len:
            raise FormatError(f"frame pieces hold {total} bytes, raw_len says {raw_len}")
        frames.append(
            FrameRef(
                obj,
                _int(fr["offset"], "frame offset", 1 << 62),
                _int(fr["length"], "frame length", MAX_FRAME_RAW + (64 << 20)),
                delta,
                dtype.name,
                raw_len,
                tuple(pieces),
            )
        )
    for fi, f in enumerate(files):
        for si, e in enumerate(f.segments):
            spans = sorted(covered.get((fi, si), []))
            cursor = 0
            for off, ln in spans:
                if off != cursor:
                    raise FormatError(f"{f.path}: frames leave a gap or overlap in segment {e.segment.name!r}")
                cursor += ln
            if cursor != e.segment.length:
                raise FormatError(
                    f"{f.path}: frames cover {cursor} of {e.segment.length} bytes of segment {e.segment.name!r}"
                )
    model = doc.get("model")
    if model is not None and (not isinstance(model, str) or not MODEL_NAME_PATTERN.fullmatch(model)):
        raise InvalidName(f"bad model name {model!r}")
    metadata = doc.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise FormatError("metadata is not an object")
    return Manifest(
        kind=kind,
        single_file=bool(doc.get("single_file")),
        files=files,
        frames=frames,
        model=model,
        number=_opt_int(doc.get("number"), "number"),
        parent=_opt_int(doc.get("parent"), "parent"),
        step=_opt_int(doc.get("step"), "step"),
        metadata=metadata,
    )
