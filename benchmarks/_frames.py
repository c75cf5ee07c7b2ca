"""One encode's frames laid end to end in memory, located in its manifest: what the benchmarks that decode in
process read from (a subscriber reads the same frames from objects)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from weightsync.codec.encoder import Encoded
from weightsync.codec.manifest import FrameRef, Manifest


@dataclass(frozen=True)
class InMemory:
    manifest: Manifest
    """The encode's manifest, each frame at its offset in `area` (no object)."""
    area: bytes

    def read(self, ref: FrameRef) -> memoryview:
        """A frame's bytes, as `Decoder.decode` and `inplace.prepare` ask for them."""
        return memoryview(self.area)[ref.offset : ref.offset + ref.length]


def in_memory(encoded: Encoded) -> InMemory:
    """`encoded`'s frames end to end and its manifest pointing into them."""
    offsets = np.cumsum([0] + [len(fr.data) for fr in encoded.frames])
    manifest = encoded.with_locations(lambda i, fr: (None, int(offsets[i])))
    return InMemory(manifest, b"".join(fr.data for fr in encoded.frames))
