"""The tensor checksum of FORMAT v2 (docs/FORMAT.md §10): a position-weighted sum that CPU and GPU agree on.

For a tensor of n elements of width W bytes, split every element into L words (bytes
when W = 1, else L = W/2 little-endian u16) and keep one 64-bit lane per word index h:

    lane[h] = Σ_i (word(i, h) + C) · (2·(start + i) + 1)   mod 2^64,   C = 0x9E3779B97F4A7C15

The checksum is (n, lane[0..L-1]). What it guarantees (FORMAT §10.3 has the proofs): any
change of one element, any swap of two different elements among the first 2^48, and any
change of the element count are detected. It is linear, so the checksum of any split of
a tensor's elements is the sum of its parts' checksums, each taken at its own `start`
(:meth:`TensorSum.__add__`): fused parameters, tensor-parallel slices and chunks are
checked piecewise. It is not a hash: crafted changes of several elements can cancel;
storage keeps SHA-256 and frames keep xxh3-128.

Three implementations give the same value: :func:`reference_sum` (numpy, the definition),
the C kernel (:func:`tensor_sum`, GIL released, threads over parts) and
`weightsync.devsum` (torch, any device).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from weightsync.codec import kernels
from weightsync.errors import InvalidArgument

CONSTANT = 0x9E3779B97F4A7C15
"""C: added to every word so zero elements still weigh, and a part placed at the wrong position changes the sum."""
MASK = (1 << 64) - 1
WIDTHS = (1, 2, 4, 8)
MAX_ELEMENTS = 1 << 48
"""Swaps are guaranteed detected between positions closer than this (FORMAT §10.3)."""
_REFERENCE_CHUNK = 1 << 20  # elements per step of the numpy reference: bounds its scratch memory


def lanes_of(width: int) -> int:
    """Lanes of the checksum of `width`-byte elements: 1 for 1- and 2-byte elements, else width/2."""
    if width not in WIDTHS:
        raise InvalidArgument(f"element width must be one of {WIDTHS}, got {width}")
    return max(1, width // 2)


_WIRE = {n: struct.Struct(f"<Q{n}Q") for n in {lanes_of(w) for w in WIDTHS}}
"""The wire form of a checksum (FORMAT §10.1) by its number of lanes."""


def wire_form(count: int, lanes: Sequence[int]) -> bytes:
    """A checksum's wire form (FORMAT §10.1) from its element count and lanes: :meth:`TensorSum.digest`."""
    return _WIRE[len(lanes)].pack(count, *lanes)


@dataclass(frozen=True)
class TensorSum:
    """The checksum of `count` elements of `width` bytes: `lanes` are unsigned 64-bit ints.

    Adding two sums of disjoint parts, each taken at its own start, gives the sum of
    their union; the sum of a whole tensor equals the sum of any partition of it.
    """

    width: int
    count: int
    lanes: tuple[int, ...]

    def __add__(self, other: TensorSum) -> TensorSum:
        """The checksum of the union of two disjoint parts (same width)."""
        if other.width != self.width:
            raise InvalidArgument(f"cannot combine checksums of {self.width}- and {other.width}-byte elements")
        return TensorSum(
            self.width,
            self.count + other.count,
            tuple((a + b) & MASK for a, b in zip(self.lanes, other.lanes, strict=True)),
        )

    def digest(self) -> bytes:
        """The wire form (FORMAT §10.1): u64 count, then the lanes, all little-endian."""
        return wire_form(self.count, self.lanes)

    def hex(self) -> str:
        """`digest()` as lowercase hex."""
        return self.digest().hex()

    def moved(self, delta: Sequence[int]) -> TensorSum:
        """This checksum after some elements changed, given the lanes' change (:func:`change_lanes`)."""
        if len(delta) != len(self.lanes):
            raise InvalidArgument(f"{len(delta)} lane changes for a checksum of {len(self.lanes)} lanes")
        return TensorSum(self.width, self.count, tuple((a + b) & MASK for a, b in zip(self.lanes, delta, strict=True)))

    @classmethod
    def from_digest(cls, width: int, digest: bytes) -> TensorSum:
        """Parse `digest()` bytes of a checksum of `width`-byte elements."""
        n = lanes_of(width)
        if len(digest) != 8 * (n + 1):
            raise InvalidArgument(f"a checksum of {width}-byte elements is {8 * (n + 1)} bytes, got {len(digest)}")
        count, *lanes = struct.unpack(f"<Q{n}Q", digest)
        return cls(width, count, tuple(lanes))

    @classmethod
    def empty(cls, width: int) -> TensorSum:
        """The checksum of no elements: the identity of `+`."""
        return cls(width, 0, (0,) * lanes_of(width))


