"""Frames: the codec's self-describing unit (docs/FORMAT.md §4).

A frame encodes one chunk of raw tensor bytes, either whole (a keyframe frame)
or as the XOR against the same bytes of a base version (a delta frame). A
version 1 frame carries the xxh3-128 of the bytes it produces and, for deltas,
of the base bytes it applies to, so applying to the wrong base or decoding
corrupted bytes is an error, never silent drift (DESIGN.md invariant 4). A
version 2 frame leaves those fields zero: it lives under a v2 manifest, whose
segment checksums (FORMAT §10) cover every byte it decodes, so encoding hashes
each byte once, for the manifest, and decoding checks segments, not frames.

Functions here are pure and thread-safe; zstd contexts are kept per thread. The
element loops are `kernels.active()`: C outside the GIL when built, else numpy.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import xxhash
import zstandard

from weightsync.codec import kernels
from weightsync.codec.checksum import PieceSums, TensorSum
from weightsync.codec.dtypes import DType, by_code
from weightsync.codec.kernels import OP_ADD, OP_SET, OP_SUB, OP_XOR, Sums
from weightsync.codec.kernels import unzigzag as unzigzag  # re-exported: values.py and benchmarks use them
from weightsync.codec.kernels import zigzag as zigzag
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
"""Frame format version 1: the header carries the base and result xxh3-128 (FORMAT §4.1)."""
VERSION_2 = 2
"""Frame format version 2: the header's hash fields are zero; the v2 manifest's checksums cover the bytes."""
VERSIONS = (VERSION, VERSION_2)
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

SPARSE_MAX_DENSITY = 0.5
"""Above this fraction of changed elements, dense planes beat gap coding (FORMAT §4.4). Measured: bf16
one-ulp steps cross over at ~50 % (sparse 0.67x the planes at 20 %, 0.89x at 40 %, 1.07x at 60 %);
at 25 % the grouped frames of a MoE step (busy experts together) fell to planes and grew 4 %."""

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
    version: int = VERSION

    @property
    def checked(self) -> bool:
        """Whether the frame carries its own base and result hashes (version 1), or relies on its manifest (2)."""
        return self.version == VERSION

    @property
    def frame_len(self) -> int:
        """Total encoded length: header plus payload."""
        return HEADER_SIZE + self.payload_len


# --- per-thread zstd contexts ----------------------------------------------------------

_local = threading.local()


PLANE_MATCH = {"min_match": 7, "search_log": 1, "hash_log": 6}
"""zstd's match finder for byte planes at the default level: level 1's, looking only for matches of 7
bytes or more among the last 64 positions it hashed. Byte planes of weights are near-random bytes of a
few bits of entropy (deltas) or a sign and exponent byte (keyframes): the short matches level 1 finds in
them cost more to code and to decode than the literals they replace. Measured on the corpus's bf16 steps
and keyframes (45 MB and the 436 MB MoE): delta sections 2-3 % smaller, decoded 6-10 % and coded
16-27 % faster; the keyframes' high byte planes 7-8 % smaller, decoded ~45 % and coded ~60 % faster.
Only the encoder's choice: any zstd frame is a valid section (FORMAT §4.3)."""


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache = getattr(_local, "cctx", None)
    if cache is None:
        cache = _local.cctx = {}
    cctx = cache.get(level)
    if cctx is None:
        # Content size is written so decoders can check it before allocating (FORMAT §4.3).
        if level == DEFAULT_LEVEL:
            params = zstandard.ZstdCompressionParameters.from_level(level, write_content_size=True, **PLANE_MATCH)
            cctx = zstandard.ZstdCompressor(compression_params=params)
        else:
            cctx = zstandard.ZstdCompressor(level=level, write_content_size=True)
        cache[level] = cctx
    return cctx


_SCRATCH_MAX = 64 << 20
"""Bytes of planes a thread keeps between frames (24-40 MiB for the default 16 MiB frames, of which only the
columns a frame's changes fill are ever touched, so resident); larger ones are not kept."""


def _scratch(rows: int, columns: int) -> np.ndarray:
    """This thread's room for `rows` byte planes of `columns` bytes, reused frame after frame.

    The sparse coder writes only the first of its `cap` columns of each plane; planes allocated
    afresh for each frame (several MB, for which numpy asks for huge pages) had the kernel zero a
    2 MiB page at each plane's first write: ~12 MB for a 4 MiB frame of 2-byte elements. What a
    frame's coding takes from it is consumed before the thread codes another frame (its sections
    are compressed copies). Each coding thread keeps up to _SCRATCH_MAX bytes; a frame that needs
    more (a larger ``chunk_bytes``) gets planes of its own."""
    if rows * columns > _SCRATCH_MAX:
        return np.empty((rows, columns), dtype=np.uint8)
    buf = getattr(_local, "scratch", None)
    if buf is None or buf.shape[0] < rows or buf.shape[1] < columns:
        rows = max(rows, buf.shape[0] if buf is not None else 0)
        columns = max(columns, buf.shape[1] if buf is not None else 0)
        buf = _local.scratch = np.empty((rows, columns), dtype=np.uint8)
    return buf


def _decompressor() -> zstandard.ZstdDecompressor:
    dctx = getattr(_local, "dctx", None)
    if dctx is None:
        dctx = _local.dctx = zstandard.ZstdDecompressor()
    return dctx


# --- sections --------------------------------------------------------------------------


