"""A checkout: a directory holding one version of a model byte for byte, plus client state.

``DIR/.weightsync/state.json`` records the model, the version, its manifest
digest and every file's size and segment xxh3-128 (from the manifest), so an
incremental pull can first prove the directory still holds that version.
``DIR/.weightsync/tmp/`` holds files being decoded; they are renamed into place
only after every frame of every step decoded and checked, so a failure leaves
the old version intact and files appear atomically.

The decode driver applies one manifest onto the current files:

- a file whose every segment is unchanged (same place, xxh3 equal to its base)
  is not rewritten;
- a file with the same layout is copied (the kernel copies, reflinks where the
  filesystem can) and patched in place: only changed pages are touched;
- any other file is written whole into a new temporary file.

Base checks happen at segment level before anything is decoded (FORMAT §5.2),
so frames skip their own base check; every frame still checks its result.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from weightsync import errors
from weightsync.client._pool import run_all
from weightsync.codec.checkpoint import STATE_DIR, check_path
from weightsync.codec.frame import apply_frame, xxh3_128
from weightsync.codec.manifest import FrameRef, Manifest

STATE_FORMAT = "weightsync.checkout"
STATE_VERSION = 1


def state_dir(root: Path) -> Path:
    return root / STATE_DIR


@dataclass
class FileState:
    """One file of the held version: its size and segments as (offset, length, xxh3 hex)."""

    path: str
    size: int
    segments: list[tuple[int, int, str]]


@dataclass
class CheckoutState:
    """What a checkout directory holds (DIR/.weightsync/state.json)."""

    model: str
    number: int
    manifest: str
    single_file: bool
    files: list[FileState]
    server: str | None = None

    @classmethod
    def of(cls, model: str, number: int, digest: str, manifest: Manifest, server: str | None = None
           ) -> CheckoutState:
        files = [FileState(f.path, f.size, [(e.segment.offset, e.segment.length, e.xxh3) for e in f.segments])
                 for f in manifest.files]
        return cls(model, number, digest, manifest.single_file, files, server)

    def to_json(self) -> bytes:
        doc = {"format": STATE_FORMAT, "version": STATE_VERSION, "model": self.model, "number": self.number,
               "manifest": self.manifest, "single_file": self.single_file, "server": self.server,
               "files": [{"path": f.path, "size": f.size, "segments": [list(s) for s in f.segments]}
                         for f in self.files]}
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def load(cls, root: Path) -> CheckoutState | None:
        """The state of checkout `root`, or None when absent or unreadable (treated as holding nothing)."""
        try:
            doc = json.loads((state_dir(root) / "state.json").read_bytes())
            if doc.get("format") != STATE_FORMAT or doc.get("version") != STATE_VERSION:
                return None
            files = [FileState(check_path(f["path"]), int(f["size"]),
                               [(int(o), int(n), str(h)) for o, n, h in f["segments"]]) for f in doc["files"]]
            return cls(str(doc["model"]), int(doc["number"]), str(doc["manifest"]), bool(doc["single_file"]),
                       files, doc.get("server"))
        except (OSError, ValueError, KeyError, TypeError, errors.InvalidName):
            return None

    def save(self, root: Path) -> None:
        write_atomic(state_dir(root) / "state.json", self.to_json())

    @staticmethod
    def remove(root: Path) -> None:
        (state_dir(root) / "state.json").unlink(missing_ok=True)


def write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@contextmanager
def locked(root: Path) -> Iterator[None]:
    """Exclusive lock on a checkout (two pulls into one directory would race on its files)."""
    sd = state_dir(root)
    sd.mkdir(parents=True, exist_ok=True)
    with open(sd / "lock", "a+b") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise errors.Conflict(f"{root}: another weightsync process is updating this directory") from None
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _map(path: Path, size: int, mode: str = "r") -> np.ndarray:
    if size == 0:
        return np.zeros(0, dtype=np.uint8)
    return np.memmap(path, dtype=np.uint8, mode=mode, shape=(size,))


def verify(root: Path, state: CheckoutState, pool: ThreadPoolExecutor, *, deep: bool = True) -> bool:
    """Whether `root` still holds `state`'s version: every file present with its size and, if `deep`, segment hashes."""
    maps = []
    for f in state.files:
        p = root / f.path
        try:
            st = os.lstat(p)
        except OSError:
            return False
        if not p.is_file() or p.is_symlink() or st.st_size != f.size:
            return False
        if deep:
            maps.append((f, _map(p, f.size)))
    jobs = [(h, pool.submit(lambda m, o, n: xxh3_128(m[o : o + n]).hex(), m, o, n))
            for f, m in maps for o, n, h in f.segments]
    return all(fut.result() == h for h, fut in jobs)