def combine(parts: Iterable[TensorSum]) -> TensorSum:
    """The checksum of a tensor from its parts' checksums (each taken at its start); at least one part."""
    total: TensorSum | None = None
    for p in parts:
        total = p if total is None else total + p
    if total is None:
        raise InvalidArgument("combine needs at least one part")
    return total


def _as_bytes(data: np.ndarray | bytes | bytearray | memoryview, width: int) -> np.ndarray:
    arr = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data
    if arr.dtype != np.uint8 or arr.ndim != 1:
        raise InvalidArgument("checksums are taken over 1-D uint8 arrays of raw element bytes")
    if len(arr) % width:
        raise InvalidArgument(f"{len(arr)} bytes is not a whole number of {width}-byte elements")
    return np.ascontiguousarray(arr)


def _check_start(start: int) -> None:
    if not 0 <= start < (1 << 64):
        raise InvalidArgument(f"start must be in [0, 2^64), got {start}")


def reference_sum(data: np.ndarray | bytes | bytearray | memoryview, width: int, *, start: int = 0) -> TensorSum:
    """The checksum as numpy computes it from the definition (the normative reference, FORMAT §10.1)."""
    lanes_n = lanes_of(width)
    arr = _as_bytes(data, width)
    _check_start(start)
    words = arr if width == 1 else arr.view("<u2")
    n = len(arr) // width
    lanes = np.zeros(lanes_n, dtype=np.uint64)
    c = np.uint64(CONSTANT)
    with np.errstate(over="ignore"):  # arithmetic is mod 2^64 by definition
        for lo in range(0, n, _REFERENCE_CHUNK):
            hi = min(n, lo + _REFERENCE_CHUNK)
            u = words[lo * lanes_n : hi * lanes_n].reshape(-1, lanes_n).astype(np.uint64) + c
            pos = np.arange(lo, hi, dtype=np.uint64) + np.uint64(start)
            weights = pos * np.uint64(2) + np.uint64(1)
            lanes += (u * weights[:, None]).sum(axis=0, dtype=np.uint64)
    return TensorSum(width, n, tuple(int(x) for x in lanes))


