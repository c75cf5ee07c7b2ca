"""Merging the manifests of a multi-part publish into the one manifest of the version (issue 14).

Each rank of a multi-part publish encodes only the files it holds into a manifest of its own
(a *part*). The version's manifest is their merge: the files of every part in rank order,
each frame's pieces re-indexed to the merged file list; frames and their objects are the
parts' own, untouched. The merge is an ordinary manifest: readers need no special case.

Refused (:class:`PartConflict`): parts of another model, parent, step or manifest format, a
file path two parts carry with different bytes, a tensor two files of different parts hold,
and metadata keys with different values. A file two parts carry with the same bytes (configs,
index JSON, a tokenizer) is kept once, the lowest rank's copy; the other copy's frames are
dropped, which needs them to hold pieces of that file only (otherwise the rank's copy is kept
and the lower rank's dropped; when neither can go, the merge is refused).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from weightsync.codec.manifest import FileEntry, FrameRef, Manifest, Piece
from weightsync.errors import PartConflict

__all__ = ["PartConflict", "merge_parts"]


def _content(f: FileEntry) -> tuple[Any, ...]:
    """What decides that two copies of a file are the same bytes: size, layout and segment digests."""
    return (f.size, tuple((e.segment, e.digest) for e in f.segments))


def merge_parts(parts: Sequence[Manifest]) -> Manifest:
    """The manifest of the version made of `parts` (in rank order); PartConflict when they disagree."""
    if not parts:
        raise ValueError("no parts to merge")
    first = parts[0]
    for rank, p in enumerate(parts):
        for what in ("model", "parent", "step", "version"):
            if getattr(p, what) != getattr(first, what):
                raise PartConflict(f"part {rank} has {what} {getattr(p, what)!r}, part 0 has {getattr(first, what)!r}")
    if len(parts) == 1:
        return first

    metadata: dict[str, Any] = {}
    for rank, p in enumerate(parts):
        for key, value in p.metadata.items():
            if key in metadata and metadata[key] != value:
                raise PartConflict(f"part {rank} sets metadata {key!r} to another value than a lower rank")
            metadata[key] = value

    # Which copy of each path is kept: (rank, file index) of its first clean copy.
    owners: dict[str, list[tuple[int, int]]] = {}
    for rank, p in enumerate(parts):
        for fi, f in enumerate(p.files):
            copies = owners.setdefault(f.path, [])
            if copies and _content(parts[copies[0][0]].files[copies[0][1]]) != _content(f):
                other = copies[0][0]
                raise PartConflict(f"{f.path}: parts {other} and {rank} carry it with different bytes")
            copies.append((rank, fi))

    def alone(rank: int, fi: int) -> bool:
        """Every frame of part `rank` with a piece of file `fi` holds pieces of that file only."""
        return all(
            all(q.file == fi for q in fr.pieces) for fr in parts[rank].frames if any(q.file == fi for q in fr.pieces)
        )

    kept: dict[str, tuple[int, int]] = {}
    for path, copies in owners.items():
        if len(copies) == 1:
            kept[path] = copies[0]
            continue
        # Keep one copy; every other must be droppable (its frames hold that file only).
        for keep in copies:
            if all(alone(r, fi) for r, fi in copies if (r, fi) != keep):
                kept[path] = keep
                break
        else:
            raise PartConflict(f"{path}: carried by several parts whose frames share it with other files")

    files: list[FileEntry] = []
    index: dict[tuple[int, int], int] = {}  # (rank, file index in the part) -> index in the merge
    for rank, p in enumerate(parts):
        for fi, f in enumerate(p.files):
            if kept[f.path] == (rank, fi):
                index[(rank, fi)] = len(files)
                files.append(f)

    holder: dict[str, str] = {}  # tensor name -> the path holding it
    for f in files:
        for e in f.segments:
            if e.segment.kind != "tensor":
                continue
            path = holder.setdefault(e.segment.name, f.path)
            if path != f.path:
                raise PartConflict(f"tensor {e.segment.name!r} is held by both {path} and {f.path}")

    frames: list[FrameRef] = []
    for rank, p in enumerate(parts):
        for fr in p.frames:
            if fr.pieces and all((rank, q.file) not in index for q in fr.pieces):
                continue  # a dropped copy's frame (a dropped copy shares no frame with a kept file)
            pieces = tuple(Piece(index[(rank, q.file)], q.seg, q.offset, q.length) for q in fr.pieces)
            frames.append(FrameRef(fr.object, fr.offset, fr.length, fr.delta, fr.dtype, fr.raw_len, pieces))

    kind = "delta" if any(p.kind == "delta" for p in parts) else "keyframe"
    return Manifest(
        kind=kind,
        single_file=False,
        files=files,
        frames=frames,
        model=first.model,
        number=first.number,
        parent=first.parent,
        step=first.step,
        metadata=metadata,
        version=first.version,
    )
