"""Frames: the codec's self-describing unit (docs/FORMAT.md §4).

A frame encodes one chunk of raw tensor bytes, either whole (a keyframe frame)
or as the XOR against the same bytes of a base version (a delta frame). Every
frame carries the xxh3-128 of the bytes it produces and, for deltas, of the
base bytes it applies to, so applying to the wrong base or decoding corrupted
bytes is an error, never silent drift (DESIGN.md invariant 4).

Functions here are pure and thread-safe; zstd contexts are kept per thread.
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass

import numpy as np
import xxhash
import zstandard

from weightsync.codec.dtypes import SIGNED, DType, by_code
from weightsync.errors import (
    BadMagic,
    BaseMismatch,
    ChecksumMismatch,
    CorruptData,
    FormatError,
    LimitExceeded,
    TruncatedInput,
    UnsupportedDtype,
    UnsupportedVersion,
)

MAGIC = b"WSFR"
VERSION = 1
FLAG_DELTA = 0x01
FLAG_ADD = 0x02  # delta values are zigzag-coded wrapping differences instead of XOR (FORMAT §4.2)
KNOWN_FLAGS = FLAG_DELTA | FLAG_ADD

# FORMAT §4.1 header: magic, version, flags, dtype code, method, raw length,
# payload length, base xxh3-128, result xxh3-128, xxh3-64 of the preceding 56 bytes.
_HEADER = struct.Struct("<4sBBBBQQ16s16sQ")
HEADER_SIZE = _HEADER.size  # 64
_SECTION = struct.Struct("<B7xQ")  # FORMAT §4.3: coding, reserved, stored length
_COUNT = struct.Struct("<Q")

METHOD_STORED = 0
METHOD_PLANES = 1
METHOD_SPARSE = 2
KNOWN_METHODS = (METHOD_STORED, METHOD_PLANES, METHOD_SPARSE)

CODING_STORED = 0
CODING_ZSTD = 1

GAP_WIDTH = 4  # gaps are u32: a frame holds at most MAX_FRAME_ELEMENTS elements
MAX_FRAME_RAW = 1 << 30  # FORMAT §8 cap: 1 GiB of decoded bytes per frame
MAX_FRAME_ELEMENTS = (1 << 32) - 1

SPARSE_MAX_DENSITY = 0.25
"""Above this fraction of changed elements, dense XOR planes beat gap coding (FORMAT §4.4)."""

ZERO_HASH = bytes(16)
DEFAULT_LEVEL = 1  # measured: level 1 codes byte planes smaller than 3 (FORMAT §4.4)


def xxh3_128(data: bytes | bytearray | memoryview | np.ndarray) -> bytes:
    """The 16-byte canonical (big-endian) xxh3-128 of a bytes-like object (an array: its contiguous bytes)."""
    return xxhash.xxh3_128_digest(data.data if isinstance(data, np.ndarray) else data)


@dataclass(frozen=True)
class FrameHeader:
    """A parsed, validated frame header (FORMAT §4.1)."""

    delta: bool
    add: bool
    dtype: DType
    method: int
    raw_len: int
    payload_len: int
    base_hash: bytes
    result_hash: bytes

    @property
    def frame_len(self) -> int:
        """Total encoded length: header plus payload."""
        return HEADER_SIZE + self.payload_len


# --- per-thread zstd contexts ----------------------------------------------------------

_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache = getattr(_local, "cctx", None)
    if cache is None:
        cache = _local.cctx = {}
    cctx = cache.get(level)
    if cctx is None:
        # Content size is written so decoders can check it before allocating (FORMAT §4.3).
        cctx = cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return cctx


def _decompressor() -> zstandard.ZstdDecompressor:
    dctx = getattr(_local, "dctx", None)
    if dctx is None:
        dctx = _local.dctx = zstandard.ZstdDecompressor()
    return dctx


# --- sections --------------------------------------------------------------------------


def _section(data: np.ndarray, level: int) -> list[bytes]:
    """Encode one byte plane: zstd when that is smaller, else stored (FORMAT §4.3)."""
    raw = data.tobytes() if not data.flags.c_contiguous else data.data.cast("B")
    if len(raw) == 0:
        return [_SECTION.pack(CODING_STORED, 0)]
    packed = _compressor(level).compress(raw)
    if len(packed) < len(raw):
        return [_SECTION.pack(CODING_ZSTD, len(packed)), packed]
    return [_SECTION.pack(CODING_STORED, len(raw)), bytes(raw)]


class _Reader:
    """Bounds-checked cursor over a frame payload."""

    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.pos = 0

    def take(self, n: int) -> memoryview:
        if n < 0 or n > len(self.buf) - self.pos:
            raise TruncatedInput(f"frame payload ends {n - (len(self.buf) - self.pos)} bytes early")
        view = self.buf[self.pos : self.pos + n]
        self.pos += n
        return view

    def section(self, expected: int) -> np.ndarray:
        """Decode the next section, which must decode to exactly `expected` bytes."""
        coding, stored_len = _SECTION.unpack(self.take(_SECTION.size))
        body = self.take(stored_len)
        if coding == CODING_STORED:
            if stored_len != expected:
                raise LimitExceeded(f"stored section holds {stored_len} bytes, expected {expected}")
            return np.frombuffer(body, dtype=np.uint8)
        if coding != CODING_ZSTD:
            raise UnsupportedVersion(f"unknown section coding {coding}")
        if expected == 0:
            raise CorruptData("zstd section where an empty one is expected")
        # Check the declared size before decompressing: max_output_size alone does not
        # stop a frame that declares its content size (FORMAT §4.3).
        try:
            declared = zstandard.frame_content_size(body)
        except zstandard.ZstdError as exc:
            raise CorruptData(f"bad zstd section: {exc}") from None
        if declared != expected:
            raise LimitExceeded(f"zstd section declares {declared} bytes, expected {expected}")
        try:
            out = _decompressor().decompress(body, max_output_size=expected, allow_extra_data=False)
        except zstandard.ZstdError as exc:
            raise CorruptData(f"zstd section does not decode: {exc}") from None
        if len(out) != expected:
            raise CorruptData(f"zstd section decodes to {len(out)} bytes, expected {expected}")
        return np.frombuffer(out, dtype=np.uint8)

    def done(self) -> None:
        if self.pos != len(self.buf):
            raise CorruptData(f"{len(self.buf) - self.pos} unexpected bytes after the last section")


# --- byte planes -----------------------------------------------------------------------


def _split_planes(values: np.ndarray, width: int) -> list[np.ndarray]:
    """Byte plane j holds byte j (little-endian) of every element (FORMAT §4.4)."""
    if width == 1:
        return [values.view(np.uint8)]
    return [(values >> (8 * j)).astype(np.uint8) for j in range(width)]


def _join_planes(planes: list[np.ndarray], dtype: np.dtype) -> np.ndarray:
    out = planes[0].astype(dtype)
    for j in range(1, len(planes)):
        out |= planes[j].astype(dtype) << (8 * j)
    return out


# --- encode ----------------------------------------------------------------------------


def _header(flags: int, dtype: DType, method: int, raw_len: int, payload_len: int,
            base_hash: bytes, result_hash: bytes) -> bytes:
    head = _HEADER.pack(MAGIC, VERSION, flags, dtype.code, method, raw_len, payload_len,
                        base_hash, result_hash, 0)[: HEADER_SIZE - 8]
    return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head))


def _check_encodable(data: np.ndarray, dtype: DType) -> None:
    if data.dtype != np.uint8 or data.ndim != 1:
        raise TypeError("frames encode 1-D uint8 arrays")
    if len(data) % dtype.width:
        raise UnsupportedDtype(f"{len(data)} bytes is not a whole number of {dtype.name} elements")
    if len(data) > MAX_FRAME_RAW:
        raise LimitExceeded(f"a frame holds at most {MAX_FRAME_RAW} bytes, got {len(data)}")


def _finish(flags: int, dtype: DType, method: int, raw_len: int, parts: list[bytes],
            base_hash: bytes, result_hash: bytes) -> bytes:
    payload_len = sum(len(p) for p in parts)
    return b"".join([_header(flags, dtype, method, raw_len, payload_len, base_hash, result_hash), *parts])


def zigzag(d: np.ndarray) -> np.ndarray:
    """Map wrapping differences to unsigned so small magnitudes of either sign are small: 0,-1,1,-2 → 0,1,2,3."""
    signed: np.ndarray = d.view(SIGNED[d.itemsize])
    out: np.ndarray = ((signed << 1) ^ (signed >> (8 * d.itemsize - 1))).view(d.dtype)
    return out


def unzigzag(z: np.ndarray) -> np.ndarray:
    """Inverse of `zigzag`, as wrapping unsigned differences."""
    out: np.ndarray = (z >> 1) ^ (np.zeros_like(z) - (z & 1))
    return out


def uses_add(dtype: DType) -> bool:
    """Whether deltas of `dtype` code differences (FORMAT §4.2): every dtype but BOOL.

    A one-ulp float change is ±1 as an integer but its XOR is 1, 3, 7, 15… depending
    on the trailing bits, so differences carry ~30 % less entropy on real steps.
    """
    return dtype.name != "BOOL"


def encode_key(data: np.ndarray, dtype: DType, *, level: int = DEFAULT_LEVEL) -> bytes:
    """Encode `data` (raw tensor bytes, 1-D uint8) as a keyframe frame.

    Byte planes split the exponent-carrying byte from the mantissa bytes so zstd's
    entropy coder sees each distribution apart; stored raw when that does not help.
    """
    _check_encodable(data, dtype)
    result_hash = xxh3_128(data)
    values = data.view(dtype.numpy_uint)
    parts: list[bytes] = []
    for plane in _split_planes(values, dtype.width):
        parts.extend(_section(plane, level))
    if sum(len(p) for p in parts) >= len(data):
        return _finish(0, dtype, METHOD_STORED, len(data), [data.tobytes()], ZERO_HASH, result_hash)
    return _finish(0, dtype, METHOD_PLANES, len(data), parts, ZERO_HASH, result_hash)


def encode_delta(base: np.ndarray, new: np.ndarray, dtype: DType, *, level: int = DEFAULT_LEVEL,
                 base_hash: bytes | None = None, result_hash: bytes | None = None,
                 add: bool | None = None) -> bytes:
    """Encode `new` element-wise against `base` (same length, 1-D uint8) as a delta frame.

    Values are wrapping differences (zigzag) or XORs, per `uses_add` unless `add` is
    given. The method follows the measured density of changed elements: gap-coded
    sparse up to SPARSE_MAX_DENSITY, dense byte planes above it (FORMAT §4.4).
    Hashes already known to the caller may be passed to avoid recomputing them.
    """
    _check_encodable(new, dtype)
    if base.shape != new.shape or base.dtype != np.uint8:
        raise LimitExceeded(f"base has {base.size} bytes, new has {new.size}")
    if len(new) // dtype.width > MAX_FRAME_ELEMENTS:
        raise LimitExceeded("too many elements for one frame")
    bh = base_hash if base_hash is not None else xxh3_128(base)
    rh = result_hash if result_hash is not None else xxh3_128(new)
    add = uses_add(dtype) if add is None else add
    flags = FLAG_DELTA | (FLAG_ADD if add else 0)
    udt = dtype.numpy_uint
    old_v, new_v = base.view(udt), new.view(udt)
    changed = old_v != new_v  # nonzero() over a bool mask is several times faster than over ints
    count = int(np.count_nonzero(changed))
    n = len(new_v)
    parts: list[bytes] = []
    if count <= SPARSE_MAX_DENSITY * n:
        positions = np.flatnonzero(changed)
        gaps = np.diff(positions, prepend=-1)
        gaps -= 1
        gaps = gaps.astype(np.uint32)
        parts.append(_COUNT.pack(count))
        for plane in _split_planes(gaps, GAP_WIDTH):
            parts.extend(_section(plane, level))
        values = _delta_values(old_v[positions], new_v[positions], add)
        for plane in _split_planes(values, dtype.width):
            parts.extend(_section(plane, level))
        method = METHOD_SPARSE
    else:
        values = _delta_values(old_v, new_v, add)
        for plane in _split_planes(values, dtype.width):
            parts.extend(_section(plane, level))
        method = METHOD_PLANES
    if sum(len(p) for p in parts) >= len(new):
        values = _delta_values(old_v, new_v, add)
        return _finish(flags, dtype, METHOD_STORED, len(new), [values.view(np.uint8).tobytes()], bh, rh)
    return _finish(flags, dtype, method, len(new), parts, bh, rh)


def _delta_values(old: np.ndarray, new: np.ndarray, add: bool) -> np.ndarray:
    return zigzag(new - old) if add else np.bitwise_xor(old, new)


def _apply_values(view: np.ndarray, values: np.ndarray, add: bool, positions: np.ndarray | None,
                  *, undo: bool = False) -> None:
    """view[positions] ∘= values, where ∘ is XOR or wrapping add (subtract when undoing)."""
    if add:
        diff = unzigzag(values)
        if undo:
            diff = np.zeros_like(diff) - diff
        if positions is None:
            np.add(view, diff, out=view)
        else:
            view[positions] += diff
    elif positions is None:
        np.bitwise_xor(view, values, out=view)
    else:
        view[positions] ^= values


# --- decode ----------------------------------------------------------------------------


def parse_header(frame: bytes | memoryview) -> FrameHeader:
    """Parse and validate a frame header: the one place every header bound is checked."""
    view = memoryview(frame)
    if len(view) < HEADER_SIZE:
        if len(view) >= 4 and bytes(view[:4]) != MAGIC:
            raise BadMagic("not a weightsync frame")
        raise TruncatedInput(f"frame header needs {HEADER_SIZE} bytes, got {len(view)}")
    magic, version, flags, code, method, raw_len, payload_len, bh, rh, check = _HEADER.unpack(
        view[:HEADER_SIZE])
    if magic != MAGIC:
        raise BadMagic("not a weightsync frame")
    if xxhash.xxh3_64_intdigest(view[: HEADER_SIZE - 8]) != check:
        raise CorruptData("frame header checksum mismatch")
    if version != VERSION:
        raise UnsupportedVersion(f"frame format version {version} (this reader knows {VERSION})")
    if flags & ~KNOWN_FLAGS:
        raise UnsupportedVersion(f"unknown frame flags 0x{flags:02x}")
    if method not in KNOWN_METHODS:
        raise UnsupportedVersion(f"unknown frame method {method}")
    dtype = by_code(code)
    delta = bool(flags & FLAG_DELTA)
    add = bool(flags & FLAG_ADD)
    if add and not delta:
        raise CorruptData("ADD flag on a keyframe frame")
    if raw_len > MAX_FRAME_RAW:
        raise LimitExceeded(f"frame declares {raw_len} bytes, cap is {MAX_FRAME_RAW}")
    if raw_len % dtype.width:
        raise CorruptData(f"frame length {raw_len} is not a whole number of {dtype.name} elements")
    if method == METHOD_SPARSE and not delta:
        raise CorruptData("sparse method in a keyframe frame")
    if not delta and bh != ZERO_HASH:
        raise CorruptData("keyframe frame with a base hash")
    if method == METHOD_STORED and payload_len != raw_len:
        raise CorruptData("stored frame whose payload length differs from its raw length")
    if len(view) - HEADER_SIZE < payload_len:
        raise TruncatedInput(f"frame payload needs {payload_len} bytes, got {len(view) - HEADER_SIZE}")
    return FrameHeader(delta, add, dtype, method, raw_len, payload_len, bh, rh)


def decode_payload(frame: bytes | memoryview, head: FrameHeader) -> tuple[np.ndarray | None, np.ndarray]:
    """Decode a frame's payload: (positions of changed elements or None when dense, values).

    `head` is `parse_header(frame)`. Values are the raw elements (keyframe) or the
    delta values (XOR, or zigzag differences when `head.add`) as unsigned integers
    of the dtype's width. Every section length is checked against the header
    before it is decompressed; only FormatError subclasses escape.
    """
    reader = _Reader(memoryview(frame)[HEADER_SIZE : HEADER_SIZE + head.payload_len])
    width = head.dtype.width
    udt = head.dtype.numpy_uint
    n = head.raw_len // width
    positions = None
    try:
        if head.method == METHOD_STORED:
            values = np.frombuffer(reader.take(head.raw_len), dtype=udt)
            reader.done()
        elif head.method == METHOD_PLANES:
            planes = [reader.section(n) for _ in range(width)]
            reader.done()
            values = _join_planes(planes, udt) if width > 1 else planes[0]
        else:
            (count,) = _COUNT.unpack(reader.take(_COUNT.size))
            if count > n:
                raise LimitExceeded(f"sparse frame declares {count} changes in {n} elements")
            gaps = _join_planes([reader.section(count) for _ in range(GAP_WIDTH)], np.dtype("<u4"))
            planes = [reader.section(count) for _ in range(width)]
            reader.done()
            positions = np.cumsum(gaps, dtype=np.int64)
            positions += np.arange(0, count, dtype=np.int64)
            if count and positions[-1] >= n:
                raise CorruptData("sparse frame position past the end of the chunk")
            values = _join_planes(planes, udt) if width > 1 else planes[0]
    except FormatError:
        raise
    except (ValueError, OverflowError, IndexError) as exc:  # defensive: malformed shapes
        raise CorruptData(f"frame does not decode: {exc}") from None
    return positions, values


def apply_frame(frame: bytes | memoryview, target: np.ndarray, *, verify_base: bool = True) -> FrameHeader:
    """Decode `frame` into `target` (1-D writable uint8 of exactly the frame's raw length).

    For a keyframe frame `target` receives the bytes. For a delta frame `target`
    must hold the base: its hash is checked first (BaseMismatch, target untouched),
    the XOR is applied in place, and the result hash is checked; on a mismatch the
    XOR is undone, so `target` again holds the base, and ChecksumMismatch is raised.
    Raises only weightsync FormatError subclasses or BaseMismatch on bad input.
    """
    head = parse_header(frame)
    if target.dtype != np.uint8 or target.ndim != 1 or len(target) != head.raw_len:
        raise LimitExceeded(f"frame decodes to {head.raw_len} bytes, target holds {target.size}")
    if head.delta and verify_base and xxh3_128(target) != head.base_hash:
        raise BaseMismatch("delta frame applied to a different base")
    positions, values = decode_payload(frame, head)
    view = target.view(head.dtype.numpy_uint)
    if head.delta:
        _apply_values(view, values, head.add, positions)
    else:
        view[:] = values
    if xxh3_128(target) != head.result_hash:
        if head.delta:
            _apply_values(view, values, head.add, positions, undo=True)
        raise ChecksumMismatch("decoded frame does not match its result checksum")
    return head


def decode_frame(frame: bytes | memoryview, base: np.ndarray | None = None) -> np.ndarray:
    """Return the bytes `frame` produces (a new array); `base` is required for deltas."""
    head = parse_header(frame)
    if head.delta:
        if base is None:
            raise BaseMismatch("delta frame needs a base")
        if len(base) != head.raw_len:
            raise BaseMismatch(f"delta frame needs a base of {head.raw_len} bytes, got {len(base)}")
        out = np.array(base, dtype=np.uint8, copy=True)
    else:
        out = np.empty(head.raw_len, dtype=np.uint8)
    apply_frame(frame, out)
    return out
