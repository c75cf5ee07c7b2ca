"""The version 1 JSON form of a manifest (docs/FORMAT.md §5.2): an object per segment and per frame.

Every segment carries its offset, length and xxh3-128 (and, delta-coded, its base's);
every frame its dtype, delta flag and raw length. Read for as long as version 1
manifests exist; weightsync writes it when asked for FORMAT v1.
"""

from __future__ import annotations

import re
from typing import Any

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
    opt_int,
)
from weightsync.common import DIGEST_PATTERN
from weightsync.errors import FormatError, LimitExceeded

_HEX32 = re.compile(r"[0-9a-f]{32}")


def document(m: Manifest) -> dict[str, Any]:
    """The version-specific part of `m`'s JSON document (§5.2): files with their segments, frames."""
    files = []
    for f in m.files:
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
                "xxh3": e.digest,
            }
            if e.base_offset is not None:
                d["base_offset"] = e.base_offset
                d["base_xxh3"] = e.base_digest
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
        for fr in m.frames
    ]
    return {"raw_bytes": m.raw_bytes, "stored_bytes": m.stored_bytes, "files": files, "frames": frames}


def read(doc: dict[str, Any]) -> tuple[list[FileEntry], list[FrameRef]]:
    """The files and frames of a version 1 document, every rule of §5.2 checked."""
    files = _read_files(doc)
    return files, _read_frames(doc, files)


def _read_files(doc: dict[str, Any]) -> list[FileEntry]:
    files: list[FileEntry] = []
    total_segments = 0
    for path, size, raw_segs in check_paths(doc["files"]):
        segs = []
        cursor = 0
        total_segments += len(raw_segs)
        if total_segments > MAX_SEGMENTS:
            raise LimitExceeded("too many segments")
        for s in raw_segs:
            dtype = check_dtype(s["dtype"], path)
            offset = check_int(s["offset"], f"{path}: offset", size)
            if offset != cursor:
                raise FormatError(f"{path}: segments do not tile the file at offset {cursor}")
            seg = check_segment(path, s["kind"], s["name"], dtype, s["shape"], offset, size)
            if check_int(s["length"], f"{path}: length", size) != seg.length:
                raise FormatError(f"{path}: segment {s['name']!r} length disagrees with its shape")
            cursor += seg.length
            base_offset = opt_int(s.get("base_offset"), f"{path}: base_offset")
            base = None if base_offset is None else check_hex(s["base_xxh3"], _HEX32, "base_xxh3")
            digest = check_hex(s["xxh3"], _HEX32, "xxh3")
            segs.append(SegmentEntry(seg, digest, base_offset, base, base is not None and digest == base))
        if cursor != size:
            raise FormatError(f"{path}: segments cover {cursor} of {size} bytes")
        files.append(FileEntry(path, size, tuple(segs)))
    return files


def _read_frames(doc: dict[str, Any], files: list[FileEntry]) -> list[FrameRef]:
    raw_frames = doc["frames"]
    if not isinstance(raw_frames, list) or len(raw_frames) > MAX_FRAMES:
        raise LimitExceeded("manifest frames: not a list or too many")
    frames: list[FrameRef] = []
    for fr in raw_frames:
        obj = fr["object"]
        if obj is not None:
            check_hex(obj, DIGEST_PATTERN, "frame object")
        dtype = check_dtype(fr["dtype"], "frame")
        delta = fr["delta"]
        if type(delta) is not bool:
            raise FormatError("frame delta flag is not a boolean")
        raw_len = check_int(fr["raw_len"], "frame raw_len", MAX_FRAME_RAW)
        # v1 lets a keyframe frame decode into a delta-coded segment: only deltas are checked.
        pieces = check_pieces(files, fr["pieces"], True if delta else None, dtype)
        if sum(p.length for p in pieces) != raw_len:
            raise FormatError(f"frame pieces hold {sum(p.length for p in pieces)} bytes, raw_len says {raw_len}")
        offset = check_int(fr["offset"], "frame offset", 1 << 62)
        length = check_int(fr["length"], "frame length", MAX_FRAME_RAW + (64 << 20))
        frames.append(FrameRef(obj, offset, length, delta, dtype.name, raw_len, pieces))
    check_coverage(files, frames, skip_unchanged=False)
    return frames
