"""A content-addressed object cache that downloads only what it lacks, in parallel ranges.

On disk (``root`` given) an object lives at ``root/<digest>`` only once its
SHA-256 has been checked. A large object is fetched as several HTTP ranges at
once; each finished range is kept under ``root/<digest>.parts/`` so a download
killed half way resumes with the ranges it lacks. A decode that needs only some
frames of an object (pull --adopt of a directory holding part of a version)
fetches just their ranges (`fetch_extents`) and reads them out of the parts;
each frame is then checked by the decode, as the whole object's SHA-256 cannot be.
Without a root the cache is a dict in memory (for `prepare`, which decodes
straight from memory): an object's ranges are read into one buffer of its size.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from weightsync import errors
from weightsync.client._http import Api
from weightsync.client._pool import run_all
from weightsync.codec.manifest import FrameRef

DEFAULT_RANGE_BYTES = 16 << 20


@dataclass
class FetchStats:
    fetched: int = 0
    """Objects downloaded (at least partly) by this call."""
    cached: int = 0
    """Objects the cache already held."""


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(4 << 20):
            h.update(chunk)
    return h.hexdigest()


class _FileSink:
    """Receives one range into `path`.tmp; a restart (b"") truncates it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tmp = path.with_name(path.name + f".{os.getpid()}.{threading.get_ident()}.tmp")
        self.f = open(self.tmp, "wb")  # noqa: SIM115 - held until finish() or abandon()

    def __call__(self, chunk: bytes | memoryview) -> None:
        if not chunk:
            self.f.seek(0)
            self.f.truncate()
            return
        self.f.write(chunk)

    def finish(self) -> None:
        self.f.close()
        os.replace(self.tmp, self.path)

    def abandon(self) -> None:
        self.f.close()
        self.tmp.unlink(missing_ok=True)


def _check_range_length(digest: str, start: int, end: int, got: int) -> None:
    """A range answered short must not be kept as a finished part (the next pull would trust it)."""
    if end > start and got != end - start:
        raise errors.TruncatedInput(f"object {digest}: range {start}-{end} answered with {got} bytes")


