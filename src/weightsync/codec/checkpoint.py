"""Checkpoints as the codec sees them: files cut into typed segments (docs/FORMAT.md §2).

Every file is a sequence of segments that together cover it exactly. A
safetensors file is its header (kind "header", U8) followed by its tensors
(kind "tensor", their own dtype); any other file is one "blob" segment of U8.
Concatenating a file's segments gives the file back byte for byte, so the
safetensors header and ``__metadata__`` survive unchanged.
"""

from __future__ import annotations

import mmap
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from weightsync.codec import safetensors
from weightsync.codec.dtypes import U8, DType
from weightsync.errors import InvalidName, SafetensorsError

STATE_DIR = ".weightsync"
"""Directory inside a checkout that holds client state; never part of a version."""

SAFETENSORS_SUFFIX = ".safetensors"
MAX_PATH = 1024
_BAD_COMPONENT = re.compile(r"^\.{1,2}$|[\x00-\x1f\\]")


@dataclass(frozen=True)
class Segment:
    """A typed byte range of a file: a safetensors header, a tensor or a whole blob."""

    kind: str  # "header" | "tensor" | "blob"
    name: str
    dtype: DType
    shape: tuple[int, ...]
    offset: int
    length: int

    @property
    def key(self) -> tuple[str, str]:
        """Identity used to pair a segment with its counterpart in the base version."""
        return (self.kind, self.name)


@dataclass(frozen=True)
class FileLayout:
    """A file's relative path, size and segments (in order, covering the file)."""

    path: str
    size: int
    segments: tuple[Segment, ...]


def tensor_names(layouts: Iterable[FileLayout]) -> dict[str, set[str]]:
    """Each file's path and the names of its tensors: what the removal rule compares (common.removed_content)."""
    return {x.path: {s.name for s in x.segments if s.kind == "tensor"} for x in layouts}


@dataclass
class CheckpointFile:
    """A file's layout plus its bytes (a read-only memory map or an in-memory array)."""

    layout: FileLayout
    data: np.ndarray

    def segment_bytes(self, seg: Segment) -> np.ndarray:
        return self.data[seg.offset : seg.offset + seg.length]


def check_path(path: str) -> str:
    """Validate a relative POSIX file path from a manifest or a directory walk; InvalidName if unsafe."""
    if not isinstance(path, str) or not path or len(path) > MAX_PATH:
        raise InvalidName(f"bad file path {path!r}")
    parts = path.split("/")
    if path.startswith("/") or any(not p or _BAD_COMPONENT.search(p) for p in parts):
        raise InvalidName(f"unsafe file path {path!r}")
    if parts[0] == STATE_DIR:
        raise InvalidName(f"file path {path!r} is inside the reserved {STATE_DIR}/ directory")
    return path


def is_safetensors(path: str) -> bool:
    """Whether `path` names a safetensors file (FORMAT §2: by its name, then by its header)."""
    return path.endswith(SAFETENSORS_SUFFIX)


LAYOUT_CACHE_BYTES = 64 << 20
"""Header bytes `layout_of` keeps the layouts of (least recently used first out)."""

_layouts: OrderedDict[tuple[str, int, bytes], FileLayout] = OrderedDict()
_layouts_bytes = 0
_layouts_lock = threading.Lock()


def layout_of(path: str, data: np.ndarray) -> FileLayout:
    """Cut `data` (a file's bytes) into segments: safetensors when it parses as one, else a blob.

    Permissive on purpose (diff, patch and checkouts carry any file exactly); a
    publish refuses a ``*.safetensors`` file that came out a blob (codec/validate.py).

    A safetensors layout is a function of the path, the file's size and its header bytes
    alone, and a publisher's versions repeat their header (same names, dtypes, shapes and
    offsets), so layouts are kept by (path, size, header bytes), up to LAYOUT_CACHE_BYTES
    of headers: a file with the same key gets the same (immutable) layout without parsing
    again (~10 µs a tensor, 0.2 s a version at 20,000 tensors).
    """
    size = len(data)
    if is_safetensors(path):
        head = _header_bytes(data)
        key = None if head is None else (path, size, head)
        if key is not None:
            with _layouts_lock:
                hit = _layouts.get(key)
                if hit is not None:
                    _layouts.move_to_end(key)
                    return hit
        try:  # the header bytes read for the key (none: its length prefix does not fit the file)
            parsed = None if head is None else safetensors.parse(head, size)
        except SafetensorsError:
            parsed = None  # not a valid safetensors file: still carried exactly, as a blob
        if parsed is not None:
            segs = [Segment("header", "", U8, (parsed.header_len,), 0, parsed.header_len)]
            segs += [Segment("tensor", t.name, t.dtype, t.shape, t.start, t.end - t.start) for t in parsed.tensors]
            layout = FileLayout(path, size, tuple(segs))
            if key is not None:
                _remember_layout(key, layout)
            return layout
    return FileLayout(path, size, (Segment("blob", "", U8, (size,), 0, size),))


