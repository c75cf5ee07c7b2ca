"""What a checkout holds: the state file of a version (model, number, manifest, files and segment digests).

Each version directory of a checkout carries one (client/checkout.py); an
incremental pull first proves the checkout still holds what it says. Digests
are of the kind the version's manifest has (FORMAT §5: xxh3-128 for version 1
manifests, the tensor checksum for version 2, which needs each segment's
element width); a state file of version 1 (before FORMAT v2) holds xxh3-128.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weightsync import errors
from weightsync.client.decode import HeldFile, Tree
from weightsync.client.selection import file_selector
from weightsync.codec.checkpoint import check_path
from weightsync.codec.manifest import DIGEST_KINDS, DIGEST_XXH3, Manifest

STATE_FORMAT = "weightsync.checkout"
STATE_VERSION = 2
"""Version 2 adds the digest kind and each segment's element width; version 1 states (xxh3-128) still read."""
SLICE_STATE_VERSION = 3
"""A checkout holding some files of its version (pull --include) writes version 3 (its `include`): a client
that predates slices reads it as holding nothing (a full pull), never as the whole version."""


@dataclass
class FileState:
    """One file of the held version: its size and segments as (offset, length, digest hex, element width)."""

    path: str
    size: int
    segments: list[tuple[int, int, str, int]]


@dataclass
class CheckoutState:
    """What a checkout holds: model, version, manifest digest, and every file's size and segment digests."""

    model: str
    number: int
    manifest: str
    single_file: bool
    files: list[FileState]
    server: str | None = None
    digest_kind: str = DIGEST_XXH3
    """The kind of the segments' digests: the manifest's (`Manifest.digest_kind`)."""
    include: tuple[str, ...] | None = None
    """The file globs the checkout holds of its version (pull --include; None: every file): `files` are those."""

    @classmethod
    def of(
        cls,
        model: str,
        number: int,
        digest: str,
        manifest: Manifest,
        server: str | None = None,
        include: tuple[str, ...] | None = None,
    ) -> CheckoutState:
        chosen = file_selector(include)
        files = [
            FileState(
                f.path,
                f.size,
                [(e.segment.offset, e.segment.length, e.digest, e.segment.dtype.width) for e in f.segments],
            )
            for f in manifest.files
            if chosen is None or chosen(f.path)
        ]
        return cls(model, number, digest, manifest.single_file, files, server, manifest.digest_kind, include)

    def to_json(self) -> bytes:
        doc: dict[str, Any] = {
            "format": STATE_FORMAT,
            "version": STATE_VERSION if self.include is None else SLICE_STATE_VERSION,
            "model": self.model,
            "number": self.number,
            "manifest": self.manifest,
            "single_file": self.single_file,
            "server": self.server,
            "digest_kind": self.digest_kind,
            "files": [{"path": f.path, "size": f.size, "segments": [list(s) for s in f.segments]} for f in self.files],
        }
        if self.include is not None:
            doc["include"] = list(self.include)
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    def tree(self, where: Path) -> Tree:
        """The files of this version, found under `where`, as the base of a decode (they are only read)."""
        return Tree(
            self.single_file,
            {
                f.path: HeldFile(where / f.path, f.size, False, {(o, n): h for o, n, h, _ in f.segments})
                for f in self.files
            },
            self.digest_kind,
        )

    @classmethod
    def read(cls, path: Path) -> CheckoutState | None:
        """The state stored at `path`, or None when absent or unreadable (treated as holding nothing)."""
        try:
            doc = json.loads(path.read_bytes())
            version = doc.get("version")
            if doc.get("format") != STATE_FORMAT or version not in (1, STATE_VERSION, SLICE_STATE_VERSION):
                return None
            include = None
            if version == SLICE_STATE_VERSION:
                include = tuple(str(p) for p in doc["include"])
                file_selector(include)  # malformed: InvalidArgument, read as holding nothing
            kind = DIGEST_XXH3 if version == 1 else str(doc["digest_kind"])
            if kind not in DIGEST_KINDS.values():
                return None
            files = [FileState(check_path(f["path"]), int(f["size"]), _segments(f["segments"])) for f in doc["files"]]
            return cls(
                str(doc["model"]),
                int(doc["number"]),
                str(doc["manifest"]),
                bool(doc["single_file"]),
                files,
                doc.get("server"),
                kind,
                include,
            )
        except (OSError, ValueError, KeyError, TypeError, errors.InvalidName, errors.InvalidArgument):
            return None


def _segments(rows: list[list[Any]]) -> list[tuple[int, int, str, int]]:
    """(offset, length, digest, width) rows; a version 1 state has no width (xxh3 needs none: 1)."""
    out = []
    for row in rows:
        o, n, h, *w = row
        width = int(w[0]) if w else 1
        if width not in (1, 2, 4, 8):
            raise ValueError(f"element width {width}")
        out.append((int(o), int(n), str(h), width))
    return out


def write_atomic(path: Path, data: bytes) -> None:
    """Write `path` whole or not at all: a temporary file, fsync, rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
