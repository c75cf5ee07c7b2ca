"""Strict parsing of safetensors headers, without torch (docs/FORMAT.md §2).

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON,
then the tensor data. weightsync reproduces files byte for byte, so the header
is kept verbatim; this module only learns where each tensor lies.
"""

from __future__ import annotations

import json
import struct
from collections import Counter
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np

from weightsync.codec.dtypes import DType, by_name
from weightsync.errors import SafetensorsError, UnsupportedDtype

MAX_HEADER = 100_000_000  # the safetensors reference implementation's own cap
MAX_TENSORS = 1_000_000
_U64 = (1 << 64) - 1  # the reference reads shapes, offsets and sizes as 64-bit integers


@dataclass(frozen=True)
class TensorSpan:
    """One tensor of a safetensors file: name, dtype, shape, absolute byte range."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class SafetensorsLayout:
    """Where a safetensors file's header and tensors lie, validated."""

    header_len: int
    """Bytes before the data region: the 8-byte length plus the JSON header."""
    tensors: tuple[TensorSpan, ...]
    """In file order."""
    metadata: dict[str, str] | None


def header_length(prefix: bytes, file_size: int) -> int:
    """From the first 8 bytes, the total header length (8 + N); SafetensorsError if it cannot fit the file."""
    if file_size == 0:
        raise SafetensorsError("the file is empty (0 bytes)")
    if file_size < 8 or len(prefix) < 8:
        raise SafetensorsError(f"the file has {file_size} bytes, fewer than the 8-byte header length")
    n: int = struct.unpack("<Q", prefix[:8])[0]
    if n > MAX_HEADER:
        raise SafetensorsError(f"header length {n} ({n:#x}) is over the {MAX_HEADER:,}-byte cap")
    if n < 2:
        raise SafetensorsError(f"header length {n} is too short for a JSON object")
    if 8 + n > file_size:
        raise SafetensorsError(f"the header ends at byte {8 + n} but the file has {file_size} bytes")
    return 8 + n


def parse_file(data: bytes | np.ndarray) -> SafetensorsLayout:
    """Validate a whole file given as bytes or a uint8 array; only its header bytes are read."""
    size = len(data)
    total = header_length(bytes(data[:8]), size)
    return parse(bytes(data[:total]), size)


def parse(header: bytes, file_size: int) -> SafetensorsLayout:
    """Validate `header` (the first 8+N bytes) against `file_size`, the one place every bound is checked.

    Tensors must cover the data region exactly, in order, without holes or
    overlaps, each exactly as long as its dtype and shape require. Each
    failure is a one-line SafetensorsError naming the defect and where it is.
    """
    total = header_length(header, file_size)
    if len(header) < total:
        raise SafetensorsError("header is truncated")
    doc = _json_object(header[8:total])
    metadata = doc.pop("__metadata__", None)
    if metadata is not None and (
        not isinstance(metadata, dict)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        raise SafetensorsError("__metadata__ must map strings to strings")
    if len(doc) > MAX_TENSORS:
        raise SafetensorsError(f"more than {MAX_TENSORS} tensors")
    spans = [_span(name, info, total) for name, info in doc.items()]
    spans.sort(key=lambda s: (s.start, s.end))
    _check_tiling(spans, total, file_size)
    return SafetensorsLayout(total, tuple(spans), metadata)


def _json_object(raw: bytes) -> dict[str, Any]:
    """The header's JSON object: strict JSON (no NaN, no duplicate keys), UTF-8, starting with "{"."""
    if not raw.startswith(b"{"):
        raise SafetensorsError("header is not a JSON object")
    try:
        doc = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError) as exc:
        raise SafetensorsError(f"header is not valid JSON: {exc}") from None
    except RecursionError:  # "{"a":{"a":… nests deeper than the parser's stack
        raise SafetensorsError("header JSON nests too deeply") from None
    if not isinstance(doc, dict):
        raise SafetensorsError("header is not a JSON object")
    return doc


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object without repeated keys: readers disagree on them (the reference refuses a repeated field)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        repeated = next(key for key, n in Counter(key for key, _ in pairs).items() if n > 1)
        raise SafetensorsError(f"header repeats the key {repeated!r}")
    return out


def _no_constant(name: str) -> NoReturn:
    raise SafetensorsError(f"header is not valid JSON: {name} is not a JSON value")


