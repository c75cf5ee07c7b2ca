"""Delta frames as (positions, values), without applying them (docs/FORMAT.md §4.2).

`apply_frame` needs the base bytes in host memory. A subscriber that applies a
delta into tensors that live elsewhere (a GPU) instead decodes each frame into
the element positions that change and the change itself, moves those small
arrays to the tensors' device and applies them there. This module is that
frame-level API: the same header checks and bounded section decoding as
`apply_frame`, minus the apply.

Functions here are pure and thread-safe.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from weightsync.codec.frame import FrameHeader, decode_frame, decode_payload, parse_header, unzigzag
from weightsync.errors import FormatError

_SIGNED = {1: np.dtype("<i1"), 2: np.dtype("<i2"), 4: np.dtype("<i4"), 8: np.dtype("<i8")}


@dataclass(frozen=True)
class DeltaValues:
    """What a delta frame changes: element `positions[i]` (within the frame) by `values[i]`.

    `positions` is None for a dense frame (STORED or PLANES): then `values` holds
    one value per element of the frame. Values are the frame's raw delta values
    (W-byte unsigned): XOR operands, or zigzag-coded differences when
    ``header.add`` is set; :meth:`operands` turns them into what to apply.
    """

    header: FrameHeader
    positions: np.ndarray | None
    values: np.ndarray

    @property
    def elements(self) -> int:
        """Elements in the frame (changed or not)."""
        return self.header.raw_len // self.header.dtype.width

    def operands(self) -> np.ndarray:
        """Signed W-byte integers to add (mod 2^8W) when ``header.add``, else the XOR masks (same dtype).

        Signed so a tensor viewed as the signed integer type of its element
        width can take them directly (two's complement addition wraps).
        """
        signed = _SIGNED[self.header.dtype.width]
        if self.header.add:
            return unzigzag(self.values).view(signed)
        return self.values.view(signed)

    def sparse(self) -> tuple[np.ndarray, np.ndarray]:
        """(positions, values) of the changed elements only; a dense frame is reduced to its nonzero values."""
        if self.positions is not None:
            return self.positions, self.values
        positions = np.flatnonzero(self.values)
        return positions, self.values[positions]


def decode_values(frame: bytes | memoryview | np.ndarray) -> DeltaValues:
    """Decode a delta frame's changes without a base; FormatError subclasses on malformed input.

    Checks everything `apply_frame` checks that does not need the base: header,
    section sizes, sparse positions within the frame. The result checksum can
    only be checked after applying (by the caller, on the whole target).
    """
    head = parse_header(frame)
    if not head.delta:
        raise FormatError("decode_values needs a delta frame (use keyframe_bytes for keyframes)")
    positions, values = decode_payload(frame, head)
    return DeltaValues(head, positions, np.ascontiguousarray(values))


def keyframe_bytes(frame: bytes | memoryview | np.ndarray) -> np.ndarray:
    """The raw bytes a keyframe frame decodes to (result checksum verified)."""
    head = parse_header(frame)
    if head.delta:
        raise FormatError("keyframe_bytes needs a keyframe frame (use decode_values for deltas)")
    return decode_frame(frame)


def apply_values(target: np.ndarray, change: DeltaValues, *, start: int = 0, count: int | None = None,
                 offset: int = 0) -> None:
    """Apply the part of `change` for frame elements [start, start+count) to `target` elements from `offset`.

    `target` is a 1-D array of the W-byte unsigned type; used to compose several
    deltas on the host. No checksum is checked here.
    """
    count = change.elements - start if count is None else count
    udt = change.header.dtype.numpy_uint
    view = target.view(udt)
    if change.positions is None:
        vals = change.values[start : start + count]
        dst = view[offset : offset + count]
        if change.header.add:
            np.add(dst, unzigzag(vals), out=dst)
        else:
            np.bitwise_xor(dst, vals, out=dst)
        return
    lo, hi = np.searchsorted(change.positions, [start, start + count])
    pos = change.positions[lo:hi] - start + offset
    vals = change.values[lo:hi]
    if change.header.add:
        view[pos] += unzigzag(vals)
    else:
        view[pos] ^= vals
