"""Reference codecs and bounds for weight deltas -- pure numpy / zstandard / xxhash (no torch, no weightsync).

Tensor dicts map a name to either a :class:`RawTensor` (what :func:`load_safetensors` returns: safetensors
dtype string, shape, raw little-endian bytes as a 1-D uint8 array) or a plain ``np.ndarray`` (its dtype
string, shape and bytes are used). Two tensors *match* when name, dtype and shape are equal.

- :func:`xor_zstd1` / :func:`xor_zstd1_encode` / :func:`xor_zstd1_decode`: the codec of the RL-framework
  peers -- per tensor, XOR the raw bytes of new with base and compress with zstd level 1 (unmatched
  tensors are compressed whole);
- :func:`snapshot_zstd1`: each tensor of the new version compressed whole with zstd level 1;
- :func:`entropy_bound`: zero-order entropy of the delta (see its docstring);
- :func:`measure_xor_zstd1` / :func:`measure_snapshot_zstd1`: sizes plus encode/decode timings.

The safetensors header (a few KB of JSON) is not counted by any of these; sizes are tensor payloads.
"""

from __future__ import annotations

import json
import math
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np
import xxhash
import zstandard

# Element width in bytes per safetensors dtype. Sub-byte formats (fp4 packed in U8) count the byte.
DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "F4": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8,
}  # fmt: skip
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
MAX_HEADER = 100 * 1024 * 1024


class RawTensor(NamedTuple):
    dtype: str  # safetensors dtype name: BF16, F32, F8_E4M3, U8, ...
    shape: tuple[int, ...]
    data: np.ndarray  # 1-D uint8, the tensor's raw bytes


def element_size(dtype: str) -> int:
    return DTYPE_SIZES.get(dtype, 1)


def as_elements(data: np.ndarray, width: int) -> np.ndarray:
    """View raw bytes as unsigned integers of ``width`` bytes (falls back to bytes if not divisible)."""
    if width == 1 or data.size % width:
        return data
    return data.view(_UINT[width])


# ---------------------------------------------------------------------------------------------------
# safetensors without torch


def read_safetensors_header(path: str | Path) -> tuple[dict, int]:
    """(header JSON incl. ``__metadata__`` if present, byte offset where tensor data starts)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: too short for a safetensors file")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER:
            raise ValueError(f"{path}: header length {n} exceeds cap")
        raw = f.read(n)
        if len(raw) != n:
            raise ValueError(f"{path}: truncated header")
    return json.loads(raw), 8 + n


def load_safetensors(path: str | Path, mmap: bool = False) -> dict[str, RawTensor]:
    """Load a safetensors file into {name: RawTensor} in header order, checking offsets against the file."""
    header, start = read_safetensors_header(path)
    size = Path(path).stat().st_size
    buf = np.memmap(path, dtype=np.uint8, mode="r") if mmap else np.fromfile(path, dtype=np.uint8)
    out: dict[str, RawTensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype, shape = info["dtype"], tuple(int(s) for s in info["shape"])
        lo, hi = (int(x) for x in info["data_offsets"])
        nbytes = math.prod(shape) * element_size(dtype) if dtype in DTYPE_SIZES else hi - lo
        if not (0 <= lo <= hi and start + hi <= size) or hi - lo != nbytes:
            raise ValueError(f"{path}: tensor {name} has bad offsets {lo}..{hi} for {dtype}{list(shape)}")
        out[name] = RawTensor(dtype, shape, buf[start + lo : start + hi])
    return out


def _norm(t) -> tuple[str, tuple[int, ...], np.ndarray, int]:
    """(dtype key, shape, 1-D uint8 bytes, element width)."""
    if isinstance(t, RawTensor):
        return t.dtype, tuple(t.shape), t.data, element_size(t.dtype)
    a = np.ascontiguousarray(t)
    return a.dtype.str, tuple(a.shape), a.reshape(-1).view(np.uint8), a.dtype.itemsize


def _match(base: dict, name: str, dtype: str, shape: tuple) -> np.ndarray | None:
    if name not in base:
        return None
    bd, bs, bb, _ = _norm(base[name])
    return bb if (bd == dtype and bs == shape) else None


def _xor(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    w = 8 if a.size % 8 == 0 else 1
    return np.bitwise_xor(as_elements(a, w), as_elements(b, w)).view(np.uint8)


# ---------------------------------------------------------------------------------------------------
# XOR + zstd-1 (the peers' codec)


@dataclass
class Encoded:
    """frames: name -> (kind "xor" | "full", raw length, zstd payload[, xxh3-128 of the result])."""

    frames: dict[str, tuple] = field(default_factory=dict)
    raw_bytes: int = 0

    @property
    def compressed_bytes(self) -> int:
        return sum(len(f[2]) for f in self.frames.values())


def xor_zstd1_encode(base: dict, new: dict, level: int = 1, checksum: bool = False) -> Encoded:
    cctx = zstandard.ZstdCompressor(level=level)
    enc = Encoded()
    for name, t in new.items():
        dtype, shape, data, _ = _norm(t)
        b = _match(base, name, dtype, shape)
        payload = data if b is None else _xor(b, data)
        frame = ("full" if b is None else "xor", data.size, cctx.compress(payload))
        if checksum:
            frame += (xxhash.xxh3_128_digest(data),)
        enc.frames[name] = frame
        enc.raw_bytes += data.size
    return enc


def xor_zstd1_decode(base: dict, enc: Encoded) -> dict[str, np.ndarray]:
    """Decompress every frame and XOR it into the matching base tensor's bytes -> {name: uint8 bytes}."""
    dctx = zstandard.ZstdDecompressor()
    out: dict[str, np.ndarray] = {}
    for name, frame in enc.frames.items():
        kind, n, payload = frame[:3]
        raw = np.frombuffer(dctx.decompress(payload, max_output_size=n), dtype=np.uint8)
        if raw.size != n:
            raise ValueError(f"{name}: frame decodes to {raw.size} bytes, expected {n}")
        if kind == "xor":
            b = _norm(base[name])[2]
            if b.size != n:
                raise ValueError(f"{name}: base has {b.size} bytes, delta {n}")
            raw = _xor(b, raw)
        if len(frame) > 3 and xxhash.xxh3_128_digest(raw) != frame[3]:
            raise ValueError(f"{name}: result checksum mismatch")
        out[name] = raw
    return out


