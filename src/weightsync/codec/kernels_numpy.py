"""The codec's loop primitives in numpy: the reference the C kernels are tested against (codec/kernels.py).

Several passes and temporaries per primitive, and the small ones hold the GIL; what they
compute is the definition. Pure and thread-safe; writes go only to the target a caller passes.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np

from weightsync.codec.dtypes import SIGNED, UINT
from weightsync.codec.kernel_ops import GAP_PLANES, OP_SET, OP_SUB, OP_XOR, Lanes, Sums


class ReferenceKernels:
    """The numpy implementation: the definition the C kernels are tested against."""

    name = "reference"

    def unzigzag(self, z: np.ndarray) -> np.ndarray:
        """See :class:`Kernels`."""
        return unzigzag(z)

    def count_changed(self, base: np.ndarray, new: np.ndarray, width: int) -> int:
        """See :class:`Kernels`."""
        return int(np.count_nonzero(base.view(UINT[width]) != new.view(UINT[width])))

    def encode_sparse(
        self, base: np.ndarray, new: np.ndarray, width: int, add: bool, cap: int
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """See :class:`Kernels`."""
        old_v, new_v = base.view(UINT[width]), new.view(UINT[width])
        changed = old_v != new_v  # nonzero() over a bool mask is several times faster than over ints
        if np.count_nonzero(changed) > cap:
            return None
        positions = np.flatnonzero(changed)
        gaps = np.diff(positions, prepend=-1)
        gaps -= 1
        values = _delta_values(old_v[positions], new_v[positions], add)
        return self.split_planes(gaps.astype("<u4").view(np.uint8), GAP_PLANES), self.split_planes(
            values.view(np.uint8), width
        )

    def encode_dense(self, base: np.ndarray, new: np.ndarray, width: int, add: bool) -> np.ndarray:
        """See :class:`Kernels`."""
        values = _delta_values(base.view(UINT[width]), new.view(UINT[width]), add)
        return self.split_planes(values.view(np.uint8), width)

    def split_planes(self, data: np.ndarray, width: int) -> np.ndarray:
        """See :class:`Kernels`."""
        return np.ascontiguousarray(data.reshape(-1, width).T)

    def join_planes(self, planes: Sequence[np.ndarray], width: int) -> np.ndarray:
        """See :class:`Kernels`."""
        if width == 1:
            return np.array(planes[0], dtype=np.uint8, copy=True)
        return np.ascontiguousarray(np.stack(planes, axis=1)).reshape(-1)

    def apply_dense(self, target: np.ndarray, width: int, op: int, planes: Sequence[np.ndarray]) -> None:
        """See :class:`Kernels`."""
        view = target.view(UINT[width])
        values = self.join_planes(planes, width).view(UINT[width])
        _apply(view, values, op, None)

    def apply_sparse(
        self,
        target: np.ndarray,
        width: int,
        op: int,
        count: int,
        gaps: Sequence[np.ndarray],
        values: Sequence[np.ndarray],
    ) -> bool:
        """See :class:`Kernels`."""
        positions = self.gap_positions(count, gaps)
        if count and positions[-1] >= len(target) // width:
            return False
        _apply(target.view(UINT[width]), self.join_planes(values, width).view(UINT[width]), op, positions)
        return True

    def memory_views(self, addresses: Sequence[int], lengths: Sequence[int]) -> list[np.ndarray]:
        """See :class:`Kernels`."""
        if len(addresses) != len(lengths):
            raise ValueError("one length per address")
        out = []
        for i, (address, length) in enumerate(zip(addresses, lengths, strict=True)):
            if length < 0 or (address == 0 and length > 0):
                raise ValueError(f"span {i}: no memory of {length} bytes at address {address}")
            if not length:
                out.append(np.zeros(0, dtype=np.uint8))
                continue
            out.append(np.frombuffer(memoryview((ctypes.c_uint8 * length).from_address(address)), dtype=np.uint8))
        return out

    def same_spans(self, a: np.ndarray, b: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """See :class:`Kernels`."""
        if not len(a) == len(b) == len(lengths):
            raise ValueError("same_spans: three u64 buffers of one length")
        spans = zip(a.tolist(), b.tolist(), lengths.tolist(), strict=True)
        return np.array(
            [not n or ctypes.string_at(x, n) == ctypes.string_at(y, n) for x, y, n in spans], dtype=np.bool_
        )

    def gap_positions(self, count: int, gaps: Sequence[np.ndarray]) -> np.ndarray:
        """See :class:`Kernels`."""
        g = self.join_planes(gaps, GAP_PLANES).view("<u4")
        positions = np.cumsum(g, dtype=np.int64)
        positions += np.arange(0, count, dtype=np.int64)
        return positions

    def piece_changes(
        self,
        count: int,
        gaps: Sequence[np.ndarray],
        values: Sequence[np.ndarray],
        width: int,
        add: bool,
        bounds: np.ndarray,
        offsets: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """See :class:`Kernels`."""
        bounds = np.asarray(bounds, dtype=np.int64)
        offsets = np.asarray(offsets, dtype=np.int64)
        if bounds.ndim != 1 or not len(bounds) or bounds[0] != 0 or np.any(bounds[1:] < bounds[:-1]):
            raise ValueError("bounds must ascend from 0")
        if len(offsets) != len(bounds):
            raise ValueError("one offset per bound")
        positions = self.gap_positions(count, gaps)
        end = int(positions[-1]) + 1 if count else 0
        piece = np.searchsorted(bounds, positions, side="right") - 1
        positions += (offsets - bounds)[piece]
        joined = self.join_planes(values, width).view(UINT[width])
        operands = unzigzag(joined) if add else joined
        cuts = np.searchsorted(piece, np.arange(len(bounds)), side="left").astype(np.int64)
        return positions, operands, cuts, end

    def gap_cuts(
        self, count: int, gaps: Sequence[np.ndarray], bounds: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """See :class:`Kernels`."""
        positions = self.gap_positions(count, gaps)
        cuts = np.searchsorted(positions, bounds).astype(np.int64)
        firsts = np.full(len(cuts), -1, dtype=np.int64)
        has = cuts < count
        firsts[has] = positions[cuts[has]]
        return cuts, firsts, int(positions[-1]) + 1 if count else 0

    def encode_sparse_sums(
        self,
        bases: Sequence[np.ndarray],
        news: Sequence[np.ndarray],
        starts: Sequence[int],
        width: int,
        add: bool,
        cap: int,
        *,
        before: bool,
        after: bool,
        scratch: np.ndarray | None = None,
        keep: bool = False,
    ) -> tuple[np.ndarray, np.ndarray, list[Sums]] | None:
        """See :class:`Kernels` (`scratch` is not used; `keep` copies each new piece over its base after coding)."""
        found = self.encode_sparse(_joined(bases), _joined(news), width, add, cap)
        if found is None:
            return None
        sums = [
            Sums(_sum(b, width, s) if before else None, _sum(n, width, s) if after else None)
            for b, n, s in zip(bases, news, starts, strict=True)
        ]
        if keep:
            _keep(bases, news)
        return found[0], found[1], sums

    def encode_dense_sums(
        self,
        bases: Sequence[np.ndarray],
        news: Sequence[np.ndarray],
        starts: Sequence[int],
        width: int,
        add: bool,
        *,
        before: bool,
        after: bool,
        scratch: np.ndarray | None = None,
        keep: bool = False,
    ) -> tuple[np.ndarray, list[Sums]]:
        """See :class:`Kernels` (`scratch` is not used; `keep` copies each new piece over its base after coding)."""
        sums = [
            Sums(_sum(b, width, s) if before else None, _sum(n, width, s) if after else None)
            for b, n, s in zip(bases, news, starts, strict=True)
        ]
        planes = self.encode_dense(_joined(bases), _joined(news), width, add)
        if keep:
            _keep(bases, news)
        return planes, sums

    def apply_sparse_sums(
        self,
        targets: Sequence[np.ndarray],
        starts: Sequence[int],
        width: int,
        op: int,
        count: int,
        gaps: Sequence[np.ndarray],
        values: Sequence[np.ndarray],
        *,
        before: bool,
        after: bool,
    ) -> list[Sums] | None:
        """See :class:`Kernels`."""
        positions = self.gap_positions(count, gaps)
        bounds = np.cumsum([0] + [len(t) // width for t in targets])
        if count and positions[-1] >= bounds[-1]:
            return None
        firsts = [_sum(t, width, s) if before else None for t, s in zip(targets, starts, strict=True)]
        joined = self.join_planes(values, width).view(UINT[width])
        cuts = np.searchsorted(positions, bounds)
        for t, lo, k0, k1 in zip(targets, bounds, cuts, cuts[1:], strict=False):
            _apply(t.view(UINT[width]), joined[k0:k1], op, positions[k0:k1] - lo)
        return [Sums(b, _sum(t, width, s) if after else None) for t, s, b in zip(targets, starts, firsts, strict=True)]

    def apply_dense_sums(
        self,
        targets: Sequence[np.ndarray],
        starts: Sequence[int],
        width: int,
        op: int,
        planes: Sequence[np.ndarray],
        *,
        before: bool,
        after: bool,
    ) -> list[Sums]:
        """See :class:`Kernels`."""
        firsts = [_sum(t, width, s) if before else None for t, s in zip(targets, starts, strict=True)]
        lo = 0
        for t in targets:
            hi = lo + len(t) // width
            self.apply_dense(t, width, op, [p[lo:hi] for p in planes])
            lo = hi
        return [Sums(b, _sum(t, width, s) if after else None) for t, s, b in zip(targets, starts, firsts, strict=True)]


def _joined(pieces: Sequence[np.ndarray]) -> np.ndarray:
    """The concatenation of a frame's pieces (a copy: the reference does not mind)."""
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.uint8)


