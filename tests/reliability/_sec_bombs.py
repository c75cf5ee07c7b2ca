"""Decompression bombs for frames and manifests, and a peak-memory probe (docs/FORMAT.md §4.3, §5.1, §8).

``build(name)`` returns a small input whose zstd content, or declared size, is huge. The
child mode (``python _sec_bombs.py FILE KIND``) decodes one bomb in a fresh process and
prints how much its peak resident memory grew (Linux: the peak is reset through
``/proc/self/clear_refs`` first, so import-time peaks do not hide anything).
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import xxhash
import zstandard

GIB = 1 << 30
MIB = 1 << 20


def _zstd_of(byte: bytes, size: int, *, content_size: bool = True) -> bytes:
    """One zstd frame of ``size`` copies of ``byte``, built in 16 MiB pieces (never holding ``size`` bytes)."""
    cctx = zstandard.ZstdCompressor(level=1, write_content_size=content_size)
    obj = cctx.compressobj(size=size if content_size else -1)
    piece = byte * (16 * MIB)
    out = []
    left = size
    while left:
        n = min(left, len(piece))
        out.append(obj.compress(piece[:n]))
        left -= n
    out.append(obj.flush())
    return b"".join(out)


def _frame(method: int, raw_len: int, payload: bytes, *, flags: int = 0, dtype_code: int = 2) -> bytes:
    # A delta's base hash is that of the all-zero base the probe decodes onto, so the base check passes.
    base = xxhash.xxh3_128_digest(bytes(raw_len)) if flags & 1 and raw_len <= GIB else bytes(16)
    head = struct.pack("<4sBBBBQQ16s16s", b"WSFR", 1, flags, dtype_code, method, raw_len, len(payload), base, bytes(16))
    return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head)) + payload


def _section(coding: int, body: bytes) -> bytes:
    return struct.pack("<B7xQ", coding, len(body)) + body


def _manifest(json_len: int, body: bytes, check: int = 0) -> bytes:
    return struct.pack("<4sBBHQQ", b"WSMF", 1, 0, 0, json_len, check) + body


def build(name: str) -> tuple[bytes, str, int]:
    """(input bytes, kind "frame" | "manifest", bytes the input declares or would expand to)."""
    if name == "frame-section-declares-1GiB":  # a 64 KiB frame whose plane is a real 1 GiB zstd frame
        return _frame(1, 64 << 10, _section(1, _zstd_of(b"\0", GIB))), "frame", GIB
    if name == "frame-section-without-size":  # the same without a declared content size
        return _frame(1, 64 << 10, _section(1, _zstd_of(b"\0", GIB, content_size=False))), "frame", GIB
    if name == "frame-raw-over-cap":  # a header declaring 2 GiB (cap 1 GiB), no payload
        return _frame(0, 2 * GIB, b""), "frame", 2 * GIB
    if name == "frame-sparse-count":  # a sparse delta declaring 2^40 changes in 64 KiB
        return _frame(2, 64 << 10, struct.pack("<Q", 1 << 40), flags=0x01), "frame", 1 << 40
    if name == "manifest-over-cap":  # the envelope declares 1 GiB of JSON (cap 256 MiB)
        return _manifest(GIB, _zstd_of(b" ", 1 << 10)), "manifest", GIB
    if name == "manifest-body-declares-1GiB":  # the envelope says 1 KiB, the zstd frame 1 GiB
        return _manifest(1 << 10, _zstd_of(b" ", GIB)), "manifest", GIB
    if name.startswith("manifest-in-cap-"):  # "{" + spaces + "}": legal JSON of L bytes, within the cap
        size = int(name.rsplit("-", 1)[1].removesuffix("MiB")) * MIB
        cctx = zstandard.ZstdCompressor(level=1, write_content_size=True)
        obj = cctx.compressobj(size=size)
        parts = [obj.compress(b"{")]
        left = size - 2
        piece = b" " * (16 * MIB)
        while left:
            n = min(left, len(piece))
            parts.append(obj.compress(piece[:n]))
            left -= n
        parts += [obj.compress(b"}"), obj.flush()]
        h = xxhash.xxh3_64()
        h.update(b"{")
        left = size - 2
        while left:
            n = min(left, len(piece))
            h.update(piece[:n])
            left -= n
        h.update(b"}")
        return _manifest(size, b"".join(parts), h.intdigest()), "manifest", size
    raise ValueError(name)


BOMBS = [
    "frame-section-declares-1GiB",
    "frame-section-without-size",
    "frame-raw-over-cap",
    "frame-sparse-count",
    "manifest-over-cap",
    "manifest-body-declares-1GiB",
    "manifest-in-cap-64MiB",
]


def _status_kib(field: str, pid: str = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def reset_peak(pid: str = "self") -> None:
    """Reset VmHWM (the peak RSS) of ``pid`` to its current RSS (Linux clear_refs, value 5)."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def peak_growth(pid: str, before_kib: int) -> int:
    """Bytes by which the peak RSS of ``pid`` rose over ``before_kib``."""
    return max(0, _status_kib("VmHWM", pid) - before_kib) * 1024


def child(path: str, kind: str) -> dict:
    import numpy as np

    from weightsync.codec.frame import decode_frame
    from weightsync.codec.manifest import Manifest
    from weightsync.errors import WeightsyncError

    data = Path(path).read_bytes()
    reset_peak()
    before = _status_kib("VmRSS")
    refused = None
    try:
        if kind == "frame":
            decode_frame(data, np.zeros(64 << 10, dtype=np.uint8))
        else:
            Manifest.decode(data)
    except WeightsyncError as exc:
        refused = f"{type(exc).__name__}: {str(exc)[:120]}"
    return {"input_bytes": len(data), "refused": refused, "rss_growth": peak_growth("self", before)}


if __name__ == "__main__":
    print(json.dumps(child(sys.argv[1], sys.argv[2])))
