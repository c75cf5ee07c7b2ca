"""HTTP ``Range`` for object downloads: one byte range (RFC 9110 §14.1.2), nothing else."""

from __future__ import annotations

__all__ = ["RangeNotSatisfiable", "parse_range"]


class RangeNotSatisfiable(ValueError):
    """The Range header is malformed, asks for several ranges, or lies outside the object."""


def _int(text: str) -> int:
    text = text.strip()
    if not text or not text.isascii() or not text.isdigit() or len(text) > 19:
        raise RangeNotSatisfiable("range bounds must be decimal integers")
    return int(text)


def parse_range(header: str, size: int) -> tuple[int, int]:
    """Return (offset, length) of ``bytes=a-b``, ``bytes=a-`` or ``bytes=-n`` in an object of ``size`` bytes.

    An end past the object is cut to its last byte (as RFC 9110 says); a start at or past
    the end, an empty suffix, several ranges, or any malformed header raise
    RangeNotSatisfiable. (RFC 9110 lets a server ignore a malformed Range, but then a
    client asking for a few bytes of a terabyte would get all of it: refusing is safer.)
    """
    unit, eq, spec = header.partition("=")
    if not eq or unit.strip().lower() != "bytes":
        raise RangeNotSatisfiable("only 'bytes=' ranges are supported")
    if "," in spec:
        raise RangeNotSatisfiable("only a single range is supported")
    first, dash, last = spec.strip().partition("-")
    if not dash:
        raise RangeNotSatisfiable("a range needs a '-'")
    if not first.strip():
        n = _int(last)
        if n == 0 or size == 0:
            raise RangeNotSatisfiable(f"suffix range of {n} bytes of a {size}-byte object")
        start = max(0, size - n)
        return start, size - start
    start = _int(first)
    end = size - 1 if not last.strip() else _int(last)
    if last.strip() and end < start:
        raise RangeNotSatisfiable("range end before its start")
    if start >= size:
        raise RangeNotSatisfiable(f"range starts at {start}, past the end of a {size}-byte object")
    end = min(end, size - 1)
    return start, end - start + 1
