"""What a user would do instead of weightsync, for the scale bench: reload from disk, or XOR + zstd-1.

- :func:`reload`: ``safetensors.torch.load_file(path, device=...)`` + ``copy_`` into the live
  tensors (the whole version from local disk);
- :func:`evict` / :func:`resident_fraction` / :func:`page_cache_check`: a cold page cache by
  ``posix_fadvise(DONTNEED)``, and whether it took effect (``mincore`` residency, and a cold
  read timed against a warm one);
- :class:`XorZstd`: per-tensor XOR + zstd-1 (benchmarks/baselines.py's codec, the RL frameworks'
  peers), encoded and decoded on all cores; decode XORs into the live tensors on their device
  (on CUDA: host → device copy, then XOR on the GPU), unverified as the peers ship it.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time
import warnings
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import zstandard

from .baselines import RawTensor, load_safetensors

_READ_CHUNK = 64 << 20


def files(vdir: Path) -> list[Path]:
    """A version's safetensors files, in name order."""
    return sorted(vdir.glob("*.safetensors"))


def load_live(vdir: Path, device: str) -> dict[str, torch.Tensor]:
    """The version's tensors in fresh memory on `device` (what a server holds while serving)."""
    from safetensors.torch import load_file

    return {k: v.to(device, copy=True) for f in files(vdir) for k, v in load_file(str(f)).items()}


def sync(device: str) -> None:
    """Wait for the device's queued work (timings end when the tensors hold the result)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def reload(live: Mapping[str, torch.Tensor], files: Iterable[Path], device: str) -> int:
    """Load every file with safetensors onto `device` and copy each tensor into `live`; bytes read."""
    from safetensors.torch import load_file

    nbytes = 0
    for path in files:
        for name, t in load_file(str(path), device=device).items():
            live[name].copy_(t)
        nbytes += path.stat().st_size
    sync(device)
    return nbytes


# ---------------------------------------------------------------------------------------------------
# page cache


def evict(files: Iterable[Path]) -> None:
    """Drop the files' pages from the page cache (written back first: dirty pages cannot be dropped)."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_fraction(path: Path) -> float:
    """Fraction of the file's pages in the page cache (``mincore`` over a read-only mapping)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    size = path.stat().st_size
    if size == 0:
        return 1.0
    pages = -(-size // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap {path}")
        try:
            if libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore {path}")
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return sum(b & 1 for b in vec) / pages


def read_seconds(path: Path) -> float:
    """Time to read the whole file once through a reused buffer."""
    buf = bytearray(_READ_CHUNK)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    return time.perf_counter() - t0


def page_cache_check(path: Path) -> dict:
    """Did eviction take effect? Residency after a read and after `evict` (the verdict: under 5 % resident).

    A cold read timed against a warm one says what eviction costs here: on a virtual disk that
    the host caches, a "cold" read may still come from the host's memory.
    """
    read_seconds(path)
    warm_resident = resident_fraction(path)
    evict([path])
    cold_resident = resident_fraction(path)
    cold_s = read_seconds(path)
    warm_s = read_seconds(path)
    size = path.stat().st_size
    return {
        "file_bytes": size,
        "resident_after_read": warm_resident,
        "resident_after_evict": cold_resident,
        "cold_read_gbps": size / cold_s / 1e9,
        "warm_read_gbps": size / warm_s / 1e9,
        "cold_over_warm": cold_s / warm_s,
        "eviction_took_effect": cold_resident < 0.05,
    }


# ---------------------------------------------------------------------------------------------------
# per-tensor XOR + zstd-1


def _words(a: np.ndarray) -> np.ndarray:
    """Raw bytes viewed as 8-byte words where they divide (numpy XORs words ~8x faster than bytes)."""
    return a.view(np.uint64) if a.size % 8 == 0 else a


class XorZstd:
    """Per-tensor XOR + zstd level 1 on `threads` threads (one compressor / decompressor per thread).

    Frames are ``{name: (zstd payload, raw length)}``. Every tensor is diffed (the versions have the
    same tensors, names, dtypes and shapes).
    """

    def __init__(self, threads: int) -> None:
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="xor-zstd")
        self.local = threading.local()

    def close(self) -> None:
        self.pool.shutdown(wait=True)

    def _ctx(self) -> tuple[zstandard.ZstdCompressor, zstandard.ZstdDecompressor]:
        ctx = getattr(self.local, "ctx", None)
        if ctx is None:
            ctx = self.local.ctx = (zstandard.ZstdCompressor(level=1), zstandard.ZstdDecompressor())
        return ctx

    def encode(self, base: Mapping[str, RawTensor], new: Mapping[str, RawTensor]) -> dict[str, tuple[bytes, int]]:
        """XOR each new tensor's bytes with its base into a per-thread buffer, compress with zstd-1."""

        def one(name: str) -> tuple[bytes, int]:
            b, n = base[name].data, new[name].data
            buf = getattr(self.local, "buf", None)
            if buf is None or buf.size < n.size:
                buf = self.local.buf = np.empty(n.size, dtype=np.uint8)
            out = buf[: n.size]
            np.bitwise_xor(_words(b), _words(n), out=_words(out))
            return self._ctx()[0].compress(out.data), n.size

        return dict(zip(new, self.pool.map(one, new), strict=True))

    def apply(self, live: Mapping[str, torch.Tensor], frames: Mapping[str, tuple[bytes, int]], device: str) -> None:
        """Decompress every frame and XOR it into its live tensor, in place on the tensor's device."""
        cuda = device.startswith("cuda")
        # torch warns that a frame's buffer (immutable bytes) is read-only; it is only read from.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")

        def one(name: str) -> None:
            payload, n = frames[name]
            raw = self._ctx()[1].decompress(payload, max_output_size=n)
            if len(raw) != n:
                raise ValueError(f"{name}: frame decodes to {len(raw)} bytes, expected {n}")
            x = np.frombuffer(raw, dtype=np.uint8)
            target = live[name].view(-1).view(torch.uint8)
            if cuda:
                target.bitwise_xor_(torch.from_numpy(x).to(target.device))
            else:
                view = target.numpy()
                np.bitwise_xor(_words(view), _words(x), out=_words(view))

        list(self.pool.map(one, frames))
        sync(device)