LITERALS_MIN_BITS = 1.6
"""A value plane coded as literals alone (:func:`_literals`) at fewer bits per byte than this is coded with the
match finder too, and the smaller kept: so skewed a plane (most bytes one value) is where runs and matches beat
Huffman's floor of one bit per byte (the 436 MB MoE step's high value plane: 0.04 bits per byte with matches, 0.9
with literals alone)."""


def _literals_context() -> tuple[Any, Any, Any] | None:
    """This thread's zstd context coding literals only, or None where the zstd build offers none.

    A low value plane of a delta (the low byte of a bf16 step's differences: ±1 ulp for 81 % of
    its changes) is near-random bytes of a few bits each. Even the narrow match finder of
    PLANE_MATCH finds short matches in it, which cost more to decode than the literals they
    replace: on the 436 MB MoE step this plane took 12 ms of the apply's 25 ms of zstd on one core.
    zstd's fast strategy with a large target length finds almost none; with literal compression
    forced on (zstd leaves it off for such settings by default) the plane is Huffman-coded literals:
    6 % smaller, decoded ~1.7x and coded ~2.5x faster (docs/SCALE-RUNS.md run AR). python-zstandard
    exposes that parameter only through its cffi binding of the same bundled zstd (``zstandard._cffi``,
    present where ``cffi`` is installed); without it planes keep PLANE_MATCH's coding. Either way the
    section is an ordinary zstd frame: any reader decodes it (FORMAT §4.3)."""
    state = getattr(_local, "literals", None)
    if state is None:
        state = _local.literals = (_new_literals_context(),)
    return state[0]


def _new_literals_context() -> tuple[Any, Any, Any] | None:
    """(the binding's lib, its ffi, a context set up as :func:`_literals_context` says), or None."""
    try:
        from zstandard import _cffi  # type: ignore[attr-defined]  # the cffi backend's binding (needs cffi)
    except ImportError:
        return None
    lib, ffi = _cffi.lib, _cffi.ffi
    settings = (
        ("ZSTD_c_compressionLevel", DEFAULT_LEVEL),
        ("ZSTD_c_strategy", 1),  # ZSTD_fast
        ("ZSTD_c_hashLog", 6),
        ("ZSTD_c_searchLog", 1),
        ("ZSTD_c_minMatch", 7),
        ("ZSTD_c_targetLength", 4096),  # the fast strategy's stride: it skips ahead, finding almost no match
        ("ZSTD_c_literalCompressionMode", 1),  # ZSTD_ps_enable: Huffman-coded literals all the same
        ("ZSTD_c_contentSizeFlag", 1),  # decoders check the size before allocating (FORMAT §4.3)
    )
    cctx = ffi.gc(lib.ZSTD_createCCtx(), lib.ZSTD_freeCCtx)
    for name, value in settings:
        param = getattr(lib, name, None)
        if param is None or lib.ZSTD_isError(lib.ZSTD_CCtx_setParameter(cctx, param, value)):
            return None
    return (lib, ffi, cctx)


def _literals(raw: memoryview | bytes) -> bytes | None:
    """`raw` as one zstd frame of Huffman-coded literals (:func:`_literals_context`); None where unavailable."""
    context = _literals_context()
    if context is None:
        return None
    lib, ffi, cctx = context
    bound = lib.ZSTD_compressBound(len(raw))
    out = getattr(_local, "literals_out", None)
    if out is None or len(out) < bound:  # this thread's output room (its largest plane yet), reused plane after plane
        out = _local.literals_out = bytearray(bound)
    n = lib.ZSTD_compress2(cctx, ffi.from_buffer(out), bound, ffi.from_buffer(raw), len(raw))
    if lib.ZSTD_isError(n):
        return None
    return bytes(memoryview(out)[:n])


def _section(data: np.ndarray, level: int, literals: bool = False) -> list[bytes]:
    """Encode one byte plane: zstd when that is smaller, else stored (FORMAT §4.3).

    `literals` (a delta's value plane below its top byte, at the default level): Huffman-coded
    literals without matches where the zstd build allows (:func:`_literals_context`), unless that
    comes out below LITERALS_MIN_BITS per byte and the match finder's coding is smaller."""
    raw = data.tobytes() if not data.flags.c_contiguous else data.data.cast("B")
    if len(raw) == 0:
        return [_SECTION.pack(CODING_STORED, 0)]
    packed = _literals(raw) if literals and level == DEFAULT_LEVEL else None
    if packed is None or len(packed) * 8 < LITERALS_MIN_BITS * len(raw):
        matched = _compressor(level).compress(raw)
        if packed is None or len(matched) < len(packed):
            packed = matched
    if len(packed) < len(raw):
        return [_SECTION.pack(CODING_ZSTD, len(packed)), packed]
    return [_SECTION.pack(CODING_STORED, len(raw)), bytes(raw)]


def _value_sections(planes: Iterable[np.ndarray] | np.ndarray, width: int, level: int) -> list[bytes]:
    """A delta's value planes (`width` of them, low byte first) as sections: those below the top byte as literals."""
    parts: list[bytes] = []
    for j, plane in enumerate(planes):
        parts.extend(_section(plane, level, literals=j < width - 1))
    return parts


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


# --- encode ----------------------------------------------------------------------------


def _header(
    version: int,
    flags: int,
    dtype: DType,
    method: int,
    raw_len: int,
    payload_len: int,
    base_hash: bytes,
    result_hash: bytes,
) -> bytes:
    head = _HEADER.pack(MAGIC, version, flags, dtype.code, method, raw_len, payload_len, base_hash, result_hash, 0)[
        : HEADER_SIZE - 8
    ]
    return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head))


