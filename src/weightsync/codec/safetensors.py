"""Strict parsing of safetensors headers, without torch (docs/FORMAT.md §2).

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON,
then the tensor data. weightsync reproduces files byte for byte, so the header
is kept verbatim; this module only learns where each tensor lies.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

from weightsync.codec.dtypes import DType, by_name
from weightsync.errors import SafetensorsError, UnsupportedDtype

MAX_HEADER = 100_000_000  # the safetensors reference implementation's own cap
MAX_TENSORS = 1_000_000


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
    """From the first 8 bytes, the total header length (8 + N); SafetensorsError if implausible."""
    if len(prefix) < 8 or file_size < 8:
        raise SafetensorsError("file is shorter than a safetensors header")
    n: int = struct.unpack("<Q", prefix[:8])[0]
    if n > MAX_HEADER or n + 8 > file_size:
        raise SafetensorsError(f"header length {n} does not fit the file ({file_size} bytes)")
    return 8 + n


def parse(header: bytes, file_size: int) -> SafetensorsLayout:
    """Validate `header` (the first 8+N bytes) against `file_size`, the one place every bound is checked.

    Tensors must cover the data region exactly, in order, without holes or
    overlaps, each exactly as long as its dtype and shape require.
    """
    total = header_length(header, file_size)
    if len(header) < total:
        raise SafetensorsError("header is truncated")
    raw = header[8:total]
    if not raw.startswith(b"{"):
        raise SafetensorsError("header is not a JSON object")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise SafetensorsError(f"header is not valid JSON: {exc}") from None
    except RecursionError:  # "{"a":{"a":… nests deeper than the parser's stack
        raise SafetensorsError("header JSON nests too deeply") from None
    if not isinstance(doc, dict):
        raise SafetensorsError("header is not a JSON object")
    metadata = doc.pop("__metadata__", None)
    if metadata is not None and (
        not isinstance(metadata, dict)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        raise SafetensorsError("__metadata__ must map strings to strings")
    if len(doc) > MAX_TENSORS:
        raise SafetensorsError(f"more than {MAX_TENSORS} tensors")
    spans = []
    for name, info in doc.items():
        if not isinstance(info, dict):
            raise SafetensorsError(f"tensor {name!r}: entry is not an object")
        try:
            dtype = by_name(str(info.get("dtype")))
        except UnsupportedDtype as exc:
            raise SafetensorsError(f"tensor {name!r}: {exc}") from None
        shape = info.get("shape")
        offsets = info.get("data_offsets")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise SafetensorsError(f"tensor {name!r}: bad shape")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(type(o) is int and o >= 0 for o in offsets)
            or offsets[0] > offsets[1]
        ):
            raise SafetensorsError(f"tensor {name!r}: bad data_offsets")
        try:
            nbytes = dtype.nbytes(shape)
        except UnsupportedDtype as exc:
            raise SafetensorsError(f"tensor {name!r}: {exc}") from None
        if offsets[1] - offsets[0] != nbytes:
            raise SafetensorsError(f"tensor {name!r}: {offsets[1] - offsets[0]} bytes for {nbytes} needed")
        spans.append(TensorSpan(name, dtype, tuple(shape), total + offsets[0], total + offsets[1]))
    spans.sort(key=lambda s: (s.start, s.end))
    cursor = total
    for span in spans:
        if span.start != cursor:
            raise SafetensorsError(f"tensor {span.name!r} leaves a hole or overlaps at offset {cursor - total}")
        cursor = span.end
    if cursor != file_size:
        raise SafetensorsError(f"tensors end at {cursor} but the file has {file_size} bytes")
    return SafetensorsLayout(total, tuple(spans), metadata)


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