@dataclass
class HeldFile:
    """Where a file of the current version is, and whether it is a temporary file of ours."""

    location: Path
    size: int
    owned: bool
    segments: dict[int, tuple[int, str]]  # offset -> (length, xxh3)


@dataclass
class Tree:
    """The current version's files during a pull: the checkout's own files or decoded temporaries."""

    single_file: bool
    files: dict[str, HeldFile] = field(default_factory=dict)

    @classmethod
    def of_state(cls, root: Path, state: CheckoutState) -> Tree:
        return cls(state.single_file, {f.path: HeldFile(root / f.path, f.size, False,
                                                          {o: (n, h) for o, n, h in f.segments})
                                       for f in state.files})

    def base_for(self, manifest: Manifest, path: str) -> HeldFile | None:
        """The base file of `path` (FORMAT §5.2: in single-file mode, the parent's only file)."""
        if manifest.single_file and len(self.files) == 1:
            return next(iter(self.files.values()))
        return self.files.get(path)


def check_bases(manifest: Manifest, tree: Tree) -> None:
    """Every delta segment's base must be what `tree` holds at that place (hash and length); else BaseMismatch."""
    for f in manifest.files:
        base = tree.base_for(manifest, f.path)
        for e in f.segments:
            if e.base_offset is None:
                continue
            held = None if base is None else base.segments.get(e.base_offset)
            if held is None or held != (e.segment.length, e.base_xxh3):
                what = "header" if e.segment.kind == "header" else f"{e.segment.kind} {e.segment.name!r}"
                raise errors.BaseMismatch(f"{f.path}: base {what} is not the one this delta was made against")


