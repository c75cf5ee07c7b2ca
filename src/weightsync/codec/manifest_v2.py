"""The version 2 JSON form of a manifest (docs/FORMAT.md §5.3): compact columns, tensor checksums.

What a v1 manifest spends its bytes on, measured on the corpus's sparse steps: per segment
two xxh3-128 (32 hex each, random, so they do not compress), repeated keys, and numbers
that follow from others (offsets, lengths, frame dtypes and sizes). Version 2 keeps only
what a reader cannot derive:

- per file, one list per column (``kind``, ``name``, ``dtype``, ``shape``, ``digest``,
  ``base``, optional ``base_offset``); a segment's length follows from its dtype and
  shape, its offset from the lengths before it;
- digests are the lanes of the FORMAT §10 checksum as hex (8 bytes per lane; the count
  follows from the length), so 1- and 2-byte tensors cost 8 random bytes, not 16;
- a delta-coded segment whose bytes equal its base's has ``digest`` null and no frame
  pieces: at sparse steps most segments are such (the encoder compares bytes to know;
  equal checksums do not prove equal bytes);
- frames are columns too; a frame's dtype, delta flag and raw length follow from its
  pieces' segments, a piece covering a whole segment is ``[file, segment]``, and store
  objects are listed once and referred to by index.

In memory the segments' digests are the full wire form (count and lanes, as hex) of
:class:`~weightsync.codec.checksum.TensorSum`, like any other digest: callers compare strings.
"""

from __future__ import annotations

import re
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from weightsync.codec.checkpoint import Segment
from weightsync.codec.checksum import WIDTHS, lanes_of
from weightsync.codec.frame import MAX_FRAME_RAW
from weightsync.codec.manifest import (
    MAX_FRAMES,
    MAX_SEGMENTS,
    FileEntry,
    FrameRef,
    Manifest,
    SegmentEntry,
    check_coverage,
    check_dtype,
    check_hex,
    check_int,
    check_paths,
    check_pieces,
    check_segment,
)
from weightsync.common import DIGEST_PATTERN
from weightsync.errors import FormatError, LimitExceeded

SEGMENT_COLUMNS = ("kind", "name", "dtype", "shape", "digest", "base")
FRAME_COLUMNS = ("object", "offset", "length", "pieces")
_COUNT_HEX = 16  # the u64 element count that leads a checksum's wire form, as hex
_LANES = {n: re.compile(f"[0-9a-f]{{{16 * n}}}") for n in (1, 2, 4)}
_LANES_BY_WIDTH = {w: _LANES[lanes_of(w)] for w in WIDTHS}
_COUNT = struct.Struct("<Q")


def _lanes(digest: str) -> str:
    """The lanes of a checksum's hex wire form: what the JSON carries (the count follows from the length)."""
    return digest[_COUNT_HEX:]


def document(m: Manifest) -> dict[str, Any]:
    """The version-specific part of `m`'s JSON document (§5.3): objects, files, frames."""
    objects = list(dict.fromkeys(fr.object for fr in m.frames if fr.object is not None))
    index = {digest: i for i, digest in enumerate(objects)}
    files = [{"path": f.path, "size": f.size, "segments": _segment_columns(f)} for f in m.files]
    frames: dict[str, list[Any]] = {c: [] for c in FRAME_COLUMNS}
    for fr in m.frames:
        frames["object"].append(None if fr.object is None else index[fr.object])
        frames["offset"].append(fr.offset)
        frames["length"].append(fr.length)
        pieces = []
        for p in fr.pieces:
            whole = p.offset == 0 and p.length == m.files[p.file].segments[p.seg].segment.length
            pieces.append([p.file, p.seg] if whole else [p.file, p.seg, p.offset, p.length])
        frames["pieces"].append(pieces)
    return {"objects": objects, "files": files, "frames": frames}


def _segment_columns(f: FileEntry) -> dict[str, list[Any]]:
    cols: dict[str, list[Any]] = {c: [] for c in SEGMENT_COLUMNS}
    moved: list[int | None] = []
    for e in f.segments:
        s = e.segment
        cols["kind"].append(s.kind)
        cols["name"].append(s.name)
        cols["dtype"].append(s.dtype.name)
        cols["shape"].append(list(s.shape))
        cols["base"].append(None if e.base_digest is None else _lanes(e.base_digest))
        cols["digest"].append(None if e.unchanged else _lanes(e.digest))
        moved.append(None if e.base_offset in (None, s.offset) else e.base_offset)
    if any(o is not None for o in moved):
        cols["base_offset"] = moved
    return cols


def _columns(doc: Any, required: tuple[str, ...], optional: tuple[str, ...], what: str, cap: int) -> int:
    """The common length of the column lists of `doc` (exactly the required keys, maybe the optional ones)."""
    if not isinstance(doc, dict) or not set(required) <= set(doc) <= set(required) | set(optional):
        raise FormatError(f"{what}: columns must be {list(required)} (and optionally {list(optional)})")
    lengths = {len(v) if isinstance(v, list) else -1 for v in doc.values()}
    if len(lengths) != 1 or -1 in lengths:
        raise FormatError(f"{what}: every column must be a list, all of one length")
    n = lengths.pop()
    if n > cap:
        raise LimitExceeded(f"{what}: {n} rows, cap is {cap}")
    return n


