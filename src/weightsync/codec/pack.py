"""Packing encoded frames into content-addressed objects (docs/FORMAT.md §7.1).

A data object is a plain concatenation of frames; the manifest says where each
frame lies. Packing keeps object counts low (one object per ~64 MiB, not one per
frame) while letting any single frame be fetched with one ranged read.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from weightsync.codec.encoder import Encoded
from weightsync.codec.manifest import Manifest

DEFAULT_OBJECT_BYTES = 64 << 20


@dataclass(frozen=True)
class PackedObject:
    """One object's bytes and its SHA-256."""

    digest: str
    data: bytes


def pack(encoded: Encoded, *, target_bytes: int = DEFAULT_OBJECT_BYTES) -> tuple[Manifest, list[PackedObject]]:
    """Group `encoded`'s frames, in order, into objects of about `target_bytes`; return the located manifest.

    A frame larger than `target_bytes` gets an object of its own.
    """
    groups: list[list[int]] = []
    size = 0
    for i, fr in enumerate(encoded.frames):
        if not groups or (size + len(fr.data) > target_bytes and groups[-1]):
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += len(fr.data)
    where: dict[int, tuple[str, int]] = {}
    objects: list[PackedObject] = []
    for group in groups:
        blob = b"".join(encoded.frames[i].data for i in group)
        digest = hashlib.sha256(blob).hexdigest()
        offset = 0
        for i in group:
            where[i] = (digest, offset)
            offset += len(encoded.frames[i].data)
        objects.append(PackedObject(digest, blob))
    return encoded.with_locations(lambda i, fr: where[i]), objects