def _span(name: str, info: Any, total: int) -> TensorSpan:
    """One header entry checked on its own: dtype, shape, offsets, and a length that matches them."""
    if not isinstance(info, dict):
        raise SafetensorsError(f"tensor {name!r}: entry is not an object")
    try:
        dtype = by_name(str(info.get("dtype")))
    except UnsupportedDtype as exc:
        raise SafetensorsError(f"tensor {name!r}: {exc}") from None
    shape = info.get("shape")
    offsets = info.get("data_offsets")
    if not isinstance(shape, list) or not all(type(d) is int and 0 <= d <= _U64 for d in shape):
        raise SafetensorsError(f"tensor {name!r}: shape {shape!r} is not a list of non-negative 64-bit integers")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int and 0 <= o <= _U64 for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise SafetensorsError(f"tensor {name!r}: data_offsets {offsets!r} are not [begin, end] with begin <= end")
    nbytes = tensor_nbytes(name, dtype, shape)
    if offsets[1] - offsets[0] != nbytes:
        raise SafetensorsError(
            f"tensor {name!r}: {dtype.name} {shape} needs {nbytes} bytes but data_offsets {offsets} hold "
            f"{offsets[1] - offsets[0]}"
        )
    return TensorSpan(name, dtype, tuple(shape), total + offsets[0], total + offsets[1])


def tensor_nbytes(name: str, dtype: DType, shape: list[int] | tuple[int, ...]) -> int:
    """Bytes a tensor of `shape` needs, computed as the reference does: elements, then bits, each within 64 bits.

    The element count is checked at every step (a 0 after an overflow does not
    save it), so this parser and the reference accept the same shapes. SafetensorsError
    names tensor `name` when they do not fit.
    """
    count = 1
    for dim in shape:
        count *= dim
        if not (0 <= dim <= _U64 and count <= _U64):
            raise SafetensorsError(f"tensor {name!r}: {dtype.name} {list(shape)} overflows 64 bits")
    bits = count * dtype.bits
    if bits > _U64:
        raise SafetensorsError(f"tensor {name!r}: {dtype.name} {list(shape)} overflows 64 bits")
    if bits % 8:
        raise SafetensorsError(f"tensor {name!r}: {count} elements of {dtype.name} do not fill whole bytes")
    return bits // 8


def _check_tiling(spans: list[TensorSpan], total: int, file_size: int) -> None:
    """Sorted `spans` must tile bytes [total, file_size) exactly: nothing past the end, no overlap, no gap."""
    past = next((s for s in spans if s.end > file_size), None)
    if past is not None:
        raise SafetensorsError(f"tensor {past.name!r} ends at byte {past.end} but the file has {file_size} bytes")
    cursor, previous = total, None
    for span in spans:
        if span.start < cursor:
            assert previous is not None  # the first span starts at or after the header
            raise SafetensorsError(
                f"tensor {span.name!r} starts at byte {span.start}, inside tensor {previous.name!r} "
                f"[{previous.start}, {previous.end})"
            )
        if span.start > cursor:
            after = f"after tensor {previous.name!r}" if previous else "after the header"
            raise SafetensorsError(f"bytes [{cursor}, {span.start}) {after} belong to no tensor")
        cursor, previous = span.end, span
    if cursor != file_size:
        raise SafetensorsError(f"bytes [{cursor}, {file_size}) at the end of the file belong to no tensor")


def serialize_header(
    tensors: list[tuple[str, str, tuple[int, ...], int]], metadata: dict[str, str] | None = None
) -> bytes:
    """The 8+N header bytes for tensors given as (name, dtype name, shape, nbytes), in data order.

    Like the reference writer, the JSON is padded with spaces so the data
    region starts 8-byte aligned.
    """
    doc: dict[str, object] = {}
    if metadata:
        doc["__metadata__"] = dict(metadata)
    offset = 0
    for name, dtype_name, shape, nbytes in tensors:
        if by_name(dtype_name).nbytes(shape) != nbytes:
            raise SafetensorsError(f"tensor {name!r}: {nbytes} bytes do not match {dtype_name}{list(shape)}")
        doc[name] = {"dtype": dtype_name, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    body = json.dumps(doc, separators=(",", ":")).encode()
    body += b" " * (-(8 + len(body)) % 8)
    return struct.pack("<Q", len(body)) + body


def serialize(tensors: list[tuple[str, str, tuple[int, ...], bytes]], metadata: dict[str, str] | None = None) -> bytes:
    """A whole safetensors file from (name, dtype name, shape, raw bytes) tuples."""
    header = serialize_header([(n, d, s, len(b)) for n, d, s, b in tensors], metadata)
    return header + b"".join(bytes(b) for _, _, _, b in tensors)