def xor_zstd1(base: dict, new: dict, level: int = 1) -> int:
    """Total compressed bytes of the per-tensor XOR + zstd-``level`` delta from base to new."""
    return xor_zstd1_encode(base, new, level).compressed_bytes


def snapshot_zstd1_encode(new: dict, level: int = 1) -> Encoded:
    return xor_zstd1_encode({}, new, level)


def snapshot_zstd1_decode(enc: Encoded) -> dict[str, np.ndarray]:
    return xor_zstd1_decode({}, enc)


def snapshot_zstd1(new: dict, level: int = 1) -> int:
    """Total bytes of a full snapshot, each tensor compressed whole with zstd-``level``."""
    return snapshot_zstd1_encode(new, level).compressed_bytes


def _timed(fn, repeats: int):
    best, res = float("inf"), None
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        res = fn()
        best = min(best, time.perf_counter() - t0)
    return res, best


def measure_xor_zstd1(
    base: dict, new: dict, level: int = 1, repeats: int = 1, verify: bool = True, checksum: bool = False
) -> dict:
    """Bytes and best-of-``repeats`` encode/decode times (MB/s over the new version's raw bytes).

    ``checksum=True`` is the verified variant: encode also hashes each new tensor (xxh3-128) and
    decode checks every result against it.
    """
    enc, te = _timed(lambda: xor_zstd1_encode(base, new, level, checksum=checksum), repeats)
    dec, td = _timed(lambda: xor_zstd1_decode(base, enc), repeats)
    if verify:
        for name, t in new.items():
            if not np.array_equal(dec[name], _norm(t)[2]):
                raise AssertionError(f"xor_zstd1 round trip differs on {name}")
    mb = enc.raw_bytes / 1e6
    return {
        "bytes": enc.compressed_bytes,
        "raw": enc.raw_bytes,
        "encode_s": te,
        "decode_s": td,
        "encode_MBps": mb / te if te else float("inf"),
        "decode_MBps": mb / td if td else float("inf"),
    }


def measure_snapshot_zstd1(new: dict, level: int = 1, repeats: int = 1) -> dict:
    return measure_xor_zstd1({}, new, level, repeats)


# ---------------------------------------------------------------------------------------------------
# Entropy bound


def _h2(p: float) -> float:
    if p <= 0.0 or p >= 1.0:
        return 0.0
    return -(p * math.log2(p) + (1 - p) * math.log2(1 - p))


def tensor_entropy_bits(base_bytes: np.ndarray | None, new_bytes: np.ndarray, width: int) -> float:
    """Bits of the zero-order bound for one tensor (see :func:`entropy_bound`)."""
    nb = as_elements(new_bytes, width)
    if nb is new_bytes and width != 1:  # size not divisible: fall back to bytes
        width = 1
    bb = np.zeros_like(nb) if base_bytes is None else as_elements(base_bytes, width)
    x = np.bitwise_xor(bb, nb)
    vals = x[x != 0]
    n, k = x.size, vals.size
    if n == 0 or k == 0:
        return 0.0
    _, counts = np.unique(vals, return_counts=True)
    p = counts / k
    h_vals = float(-(p * np.log2(p)).sum())
    return n * _h2(k / n) + k * h_vals


def entropy_bound(base: dict, new: dict, per_tensor: bool = False):
    """Zero-order entropy bound of the delta base -> new, in BYTES (float).

    Per tensor, with elements of the dtype's width (2 bytes for BF16, 4 for F32, 1 for F8 and for U8 --
    for sub-byte formats packed into U8 the element is the byte), XOR each new element with the base
    element; let n be the element count and k the number of non-zero XORs (changed elements)::

        bits = n * H2(k / n)  +  k * H(X)
        H2(p) = -p log2 p - (1 - p) log2 (1 - p)          (position of the changed elements)
        H(X)  = -sum_v q_v log2 q_v,  q_v = (count of XOR value v among the k) / k   (their values)

    i.e. an ideal coder that knows each tensor's changed-fraction and the empirical XOR-value histogram
    (models/headers not counted). Tensors without a match in base (name, dtype, shape) are XORed against
    zeros. The result is the sum over the tensors of ``new`` divided by 8; with ``per_tensor=True`` the
    function returns ``(total_bytes, {name: bytes})``.
    """
    per: dict[str, float] = {}
    for name, t in new.items():
        dtype, shape, data, width = _norm(t)
        per[name] = tensor_entropy_bits(_match(base, name, dtype, shape), data, width) / 8.0
    total = float(sum(per.values()))
    return (total, per) if per_tensor else total