def _header_bytes(data: np.ndarray) -> bytes | None:
    """The file's 8+N header bytes, or None when its length prefix does not fit the file (parse says why)."""
    try:
        total = safetensors.header_length(bytes(data[:8]), len(data))
    except SafetensorsError:
        return None
    return bytes(data[:total])


def _remember_layout(key: tuple[str, int, bytes], layout: FileLayout) -> None:
    global _layouts_bytes
    size = len(key[2])
    if size > LAYOUT_CACHE_BYTES:
        return
    with _layouts_lock:
        if key in _layouts:
            return
        _layouts[key] = layout
        _layouts_bytes += size
        while _layouts_bytes > LAYOUT_CACHE_BYTES:
            old, _ = _layouts.popitem(last=False)
            _layouts_bytes -= len(old[2])


def _map(path: Path) -> np.ndarray:
    """The file's bytes, mapped read-only, as a plain uint8 array (the map lives as long as any view of it).

    Not np.memmap: every slice of a memmap goes through its Python ``__array_finalize__``, and the
    encoder slices thousands of times per version (14 % of a 45 MB delta's encode, measured).
    """
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return np.zeros(0, dtype=np.uint8)
        return np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), dtype=np.uint8)


def list_files(root: Path) -> list[str]:
    """Relative paths of the regular files under directory `root`, sorted; weightsync's own top-level
    directories (``.weightsync``, a checkout's state; ``.weightsync-*``, e.g. an engine adapter's staging)
    excluded."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        if rel_dir == Path("."):
            dirnames[:] = [d for d in dirnames if d != STATE_DIR and not d.startswith(STATE_DIR + "-")]
        dirnames.sort()
        for name in filenames:
            full = Path(dirpath) / name
            if full.is_symlink() or not full.is_file():
                continue
            out.append(check_path((rel_dir / name).as_posix()))
    return sorted(out)


class Checkpoint:
    """A version's files, in order. Either a single file or a directory tree."""

    def __init__(self, files: list[CheckpointFile], *, single_file: bool = False) -> None:
        self.files = files
        self.single_file = single_file

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> Checkpoint:
        """Map a safetensors file or a directory of files; FileNotFoundError if absent."""
        root = Path(path)
        if root.is_dir():
            files = [CheckpointFile(layout_of(rel, data := _map(root / rel)), data) for rel in list_files(root)]
            return cls(files)
        if not root.exists():
            raise FileNotFoundError(f"{root}: no such file or directory")
        data = _map(root)
        return cls([CheckpointFile(layout_of(check_path(root.name), data), data)], single_file=True)

    @classmethod
    def from_bytes(cls, files: dict[str, bytes | bytearray | np.ndarray]) -> Checkpoint:
        """A checkpoint from in-memory file contents keyed by relative path."""
        out = []
        for rel in sorted(files):
            src = files[rel]
            data = src.view(np.uint8).reshape(-1) if isinstance(src, np.ndarray) else np.frombuffer(src, np.uint8)
            out.append(CheckpointFile(layout_of(check_path(rel), data), data))
        return cls(out)

    def by_path(self) -> dict[str, CheckpointFile]:
        return {f.layout.path: f for f in self.files}

    @property
    def raw_bytes(self) -> int:
        return sum(f.layout.size for f in self.files)
