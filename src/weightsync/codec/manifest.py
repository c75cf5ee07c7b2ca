"""The manifest: the description of one encoded version (docs/FORMAT.md §5).

A manifest lists the version's files and their segments (with a digest of each
segment's bytes and, for delta-coded segments, of the base bytes they apply to)
and the frames that produce them, each naming where its bytes live and which
pieces of which segments it decodes into. Two JSON forms exist: version 1
(objects per segment and frame, xxh3-128 digests, §5.2, in `manifest_v1`) and
version 2 (columns, tensor checksums, no pieces for a segment equal to its base,
§5.3, in `manifest_v2`). Both parse into the same objects; a digest is a lowercase hex
string of the manifest's `digest_kind`, so callers compare digests as strings.
``Manifest.parse`` is the one strict validator: every cap and cross-reference is
checked there, before any decode allocates anything.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import xxhash
import zstandard

from weightsync.codec.checkpoint import FileLayout, Segment, check_path
from weightsync.codec.dtypes import DType, by_name
from weightsync.common import MODEL_NAME_PATTERN
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
VERSION_2 = 2
LATEST = VERSION_2
DIGEST_XXH3 = "xxh3-128"
"""Digest kind of version 1 manifests: xxh3-128 of the bytes, 32 hex."""
DIGEST_SUM = "sum64x16"
"""Digest kind of version 2 manifests: the tensor checksum of FORMAT §10 in its wire form, as hex."""
DIGEST_KINDS = {VERSION: DIGEST_XXH3, VERSION_2: DIGEST_SUM}
MAX_MANIFEST = 256 << 20
MAX_FILES = 100_000
MAX_SEGMENTS = 2_000_000
MAX_FRAMES = 4_000_000
MAX_FILE_SIZE = 1 << 44  # 16 TiB
KINDS = ("header", "tensor", "blob")
MAGIC = b"WSMF"
ENVELOPE_VERSION = 1
"""The envelope (§5.1) is the same for every manifest version; the JSON says which one it holds."""
# FORMAT §5.1: magic, version, flags, reserved, JSON length, xxh3-64 of the JSON; then zstd(JSON).
_ENVELOPE = struct.Struct("<4sBBHQQ")
ENVELOPE_SIZE = _ENVELOPE.size  # 24
MANIFEST_LEVEL = 3
"""The JSON's zstd level. Measured on the corpus's delta manifests (12-36 KB of JSON): level 3 takes 0.04-0.14 ms
and comes out 1.5-8 % larger than level 15, which took 1.5-3.3 ms of every publish for 0.1-0.4 % of a delta file."""


class SegmentEntry(NamedTuple):
    """A segment plus its digests; `base_offset` set means delta-coded against the base file.

    `digest` is the segment's bytes' digest in this version and `base_digest` the digest
    the base bytes must have, both of the manifest's `digest_kind`. `unchanged`: delta-coded
    and its bytes equal its base's (then ``digest == base_digest``; a v2 manifest gives it
    no frame pieces, FORMAT §5.3). It is stated, never inferred from equal digests: the v2
    checksum is linear, so a few small changes of a small tensor can add up to the base's
    checksum (tests/codec/test_format_v2.py found one: 3 bytes of a 12-byte BOOL tensor).

    A named tuple, as `Piece`: a manifest holds one per tensor and every read of a manifest makes them
    all, and a frozen dataclass took ~1.3 µs to make against ~0.5 (0.36 ms of a 419-tensor manifest's
    1.8 ms parse on the 2-core VM, run AS).
    """

    segment: Segment
    digest: str
    base_offset: int | None = None
    base_digest: str | None = None
    unchanged: bool = False

    @property
    def base_xxh3(self) -> str | None:
        """The former name of `base_digest`, read by ops/core.py until it moves to `base_digest`."""
        return self.base_digest


@dataclass(frozen=True)
class FileEntry:
    path: str
    size: int
    segments: tuple[SegmentEntry, ...]

    @property
    def layout(self) -> FileLayout:
        return FileLayout(self.path, self.size, tuple(e.segment for e in self.segments))

    def spans(self) -> dict[tuple[int, int], str]:
        """Each segment's digest by (offset, length): what a delta's base must hold at that place.

        Keyed by both, not the offset alone: a 0-element tensor shares its offset with the segment after it.
        """
        return {(e.segment.offset, e.segment.length): e.digest for e in self.segments}


class Piece(NamedTuple):
    """`length` bytes at `offset` within segment `seg` of file `file` (indices into the manifest).

    A named tuple, not a dataclass: a manifest holds one per tensor a frame covers (tens of
    thousands for a large MoE), and a tuple of ints is ~3x cheaper to make and leaves the
    garbage collector's lists after its first pass."""

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
    version: int = VERSION
    """The manifest format version: 1 (§5.2) or 2 (§5.3); it fixes `digest_kind` and the frames' version."""

    @property
    def digest_kind(self) -> str:
        """What the segments' digests are: "xxh3-128" (version 1) or "sum64x16" (version 2)."""
        return DIGEST_KINDS[self.version]

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
        """The JSON document of the manifest's version (§5.2 or §5.3)."""
        from weightsync.codec import manifest_v1, manifest_v2  # they build on this module

        body = manifest_v2.document(self) if self.version == VERSION_2 else manifest_v1.document(self)
        return {
            "format": FORMAT,
            "version": self.version,
            "kind": self.kind,
            "single_file": self.single_file,
            "model": self.model,
            "number": self.number,
            "parent": self.parent,
            "step": self.step,
            "metadata": self.metadata,
            **body,
        }

    def to_json(self) -> bytes:
        """Canonical bytes: sorted keys, no whitespace, so equal manifests hash equal."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":")).encode()

    def encode(self) -> bytes:
        """The manifest's stored form (FORMAT §5.1): a small envelope around zstd of the canonical JSON."""
        body = self.to_json()
        packed = zstandard.ZstdCompressor(level=MANIFEST_LEVEL, write_content_size=True).compress(body)
        return _ENVELOPE.pack(MAGIC, ENVELOPE_VERSION, 0, 0, len(body), xxhash.xxh3_64_intdigest(body)) + packed

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
        if version != ENVELOPE_VERSION or flags or reserved:
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
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            raise FormatError(f"malformed manifest: {type(exc).__name__}: {exc}") from None


# --- shared checks (both JSON forms) ----------------------------------------------------------


def check_int(v: Any, what: str, hi: int) -> int:
    """`v` if it is an integer in [0, hi], else LimitExceeded."""
    if type(v) is not int or v < 0 or v > hi:
        raise LimitExceeded(f"{what}: {v!r} is not an integer in [0, {hi}]")
    return v


def opt_int(v: Any, what: str) -> int | None:
    """None, or `v` if it is an integer in [0, 2^62]."""
    return None if v is None else check_int(v, what, 1 << 62)


def check_hex(v: Any, pattern: re.Pattern[str], what: str) -> str:
    """`v` if it is a string `pattern` matches whole, else FormatError."""
    if not isinstance(v, str) or not pattern.fullmatch(v):
        raise FormatError(f"{what}: not a lowercase hex digest")
    return v


def check_dtype(name: Any, what: str) -> DType:
    """The dtype named `name`, else FormatError."""
    try:
        return by_name(name)
    except (UnsupportedDtype, TypeError, KeyError):
        raise FormatError(f"{what}: unknown dtype {name!r}") from None


_MAX_DIM = 1 << 48


def check_segment(path: str, kind: Any, name: Any, dtype: DType, shape_doc: Any, offset: int, size: int) -> Segment:
    """A segment at `offset` of file `path` (`size` bytes); its length follows from dtype and shape."""
    if kind not in KINDS or not isinstance(name, str):
        raise FormatError(f"{path}: bad segment kind or name")
    if not isinstance(shape_doc, list):
        raise FormatError(f"{path}: segment {name!r} shape is not a list")
    if all(type(d) is int and 0 <= d <= _MAX_DIM for d in shape_doc):
        shape = tuple(shape_doc)
    else:  # name the bad dimension
        shape = tuple(check_int(d, f"{path}: shape", _MAX_DIM) for d in shape_doc)
    try:
        length = dtype.nbytes(shape)
    except UnsupportedDtype as exc:
        raise FormatError(f"{path}: {exc}") from None
    if length > size - offset:
        raise FormatError(f"{path}: segment {name!r} runs past the end of the file")
    return Segment(kind, name, dtype, shape, offset, length)


def check_paths(raw_files: Any) -> list[tuple[str, int, Any]]:
    """(path, size, segments document) of every file: caps, safe and unique paths, sizes."""
    if not isinstance(raw_files, list) or len(raw_files) > MAX_FILES:
        raise LimitExceeded("manifest files: not a list or too many")
    out = []
    seen: set[str] = set()
    for f in raw_files:
        path = check_path(f["path"])
        if path in seen:
            raise FormatError(f"file {path!r} listed twice")
        seen.add(path)
        out.append((path, check_int(f["size"], f"{path}: size", MAX_FILE_SIZE), f["segments"]))
    return out


def check_pieces(
    files: list[FileEntry], raw: Any, delta: bool | None, dtype: DType | None, *, like_first: bool = False
) -> tuple[Piece, ...]:
    """Frame pieces `raw` ([file, segment, offset, length] each), checked against `files`, in one pass.

    `delta` and `dtype`, when given, are the frame's: each piece's segment must agree. With
    `like_first` (version 2) a piece may also be [file, segment], the whole segment, and the
    frame's dtype and coding are its first piece's.
    """
    pieces: list[Piece] = []
    last_file = len(files) - 1
    for p in raw:
        if not isinstance(p, list) or len(p) not in ((2, 4) if like_first else (4,)):
            raise FormatError("frame piece is not [file, segment, offset, length]")
        fi, si = p[0], p[1]
        if type(fi) is not int or not 0 <= fi <= last_file:
            fi = check_int(fi, "piece file", last_file)
        segments = files[fi].segments
        if type(si) is not int or not 0 <= si < len(segments):
            si = check_int(si, "piece segment", len(segments) - 1)
        entry = segments[si]
        seg = entry.segment
        if len(p) == 2:  # a whole segment: whole elements by construction
            off, ln = 0, seg.length
        else:
            off = check_int(p[2], "piece offset", seg.length)
            ln = check_int(p[3], "piece length", seg.length - off)
        if like_first and not pieces:
            dtype, delta = seg.dtype, entry.base_offset is not None
        if dtype is not None and seg.dtype is not dtype:
            raise FormatError("frame dtype differs from a segment it decodes into")
        if len(p) == 4 and (off % seg.dtype.width or ln % seg.dtype.width):
            raise FormatError("piece not aligned to whole elements")
        if delta is not None and delta != (entry.base_offset is not None):
            raise FormatError(f"a {'delta' if delta else 'keyframe'} frame decodes into a segment coded otherwise")
        pieces.append(Piece(fi, si, off, ln))
    return tuple(pieces)


def check_coverage(files: list[FileEntry], frames: list[FrameRef], *, skip_unchanged: bool) -> None:
    """The pieces of all frames cover every segment exactly once (unchanged ones: not at all, when skipped)."""
    covered: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for fr in frames:
        for p in fr.pieces:
            covered.setdefault((p.file, p.seg), []).append((p.offset, p.length))
    for fi, f in enumerate(files):
        for si, e in enumerate(f.segments):
            spans = sorted(covered.get((fi, si), []))
            if skip_unchanged and e.unchanged:
                if spans:
                    raise FormatError(f"{f.path}: segment {e.segment.name!r} equals its base but has frame pieces")
                continue
            cursor = 0
            for off, ln in spans:
                if off != cursor:
                    raise FormatError(f"{f.path}: frames leave a gap or overlap in segment {e.segment.name!r}")
                cursor += ln
            if cursor != e.segment.length:
                raise FormatError(
                    f"{f.path}: frames cover {cursor} of {e.segment.length} bytes of segment {e.segment.name!r}"
                )


def _validate(doc: Any) -> Manifest:
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise FormatError("not a weightsync manifest")
    version = doc.get("version")
    if type(version) is not int or version not in DIGEST_KINDS:
        raise UnsupportedVersion(f"manifest version {version!r} (this reader knows {sorted(DIGEST_KINDS)})")
    kind = doc["kind"]
    if kind not in ("keyframe", "delta"):
        raise FormatError(f"manifest kind {kind!r}")
    from weightsync.codec import manifest_v1, manifest_v2  # they build on this module

    files, frames = manifest_v2.read(doc) if version == VERSION_2 else manifest_v1.read(doc)
    if doc.get("single_file") and len(files) != 1:
        raise FormatError("single-file manifest with other than one file")
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
        number=opt_int(doc.get("number"), "number"),
        parent=opt_int(doc.get("parent"), "parent"),
        step=opt_int(doc.get("step"), "step"),
        metadata=metadata,
        version=version,
    )