class ObjectCache:
    """Verified objects by digest, on disk under `root` or in memory (root None). Thread-safe."""

    def __init__(self, root: Path | None) -> None:
        self.root = root
        self._mem: dict[str, bytes | memoryview] = {}
        self._mem_parts: dict[tuple[str, int, int], bytes | memoryview] = {}
        self._mem_hashed: dict[tuple[str, int, int], Any] = {}  # first parts' SHA-256, taken as they arrived
        self._verified: set[str] = set()
        self._lock = threading.Lock()
        if root is not None:
            root.mkdir(parents=True, exist_ok=True)

    def sweep(self) -> None:
        """Remove partial files a killed process left (only safe while no one else uses this cache)."""
        if self.root is None:
            return
        for p in self.root.glob("*.tmp"):
            p.unlink(missing_ok=True)
        for p in self.root.glob("*.parts/*.tmp"):
            p.unlink(missing_ok=True)

    def clear(self) -> None:
        """Drop every cached object and part (only for a checkout's own cache, under its lock)."""
        self._mem.clear()
        self._mem_parts.clear()
        self._mem_hashed.clear()
        if self.root is not None and self.root.is_dir():
            shutil.rmtree(self.root, ignore_errors=True)

    def _path(self, digest: str) -> Path:
        assert self.root is not None
        return self.root / digest

    def has(self, digest: str) -> bool:
        if self.root is None:
            return digest in self._mem
        return self._path(digest).is_file()

    def read(self, digest: str) -> memoryview | np.ndarray:
        """The object's bytes (a read-only map on disk)."""
        if self.root is None:
            return memoryview(self._mem[digest])
        path = self._path(digest)
        if path.stat().st_size == 0:
            return memoryview(b"")
        return np.memmap(path, dtype=np.uint8, mode="r")

    def put(self, digest: str, data: bytes | memoryview) -> None:
        """Add an object's bytes, checked against its name here (DigestMismatch: nothing kept)."""
        if hashlib.sha256(data).hexdigest() != digest:
            raise errors.DigestMismatch(f"object {digest} was received with other bytes")
        self.put_checked(digest, data)

    def put_checked(self, digest: str, data: bytes | memoryview) -> None:
        """Add an object's bytes that the caller has just checked against its name (hashed as they arrived)."""
        if self.root is None:
            self._mem[digest] = data
            return
        sink = _FileSink(self._path(digest))
        sink(data)
        sink.finish()

    def discard(self, digests: list[str]) -> None:
        for d in digests:
            self._mem.pop(d, None)
            if self.root is not None:
                self._path(d).unlink(missing_ok=True)
                shutil.rmtree(self.root / f"{d}.parts", ignore_errors=True)

    def _valid(self, digest: str) -> bool:
        """A cached object from an earlier run is re-hashed once before it is trusted (disks rot)."""
        if not self.has(digest):
            return False
        if self.root is None or digest in self._verified:
            return True
        path = self._path(digest)
        if _sha256_file(path) == digest:
            with self._lock:
                self._verified.add(digest)
            return True
        path.unlink(missing_ok=True)
        return False

    def fetch(
        self, api: Api, objects: dict[str, int], pool: ThreadPoolExecutor, *, range_bytes: int = DEFAULT_RANGE_BYTES
    ) -> FetchStats:
        """Make every object in `objects` (digest → extent to fetch) present and verified.

        Ranges of all missing objects are fetched concurrently on `pool` (in memory, each object's into
        one buffer of its extent, which then is the object: no join); each object is then assembled and
        checked against its SHA-256 name.
        """
        stats = FetchStats()
        todo: list[tuple[str, int]] = []
        for digest, extent in objects.items():
            if self._valid(digest):
                stats.cached += 1
            else:
                todo.append((digest, extent))
        stats.fetched = len(todo)
        if not todo:
            return stats
        buffers: dict[str, memoryview] = {}
        jobs: list[tuple[str, int, int]] = []
        for digest, extent in todo:
            ranges = [j for j in self._ranges(digest, 0, extent, range_bytes) if j is not None]
            if self.root is None and extent and ranges:
                buffers[digest] = np.empty(extent, dtype=np.uint8).data  # its ranges land in it: joined as they come
            jobs.extend(ranges)

        run_all(pool, lambda job: self._fetch_range(api, *job, whole=True, into=buffers.get(job[0])), jobs)
        run_all(pool, lambda t: self._assemble(api, t[0], t[1], range_bytes), todo)
        return stats

    def fetch_extents(
        self,
        api: Api,
        extents: dict[str, list[tuple[int, int]]],
        pool: ThreadPoolExecutor,
        *,
        range_bytes: int = DEFAULT_RANGE_BYTES,
    ) -> FetchStats:
        """Make the byte ranges `extents` (digest → [(start, end)]) of objects readable, not whole objects.

        For a decode that needs only some frames of an object (pull --adopt of a directory
        holding part of a version). Missing ranges are fetched concurrently on `pool` and
        kept as parts (a killed run resumes with the ranges it lacks); an object already
        held whole is read from there. The parts are not checked against the object's
        SHA-256 (that needs all of it): each frame read from them is checked by the decode
        (its header, and its result's digest). Read them with `object_reader`; after a
        failed decode, `drop_parts` makes the next run fetch them again.
        """
        stats = FetchStats()
        jobs: list[tuple[str, int, int]] = []
        for digest, ranges in extents.items():
            if self._valid(digest):
                stats.cached += 1
                continue
            missing = [job for a, b in ranges for job in self._ranges(digest, a, b, range_bytes) if job is not None]
            stats.fetched += bool(missing)
            stats.cached += not missing
            jobs.extend(missing)
        run_all(pool, lambda job: self._fetch_range(api, *job), jobs)
        return stats

    def parts(self, digest: str) -> Parts:
        """The parts held of an object the cache does not hold whole (`fetch_extents`), to read ranges from."""
        return Parts(self, digest, self._held_parts(digest))

    def read_part(self, digest: str, start: int, end: int) -> memoryview | np.ndarray:
        """The bytes of the part [start, end) held of an object (a read-only map on disk)."""
        if self.root is None:
            with self._lock:
                return memoryview(self._mem_parts[(digest, start, end)])
        if end == start:
            return memoryview(b"")
        return np.memmap(self._parts_dir(digest) / f"{start}-{end}", dtype=np.uint8, mode="r")

    def drop_parts(self, digests: list[str]) -> None:
        """Forget the parts fetched of these objects (whole objects held stay)."""
        for d in digests:
            self._drop_parts(d)

    # --- ranges -------------------------------------------------------------------------

    def _parts_dir(self, digest: str) -> Path:
        assert self.root is not None
        return self.root / f"{digest}.parts"

    def _ranges(self, digest: str, start: int, end: int, range_bytes: int) -> list[tuple[str, int, int] | None]:
        """The ranges of [start, end) not yet held (whatever range size earlier runs used), as jobs."""
        if end <= start:
            return [(digest, start, end)] if end == start == 0 else []
        gaps = []
        cursor = start
        for a, b in self._held_parts(digest):
            if b <= cursor:
                continue
            if a > cursor:
                gaps.append((cursor, min(a, end)))
            cursor = max(cursor, b)
            if cursor >= end:
                break
        if cursor < end:
            gaps.append((cursor, end))
        return [(digest, a, min(a + range_bytes, b)) for g0, b in gaps for a in range(g0, b, range_bytes)]

    def _fetch_range(
        self,
        api: Api,
        digest: str,
        start: int,
        end: int,
        *,
        whole: bool = False,
        into: memoryview | None = None,
    ) -> None:
        """Fetch the part [start, end) of an object; `whole`: one of the parts the object is joined from. In memory,
        `into` (the object's buffer) receives the part at its place."""
        if self.root is None:
            # The first range of an object to be joined is hashed as it arrives (the join resumes from there): a
            # one-range object's SHA-256 is taken while its bytes are on their way, not after. Ranges of a
            # selection (fetch_extents) are never joined: not hashed.
            ahead = whole and not start
            hasher = [hashlib.sha256()]

            def watch(piece: memoryview | bytes) -> None:
                if piece:
                    hasher[0].update(piece)
                else:  # an attempt starts (again)
                    hasher[0] = hashlib.sha256()

            data = api.read_object(
                digest,
                start=start,
                end=end if end > start else None,
                watch=watch if ahead else None,
                into=into[start:end] if into is not None and end > start else None,
            )
            _check_range_length(digest, start, end, len(data))
            with self._lock:
                self._mem_parts[(digest, start, end)] = data
                if ahead:
                    self._mem_hashed[(digest, start, end)] = hasher[0]
            return
        parts = self._parts_dir(digest)
        parts.mkdir(exist_ok=True)
        fsink = _FileSink(parts / f"{start}-{end}")
        try:
            api.get_object(digest, fsink, start=start, end=end if end > start else None)
            _check_range_length(digest, start, end, fsink.f.tell())
        except BaseException:
            fsink.abandon()
            raise
        fsink.finish()

    def _held_parts(self, digest: str) -> list[tuple[int, int]]:
        if self.root is None:
            with self._lock:
                return sorted((a, b) for (d, a, b) in self._mem_parts if d == digest)
        out: list[tuple[int, int]] = []
        if not self._parts_dir(digest).is_dir():
            return out
        for p in self._parts_dir(digest).iterdir():
            if p.name.endswith(".tmp"):
                continue
            a, _, b = p.name.partition("-")
            out.append((int(a), int(b)))
        return sorted(out)

    def _assemble(self, api: Api, digest: str, extent: int, range_bytes: int) -> None:
        """Join the parts, check the digest; an object longer than the frames' extent gets its tail fetched."""
        for attempt in range(2):
            cursor = self._join(digest)
            if cursor < 0:
                return
            if attempt:
                break
            size = api.head_object(digest)
            if size <= cursor:
                break
            # The frames use only a prefix of this object: fetch the rest to check the digest.
            for job in self._ranges(digest, cursor, size, range_bytes):
                if job is not None:
                    self._fetch_range(api, *job, whole=True)
        self._drop_parts(digest)
        raise errors.DigestMismatch(f"object {digest} was received with other bytes")

    def _chain(self, digest: str) -> list[tuple[int, int, int]]:
        """Parts that tile [0, n) in order, as (start, end, skip): `skip` bytes of the part are already covered."""
        parts = self._held_parts(digest)
        chain: list[tuple[int, int, int]] = []
        cursor = 0
        while True:
            best = max((p for p in parts if p[0] <= cursor < p[1]), key=lambda p: p[1], default=None)
            if best is None:
                return chain
            chain.append((best[0], best[1], cursor - best[0]))
            cursor = best[1]

    def _join(self, digest: str) -> int:
        """Concatenate the parts; store the object and return -1 if they hash to `digest`,
        else return how many bytes they cover."""
        h = hashlib.sha256()
        cursor = 0
        chain = self._chain(digest)
        if self.root is None:
            chunks = []
            for a, b, skip in chain:
                chunks.append(self._mem_parts[(digest, a, b)][skip:])
                with self._lock:
                    ahead = self._mem_hashed.get((digest, a, b)) if not a and not skip else None
                if ahead is not None:  # the first part, hashed as it arrived
                    h = ahead.copy()
                else:
                    h.update(chunks[-1])
                cursor = b
            if h.hexdigest() != digest:
                return cursor
            self._mem[digest] = _joined(chunks)
        else:
            sink = _FileSink(self._path(digest))
            try:
                for a, b, skip in chain:
                    with open(self._parts_dir(digest) / f"{a}-{b}", "rb") as f:
                        f.seek(skip)
                        while chunk := f.read(4 << 20):
                            h.update(chunk)
                            sink(chunk)
                    cursor = b
            except BaseException:
                sink.abandon()
                raise
            if h.hexdigest() != digest:
                sink.abandon()
                return cursor
            sink.finish()
        with self._lock:
            self._verified.add(digest)
        self._drop_parts(digest)
        return -1

    def _drop_parts(self, digest: str) -> None:
        if self.root is None:
            with self._lock:
                for key in [k for k in self._mem_parts if k[0] == digest]:
                    del self._mem_parts[key]
                    self._mem_hashed.pop(key, None)
        else:
            shutil.rmtree(self._parts_dir(digest), ignore_errors=True)


