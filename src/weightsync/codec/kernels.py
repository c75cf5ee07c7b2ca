"""The codec's hot loops, twice: a C extension that runs outside the GIL, and the numpy reference.

Frames (docs/FORMAT.md §4) are built from a few element-wise loops: find the changed
elements, code their gaps and values as byte planes, join the planes back and apply them.
In numpy each is several passes with temporaries, and the small ones hold the GIL; the C
extension (`_kernels.c`, docs/DESIGN.md "Native core") does each in one pass with the GIL
released, so frames encode and decode on as many cores as there are threads.

Both implementations satisfy :class:`Kernels` and produce identical bytes
(tests/codec/test_kernels.py checks them against each other): the numpy reference in
`kernels_numpy`, the extension's wrapper in `kernels_native`; this module picks one.
:func:`active` returns the native one when the extension is built, else the reference,
after logging one warning;
``WEIGHTSYNC_NATIVE=0`` in the environment selects the reference (measurements, debugging);
``WEIGHTSYNC_KERNELS_PORTABLE=1`` keeps the extension but makes it skip its AVX2 loops (the
tests run the differential suite both ways).

Arrays are 1-D uint8 (raw little-endian element bytes) unless stated; a plane array is
2-D uint8 ``(planes, elements)``, one C-contiguous row per plane. Functions are pure and
thread-safe; writes go only to the target a caller passes.

The ``*_sums`` primitives fuse the tensor checksum (FORMAT §10) into the pass that codes or
applies a frame's pieces: a frame's bytes are read from memory once, not once to code and
once or twice more to checksum (docs/DESIGN.md "Native core").
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Any, Protocol

import numpy as np

from weightsync.codec.kernel_ops import GAP_PLANES as GAP_PLANES
from weightsync.codec.kernel_ops import OP_ADD as OP_ADD
from weightsync.codec.kernel_ops import OP_SET as OP_SET
from weightsync.codec.kernel_ops import OP_SUB as OP_SUB
from weightsync.codec.kernel_ops import OP_XOR as OP_XOR
from weightsync.codec.kernel_ops import Lanes as Lanes
from weightsync.codec.kernel_ops import Sums as Sums
from weightsync.codec.kernels_native import NativeKernels
from weightsync.codec.kernels_numpy import ReferenceKernels
from weightsync.codec.kernels_numpy import zigzag as zigzag

log = logging.getLogger(__name__)


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

    def unzigzag(self, z: np.ndarray) -> np.ndarray:
        """The wrapping differences (a new unsigned array of `z`'s dtype) that zigzag values `z` code."""
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
        """A delta frame's `count` gap-coded changes as the changes of the pieces it holds: (positions, operands,
        cuts, end), in one pass.

        Piece i covers frame elements [bounds[i], bounds[i + 1]) (int64, ascending from 0; the last
        runs to the frame's end) and starts at element offsets[i] of its tensor. positions (int64)
        are each change's element within its piece's tensor; operands (unsigned, `width` bytes) the
        wrapping differences to add when `add` (un-zigzagged), else the XOR masks; cuts[i] the index
        of piece i's first change. end is the last frame position + 1 (0 without changes), for the
        caller's check against the frame's length. ValueError for bounds not ascending from 0.
        """
        ...

    def memory_views(self, addresses: Sequence[int], lengths: Sequence[int]) -> list[Any]:
        """Writable 1-D byte buffers over raw memory, one per (address, length), usable as targets of the
        ``*_sums`` applies. They own nothing: the caller keeps the memory alive while they are used.
        ValueError for a negative length, or a null address with bytes."""
        ...

    def same_spans(self, a: np.ndarray, b: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """For each i, whether the `lengths[i]` bytes at raw address `a[i]` equal those at `b[i]` (a bool
        array). The three are uint64 arrays of one length; the caller keeps every span alive and in
        bounds. ValueError for arrays of different lengths."""
        ...

    def gap_cuts(
        self, count: int, gaps: Sequence[np.ndarray], bounds: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """Where gap-coded changes cross ascending element `bounds` (int64): (cuts, firsts, end).

        cuts[i] is the index of the first change at or after bounds[i] (count if none),
        firsts[i] its position (-1 if none); end is the last position + 1 (0 without changes).
        """
        ...

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
        """`encode_sparse` of the concatenated pieces, plus each piece's checksums, in one pass.

        `starts[i]` is the position of piece i's first element within its tensor (the
        checksum's start, FORMAT §10.2); `before`/`after` ask for the checksums of the base
        and of the new pieces. None above `cap` changes (no checksums then).

        `scratch`, a C-contiguous uint8 array of at least (GAP_PLANES + width, cap), may
        hold the planes (they are then views of it, valid until its next use): a thread
        coding frame after frame reuses it instead of faulting in fresh pages each time.

        `keep` (the bases writable): the bases hold the new bytes afterwards, each change
        written in the coding pass (a publisher keeping its next base); when None is returned
        (above `cap`), they hold their bytes of before.
        """
        ...

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
        """`encode_dense` of the concatenated pieces (no copy of them), plus each piece's checksums, in one pass.

        `scratch`: as for `encode_sparse_sums`, at least (width, elements). `keep`: the bases
        hold the new bytes afterwards (as for `encode_sparse_sums`).
        """
        ...

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
        """Apply `count` gap-coded changes across the concatenated `targets`, with each target's checksums.

        One pass: each block of a target is checksummed (`before`), patched and checksummed
        again (`after`) while in cache. None, with every target untouched, if a change falls
        past the targets' end.
        """
        ...

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
        """`apply_dense` across the concatenated `targets` (planes of their total length), with their checksums."""
        ...


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


def unzigzag(z: np.ndarray) -> np.ndarray:
    """Inverse of `zigzag` (wrapping unsigned differences), by the active kernels (one pass, GIL released
    when native: the subscriber's decode runs it on every added frame)."""
    return _active.unzigzag(z)


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
