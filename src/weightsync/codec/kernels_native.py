"""The codec's loop primitives in C: a thin wrapper over the `_kernels` extension (codec/kernels.py).

Each primitive is one pass with the GIL released (`_kernels.c`); this module allocates the
outputs and passes views of their rows. Thread-safe.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from types import ModuleType

import numpy as np

from weightsync.codec.kernel_ops import GAP_PLANES, Sums


def _rows(a: np.ndarray) -> list[np.ndarray]:
    """The rows of a plane array, each a contiguous buffer the C side can hold."""
    return [a[j] for j in range(a.shape[0])]


def _planes(scratch: np.ndarray | None, rows: int, columns: int) -> np.ndarray:
    """Room for `rows` planes of `columns` bytes: new (pages untouched until written) or a corner of `scratch`."""
    if scratch is None:
        return np.empty((rows, columns), dtype=np.uint8)
    if scratch.dtype != np.uint8 or scratch.ndim != 2 or not scratch.flags.c_contiguous:
        raise ValueError("scratch must be a C-contiguous 2-D uint8 array")
    if scratch.shape[0] < rows or scratch.shape[1] < columns:
        raise ValueError(f"scratch of shape {scratch.shape} is smaller than ({rows}, {columns})")
    return scratch[:rows, :columns]


@cache
def _constant() -> int:
    """The checksum's C (FORMAT §10.1), defined once in codec/checksum.py (which imports kernels: read late)."""
    from weightsync.codec.checksum import CONSTANT

    return CONSTANT


def _want(before: bool, after: bool) -> int:
    """The C side's selection of checksums: 1 before, 2 after."""
    return (1 if before else 0) | (2 if after else 0)


class NativeKernels:
    """The C implementation (`_kernels.c`): one pass per primitive, GIL released."""

    name = "native"

    def __init__(self, ext: ModuleType) -> None:
        self._ext = ext

    def count_changed(self, base: np.ndarray, new: np.ndarray, width: int) -> int:
        """See :class:`Kernels`."""
        return int(self._ext.count_changed(base, new, width))

    def encode_sparse(
        self, base: np.ndarray, new: np.ndarray, width: int, add: bool, cap: int
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """See :class:`Kernels`."""
        # Room for `cap` changes; pages past the written prefix are never touched.
        gaps = np.empty((GAP_PLANES, cap), dtype=np.uint8)
        values = np.empty((width, cap), dtype=np.uint8)
        count = int(self._ext.encode_sparse(base, new, width, add, cap, _rows(gaps), _rows(values)))
        if count > cap:
            return None
        return gaps[:, :count], values[:, :count]

    def encode_dense(self, base: np.ndarray, new: np.ndarray, width: int, add: bool) -> np.ndarray:
        """See :class:`Kernels`."""
        planes = np.empty((width, len(new) // width), dtype=np.uint8)
        self._ext.encode_dense(base, new, width, add, _rows(planes))
        return planes

    def split_planes(self, data: np.ndarray, width: int) -> np.ndarray:
        """See :class:`Kernels`."""
        planes = np.empty((width, len(data) // width), dtype=np.uint8)
        self._ext.split_planes(data, width, _rows(planes))
        return planes

    def join_planes(self, planes: Sequence[np.ndarray], width: int) -> np.ndarray:
        """See :class:`Kernels`."""
        out = np.empty(len(planes[0]) * width, dtype=np.uint8)
        self._ext.join_planes(planes, width, out)
        return out

    def unzigzag(self, z: np.ndarray) -> np.ndarray:
        """See :class:`Kernels`."""
        z = np.ascontiguousarray(z)
        out = np.empty_like(z)
        self._ext.unzigzag(z, z.itemsize, out)
        return out

    def apply_dense(self, target: np.ndarray, width: int, op: int, planes: Sequence[np.ndarray]) -> None:
        """See :class:`Kernels`."""
        self._ext.apply_dense(target, width, op, planes)

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
        return bool(self._ext.apply_sparse(target, width, op, count, gaps, values))

    def gap_positions(self, count: int, gaps: Sequence[np.ndarray]) -> np.ndarray:
        """See :class:`Kernels`."""
        out = np.empty(count, dtype=np.int64)
        self._ext.gap_positions(count, gaps, out)
        return out

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
        bounds = np.ascontiguousarray(bounds, dtype=np.int64)
        offsets = np.ascontiguousarray(offsets, dtype=np.int64)
        positions = np.empty(count, dtype=np.int64)
        operands = np.empty(count, dtype=f"<u{width}")
        cuts = np.empty_like(bounds)
        end = self._ext.piece_changes(
            count, gaps, values, width, int(add), bounds, offsets, positions, operands.view(np.uint8), cuts
        )
        return positions, operands, cuts, int(end)

    def memory_views(self, addresses: Sequence[int], lengths: Sequence[int]) -> list[memoryview]:
        """See :class:`Kernels`."""
        return list(self._ext.memory_views(addresses, lengths))

    def same_spans(self, a: np.ndarray, b: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """See :class:`Kernels`."""
        cols = [np.ascontiguousarray(x, dtype=np.uint64) for x in (a, b, lengths)]
        return np.frombuffer(self._ext.same_spans(*cols), dtype=np.bool_)

    def gap_cuts(
        self, count: int, gaps: Sequence[np.ndarray], bounds: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """See :class:`Kernels`."""
        bounds = np.ascontiguousarray(bounds, dtype=np.int64)
        cuts, firsts = np.empty_like(bounds), np.empty_like(bounds)
        end = int(self._ext.gap_cuts(count, gaps, bounds, cuts, firsts))
        return cuts, firsts, end

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
        """See :class:`Kernels`."""
        planes = _planes(scratch, GAP_PLANES + width, cap)
        gaps, values = planes[:GAP_PLANES], planes[GAP_PLANES:]
        count, sums = self._ext.encode_sparse_sums(
            bases, news, starts, width, add, cap, _rows(gaps), _rows(values), _constant(), _want(before, after), keep
        )
        if count > cap:
            return None
        return gaps[:, :count], values[:, :count], [Sums(b, a) for b, a in sums]

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
        """See :class:`Kernels`."""
        planes = _planes(scratch, width, sum(len(n) for n in news) // width)
        sums = self._ext.encode_dense_sums(
            bases, news, starts, width, add, _rows(planes), _constant(), _want(before, after), keep
        )
        return planes, [Sums(b, a) for b, a in sums]

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
        sums = self._ext.apply_sparse_sums(
            targets, starts, width, op, count, gaps, values, _constant(), _want(before, after)
        )
        return None if sums is None else [Sums(b, a) for b, a in sums]

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
        sums = self._ext.apply_dense_sums(targets, starts, width, op, planes, _constant(), _want(before, after))
        return [Sums(b, a) for b, a in sums]