def _sum(data: np.ndarray, width: int, start: int) -> Lanes:
    """The checksum lanes of a piece by the definition (codec/checksum.py; imported late: it imports this module)."""
    from weightsync.codec.checksum import reference_sum

    return reference_sum(data, width, start=start).lanes


def zigzag(d: np.ndarray) -> np.ndarray:
    """Map wrapping differences to unsigned so small magnitudes of either sign are small: 0,-1,1,-2 → 0,1,2,3."""
    signed: np.ndarray = d.view(SIGNED[d.itemsize])
    out: np.ndarray = ((signed << 1) ^ (signed >> (8 * d.itemsize - 1))).view(d.dtype)
    return out


def unzigzag(z: np.ndarray) -> np.ndarray:
    """Inverse of `zigzag`, as wrapping unsigned differences."""
    out: np.ndarray = (z >> 1) ^ -(z & 1)  # unsigned negation wraps: 0 or all ones
    return out


def _delta_values(old: np.ndarray, new: np.ndarray, add: bool) -> np.ndarray:
    return zigzag(new - old) if add else np.bitwise_xor(old, new)


def _apply(view: np.ndarray, values: np.ndarray, op: int, positions: np.ndarray | None) -> None:
    if op == OP_SET:
        if positions is None:
            view[:] = values
        else:
            view[positions] = values
        return
    if op == OP_XOR:
        if positions is None:
            np.bitwise_xor(view, values, out=view)
        else:
            view[positions] ^= values
        return
    diff = unzigzag(values)
    if op == OP_SUB:
        diff = np.zeros_like(diff) - diff
    if positions is None:
        np.add(view, diff, out=view)
    else:
        view[positions] += diff


def _keep(bases: Sequence[np.ndarray], news: Sequence[np.ndarray]) -> None:
    """Each new piece copied over its base (what `keep` asks: the bases become the new bytes)."""
    for b, n in zip(bases, news, strict=True):
        np.copyto(b, n)
