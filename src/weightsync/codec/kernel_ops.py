"""What the codec's loop primitives share (docs/FORMAT.md §4.2, §10): apply operations and checksum results.

A leaf module: `kernels` (the façade), `kernels_numpy` (the reference) and `kernels_native`
(the C extension's wrapper) all use these; `kernels` re-exports them.
"""

from __future__ import annotations

from typing import NamedTuple

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

Lanes = tuple[int, ...]
"""The lanes of a tensor checksum (FORMAT §10.1), the constant's share included."""


class Sums(NamedTuple):
    """One piece's checksums, taken at its start: of its bytes before (the base) and after (new or result).

    None where the caller did not ask for that one.
    """

    before: Lanes | None
    after: Lanes | None