def _lanes_pattern(width: int) -> re.Pattern[str]:
    """The pattern of the lanes' hex of a checksum of `width`-byte elements (InvalidArgument: no such width)."""
    found = _LANES_BY_WIDTH.get(width)
    return found if found is not None else _LANES[lanes_of(width)]


def read(doc: dict[str, Any]) -> tuple[list[FileEntry], list[FrameRef]]:
    """The files and frames of a version 2 document, every rule of §5.3 checked."""
    objects = doc["objects"]
    if not isinstance(objects, list) or len(objects) > MAX_FRAMES or len(set(map(str, objects))) != len(objects):
        raise FormatError("manifest objects: not a list of distinct digests")
    for o in objects:
        check_hex(o, DIGEST_PATTERN, "object")
    files = _read_files(doc)
    frames = _read_frames(doc["frames"], files, objects)
    check_coverage(files, frames, skip_unchanged=True)
    return files, frames


def _read_files(doc: dict[str, Any]) -> list[FileEntry]:
    files: list[FileEntry] = []
    total = 0
    for path, size, cols in check_paths(doc["files"]):
        n = _columns(cols, SEGMENT_COLUMNS, ("base_offset",), f"{path}: segments", MAX_SEGMENTS)
        total += n
        if total > MAX_SEGMENTS:
            raise LimitExceeded("too many segments")
        known = _known_structure(path, size, cols)
        entries = None if known is None else _entries(known, cols)
        if entries is None:  # a new structure, or something to name: the reference reader below
            entries = _read_segments(path, size, cols, n)
            if known is None:
                _remember_structure(path, size, cols, entries)
        files.append(FileEntry(path, size, entries))
    return files


# --- structures seen before ---------------------------------------------------------------------
#
# A model's versions repeat each file's structure (the kind, name, dtype, shape and base_offset
# columns: tensors, their order and their coding), and what the reference reader checks per
# segment follows from the structure and the file's size alone: the segments themselves, their
# lengths and offsets, the digests' element counts and lane widths. A structure the reference
# reader accepted is kept (by path and size, the last _MAX_STRUCTURES, _MAX_STRUCTURE_ROWS rows in
# all); a later document whose
# columns equal it, with integers as strictly typed as the reference asks, reuses its segments, and
# only the digest columns are read per row. Anything else, and any row that does not pass, goes to
# the reference reader, which names the defect (tests/codec/test_manifest_structures.py holds the
# two readers to the same answers).

_MAX_STRUCTURES = 16
_MAX_STRUCTURE_ROWS = 1 << 20
"""Rows kept across all structures: a server reads manifests from any publisher, whose structures
(up to MAX_SEGMENTS rows each) must not pin unbounded memory."""


@dataclass(frozen=True)
class _Structure:
    """A file's structure columns as first read, and what the reference reader made of them."""

    columns: tuple[list[Any] | None, ...]
    """kind, name, dtype, shape, then base_offset (None when the column was absent)."""
    segments: tuple[Segment, ...]
    counts: tuple[str, ...]
    """Each segment's element count as the hex its digests start with."""
    lanes: tuple[int, ...]
    """Each segment's digest lanes as hex characters (16 a lane)."""


_structures: OrderedDict[tuple[str, int], _Structure] = OrderedDict()
_structures_lock = threading.Lock()
_HEX = re.compile("[0-9a-f]*")


def _known_structure(path: str, size: int, cols: dict[str, Any]) -> _Structure | None:
    """The structure kept for (path, size) when `cols` repeats it exactly (ints strictly typed), else None."""
    with _structures_lock:
        known = _structures.get((path, size))
    if known is None:
        return None
    kinds, names, dtypes, shapes, moved = known.columns
    if not (
        cols["kind"] == kinds
        and cols["name"] == names
        and cols["dtype"] == dtypes
        and cols["shape"] == shapes
        and cols.get("base_offset") == moved
    ):
        return None
    # Equal lists can still differ in type (1 == 1.0 == True): the reference takes ints only.
    if not all(type(d) is int for shape in cols["shape"] for d in shape):
        return None
    offsets = cols.get("base_offset")
    if offsets is not None and not all(o is None or type(o) is int for o in offsets):
        return None
    return known


