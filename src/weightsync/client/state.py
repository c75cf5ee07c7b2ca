"""What a checkout holds: the state file of a version (model, number, manifest, files and segment hashes).

Each version directory of a checkout carries one (client/checkout.py); an
incremental pull first proves the checkout still holds what it says.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

from weightsync import errors
from weightsync.client.decode import HeldFile, Tree
from weightsync.codec.checkpoint import check_path
from weightsync.codec.manifest import Manifest

STATE_FORMAT = "weightsync.checkout"
STATE_VERSION = 1


@dataclass
class FileState:
    """One file of the held version: its size and segments as (offset, length, xxh3 hex)."""

    path: str
    size: int
    segments: list[tuple[int, int, str]]


@dataclass
class CheckoutState:
    """What a checkout holds: model, version, manifest digest, and every file's size and segment hashes."""

    model: str
    number: int
    manifest: str
    single_file: bool
    files: list[FileState]
    server: str | None = None

    @classmethod
    def of(cls, model: str, number: int, digest: str, manifest: Manifest, server: str | None = None) -> CheckoutState:
        files = [
            FileState(f.path, f.size, [(e.segment.offset, e.segment.length, e.xxh3) for e in f.segments])
            for f in manifest.files
        ]
        return cls(model, number, digest, manifest.single_file, files, server)

    def to_json(self) -> bytes:
        doc = {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "model": self.model,
            "number": self.number,
            "manifest": self.manifest,
            "single_file": self.single_file,
            "server": self.server,
            "files": [{"path": f.path, "size": f.size, "segments": [list(s) for s in f.segments]} for f in self.files],
        }
        return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    def tree(self, where: Path) -> Tree:
        """The files of this version, found under `where`, as the base of a decode (they are only read)."""
        return Tree(
            self.single_file,
            {
                f.path: HeldFile(where / f.path, f.size, False, {(o, n): h for o, n, h in f.segments})
                for f in self.files
            },
        )

    @classmethod
    def read(cls, path: Path) -> CheckoutState | None:
        """The state stored at `path`, or None when absent or unreadable (treated as holding nothing)."""
        try:
            doc = json.loads(path.read_bytes())
            if doc.get("format") != STATE_FORMAT or doc.get("version") != STATE_VERSION:
                return None
            files = [
                FileState(
                    check_path(f["path"]), int(f["size"]), [(int(o), int(n), str(h)) for o, n, h in f["segments"]]
                )
                for f in doc["files"]
            ]
            return cls(
                str(doc["model"]),
                int(doc["number"]),
                str(doc["manifest"]),
                bool(doc["single_file"]),
                files,
                doc.get("server"),
            )
        except (OSError, ValueError, KeyError, TypeError, errors.InvalidName):
            return None


def write_atomic(path: Path, data: bytes) -> None:
    """Write `path` whole or not at all: a temporary file, fsync, rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
