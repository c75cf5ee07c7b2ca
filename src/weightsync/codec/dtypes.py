"""The dtype table of docs/FORMAT.md §3: safetensors names, wire codes and widths.

Codes are part of the format: never renumber one. Sub-byte dtypes (F4, F6_*) are
stored packed, so the codec treats their bytes as 1-byte elements (FORMAT §3).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from weightsync.errors import UnsupportedDtype


@dataclass(frozen=True)
class DType:
    """One tensor element type: its safetensors name, wire code and sizes."""

    name: str
    code: int
    bits: int
    """Bits per element as stored by safetensors (4 for F4, 6 for F6_*)."""
    float_exponent_bits: int = 0
    """Exponent width for floating dtypes of 8+ bits (used to pick byte planes)."""
    width: int = field(init=False, repr=False, compare=False)
    """Coding element width in bytes: XOR and byte planes work on this unit (max(1, bits // 8))."""

    def __post_init__(self) -> None:
        # A field, not a property: it is read per segment and per piece on every manifest parse.
        object.__setattr__(self, "width", max(1, self.bits // 8))

    @property
    def numpy_uint(self) -> np.dtype[Any]:
        """Unsigned integer numpy dtype of `width` bytes, little-endian."""
        return UINT[self.width]

    @property
    def numpy_int(self) -> np.dtype[Any]:
        """Signed integer numpy dtype of `width` bytes, little-endian (zigzag coding, FORMAT §4.5)."""
        return SIGNED[self.width]

    def nbytes(self, shape: tuple[int, ...] | list[int]) -> int:
        """Bytes a tensor of `shape` occupies; UnsupportedDtype if it packs to a partial byte."""
        count = 1
        for dim in shape:
            count *= int(dim)
        total_bits = count * self.bits
        if total_bits % 8:
            raise UnsupportedDtype(f"{count} elements of {self.name} do not fill whole bytes")
        return total_bits // 8


UINT: dict[int, np.dtype[Any]] = {1: np.dtype("<u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}
"""Unsigned little-endian numpy dtype of each element width in bytes."""
SIGNED: dict[int, np.dtype[Any]] = {1: np.dtype("<i1"), 2: np.dtype("<i2"), 4: np.dtype("<i4"), 8: np.dtype("<i8")}
"""Signed little-endian numpy dtype of each element width in bytes."""

_TABLE = (
    DType("BOOL", 1, 8),
    DType("U8", 2, 8),
    DType("I8", 3, 8),
    DType("F8_E5M2", 4, 8, 5),
    DType("F8_E4M3", 5, 8, 4),
    DType("I16", 6, 16),
    DType("U16", 7, 16),
    DType("F16", 8, 16, 5),
    DType("BF16", 9, 16, 8),
    DType("I32", 10, 32),
    DType("U32", 11, 32),
    DType("F32", 12, 32, 8),
    DType("F64", 13, 64, 11),
    DType("I64", 14, 64),
    DType("U64", 15, 64),
    DType("F8_E8M0", 16, 8, 8),
    DType("F4", 17, 4),
    DType("F6_E2M3", 18, 6),
    DType("F6_E3M2", 19, 6),
)

BY_NAME: dict[str, DType] = {d.name: d for d in _TABLE}
BY_CODE: dict[int, DType] = {d.code: d for d in _TABLE}
U8 = BY_NAME["U8"]


def by_name(name: str) -> DType:
    """The dtype called `name` in safetensors headers; UnsupportedDtype if unknown."""
    try:
        return BY_NAME[name]
    except (KeyError, TypeError):
        raise UnsupportedDtype(f"unknown dtype {name!r}") from None


def by_code(code: int) -> DType:
    """The dtype with wire code `code`; UnsupportedDtype if unknown."""
    try:
        return BY_CODE[code]
    except KeyError:
        raise UnsupportedDtype(f"unknown dtype code {code}") from None