def _remember_structure(path: str, size: int, cols: dict[str, Any], entries: tuple[SegmentEntry, ...]) -> None:
    if len(entries) > _MAX_STRUCTURE_ROWS:
        return
    moved = cols.get("base_offset")
    columns: tuple[list[Any] | None, ...] = (
        list(cols["kind"]),
        list(cols["name"]),
        list(cols["dtype"]),
        [list(shape) for shape in cols["shape"]],
        None if moved is None else list(moved),
    )
    segments = tuple(e.segment for e in entries)
    counts = tuple(_COUNT.pack(s.length // s.dtype.width).hex() for s in segments)
    lanes = tuple(16 * lanes_of(s.dtype.width) for s in segments)
    with _structures_lock:
        _structures[path, size] = _Structure(columns, segments, counts, lanes)
        _structures.move_to_end((path, size))
        rows = sum(len(st.segments) for st in _structures.values())
        while len(_structures) > _MAX_STRUCTURES or rows > _MAX_STRUCTURE_ROWS:
            _, dropped = _structures.popitem(last=False)
            rows -= len(dropped.segments)


def _entries(known: _Structure, cols: dict[str, Any]) -> tuple[SegmentEntry, ...] | None:
    """The segment entries of a known structure from the digest columns; None at the first row that
    is not plainly valid (the reference reader then names what is wrong)."""
    bases, digests = cols["base"], cols["digest"]
    given = [x for x in bases if x is not None]
    given += [x for x in digests if x is not None]
    try:
        if not _HEX.fullmatch("".join(given)):
            return None
    except TypeError:  # not every digest is a string
        return None
    moved = cols.get("base_offset")
    out = []
    for i, (seg, count, width, base_lanes, lanes) in enumerate(
        zip(known.segments, known.counts, known.lanes, bases, digests, strict=True)
    ):
        if base_lanes is None:
            if lanes is None or len(lanes) != width or (moved is not None and moved[i] is not None):
                return None
            out.append(SegmentEntry(seg, count + lanes))
            continue
        if len(base_lanes) != width or (lanes is not None and len(lanes) != width):
            return None
        base = count + base_lanes
        digest = base if lanes is None else count + lanes
        # base_offset is a structure column: equal to the accepted one, so in range where it is set.
        at = None if moved is None else moved[i]
        out.append(SegmentEntry(seg, digest, seg.offset if at is None else at, base, lanes is None))
    return tuple(out)


def _read_segments(path: str, size: int, cols: dict[str, Any], n: int) -> tuple[SegmentEntry, ...]:
    """The reference reader of one file's segment columns: every rule checked row by row, defects named."""
    moved = cols.get("base_offset", [None] * n)
    kinds, names, dtypes, shapes = cols["kind"], cols["name"], cols["dtype"], cols["shape"]
    bases, digests = cols["base"], cols["digest"]
    segs = []
    cursor = 0
    for i in range(n):
        dtype = check_dtype(dtypes[i], path)
        seg = check_segment(path, kinds[i], names[i], dtype, shapes[i], cursor, size)
        cursor += seg.length
        count = _COUNT.pack(seg.length // dtype.width).hex()  # the digests' leading element count
        pattern = _lanes_pattern(dtype.width)
        base_lanes, lanes = bases[i], digests[i]
        if base_lanes is None:
            if lanes is None or moved[i] is not None:
                raise FormatError(f"{path}: segment {seg.name!r} has neither a digest nor a base")
            segs.append(SegmentEntry(seg, count + check_hex(lanes, pattern, "digest")))
            continue
        base = count + check_hex(base_lanes, pattern, "base")
        digest = base if lanes is None else count + check_hex(lanes, pattern, "digest")
        base_offset = seg.offset if moved[i] is None else check_int(moved[i], f"{path}: base_offset", 1 << 62)
        segs.append(SegmentEntry(seg, digest, base_offset, base, lanes is None))
    if cursor != size:
        raise FormatError(f"{path}: segments cover {cursor} of {size} bytes")
    return tuple(segs)


def _read_frames(cols: Any, files: list[FileEntry], objects: list[str]) -> list[FrameRef]:
    _columns(cols, FRAME_COLUMNS, (), "frames", MAX_FRAMES)
    used: set[int] = set()
    frames = []
    last_object = len(objects) - 1
    for obj, raw, offset, length in zip(cols["object"], cols["pieces"], cols["offset"], cols["length"], strict=True):
        if obj is not None:
            used.add(check_int(obj, "frame object", last_object))
        if not isinstance(raw, list) or not raw:
            raise FormatError("a frame must list its pieces")
        pieces = check_pieces(files, raw, None, None, like_first=True)
        entry = files[pieces[0].file].segments[pieces[0].seg]
        raw_len = sum(p.length for p in pieces)
        if raw_len > MAX_FRAME_RAW:
            raise LimitExceeded(f"frame pieces hold {raw_len} bytes, cap is {MAX_FRAME_RAW}")
        offset = check_int(offset, "frame offset", 1 << 62)
        length = check_int(length, "frame length", MAX_FRAME_RAW + (64 << 20))
        name = None if obj is None else objects[obj]
        delta = entry.base_offset is not None
        frames.append(FrameRef(name, offset, length, delta, entry.segment.dtype.name, raw_len, pieces))
    if len(used) != len(objects):
        raise FormatError("manifest lists an object no frame is in")
    return frames
