"""Commit records: the store's own proof that a version was committed (docs/FORMAT.md §7.3).

A manifest is written before the catalog commit, so a manifest alone does not
prove its version became visible (the publish may have lost its compare-and-swap
or crashed). After the commit, the commit record names the model, the number the
catalog gave the version, its parent, kind and manifest. Rebuilding a lost catalog
reads only commit records and the manifests they name. The bytes are a function of
the catalog row alone, so fsck can recompute a missing record's exact digest and
GC can find the record of a version it deletes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from weightsync.catalog import Version
from weightsync.errors import BadMagic, FormatError, UnsupportedVersion, VersionNotFound

MAGIC = b"WSCR"
VERSION = 1
MAX_RECORD = 1 << 20


@dataclass(frozen=True)
class CommitRecord:
    model: str
    number: int
    parent: int | None
    kind: str
    chain_base: int
    manifest: str
    step: int | None
    metadata: dict[str, Any]
    committed_at: datetime

    def encode(self) -> bytes:
        """Canonical bytes: magic, version byte, then sorted compact JSON."""
        doc = {
            "format": "weightsync.commit",
            "model": self.model,
            "number": self.number,
            "parent": self.parent,
            "kind": self.kind,
            "chain_base": self.chain_base,
            "manifest": self.manifest,
            "step": self.step,
            "metadata": self.metadata,
            "committed_at": self.committed_at.astimezone(UTC).isoformat(),
        }
        return MAGIC + bytes([VERSION]) + json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.encode()).hexdigest()

    @classmethod
    def decode(cls, data: bytes) -> CommitRecord:
        """Parse a commit record; FormatError subclasses on anything wrong."""
        if len(data) > MAX_RECORD:
            raise FormatError("commit record too large")
        if data[:4] != MAGIC:
            raise BadMagic("not a commit record")
        if data[4:5] != bytes([VERSION]):
            raise UnsupportedVersion(f"commit record version {data[4:5]!r}")
        try:
            doc = json.loads(data[5:])
            if doc.get("format") != "weightsync.commit":
                raise FormatError("not a commit record")
            rec = cls(
                model=str(doc["model"]),
                number=int(doc["number"]),
                parent=None if doc["parent"] is None else int(doc["parent"]),
                kind=str(doc["kind"]),
                chain_base=int(doc["chain_base"]),
                manifest=str(doc["manifest"]),
                step=None if doc["step"] is None else int(doc["step"]),
                metadata=dict(doc["metadata"]),
                committed_at=datetime.fromisoformat(doc["committed_at"]),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise FormatError(f"malformed commit record: {exc}") from None
        except RecursionError:  # deeply nested JSON
            raise FormatError("malformed commit record: JSON nests too deeply") from None
        if rec.encode() != bytes(data):
            raise FormatError("commit record is not in canonical form")
        return rec


def record_of(version: Version) -> CommitRecord:
    """The commit record of a committed catalog version; FormatError if the version is not committed."""
    if (
        version.number is None
        or version.chain_base is None
        or version.manifest_digest is None
        or version.committed_at is None
    ):
        raise VersionNotFound(f"a version of {version.model!r} (publish {version.publish_id}) is not committed")
    return CommitRecord(
        model=version.model,
        number=version.number,
        parent=version.parent,
        kind=version.kind,
        chain_base=version.chain_base,
        manifest=version.manifest_digest,
        step=version.step,
        metadata=dict(version.metadata or {}),
        committed_at=version.committed_at,
    )