class Workspace:
    """Temporary files of a pull, under DIR/.weightsync/tmp (same filesystem: renames are atomic)."""

    def __init__(self, root: Path) -> None:
        self.dir = state_dir(root) / "tmp"
        shutil.rmtree(self.dir, ignore_errors=True)  # leftovers of a killed pull
        self.dir.mkdir(parents=True, exist_ok=True)

    def new(self) -> Path:
        return self.dir / uuid.uuid4().hex

    def clear(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def decode_step(manifest: Manifest, read_frame: Callable[[FrameRef], Any], tree: Tree, work: Workspace,
                pool: ThreadPoolExecutor) -> Tree:
    """Decode `manifest` on top of `tree` (its parent version, bases already checked) into a new Tree."""
    n = len(manifest.files)
    outputs: list[np.ndarray | None] = [None] * n
    bases: list[np.ndarray | None] = [None] * n
    modes: list[str] = [""] * n
    new = Tree(manifest.single_file)
    for fi, f in enumerate(manifest.files):
        b = tree.base_for(manifest, f.path)
        deltas = [e for e in f.segments if e.base_offset is not None]
        # Patch a copy in place only when something is delta-coded and nothing moved.
        same_layout = (b is not None and bool(deltas) and b.size == f.size
                       and all(e.base_offset == e.segment.offset for e in deltas))
        segs = {e.segment.offset: (e.segment.length, e.xxh3) for e in f.segments}
        if same_layout and len(deltas) == len(f.segments) and all(e.xxh3 == e.base_xxh3 for e in deltas):
            modes[fi] = "unchanged"
            bases[fi] = _map(b.location, b.size)
            new.files[f.path] = HeldFile(b.location, f.size, b.owned, segs)
            continue
        if same_layout:
            modes[fi] = "inplace"
            if b.owned:
                loc = b.location
            else:
                loc = work.new()
                shutil.copyfile(b.location, loc)  # copy_file_range/sendfile: the kernel copies
            outputs[fi] = bases[fi] = _map(loc, f.size, "r+")
        else:
            modes[fi] = "new"
            loc = work.new()
            with open(loc, "wb") as fh:
                fh.truncate(f.size)
            outputs[fi] = _map(loc, f.size, "r+")
            if b is not None:
                bases[fi] = _map(b.location, b.size)
        new.files[f.path] = HeldFile(loc, f.size, True, segs)

    def skip(fi: int, si: int) -> bool:
        if modes[fi] == "unchanged":
            return True
        e = manifest.files[fi].segments[si]
        return modes[fi] == "inplace" and e.base_offset == e.segment.offset and e.xxh3 == e.base_xxh3

    def run(ref: FrameRef) -> None:
        pieces = ref.pieces
        if all(skip(p.file, p.seg) for p in pieces):
            return
        blob = read_frame(ref)
        if len(pieces) == 1:
            p = pieces[0]
            e = manifest.files[p.file].segments[p.seg]
            start = e.segment.offset + p.offset
            target = outputs[p.file][start : start + p.length]
            if ref.delta and modes[p.file] == "new":
                b0 = e.base_offset + p.offset
                target[:] = bases[p.file][b0 : b0 + p.length]
            apply_frame(blob, target, verify_base=False)
            return
        if ref.delta:
            parts = []
            for p in pieces:
                e = manifest.files[p.file].segments[p.seg]
                b0 = e.base_offset + p.offset
                parts.append(bases[p.file][b0 : b0 + p.length])
            scratch = np.concatenate(parts)
        else:
            scratch = np.empty(ref.raw_len, dtype=np.uint8)
        apply_frame(blob, scratch, verify_base=False)
        pos = 0
        for p in pieces:
            if not skip(p.file, p.seg):
                start = manifest.files[p.file].segments[p.seg].segment.offset + p.offset
                outputs[p.file][start : start + p.length] = scratch[pos : pos + p.length]
            pos += p.length

    try:
        run_all(pool, run, manifest.frames)
        for out in outputs:
            if isinstance(out, np.memmap):
                out.flush()
    except BaseException:
        for held in new.files.values():
            if held.owned and held.location.parent == work.dir:
                held.location.unlink(missing_ok=True)
        raise
    finally:
        del outputs, bases
    # Temporaries of the previous step that this one did not reuse are garbage now.
    kept = {h.location for h in new.files.values()}
    for held in tree.files.values():
        if held.owned and held.location not in kept:
            held.location.unlink(missing_ok=True)
    return new


def _check_no_symlinked_parent(root: Path, path: str) -> None:
    """A directory symlink inside the checkout would redirect writes outside it: refuse (InvalidName)."""
    current = root
    for part in Path(path).parts[:-1]:
        current = current / part
        if current.is_symlink():
            raise errors.InvalidName(f"{path}: {current} is a symlink inside the checkout; refusing to write "
                                     "through it")


def install(root: Path, tree: Tree, old: CheckoutState | None) -> None:
    """Rename the decoded temporaries into place and drop files the new version no longer has.

    Every destination is checked before the first rename, so a refused path
    leaves the checkout as it was.
    """
    for path, held in tree.files.items():
        if held.owned:
            _check_no_symlinked_parent(root, path)
    for path, held in tree.files.items():
        if not held.owned:
            continue
        final = root / path
        final.parent.mkdir(parents=True, exist_ok=True)
        with open(held.location, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(held.location, final)
        held.location, held.owned = final, False
    if old is not None:
        for f in old.files:
            if f.path not in tree.files:
                (root / f.path).unlink(missing_ok=True)
    try:
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass
