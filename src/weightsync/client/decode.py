"""Decoding manifests onto a version's files: the driver that turns version N's files into N+1's.

A pull decodes each step of its plan onto the previous one (FORMAT §5.2):

- a file whose every segment is unchanged (same place, digest equal to its base)
  is not rewritten: the new version shares it;
- a file with the same layout is copied (the kernel copies, reflinks where the
  filesystem can) and patched in place: only changed pages are touched;
- any other file is written whole into a new temporary file.

Base checks happen at segment level before anything is decoded (FORMAT §5.2),
so frames skip their own base check. Results are checked as they decode: by
each version 1 frame's own xxh3, or, for version 2, by adding the checksums of
every segment's pieces, each summed right after its frame applied (§5.3). A
version 2 segment equal to its base has no frames: a file written whole gets
it copied from the base. Files of the held version are only ever read; what is
written goes to temporaries of the caller's scratch space.

A decode may be limited to some files (pull --adopt rebuilds only the files a
directory lacks): `needed_files` says which files each step of a chain decodes,
`frames_for` which frames that reads.
"""

from __future__ import annotations

import mmap
import shutil
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np

from weightsync import errors
from weightsync.client._pool import run_all
from weightsync.codec.checksum import TensorSum
from weightsync.codec.decoder import apply_summed, check_frame, check_results, describe
from weightsync.codec.frame import apply_frame
from weightsync.codec.manifest import VERSION_2, FileEntry, FrameRef, Manifest, Piece, SegmentEntry


class Scratch(Protocol):
    """Where a decode writes its temporaries (a checkout's workspace)."""

    def new(self) -> Path: ...

    def owns(self, path: Path) -> bool: ...


def map_file(path: Path, size: int, mode: Literal["r", "r+"] = "r") -> np.ndarray:
    """A file's bytes as a uint8 memory map (read-only unless `mode` says otherwise).

    Read-only: a plain array over the map, not np.memmap, whose every slice runs Python
    (``__array_finalize__``): checks and decodes slice it once per segment (codec/checkpoint.py
    ``_map``). Writable: np.memmap, which the decode flushes.
    """
    if size == 0:
        return np.zeros(0, dtype=np.uint8)
    if mode == "r":
        with open(path, "rb") as f:
            return np.frombuffer(mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ), dtype=np.uint8)
    return np.memmap(path, dtype=np.uint8, mode=mode, shape=(size,))


@dataclass
class HeldFile:
    """Where a file of the current version is, and whether it is a temporary file of ours."""

    location: Path
    size: int
    owned: bool
    # (offset, length) -> digest: a 0-length tensor shares its offset with the next segment
    segments: dict[tuple[int, int], str]


@dataclass
class Tree:
    """The current version's files during a pull: the checkout's own files or decoded temporaries."""

    single_file: bool
    files: dict[str, HeldFile] = field(default_factory=dict)
    digest_kind: str | None = None
    """The kind of the segments' digests (its manifest's); None while it holds nothing to diff against."""

    def base_for(self, manifest: Manifest, path: str) -> HeldFile | None:
        """The base file of `path` (FORMAT §5.2: in single-file mode, the parent's only file)."""
        if manifest.single_file and len(self.files) == 1:
            return next(iter(self.files.values()))
        return self.files.get(path)


def check_bases(manifest: Manifest, tree: Tree, only: Collection[str] | None = None) -> None:
    """Every delta segment's base must be what `tree` holds at that place (digest and length); else BaseMismatch.

    Digests compare as strings of one kind: a delta whose manifest is of another format
    than the tree's is refused whole (a chain never mixes formats, FORMAT §5.3). `only`:
    the paths to be decoded (None: every file); the others' bases are not looked at.
    """
    deltas = any(e.base_offset is not None for f in manifest.files for e in f.segments)
    if deltas and tree.digest_kind is not None and tree.digest_kind != manifest.digest_kind:
        raise errors.BaseMismatch(
            f"this delta has {manifest.digest_kind} digests but the version held has {tree.digest_kind}: "
            "a chain never mixes formats"
        )
    for f in manifest.files:
        if only is not None and f.path not in only:
            continue
        base = tree.base_for(manifest, f.path)
        for e in f.segments:
            if e.base_offset is None:
                continue
            held = None if base is None else base.segments.get((e.base_offset, e.segment.length))
            if held is None or held != e.base_digest:
                raise errors.BaseMismatch(f"{f.path}: base {describe(e)} is not the one this delta was made against")