def _check_encodable(data: np.ndarray, dtype: DType) -> None:
    if data.dtype != np.uint8 or data.ndim != 1:
        raise TypeError("frames encode 1-D uint8 arrays")
    if len(data) % dtype.width:
        raise UnsupportedDtype(f"{len(data)} bytes is not a whole number of {dtype.name} elements")
    if len(data) > MAX_FRAME_RAW:
        raise LimitExceeded(f"a frame holds at most {MAX_FRAME_RAW} bytes, got {len(data)}")


def _finish(
    version: int,
    flags: int,
    dtype: DType,
    method: int,
    raw_len: int,
    parts: list[bytes],
    base_hash: bytes,
    result_hash: bytes,
) -> bytes:
    payload_len = sum(len(p) for p in parts)
    if version != VERSION:  # FORMAT §4.1: a version 2 header's hash fields are zero
        base_hash = result_hash = ZERO_HASH
    head = _header(version, flags, dtype, method, raw_len, payload_len, base_hash, result_hash)
    return b"".join([head, *parts])


def _check_version(version: int) -> None:
    if version not in VERSIONS:
        raise UnsupportedVersion(f"frame format version {version} (this writer knows {VERSIONS})")


def uses_add(dtype: DType) -> bool:
    """Whether deltas of `dtype` code differences (FORMAT §4.2): every dtype but BOOL.

    A one-ulp float change is ±1 as an integer but its XOR is 1, 3, 7, 15… depending
    on the trailing bits, so differences carry ~30 % less entropy on real steps.
    """
    return dtype.name != "BOOL"


def encode_key(
    data: np.ndarray,
    dtype: DType,
    *,
    level: int = DEFAULT_LEVEL,
    result_hash: bytes | None = None,
    version: int = VERSION,
) -> bytes:
    """Encode `data` (raw tensor bytes, 1-D uint8) as a keyframe frame of format `version`.

    Byte planes split the exponent-carrying byte from the mantissa bytes so zstd's
    entropy coder sees each distribution apart; stored raw when that does not help.
    `result_hash`, when the caller already knows the xxh3-128 of `data`, skips hashing it
    again; a version 2 frame hashes nothing (its manifest carries the checksum).
    """
    _check_version(version)
    _check_encodable(data, dtype)
    data = np.ascontiguousarray(data)
    if version == VERSION and result_hash is None:
        result_hash = xxh3_128(data)
    rh = result_hash or ZERO_HASH
    parts: list[bytes] = []
    for plane in _planes(data, dtype.width):
        parts.extend(_section(plane, level))
    if sum(len(p) for p in parts) >= len(data):
        return _finish(version, 0, dtype, METHOD_STORED, len(data), [data.tobytes()], ZERO_HASH, rh)
    return _finish(version, 0, dtype, METHOD_PLANES, len(data), parts, ZERO_HASH, rh)


def encode_delta(
    base: np.ndarray,
    new: np.ndarray,
    dtype: DType,
    *,
    level: int = DEFAULT_LEVEL,
    base_hash: bytes | None = None,
    result_hash: bytes | None = None,
    add: bool | None = None,
    version: int = VERSION,
) -> bytes:
    """Encode `new` element-wise against `base` (same length, 1-D uint8) as a delta frame of format `version`.

    Values are wrapping differences (zigzag) or XORs, per `uses_add` unless `add` is
    given. The method follows the measured density of changed elements: gap-coded
    sparse up to SPARSE_MAX_DENSITY, dense byte planes above it (FORMAT §4.4).
    Hashes already known to the caller may be passed to avoid recomputing them.
    """
    _check_encodable(new, dtype)
    return encode_delta_pieces(
        [base], [new], dtype, level=level, base_hash=base_hash, result_hash=result_hash, add=add, version=version
    )