class Alternatives:
    """The reload and XOR + zstd-1 paths, each into its own live tensors, version after version."""

    def __init__(self, first: Path, device: str, threads: int) -> None:
        self.device = device
        self.reloaded, self.xored = load_live(first, device), load_live(first, device)
        self.xz = XorZstd(threads)

    def close(self) -> None:
        self.xz.close()

    def version(self, prev: Path, vdir: Path) -> dict[str, float]:
        """Reload `vdir` cold then warm; XOR + zstd-1 encode `prev` → `vdir` and apply it; times and bytes."""
        row: dict[str, float] = {}
        evict(files(vdir))
        row["reload_cold_resident"] = max(resident_fraction(f) for f in files(vdir))
        t0 = time.perf_counter()
        row["reload_bytes"] = float(reload(self.reloaded, files(vdir), self.device))
        row["reload_cold_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        reload(self.reloaded, files(vdir), self.device)
        row["reload_warm_s"] = time.perf_counter() - t0
        base = {k: v for f in files(prev) for k, v in load_safetensors(f).items()}
        new = {k: v for f in files(vdir) for k, v in load_safetensors(f).items()}
        t0 = time.perf_counter()
        frames = self.xz.encode(base, new)
        row["xor_encode_s"] = time.perf_counter() - t0
        row["xor_bytes"] = float(sum(len(p) for p, _ in frames.values()))
        t0 = time.perf_counter()
        self.xz.apply(self.xored, frames, self.device)
        row["xor_apply_s"] = time.perf_counter() - t0
        return row