def decode_step(
    manifest: Manifest,
    read_frame: Callable[[FrameRef], Any],
    tree: Tree,
    work: Scratch,
    pool: ThreadPoolExecutor,
    only: Collection[str] | None = None,
) -> Tree:
    """Decode `manifest` on top of `tree` (its parent version, bases already checked) into a new Tree.

    `only`: the paths to decode (None: every file); the new Tree holds just those, and
    only the frames with a piece in one of them are read (`frames_for`). A version 2
    frame shared with a file left out gets zeros as that piece's base (its result is
    dropped; each piece is checked by its own checksum); a version 1 frame checks its
    result whole, so every file of a shared delta frame must be decoded (`needed_files`).
    """
    n = len(manifest.files)
    outputs: list[np.ndarray | None] = [None] * n
    bases: list[np.ndarray | None] = [None] * n
    modes: list[str] = [""] * n
    new = Tree(manifest.single_file, digest_kind=manifest.digest_kind)
    for fi, f in enumerate(manifest.files):
        if only is not None and f.path not in only:
            modes[fi] = "left out"
            continue
        b = tree.base_for(manifest, f.path)
        deltas = [e for e in f.segments if e.base_offset is not None]
        # Patch a copy in place only when something is delta-coded and nothing moved.
        same_layout = (
            b is not None
            and bool(deltas)
            and b.size == f.size
            and all(e.base_offset == e.segment.offset for e in deltas)
        )
        segs = f.spans()
        unchanged = same_layout and len(deltas) == len(f.segments) and all(e.unchanged for e in deltas)
        if b is not None and unchanged:
            modes[fi] = "unchanged"
            bases[fi] = map_file(b.location, b.size)
            new.files[f.path] = HeldFile(b.location, f.size, b.owned, segs)
            continue
        if b is not None and same_layout:
            modes[fi] = "inplace"
            if b.owned:
                loc = b.location
            else:
                loc = work.new()
                shutil.copyfile(b.location, loc)  # copy_file_range/sendfile: the kernel copies
            outputs[fi] = bases[fi] = map_file(loc, f.size, "r+")
        else:
            modes[fi] = "new"
            loc = work.new()
            with open(loc, "wb") as fh:
                fh.truncate(f.size)
            outputs[fi] = map_file(loc, f.size, "r+")
            if b is not None:
                bases[fi] = map_file(b.location, b.size)
        new.files[f.path] = HeldFile(loc, f.size, True, segs)

    def skip(fi: int, si: int) -> bool:
        if modes[fi] in ("unchanged", "left out"):
            return True
        e = manifest.files[fi].segments[si]
        return modes[fi] == "inplace" and e.base_offset == e.segment.offset and e.unchanged

    def out(fi: int) -> np.ndarray:
        o = outputs[fi]
        assert o is not None, "a file with frames to decode has an output"
        return o

    def base(fi: int, e: SegmentEntry, offset: int, length: int) -> np.ndarray:
        if modes[fi] == "left out":  # a version 2 piece whose result is dropped: any base will do
            return np.zeros(length, dtype=np.uint8)
        b = bases[fi]
        assert b is not None and e.base_offset is not None, "a delta frame's segment has a base"
        return b[e.base_offset + offset : e.base_offset + offset + length]

    v2 = manifest.version == VERSION_2

    def run(ref: FrameRef) -> list[tuple[Piece, TensorSum]]:
        """Decode one frame into its outputs; (piece, checksum of its result) of each piece for version 2."""
        pieces = ref.pieces
        if all(skip(p.file, p.seg) for p in pieces):
            return []
        if not v2 and ref.delta and any(modes[p.file] == "left out" for p in pieces):
            raise AssertionError("a version 1 delta frame is decoded with all its files (needed_files)")
        blob = read_frame(ref)
        check_frame(manifest, ref, blob)
        if len(pieces) == 1:
            p = pieces[0]
            e = manifest.files[p.file].segments[p.seg]
            start = e.segment.offset + p.offset
            target = out(p.file)[start : start + p.length]
            if ref.delta and modes[p.file] == "new":
                target[:] = base(p.file, e, p.offset, p.length)
            if v2:  # the result's checksum comes from the apply pass itself
                return apply_summed(blob, pieces, [target])
            apply_frame(blob, target, verify_base=False)
            return []
        if ref.delta:
            parts = []
            for p in pieces:
                parts.append(base(p.file, manifest.files[p.file].segments[p.seg], p.offset, p.length))
            scratch = np.concatenate(parts)
        else:
            scratch = np.empty(ref.raw_len, dtype=np.uint8)
        bounds = np.cumsum([0] + [p.length for p in pieces])
        views = [scratch[lo:hi] for lo, hi in zip(bounds, bounds[1:], strict=False)]
        sums = apply_summed(blob, pieces, views) if v2 else []
        if not v2:
            apply_frame(blob, scratch, verify_base=False)
        for p, view in zip(pieces, views, strict=True):
            if not skip(p.file, p.seg):
                start = manifest.files[p.file].segments[p.seg].segment.offset + p.offset
                out(p.file)[start : start + p.length] = view
        return sums

    def copy_unchanged(job: tuple[int, SegmentEntry]) -> None:
        fi, e = job
        start = e.segment.offset
        out(fi)[start : start + e.segment.length] = base(fi, e, 0, e.segment.length)

    try:
        sums = [x for done in run_all(pool, run, manifest.frames) for x in done]
        if v2:  # segments equal to their base have no frames: a file written whole copies them
            copies = [
                (fi, e)
                for fi, f in enumerate(manifest.files)
                if modes[fi] == "new"
                for e in f.segments
                if e.unchanged and e.segment.length
            ]
            run_all(pool, copy_unchanged, copies)
            check_results(_decoded_part(manifest, modes), sums)
        for o in outputs:
            if isinstance(o, np.memmap):
                o.flush()
    except BaseException:
        for held in new.files.values():
            if held.owned and work.owns(held.location):
                held.location.unlink(missing_ok=True)
        raise
    finally:
        outputs.clear()  # drop the maps now: the files are renamed next
        bases.clear()
    # Temporaries of the previous step that this one did not reuse are garbage now.
    kept = {h.location for h in new.files.values()}
    for held in tree.files.values():
        if held.owned and held.location not in kept:
            held.location.unlink(missing_ok=True)
    return new