def encode_delta_pieces(
    bases: Sequence[np.ndarray],
    news: Sequence[np.ndarray],
    dtype: DType,
    *,
    level: int = DEFAULT_LEVEL,
    base_hash: bytes | None = None,
    result_hash: bytes | None = None,
    add: bool | None = None,
    piece_hashes: list[tuple[bytes, bytes]] | None = None,
    version: int = VERSION,
    piece_sums: PieceSums | None = None,
    keep_base: bool = False,
) -> bytes:
    """`encode_delta` of the concatenations of `bases` and of `news` (pairwise equal lengths), without concatenating.

    A frame grouping many small tensors (FORMAT §4.5) is coded piece by piece: each
    piece is read once where it lies instead of being copied into a scratch buffer
    first. The bytes equal `encode_delta(concat(bases), concat(news))`.

    Every byte is hashed in the same pass that codes it, 512 KiB at a time while it is
    in cache. `piece_hashes`, when given (a list), receives (xxh3-128 of the new piece,
    of the base piece) for every piece, from that same pass: a caller that needs the
    pieces' hashes too (the manifest's segment hashes) does not read them again.

    A version 2 frame hashes nothing of its own; `piece_sums`, when given, is fed every
    part of every piece in the same pass instead (the manifest's checksums, FORMAT §10).

    `keep_base` (version 2; the bases writable): the bases hold the new bytes when this
    returns, each change written in the coding pass while its line is in cache (a publisher
    keeping its next base: no second pass, no copy). On an exception they may hold either.
    """
    _check_version(version)
    if version != VERSION and piece_hashes is not None:
        raise ValueError("version 2 frames carry no xxh3: pass piece_sums for the pieces' checksums")
    if keep_base and version == VERSION:
        raise ValueError("keep_base is for version 2 frames")
    if len(bases) != len(news) or not news:
        raise LimitExceeded("one base piece per new piece, at least one")
    for b, nw in zip(bases, news, strict=True):
        if b.shape != nw.shape or b.dtype != np.uint8 or nw.dtype != np.uint8 or nw.ndim != 1:
            raise LimitExceeded(f"base piece has {b.size} bytes, new piece has {nw.size}")
        if len(nw) % dtype.width:
            raise UnsupportedDtype(f"{len(nw)} bytes is not a whole number of {dtype.name} elements")
    raw_len = sum(len(nw) for nw in news)
    if raw_len > MAX_FRAME_RAW:
        raise LimitExceeded(f"a frame holds at most {MAX_FRAME_RAW} bytes, got {raw_len}")
    if raw_len // dtype.width > MAX_FRAME_ELEMENTS:
        raise LimitExceeded("too many elements for one frame")
    bases = [np.ascontiguousarray(b) for b in bases]
    news = [np.ascontiguousarray(nw) for nw in news]
    add = uses_add(dtype) if add is None else add
    flags = FLAG_DELTA | (FLAG_ADD if add else 0)
    k = kernels.active()
    width = dtype.width
    n = raw_len // width
    if version != VERSION:
        return _encode_pieces_v2(k, bases, news, dtype, level, add, piece_sums, keep_base)
    hashes = _Hashes(len(news), per_piece=piece_hashes is not None, new=result_hash is None, base=base_hash is None)
    parts: list[bytes] = []
    sparse = _sparse_pieces(k, bases, news, width, add, int(SPARSE_MAX_DENSITY * n), hashes.update)
    if sparse is not None:
        gaps, values = sparse
        parts.append(_COUNT.pack(len(gaps[0])))
        for plane in gaps:
            parts.extend(_section(plane, level))
        parts.extend(_value_sections(values, width, level))
        method = METHOD_SPARSE
        bh = base_hash if base_hash is not None else hashes.frame_base()
        rh = result_hash if result_hash is not None else hashes.frame_new()
        if piece_hashes is not None:
            piece_hashes.extend(hashes.of_pieces())
    else:
        base, new = _concat(bases), _concat(news)
        parts.extend(_value_sections(k.encode_dense(base, new, width, add), width, level))
        method = METHOD_PLANES
        bh = base_hash if base_hash is not None else _xxh3_128_pieces(bases)
        rh = result_hash if result_hash is not None else _xxh3_128_pieces(news)
        if piece_hashes is not None:
            piece_hashes.extend((xxh3_128(nw), xxh3_128(b)) for b, nw in zip(bases, news, strict=True))

    def dense() -> np.ndarray:
        return k.join_planes(list(k.encode_dense(_concat(bases), _concat(news), width, add)), width)

    return _finish_delta(VERSION, flags, dtype, method, raw_len, parts, dense, bh, rh)