def tensor_sum(
    data: np.ndarray | bytes | bytearray | memoryview, width: int, *, start: int = 0, threads: int = 1
) -> TensorSum:
    """The checksum of raw element bytes whose first element sits at position `start` of its tensor.

    Runs the C kernel when built (GIL released; `threads` > 1 splits large inputs across
    threads by the piecewise rule), else :func:`reference_sum`. Thread-safe.
    """
    ext = kernels.EXTENSION
    if ext is None or kernels.active() is kernels.REFERENCE:
        return reference_sum(data, width, start=start)
    lanes_of(width)
    arr = _as_bytes(data, width)
    _check_start(start)
    lanes = ext.checksum(arr, width, start, CONSTANT, max(1, threads))
    return TensorSum(width, len(arr) // width, tuple(int(x) for x in lanes))


def change_lanes(before: np.ndarray, after: np.ndarray, positions: np.ndarray, width: int) -> tuple[int, ...]:
    """How a tensor's checksum lanes move when its elements at `positions` go from `before` to `after`.

    The checksum is linear in the words (FORMAT §10.1), so the lanes move by
    Σ (after word − before word) · weight(p) over the changed elements, mod 2^64: a
    result can be checked from its verified base and the elements that changed,
    without reading the rest again. `before` and `after` hold the elements' bytes (any
    array of `width`-byte elements, as many as `positions`); positions are within
    the tensor (start 0). Work is proportional to the changed elements.
    """
    lanes_n = lanes_of(width)
    word = np.uint8 if width == 1 else np.dtype("<u2")
    b = np.ascontiguousarray(before).view(word).reshape(-1, lanes_n)
    a = np.ascontiguousarray(after).view(word).reshape(-1, lanes_n)
    if len(a) != len(b) or len(a) != len(positions):
        raise InvalidArgument("one before and one after element per position")
    with np.errstate(over="ignore"):  # mod 2^64 by definition
        weights = np.asarray(positions, dtype=np.int64) * 2 + 1
        moved = ((a.astype(np.int64) - b.astype(np.int64)) * weights[:, None]).sum(axis=0, dtype=np.int64)
    return tuple(int(x) & MASK for x in moved)


class PieceSums:
    """The checksums of a frame's pieces, taken as the frame codes them (FORMAT §10.2).

    Piece `i` starts at element ``starts[i]`` of its segment, so a segment cut across
    frames sums its frames' pieces with no ordering between them. The coder either hands
    over each piece's sums from its own pass (`take`: the fused kernels) or feeds parts of
    the pieces in order (`update`), each summed at its own position. Base bytes are summed
    only where a piece's `base` flag is set (a base checksum already known is not
    recomputed). Not thread-safe: one frame task fills one instance.
    """

    def __init__(self, width: int, starts: Sequence[int], base: Sequence[bool]) -> None:
        lanes_of(width)
        if len(starts) != len(base):
            raise InvalidArgument("one base flag per piece")
        self.width = width
        self.starts = list(starts)
        self._wants_base = list(base)
        self.new: list[TensorSum] = []
        self.base: list[TensorSum | None] = []
        self.restart()

    @property
    def wants_base(self) -> bool:
        """Whether any piece's base checksum is wanted."""
        return any(self._wants_base)

    def take(self, sizes: Sequence[int], sums: Sequence[tuple[Sequence[int] | None, Sequence[int] | None]]) -> None:
        """Set every piece's checksums from (base lanes, new lanes) pairs computed by the coder (pieces of `sizes`
        bytes); base lanes are kept where wanted."""
        new: list[TensorSum] = []
        base: list[TensorSum | None] = []
        for n, (before, after), wanted in zip(sizes, sums, self._wants_base, strict=True):
            if after is None:
                raise InvalidArgument("the coder did not sum a piece's new bytes")
            count = n // self.width
            new.append(TensorSum(self.width, count, tuple(after)))
            if not wanted:
                base.append(None)
            elif before is None:
                raise InvalidArgument("the coder did not sum a piece's base bytes")
            else:
                base.append(TensorSum(self.width, count, tuple(before)))
        self._pos = list(self.starts)
        self.new, self.base = new, base

    def restart(self) -> None:
        """Forget what was fed (a coding pass that gave up part way feeds every piece again)."""
        empty = TensorSum.empty(self.width)  # immutable: one for every piece
        self._pos = list(self.starts)
        self.new = [empty] * len(self.starts)
        self.base = [empty if b else None for b in self._wants_base]

    def update(self, i: int, base: np.ndarray, new: np.ndarray) -> None:
        """Feed the next bytes of piece `i`: `new` always, `base` when its base checksum is wanted."""
        start = self._pos[i]
        self.new[i] = self.new[i] + tensor_sum(new, self.width, start=start)
        known = self.base[i]
        if known is not None:
            self.base[i] = known + tensor_sum(base, self.width, start=start)
        self._pos[i] = start + len(new) // self.width