def _decoded_part(manifest: Manifest, modes: list[str]) -> Manifest:
    """`manifest` with the segments of the files left out of a decode removed (their results are not checked)."""
    if "left out" not in modes:
        return manifest
    files = [
        FileEntry(f.path, f.size, ()) if mode == "left out" else f
        for f, mode in zip(manifest.files, modes, strict=True)
    ]
    return replace(manifest, files=files)


def frames_for(manifest: Manifest, paths: Collection[str]) -> list[FrameRef]:
    """The frames of `manifest` a decode of the files `paths` reads: those with a piece in one of them."""
    wanted = {fi for fi, f in enumerate(manifest.files) if f.path in paths}
    return [ref for ref in manifest.frames if any(p.file in wanted for p in ref.pieces)]


def needed_files(chain: Sequence[Manifest], wanted: Collection[str]) -> list[set[str]]:
    """Which files each manifest of `chain` (a plan's steps, in order) must decode so that the last one yields `wanted`.

    A file with delta segments needs its base, the previous step's file at its path (in
    single-file mode, the previous step's only file). A version 1 delta frame checks
    its result whole, so every file it has a piece of is decoded with the others (and
    needs its base in turn); a version 2 frame checks each piece on its own, so a shared
    frame pulls in nothing (see `decode_step`).
    """
    needs = [set[str]() for _ in chain]
    if not chain:
        return needs
    needs[-1] = {f.path for f in chain[-1].files if f.path in wanted}
    for k in range(len(chain) - 1, -1, -1):
        m = chain[k]
        if m.version != VERSION_2:
            grew = True
            while grew:
                grew = False
                for ref in m.frames:
                    paths = {m.files[p.file].path for p in ref.pieces}
                    if ref.delta and paths & needs[k] and not paths <= needs[k]:
                        needs[k] |= paths
                        grew = True
        if k == 0:
            break
        prev = chain[k - 1]
        held = {f.path for f in prev.files}
        for f in m.files:
            if f.path in needs[k] and any(e.base_offset is not None for e in f.segments):
                base = prev.files[0].path if m.single_file and len(prev.files) == 1 else f.path
                if base in held:
                    needs[k - 1].add(base)
    return needs