def _joined(chunks: list[Any]) -> bytes | memoryview:
    """The bytes of `chunks` in order: one chunk, or chunks lying one after another in one buffer (the ranges of an
    object read into it), as a view, not copied; others joined into a copy."""
    if len(chunks) <= 1:
        return chunks[0] if chunks else b""
    views = [memoryview(c) for c in chunks]
    owner = views[0].obj
    if isinstance(owner, np.ndarray) and all(v.obj is owner for v in views):
        whole = owner.reshape(-1).view(np.uint8)
        base = whole.ctypes.data
        at = np.frombuffer(views[0], dtype=np.uint8).ctypes.data - base
        cursor = at
        for v in views:
            if np.frombuffer(v, dtype=np.uint8).ctypes.data - base != cursor:
                break
            cursor += v.nbytes
        else:
            return whole[at:cursor].data.toreadonly()
    return b"".join(views)


class Parts:
    """Ranges of one object read out of the parts fetched of it (maps kept open). Thread-safe."""

    def __init__(self, cache: ObjectCache, digest: str, held: list[tuple[int, int]]) -> None:
        self.cache = cache
        self.digest = digest
        self.held = held
        self._maps: dict[tuple[int, int], memoryview | np.ndarray] = {}
        self._lock = threading.Lock()

    def read(self, start: int, end: int) -> memoryview | np.ndarray:
        """Bytes [start, end) of the object (copied only when they span parts); TruncatedInput if not all fetched."""
        chunks: list[memoryview | np.ndarray] = []
        cursor = start
        while cursor < end:
            part = max((p for p in self.held if p[0] <= cursor < p[1]), key=lambda p: p[1], default=None)
            if part is None:
                raise errors.TruncatedInput(f"object {self.digest}: bytes {cursor}-{end} were not fetched")
            with self._lock:
                data = self._maps.get(part)
                if data is None:
                    data = self._maps[part] = self.cache.read_part(self.digest, *part)
            upto = min(end, part[1])
            chunks.append(data[cursor - part[0] : upto - part[0]])
            cursor = upto
        if len(chunks) == 1:
            return chunks[0]
        return np.concatenate([np.frombuffer(c, dtype=np.uint8) for c in chunks])


def object_reader(cache: ObjectCache) -> Callable[[FrameRef], memoryview | np.ndarray]:
    """A `read_frame(ref)` for the decoder: frame bytes sliced out of cached objects (maps kept open), or
    out of the parts `ObjectCache.fetch_extents` fetched of an object the cache does not hold whole."""
    opened: dict[str, memoryview | np.ndarray | Parts] = {}
    lock = threading.Lock()

    def read(ref: FrameRef) -> memoryview | np.ndarray:
        digest = ref.object
        if digest is None:  # only a delta container's frames live nowhere else; a stored manifest names objects
            raise errors.FormatError("a stored manifest's frame names no object")
        with lock:
            data = opened.get(digest)
            if data is None:
                data = opened[digest] = cache.read(digest) if cache.has(digest) else cache.parts(digest)
        if isinstance(data, Parts):
            return data.read(ref.offset, ref.offset + ref.length)
        if ref.offset + ref.length > len(data):
            raise errors.TruncatedInput(f"frame at {ref.offset}+{ref.length} lies past the end of object {digest}")
        return data[ref.offset : ref.offset + ref.length]

    return read
