"""The codec's hot loops, twice: a C extension that runs outside the GIL, and the numpy reference.

Frames (docs/FORMAT.md §4) are built from a few element-wise loops: find the changed
elements, code their gaps and values as byte planes, join the planes back and apply them.
In numpy each is several passes with temporaries, and the small ones hold the GIL; the C
extension (`_kernels.c`, docs/DESIGN.md "Native core") does each in one pass with the GIL
released, so frames encode and decode on as many cores as there are threads.

Both implementations satisfy :class:`Kernels` and produce identical bytes
(tests/codec/test_kernels.py checks them against each other). :func:`active` returns the
native one when the extension is built, else the reference, after logging one warning;
``WEIGHTSYNC_NATIVE=0`` in the environment selects the reference (measurements, debugging).

Arrays are 1-D uint8 (raw little-endian element bytes) unless stated; a plane array is
2-D uint8 ``(planes, elements)``, one C-contiguous row per plane. Functions are pure and
thread-safe; writes go only to the target a caller passes.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Protocol

import numpy as np

from weightsync.codec.dtypes import SIGNED, UINT

log = logging.getLogger(__name__)

GAP_PLANES = 4  # gaps are u32 (FORMAT §4.2)

# Apply operations: target element ∘= value (FORMAT §4.2).
OP_SET = 0
"""Keyframe: the element becomes the value."""
OP_XOR = 1
"""XOR delta (and its own undo)."""
OP_ADD = 2
"""ADD delta: add the zigzag-decoded difference, wrapping."""
OP_SUB = 3
"""Undo of OP_ADD."""


class Kernels(Protocol):
    """The loop primitives frames are built from; `name` says which implementation this is."""

    name: str

    def count_changed(self, base: np.ndarray, new: np.ndarray, width: int) -> int:
        """Number of `width`-byte elements where `base` and `new` differ."""
        ...

    def encode_sparse(
        self, base: np.ndarray, new: np.ndarray, width: int, add: bool, cap: int
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """(gap planes (4, count), value planes (width, count)) of the changed elements, None if more than `cap`.

        Gap k is the number of unchanged elements before change k since change k-1; value k
        is zigzag(new - old) when `add`, else old ^ new (FORMAT §4.2). One pass: the count
        is found while coding. Each plane (row) is contiguous; the 2-D arrays may not be.
        """
        ...

    def encode_dense(self, base: np.ndarray, new: np.ndarray, width: int, add: bool) -> np.ndarray:
        """Value planes (width, n) of every element's delta value (FORMAT §4.2)."""
        ...

    def split_planes(self, data: np.ndarray, width: int) -> np.ndarray:
        """Byte planes (width, n) of raw elements: plane j holds byte j of every element."""
        ...

    def join_planes(self, planes: Sequence[np.ndarray], width: int) -> np.ndarray:
        """The raw element bytes (1-D uint8) whose byte planes are `planes`."""
        ...

    def apply_dense(self, target: np.ndarray, width: int, op: int, planes: Sequence[np.ndarray]) -> None:
        """target[i] ∘= value[i] for every element, the values given as `width` byte planes."""
        ...

    def apply_sparse(
        self,
        target: np.ndarray,
        width: int,
        op: int,
        count: int,
        gaps: Sequence[np.ndarray],
        values: Sequence[np.ndarray],
    ) -> bool:
        """Apply `count` gap-coded changes; False, with `target` untouched, if one falls past its end."""
        ...

    def gap_positions(self, count: int, gaps: Sequence[np.ndarray]) -> np.ndarray:
        """Element positions (int64, ascending) of `count` gap-coded changes (unchecked against a length)."""
        ...

    def gap_cuts(
        self, count: int, gaps: Sequence[np.ndarray], bounds: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """Where gap-coded changes cross ascending element `bounds` (int64): (cuts, firsts, end).

        cuts[i] is the index of the first change at or after bounds[i] (count if none),
        firsts[i] its position (-1 if none); end is the last position + 1 (0 without changes).
        """
        ...


def _rows(a: np.ndarray) -> list[np.ndarray]:
    return [a[j] for j in range(a.shape[0])]


class ReferenceKernels:
    """The numpy implementation: the definition the C kernels are tested against."""

    name = "reference"

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

    def gap_positions(self, count: int, gaps: Sequence[np.ndarray]) -> np.ndarray:
        """See :class:`Kernels`."""
        g = self.join_planes(gaps, GAP_PLANES).view("<u4")
        positions = np.cumsum(g, dtype=np.int64)
        positions += np.arange(0, count, dtype=np.int64)
        return positions

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


def zigzag(d: np.ndarray) -> np.ndarray:
    """Map wrapping differences to unsigned so small magnitudes of either sign are small: 0,-1,1,-2 → 0,1,2,3."""
    signed: np.ndarray = d.view(SIGNED[d.itemsize])
    out: np.ndarray = ((signed << 1) ^ (signed >> (8 * d.itemsize - 1))).view(d.dtype)
    return out


def unzigzag(z: np.ndarray) -> np.ndarray:
    """Inverse of `zigzag`, as wrapping unsigned differences."""
    out: np.ndarray = (z >> 1) ^ (np.zeros_like(z) - (z & 1))
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

    def gap_cuts(
        self, count: int, gaps: Sequence[np.ndarray], bounds: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """See :class:`Kernels`."""
        bounds = np.ascontiguousarray(bounds, dtype=np.int64)
        cuts, firsts = np.empty_like(bounds), np.empty_like(bounds)
        end = int(self._ext.gap_cuts(count, gaps, bounds, cuts, firsts))
        return cuts, firsts, end


REFERENCE: Kernels = ReferenceKernels()


def _load_native() -> tuple[ModuleType | None, str | None]:
    try:
        # The wrapper's own compiled half (setup.py builds it); nothing else imports it.
        from weightsync.codec import _kernels  # type: ignore[attr-defined]
    except ImportError as exc:
        return None, str(exc)
    ext: ModuleType = _kernels
    return ext, None


EXTENSION, LOAD_ERROR = _load_native()
"""The compiled module, or None with the reason in LOAD_ERROR."""
NATIVE: Kernels | None = NativeKernels(EXTENSION) if EXTENSION is not None else None
"""The C kernels, or None when the extension is not built."""

_active: Kernels
if os.environ.get("WEIGHTSYNC_NATIVE", "1") == "0":
    _active = REFERENCE
elif NATIVE is None:
    log.warning(
        "weightsync: C kernels not built (%s); the codec runs its numpy reference path, "
        "several times slower (pip install -e . with a C compiler builds them)",
        LOAD_ERROR,
    )
    _active = REFERENCE
else:
    _active = NATIVE


def active() -> Kernels:
    """The implementation the codec uses: native when built (and not disabled), else the reference."""
    return _active


@contextlib.contextmanager
def using(kernels: Kernels) -> Iterator[None]:
    """Make `kernels` the active implementation inside the block (tests and benchmarks; not thread-safe)."""
    global _active
    previous, _active = _active, kernels
    try:
        yield
    finally:
        _active = previous