def _encode_pieces_v2(
    k: kernels.Kernels,
    bases: Sequence[np.ndarray],
    news: Sequence[np.ndarray],
    dtype: DType,
    level: int,
    add: bool,
    sums: PieceSums | None,
    keep: bool = False,
) -> bytes:
    """A version 2 delta frame of the pieces: no hash of its own; `sums` filled by the coding pass itself
    (the fused kernels read each byte once for the coding and both checksums); with `keep`, that pass
    also writes the new bytes into the bases (so a STORED frame is made from the coded values, never
    from the bases again)."""
    width = dtype.width
    raw_len = sum(len(nw) for nw in news)
    flags = FLAG_DELTA | (FLAG_ADD if add else 0)
    starts = sums.starts if sums is not None else [0] * len(news)
    before, after = sums is not None and sums.wants_base, sums is not None
    parts: list[bytes] = []
    cap = int(SPARSE_MAX_DENSITY * (raw_len // width))
    sparse = k.encode_sparse_sums(
        bases,
        news,
        starts,
        width,
        add,
        cap,
        before=before,
        after=after,
        keep=keep,
        scratch=_scratch(kernels.GAP_PLANES + width, cap),
    )
    if sparse is not None:
        gaps, values, found = sparse
        count = gaps.shape[1]
        parts.append(_COUNT.pack(count))
        for plane in gaps:
            parts.extend(_section(plane, level))
        parts.extend(_value_sections(values, width, level))
        method = METHOD_SPARSE

        def dense() -> np.ndarray:  # the dense values: zero but where an element changed (XOR onto zeros)
            out = np.zeros(raw_len, dtype=np.uint8)
            k.apply_sparse(out, width, OP_XOR, count, list(gaps), list(values))
            return out
    else:
        planes, found = k.encode_dense_sums(bases, news, starts, width, add, before=before, after=after, keep=keep)
        parts.extend(_value_sections(planes, width, level))
        method = METHOD_PLANES

        def dense() -> np.ndarray:
            return k.join_planes(list(planes), width)

    if sums is not None:
        sums.take([len(nw) for nw in news], found)
    return _finish_delta(VERSION_2, flags, dtype, method, raw_len, parts, dense, ZERO_HASH, ZERO_HASH)


def changed_elements(frame: bytes | memoryview | np.ndarray) -> int | None:
    """The number of changed elements a SPARSE delta frame declares (FORMAT §4.2); None for other methods."""
    head = parse_header(frame)
    if head.method != METHOD_SPARSE:
        return None
    (count,) = _COUNT.unpack_from(_view(frame), HEADER_SIZE)
    return int(count)


def _finish_delta(
    version: int,
    flags: int,
    dtype: DType,
    method: int,
    raw_len: int,
    parts: list[bytes],
    dense: Callable[[], np.ndarray],
    bh: bytes,
    rh: bytes,
) -> bytes:
    """The delta frame of `parts`, or STORED (the dense values `dense()` gives, element by element) when
    coding did not make it smaller (FORMAT §4.4)."""
    if sum(len(p) for p in parts) >= raw_len:
        return _finish(version, flags, dtype, METHOD_STORED, raw_len, [dense().tobytes()], bh, rh)
    return _finish(version, flags, dtype, method, raw_len, parts, bh, rh)


_HOT_BYTES = 512 << 10
"""Bytes coded and hashed together: small enough to stay in a core's L2 between the passes."""


class _Hashes:
    """Streaming xxh3-128 of a frame's base and new bytes and, when asked, of each of its pieces."""

    def __init__(self, pieces: int, *, per_piece: bool, new: bool, base: bool) -> None:
        self.new = xxhash.xxh3_128() if new or (per_piece and pieces == 1) else None
        self.base = xxhash.xxh3_128() if base or (per_piece and pieces == 1) else None
        self.piece_new: list[xxhash.xxh3_128] = []
        self.piece_base: list[xxhash.xxh3_128] = []
        if per_piece and pieces > 1:
            self.piece_new = [xxhash.xxh3_128() for _ in range(pieces)]
            self.piece_base = [xxhash.xxh3_128() for _ in range(pieces)]
        elif per_piece:  # one piece: its hashes are the frame's, no second hasher
            assert self.new is not None and self.base is not None
            self.piece_new, self.piece_base = [self.new], [self.base]
        self.shared = per_piece and pieces == 1

    def update(self, i: int, base: np.ndarray, new: np.ndarray) -> None:
        """Feed the next bytes of piece `i` (pieces, and parts of a piece, in order)."""
        if self.new is not None:
            self.new.update(new.data)
        if self.base is not None:
            self.base.update(base.data)
        if self.piece_new and not self.shared:
            self.piece_new[i].update(new.data)
            self.piece_base[i].update(base.data)

    def frame_new(self) -> bytes:
        """xxh3-128 of the frame's new bytes."""
        assert self.new is not None
        return self.new.digest()

    def frame_base(self) -> bytes:
        """xxh3-128 of the frame's base bytes."""
        assert self.base is not None
        return self.base.digest()

    def of_pieces(self) -> list[tuple[bytes, bytes]]:
        """(new, base) xxh3-128 of every piece."""
        return [(n.digest(), b.digest()) for n, b in zip(self.piece_new, self.piece_base, strict=True)]


def _concat(pieces: Sequence[np.ndarray]) -> np.ndarray:
    return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)


def _xxh3_128_pieces(pieces: Sequence[np.ndarray]) -> bytes:
    if len(pieces) == 1:
        return xxh3_128(pieces[0])
    h = xxhash.xxh3_128()
    for p in pieces:
        h.update(p.data)
    return h.digest()


def _sparse_pieces(
    k: kernels.Kernels,
    bases: Sequence[np.ndarray],
    news: Sequence[np.ndarray],
    width: int,
    add: bool,
    cap: int,
    feed: Callable[[int, np.ndarray, np.ndarray], None],
) -> tuple[list[np.ndarray], list[np.ndarray]] | None:
    """Sparse planes of the concatenated pieces, or None above `cap` changes (FORMAT §4.2).

    Works through the pieces in parts of at most _HOT_BYTES, calling ``feed(piece, base
    part, new part)`` on each part right after coding it (hashes or checksums, in cache).
    Each part codes its first gap from its own start; the frame counts from its previous
    change, so that one gap is rewritten.
    """
    gap_rows: list[list[np.ndarray]] = [[] for _ in range(kernels.GAP_PLANES)]
    value_rows: list[list[np.ndarray]] = [[] for _ in range(width)]
    count = 0
    start = 0  # frame element index of the part's first element
    last = -1  # frame element index of the previous change
    for i, (piece_b, piece_n) in enumerate(zip(bases, news, strict=True)):
        for off in range(0, len(piece_n), _HOT_BYTES):
            b, nw = piece_b[off : off + _HOT_BYTES], piece_n[off : off + _HOT_BYTES]
            found = k.encode_sparse(b, nw, width, add, cap - count)
            if found is None:
                return None
            feed(i, b, nw)
            gaps, values = found
            m = gaps.shape[1]
            if m:
                local_last = int(k.gap_positions(m, list(gaps))[-1])
                if last != start - 1:
                    first = int(gaps[0, 0]) | int(gaps[1, 0]) << 8 | int(gaps[2, 0]) << 16 | int(gaps[3, 0]) << 24
                    first += start - last - 1
                    gaps = np.array(gaps, copy=True)
                    gaps[:, 0] = [(first >> (8 * j)) & 0xFF for j in range(kernels.GAP_PLANES)]
                for j in range(kernels.GAP_PLANES):
                    gap_rows[j].append(gaps[j])
                for j in range(width):
                    value_rows[j].append(values[j])
                last = start + local_last
            count += m
            start += len(nw) // width
    empty = np.zeros(0, dtype=np.uint8)
    return ([_concat(r) if r else empty for r in gap_rows], [_concat(r) if r else empty for r in value_rows])


def _planes(data: np.ndarray, width: int) -> list[np.ndarray]:
    """Byte planes of raw elements (FORMAT §4.4); one plane is the data itself."""
    if width == 1:
        return [data]
    return list(kernels.active().split_planes(data, width))


# --- decode ----------------------------------------------------------------------------


def _view(frame: bytes | memoryview | np.ndarray) -> memoryview:
    """Frame bytes as a byte memoryview (a numpy frame: its contiguous bytes)."""
    return frame.data.cast("B") if isinstance(frame, np.ndarray) else memoryview(frame)


def parse_header(frame: bytes | memoryview | np.ndarray) -> FrameHeader:
    """Parse and validate a frame header: the one place every header bound is checked."""
    view = _view(frame)
    if len(view) < HEADER_SIZE:
        if len(view) >= 4 and bytes(view[:4]) != MAGIC:
            raise BadMagic("not a weightsync frame")
        raise TruncatedInput(f"frame header needs {HEADER_SIZE} bytes, got {len(view)}")
    magic, version, flags, code, method, raw_len, payload_len, bh, rh, check = _HEADER.unpack(view[:HEADER_SIZE])
    if magic != MAGIC:
        raise BadMagic("not a weightsync frame")
    if xxhash.xxh3_64_intdigest(view[: HEADER_SIZE - 8]) != check:
        raise CorruptData("frame header checksum mismatch")
    if version not in VERSIONS:
        raise UnsupportedVersion(f"frame format version {version} (this reader knows {VERSIONS})")
    if version != VERSION and (bh != ZERO_HASH or rh != ZERO_HASH):
        raise CorruptData("a version 2 frame's hash fields must be zero")
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
    return FrameHeader(delta, add, dtype, method, raw_len, payload_len, bh, rh, version)


@dataclass(frozen=True)
class _Payload:
    """A frame payload's decoded sections: `values` planes, plus `gaps` planes when sparse.

    STORED payloads have no planes: `stored` holds the raw values instead.
    """

    count: int | None
    gaps: list[np.ndarray]
    values: list[np.ndarray]
    stored: np.ndarray | None


def _read_payload(frame: bytes | memoryview | np.ndarray, head: FrameHeader) -> _Payload:
    """Decompress a frame's sections, every length checked against the header first (FORMAT §4.3)."""
    reader = _Reader(_view(frame)[HEADER_SIZE : HEADER_SIZE + head.payload_len])
    width = head.dtype.width
    n = head.raw_len // width
    try:
        if head.method == METHOD_STORED:
            stored = np.frombuffer(reader.take(head.raw_len), dtype=np.uint8)
            reader.done()
            return _Payload(None, [], [], stored)
        if head.method == METHOD_PLANES:
            planes = [reader.section(n) for _ in range(width)]
            reader.done()
            return _Payload(None, [], planes, None)
        (count,) = _COUNT.unpack(reader.take(_COUNT.size))
        if count > n:
            raise LimitExceeded(f"sparse frame declares {count} changes in {n} elements")
        gaps = [reader.section(count) for _ in range(GAP_WIDTH)]
        planes = [reader.section(count) for _ in range(width)]
        reader.done()
        return _Payload(count, gaps, planes, None)
    except FormatError:
        raise
    except (ValueError, OverflowError, IndexError) as exc:  # defensive: malformed shapes
        raise CorruptData(f"frame does not decode: {exc}") from None


def decode_payload(frame: bytes | memoryview | np.ndarray, head: FrameHeader) -> tuple[np.ndarray | None, np.ndarray]:
    """Decode a frame's payload: (positions of changed elements or None when dense, values).

    `head` is `parse_header(frame)`. Values are the raw elements (keyframe) or the
    delta values (XOR, or zigzag differences when `head.add`) as unsigned integers
    of the dtype's width. Every section length is checked against the header
    before it is decompressed; only FormatError subclasses escape.
    """
    k = kernels.active()
    width = head.dtype.width
    udt = head.dtype.numpy_uint
    payload = _read_payload(frame, head)
    if payload.stored is not None:
        return None, payload.stored.view(udt)
    values = k.join_planes(payload.values, width).view(udt)
    if payload.count is None:
        return None, values
    positions = k.gap_positions(payload.count, payload.gaps)
    if payload.count and positions[-1] >= head.raw_len // width:
        raise CorruptData("sparse frame position past the end of the chunk")
    return positions, values


def sparse_sections(
    frame: bytes | memoryview | np.ndarray, head: FrameHeader
) -> tuple[int, list[np.ndarray], list[np.ndarray]]:
    """A sparse delta frame's (count, gap planes, value planes), decompressed with every length checked against
    the header first (FORMAT §4.3); ValueError for a frame of another method."""
    if not head.delta or head.method != METHOD_SPARSE:
        raise ValueError("sparse_sections reads sparse delta frames")
    payload = _read_payload(frame, head)
    assert payload.count is not None, "a sparse frame's payload has a count"
    return payload.count, payload.gaps, payload.values


def decode_sparse_pieces(
    frame: bytes | memoryview | np.ndarray, head: FrameHeader, bounds: np.ndarray, offsets: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A sparse delta frame's changes as those of its pieces, in one pass (``Kernels.piece_changes``).

    `head` is `parse_header(frame)` of a delta frame of METHOD_SPARSE (ValueError otherwise).
    Piece i covers frame elements [bounds[i], bounds[i + 1]) (int64, ascending from 0) and
    starts at element offsets[i] of its tensor. Returns (positions, operands, cuts): each
    change's element within its piece's tensor (int64), the signed operands (addends or XOR
    masks, as ``values.Change`` holds them) and the index of each piece's first change. The
    same checks as :func:`decode_payload`; only FormatError subclasses escape on bad input.
    """
    if not head.delta or head.method != METHOD_SPARSE:
        raise ValueError("decode_sparse_pieces decodes sparse delta frames")
    count, gaps, values = sparse_sections(frame, head)
    width = head.dtype.width
    positions, operands, cuts, end = kernels.active().piece_changes(
        count, gaps, values, width, head.add, bounds, offsets
    )
    if end > head.raw_len // width:
        raise CorruptData("sparse frame position past the end of the chunk")
    return positions, operands.view(head.dtype.numpy_int), cuts


def _apply_payload(targets: Sequence[np.ndarray], head: FrameHeader, payload: _Payload, op: int) -> None:
    """concat(targets) ∘= the payload's values (FORMAT §4.2); CorruptData, nothing written, on a bad position."""
    k = kernels.active()
    width = head.dtype.width
    planes = payload.values
    if payload.stored is not None:
        # STORED holds values whole, not as planes: split them (rare: incompressible frames).
        planes = [payload.stored] if width == 1 else list(k.split_planes(payload.stored, width))
    if len(targets) == 1:
        if payload.count is None:
            k.apply_dense(targets[0], width, op, planes)
        elif not k.apply_sparse(targets[0], width, op, payload.count, payload.gaps, planes):
            raise CorruptData("sparse frame position past the end of the chunk")
        return
    bounds = np.cumsum([0] + [len(t) // width for t in targets])
    if payload.count is None:
        for t, lo, hi in zip(targets, bounds, bounds[1:], strict=False):
            k.apply_dense(t, width, op, [p[lo:hi] for p in planes])
        return
    cuts, firsts, end = k.gap_cuts(payload.count, payload.gaps, bounds)
    if end > bounds[-1]:
        raise CorruptData("sparse frame position past the end of the chunk")
    for t, e0, first_pos, lo, hi in zip(targets, bounds, firsts, cuts, cuts[1:], strict=False):
        if hi == lo:
            continue
        gaps = [np.array(g[lo:hi], copy=True) for g in payload.gaps]
        first = int(first_pos) - int(e0)  # the piece's first gap counts from its own start
        for j, g in enumerate(gaps):
            g[0] = (first >> (8 * j)) & 0xFF
        k.apply_sparse(t, width, op, int(hi - lo), gaps, [p[lo:hi] for p in planes])


def apply_frame_pieces(
    frame: bytes | memoryview | np.ndarray, targets: Sequence[np.ndarray], *, verify_base: bool = True
) -> FrameHeader:
    """`apply_frame` into the concatenation of `targets` (1-D writable uint8 views), without concatenating.

    A frame grouping several tensors (FORMAT §4.5) applies straight into each tensor's
    bytes; the same checks and undo on a result mismatch as `apply_frame`.
    """
    head = parse_header(frame)
    _check_targets(targets, head)
    if head.checked and head.delta and verify_base and _xxh3_128_pieces(targets) != head.base_hash:
        raise BaseMismatch("delta frame applied to a different base")
    payload = _read_payload(frame, head)
    op = (OP_ADD if head.add else OP_XOR) if head.delta else OP_SET
    _apply_payload(targets, head, payload, op)
    if head.checked and _xxh3_128_pieces(targets) != head.result_hash:
        if head.delta:
            _apply_payload(targets, head, payload, OP_SUB if head.add else OP_XOR)
        raise ChecksumMismatch("decoded frame does not match its result checksum")
    return head


class TargetSums(NamedTuple):
    """One target's checksums from the pass that applied a frame to it (FORMAT §10.2, at the target's start).

    `before`: of the bytes it held before the frame applied (its base), None unless asked for;
    `after`: of the bytes it holds after (the result).
    """

    before: TensorSum | None
    after: TensorSum


def apply_frame_sums(
    frame: bytes | memoryview | np.ndarray,
    targets: Sequence[np.ndarray],
    starts: Sequence[int],
    *,
    before: bool = False,
) -> tuple[FrameHeader, list[TargetSums]]:
    """Apply a version 2 `frame` into the concatenation of `targets` and return each target's checksums.

    The checksums come from the pass that applies (FORMAT §10.2: target `i` summed at
    ``starts[i]``, its first element's position in its segment): each block is summed
    right before it is patched, while in cache, and a sparse frame's result is that sum
    moved by each change as it is written (the checksum is linear), so neither checking the
    base (`before`) nor the result reads a byte again. Nothing of
    the frame's own is checked (it has no hashes): the caller compares the sums with its
    manifest's digests (FORMAT §5.3) and, on a mismatch, may `undo_frame`. Same target
    rules as `apply_frame_pieces`; CorruptData, nothing written, on a change past the end.
    """
    head, found = apply_frame_lanes(frame, targets, starts, before=before)
    width = head.dtype.width
    sums = []
    for t, (b, a) in zip(targets, found, strict=True):
        assert a is not None, "asked for"
        n = len(t) // width
        sums.append(TargetSums(None if b is None else TensorSum(width, n, tuple(b)), TensorSum(width, n, tuple(a))))
    return head, sums


def apply_frame_lanes(
    frame: bytes | memoryview | np.ndarray,
    targets: Sequence[np.ndarray],
    starts: Sequence[int],
    *,
    before: bool = False,
) -> tuple[FrameHeader, list[Sums]]:
    """:func:`apply_frame_sums`, each target's checksums as their bare lanes: (before or None, after).

    For callers that add up and compare tens of thousands of pieces' checksums (a model of that
    many tensors), where an object per checksum costs more than the pass: each target's element
    count is its length over the frame's element width.
    """
    head = parse_header(frame)
    if head.checked:
        raise UnsupportedVersion("apply_frame_sums applies version 2 frames (version 1 frames check themselves)")
    _check_targets(targets, head)
    if len(starts) != len(targets):
        raise LimitExceeded("one start per target")
    payload = _read_payload(frame, head)
    op = (OP_ADD if head.add else OP_XOR) if head.delta else OP_SET
    return head, _apply_summing(targets, starts, head, payload, op, before=before, after=True)


def undo_frame(
    frame: bytes | memoryview | np.ndarray, targets: Sequence[np.ndarray], starts: Sequence[int] | None = None
) -> list[TensorSum] | None:
    """Undo a delta `frame` applied into the concatenation of `targets`: they hold its base again.

    The inverse of each change is applied (XOR is its own inverse, ADD is undone by SUB,
    FORMAT §4.2), so only the changed elements are written; `targets` must hold exactly
    what applying the frame left (`apply_frame*` of either version). With `starts` (as for
    `apply_frame_sums`), returns each target's checksum after the undo from the same pass,
    so a caller can confirm the base is back. A keyframe frame cannot be undone (its
    values replace the bytes): ValueError.
    """
    head = parse_header(frame)
    if not head.delta:
        raise ValueError("a keyframe frame overwrites its target: keep a copy to restore instead")
    _check_targets(targets, head)
    if starts is not None and len(starts) != len(targets):
        raise LimitExceeded("one start per target")
    payload = _read_payload(frame, head)
    want = starts is not None
    found = _apply_summing(
        targets, starts or [0] * len(targets), head, payload, OP_SUB if head.add else OP_XOR, before=False, after=want
    )
    if not want:
        return None
    width = head.dtype.width
    sums = []
    for t, (_, a) in zip(targets, found, strict=True):
        assert a is not None, "asked for"
        sums.append(TensorSum(width, len(t) // width, tuple(a)))
    return sums


def _apply_summing(
    targets: Sequence[np.ndarray],
    starts: Sequence[int],
    head: FrameHeader,
    payload: _Payload,
    op: int,
    *,
    before: bool,
    after: bool,
) -> list[Sums]:
    """concat(targets) ∘= the payload's values in one pass, with the checksums asked for; CorruptData, nothing
    written, on a change past the end."""
    k = kernels.active()
    width = head.dtype.width
    planes = payload.values
    if payload.stored is not None:  # STORED holds values whole, not as planes
        planes = [payload.stored] if width == 1 else list(k.split_planes(payload.stored, width))
    if payload.count is None:
        return k.apply_dense_sums(targets, starts, width, op, planes, before=before, after=after)
    found = k.apply_sparse_sums(
        targets, starts, width, op, payload.count, payload.gaps, planes, before=before, after=after
    )
    if found is None:
        raise CorruptData("sparse frame position past the end of the chunk")
    return found


def _check_targets(targets: Sequence[np.ndarray | memoryview], head: FrameHeader) -> None:
    """Targets are contiguous 1-D uint8 arrays, or byte memoryviews (the active kernels' ``memory_views``), of whole
    elements, holding the frame's raw length between them."""
    if not targets or any(not _byte_buffer(t) or len(t) % head.dtype.width for t in targets):
        raise LimitExceeded("frame targets must be contiguous 1-D uint8 arrays of whole elements")
    if sum(len(t) for t in targets) != head.raw_len:
        raise LimitExceeded(f"frame decodes to {head.raw_len} bytes, targets hold {sum(len(t) for t in targets)}")


def apply_frame(frame: bytes | memoryview | np.ndarray, target: np.ndarray, *, verify_base: bool = True) -> FrameHeader:
    """Decode `frame` into `target` (1-D writable uint8 of exactly the frame's raw length).

    For a keyframe frame `target` receives the bytes. For a delta frame `target`
    must hold the base: its hash is checked first (BaseMismatch, target untouched),
    the XOR is applied in place, and the result hash is checked; on a mismatch the
    XOR is undone, so `target` again holds the base, and ChecksumMismatch is raised.
    Raises only weightsync FormatError subclasses or BaseMismatch on bad input.

    A version 2 frame carries no hashes: nothing is checked here, and the caller checks
    base and result with its manifest's segment checksums (FORMAT §5.3).
    """
    head = parse_header(frame)
    if target.dtype != np.uint8 or target.ndim != 1 or len(target) != head.raw_len:
        raise LimitExceeded(f"frame decodes to {head.raw_len} bytes, target holds {target.size}")
    if not target.flags.c_contiguous:
        raise LimitExceeded("the target of a frame must be contiguous")
    return apply_frame_pieces(frame, [target], verify_base=verify_base)


def decode_frame(frame: bytes | memoryview | np.ndarray, base: np.ndarray | None = None) -> np.ndarray:
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


def _byte_buffer(t: np.ndarray | memoryview) -> bool:
    if isinstance(t, memoryview):
        return t.format == "B" and t.ndim == 1 and t.c_contiguous
    return t.dtype == np.uint8 and t.ndim == 1 and t.flags.c_contiguous
