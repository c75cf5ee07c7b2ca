"""Delta frames as (positions, values), without applying them (docs/FORMAT.md §4.2).

`apply_frame` needs the base bytes in host memory. A subscriber that applies a
delta into tensors that live elsewhere (a GPU) instead decodes each frame into
the element positions that change and the change itself, moves those small
arrays to the tensors' device and applies them there. This module is that
frame-level API: the same header checks and bounded section decoding as
`apply_frame`, minus the apply.

Several consecutive deltas of one tensor compose into one :class:`Change`
(`compose`): a subscriber several versions behind applies each changed element
once instead of once per version.

Functions here are pure and thread-safe.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from weightsync.codec.frame import (
    METHOD_SPARSE,
    FrameHeader,
    decode_frame,
    decode_payload,
    decode_sparse_pieces,
    parse_header,
    unzigzag,
)
from weightsync.errors import FormatError


@dataclass(frozen=True)
class Change:
    """Elements to change in an array of W-byte elements: `operands[i]` applies at element `positions[i]`.

    `positions` are sorted and unique (int64). `operands` are signed W-byte
    integers: addends (mod 2^8W) when `add`, else XOR masks. Signed so a
    tensor viewed as the signed integer type of its element width takes them
    directly (two's complement addition wraps).
    """

    add: bool
    positions: np.ndarray
    operands: np.ndarray

    def __len__(self) -> int:
        return len(self.positions)

    def apply(self, target: np.ndarray) -> None:
        """Apply to `target`, a 1-D array of W-byte elements (any integer view of them), on the host."""
        view = target.view(self.operands.dtype)
        if self.add:
            view[self.positions] += self.operands
        else:
            view[self.positions] ^= self.operands


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
        return self._operands(self.values)

    def _operands(self, values: np.ndarray) -> np.ndarray:
        signed = self.header.dtype.numpy_int
        out: np.ndarray = (unzigzag(values) if self.header.add else values).view(signed)
        return out

    def sparse(self, start: int = 0, count: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(positions, values) of the changed elements among frame elements [start, start+count).

        Positions are relative to `start`; a dense frame is reduced to its nonzero values.
        """
        count = self.elements - start if count is None else count
        if self.positions is None:
            window = self.values[start : start + count]
            where = np.flatnonzero(window)
            return where, window[where]
        if start == 0 and count >= self.elements:
            return self.positions, self.values
        lo, hi = np.searchsorted(self.positions, [start, start + count])
        return self.positions[lo:hi] - start, self.values[lo:hi]

    def change(self, *, start: int = 0, count: int | None = None, offset: int = 0) -> Change:
        """The change to frame elements [start, start+count), placed at element `offset` of a target."""
        where, values = self.sparse(start, count)
        return Change(self.header.add, np.add(where, offset, dtype=np.int64), self._operands(values))


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


def decode_pieces(frame: bytes | memoryview | np.ndarray, pieces: Sequence[tuple[int, int]]) -> list[Change]:
    """The changes of a delta frame's consecutive pieces, each placed in its own tensor.

    `pieces` are (elements, offset): piece i takes the next `elements` elements of the frame
    (together exactly the frame's elements, ValueError otherwise) and starts at element `offset`
    of its tensor. Equal to ``decode_values(frame).change(start=..., count=..., offset=...)``
    per piece, with its checks; a sparse frame is decoded in one pass outside the GIL
    (``Kernels.piece_changes``) and the Changes' arrays are slices of two arrays, not copies.
    """
    head = parse_header(frame)
    if not head.delta:
        raise FormatError("decode_pieces needs a delta frame (use keyframe_bytes for keyframes)")
    counts = [c for c, _ in pieces]
    if any(c < 0 for c in counts) or sum(counts) != head.raw_len // head.dtype.width or not pieces:
        raise ValueError(f"the pieces cover {sum(counts)} elements of a frame of {head.raw_len // head.dtype.width}")
    starts = np.zeros(len(pieces), dtype=np.int64)
    np.cumsum(counts[:-1], out=starts[1:])
    if head.method != METHOD_SPARSE:  # a dense frame (rare: most elements changed)
        values = decode_values(frame)
        return [
            values.change(start=int(s), count=c, offset=o) for s, (c, o) in zip(starts.tolist(), pieces, strict=True)
        ]
    offsets = np.array([o for _, o in pieces], dtype=np.int64)
    positions, operands, cuts = decode_sparse_pieces(frame, head, starts, offsets)
    ends = [*cuts[1:].tolist(), len(positions)]
    return [Change(head.add, positions[a:b], operands[a:b]) for a, b in zip(cuts.tolist(), ends, strict=True)]


def keyframe_bytes(frame: bytes | memoryview | np.ndarray) -> np.ndarray:
    """The raw bytes a keyframe frame decodes to (result checksum verified)."""
    head = parse_header(frame)
    if head.delta:
        raise FormatError("keyframe_bytes needs a keyframe frame (use decode_values for deltas)")
    return decode_frame(frame)


def compose(changes: Iterable[Change]) -> list[Change]:
    """Changes equal to applying `changes` in order, each element changed at most once per run.

    Consecutive changes of one kind and width merge into one (addends add
    modulo 2^8W, XOR masks xor); an element whose merged operand is zero is
    dropped, so changes that cancel out vanish. A change of another kind
    starts a new run (it does not commute with the previous one). Changes of
    disjoint elements (pieces of one delta) compose to their union.
    """
    out: list[Change] = []
    run: list[Change] = []
    for c in changes:
        if run and (c.add != run[0].add or c.operands.dtype != run[0].operands.dtype):
            out.append(_merge(run))
            run = []
        run.append(c)
    if run:
        out.append(_merge(run))
    return [c for c in out if len(c)]


def _merge(run: list[Change]) -> Change:
    first = run[0]
    # Pieces of one delta (the usual run: one step) cover disjoint, increasing ranges: ordered by
    # their first positions they concatenate to a strictly increasing list, checked in one pass,
    # and their union needs no sort and no reduction (nothing to add up, order does not matter).
    nonempty = sorted((c for c in run if len(c)), key=lambda c: int(c.positions[0]))
    if len(nonempty) == 1:  # one piece (a tensor in one frame, one step): its arrays as they are, no copy
        positions, operands = nonempty[0].positions, nonempty[0].operands
    else:
        positions = np.concatenate([c.positions for c in nonempty]) if nonempty else np.zeros(0, np.int64)
        operands = np.concatenate([c.operands for c in nonempty]) if nonempty else first.operands[:0]
    if len(positions) == 0:
        return Change(first.add, positions.astype(np.int64), operands)
    if len(positions) == 1 or bool(np.all(positions[1:] > positions[:-1])):
        keep = operands != 0
        if bool(keep.all()):
            return Change(first.add, positions.astype(np.int64, copy=False), operands)
        return Change(first.add, positions[keep].astype(np.int64, copy=False), operands[keep])
    order = np.argsort(positions, kind="stable")  # stable: a later change of an element stays later
    positions, operands = positions[order], operands[order]
    unique, starts = np.unique(positions, return_index=True)
    reduce = np.add if first.add else np.bitwise_xor
    merged = reduce.reduceat(operands, starts, dtype=operands.dtype)  # wraps: two's complement addition
    keep = merged != 0
    return Change(first.add, unique[keep].astype(np.int64, copy=False), merged[keep])
