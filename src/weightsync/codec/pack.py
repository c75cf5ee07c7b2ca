"""Packing encoded frames into content-addressed objects (docs/FORMAT.md §7.1).

A data object is a plain concatenation of frames; the manifest says where each
frame lies. Packing keeps object counts low (one object per ~64 MiB, not one per
frame) while letting any single frame be fetched with one ranged read.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

from weightsync.codec.encoder import Encoded, EncodedFrame
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
    packer = Packer(target_bytes=target_bytes)
    for fr in encoded.frames:
        packer.add(fr)
    return packer.finish(encoded)


class Packer:
    """:func:`pack` one frame at a time, as an encode makes them (``Encoder.encode``'s `on_frame`): each object
    is made (joined, hashed) as soon as its last frame is in, and handed to `on_object` (all but the last,
    which :meth:`finish` makes), so it can be uploaded while later frames encode. The objects are those
    :func:`pack` makes of the same frames.
    Not thread-safe: the frames come in order, one call at a time."""

    def __init__(
        self, *, target_bytes: int = DEFAULT_OBJECT_BYTES, on_object: Callable[[PackedObject], None] | None = None
    ) -> None:
        self.target_bytes = target_bytes
        self.on_object = on_object
        self.objects: list[PackedObject] = []
        self._where: list[tuple[str, int]] = []
        self._group: list[bytes] = []
        self._size = 0

    def add(self, frame: EncodedFrame) -> None:
        """The next frame in order; the object before it is made when this one does not fit in it."""
        n = len(frame.data)
        if self._group and self._size + n > self.target_bytes:
            self._close()
        self._group.append(frame.data)
        self._size += n

    def _close(self, hand_on: bool = True) -> None:
        blob = b"".join(self._group)
        digest = hashlib.sha256(blob).hexdigest()
        offset = 0
        for data in self._group:
            self._where.append((digest, offset))
            offset += len(data)
        self._group, self._size = [], 0
        obj = PackedObject(digest, blob)
        self.objects.append(obj)
        if hand_on and self.on_object is not None:
            self.on_object(obj)

    def finish(self, encoded: Encoded) -> tuple[Manifest, list[PackedObject]]:
        """Make the last object (not handed to `on_object`: the caller sends it with the manifest); `encoded`'s
        manifest located in the objects (its frames are those added) and every object, the last included."""
        if self._group:
            self._close(hand_on=False)
        if len(self._where) != len(encoded.frames):
            raise ValueError(f"{len(self._where)} frames packed, the encode made {len(encoded.frames)}")
        return encoded.with_locations(lambda i, fr: self._where[i]), self.objects
