"""Filesystem object store: the default backend (docs/STORE.md, "Filesystem layout").

Layout under ``root``::

    objects/ab/cd/abcd…(64 hex)   one file per object, read-only, never modified
    tmp/<random>.tmp              writes in progress; stale ones are harmless

A write goes to a temporary file in ``tmp/`` (same filesystem, so the final
step is a metadata operation), is fsynced, then hard-linked to its final name.
``link`` fails if the name exists, which makes the write create-once without
any lock even across processes; the directory is then fsynced so the new name
survives a crash. Every blocking call runs in a worker thread
(``asyncio.to_thread``) so the event loop keeps serving.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import os
import secrets
import time
from collections.abc import AsyncIterable, AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

from weightsync import errors
from weightsync.common import pread_exact
from weightsync.store.base import (
    DEFAULT_CHUNK_SIZE,
    Capabilities,
    ObjectInfo,
    ObjectStore,
    PutResult,
    check_expected,
    check_max_size,
    check_range,
    hash_stream,
    sha256_hex_async,
    validate_digest,
    validate_prefix,
)

__all__ = ["FsStore"]

# Errors meaning "this filesystem has no hard links" (some FUSE and SMB mounts).
_NO_LINK_ERRNOS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _mtime(st: os.stat_result) -> datetime:
    return datetime.fromtimestamp(st.st_mtime, tz=UTC)


class FsStore(ObjectStore):
    """Objects as files under ``root``; safe for many tasks and many processes sharing ``root``.

    ``fsync=False`` skips every fsync: only for throwaway stores (tests,
    caches), since a crash may then leave a named but empty object.
    """

    def __init__(self, root: str | os.PathLike[str], *, fsync: bool = True, create: bool = True) -> None:
        self.root = Path(os.path.abspath(root))
        self._objects = self.root / "objects"
        self._tmp = self.root / "tmp"
        self._fsync = fsync
        # Flipped the first time link() is refused; rename-if-absent is then
        # used, which is not atomic between check and rename (see _publish).
        self._links_work = True
        if create:
            self._objects.mkdir(parents=True, exist_ok=True)
            self._tmp.mkdir(parents=True, exist_ok=True)
        elif not self._objects.is_dir():
            raise errors.StoreError(f"no object store at {self.root}")

    def __repr__(self) -> str:
        return f"FsStore({str(self.root)!r})"

    @property
    def capabilities(self) -> Capabilities:
        """No presigned URLs, no size limit of its own, create-once while hard links work."""
        return Capabilities(
            presigned_urls=False,
            max_object_size=None,
            multipart_part_size=None,
            atomic_create=self._links_work,
        )

    def path_of(self, digest: str) -> Path:
        """Return the file that holds ``digest``; derived only from a validated digest."""
        d = validate_digest(digest)
        return self._objects / d[:2] / d[2:4] / d

    # --- writes ---------------------------------------------------------------------

    def _new_temp(self) -> tuple[Path, int]:
        path = self._tmp / f"{secrets.token_hex(16)}.tmp"
        # 0o444: objects are immutable, so they are never writable once named.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o444)
        return path, fd

    def _ensure_dirs(self, final: Path) -> None:
        # Each new fan-out directory must itself be durable before the object
        # name inside it can be: fsync the parent that gained the entry.
        for d in (final.parent.parent, final.parent):
            try:
                d.mkdir()
            except FileExistsError:
                continue
            if self._fsync:
                _fsync_dir(d.parent)

    def _publish(self, tmp: Path, final: Path) -> bool:
        """Give the fsynced temp file its final name unless it exists; return whether it was created."""
        self._ensure_dirs(final)
        created = False
        try:
            if self._links_work:
                try:
                    os.link(tmp, final)
                    created = True
                except FileExistsError:
                    created = False
                except OSError as e:
                    if e.errno not in _NO_LINK_ERRNOS:
                        raise
                    self._links_work = False
            if not self._links_work and not final.exists():
                # Without links two writers can both pass the check; both
                # rename identical bytes, so the object is still correct and
                # only `created` may be True twice.
                os.replace(tmp, final)
                created = True
        finally:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        if created and self._fsync:
            _fsync_dir(final.parent)
        return created

    def _write_whole(self, digest: str, data: bytes | bytearray | memoryview) -> bool:
        final = self.path_of(digest)
        if final.exists():
            return False
        tmp, fd = self._new_temp()
        try:
            try:
                view = memoryview(data)
                while view:
                    n = os.write(fd, view)
                    view = view[n:]
                if self._fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            return self._publish(tmp, final)
        except BaseException:
            _unlink_quietly(tmp)
            raise

    async def put(self, data: bytes, *, expected_digest: str | None = None) -> PutResult:
        """See :meth:`ObjectStore.put`."""
        if expected_digest is not None:
            validate_digest(expected_digest)
        digest = await sha256_hex_async(data)
        check_expected(digest, expected_digest)
        created = await asyncio.to_thread(self._write_whole, digest, data)
        return PutResult(digest=digest, size=len(data), created=created)

    async def put_stream(
        self,
        chunks: AsyncIterable[bytes],
        *,
        expected_digest: str | None = None,
        max_size: int | None = None,
    ) -> PutResult:
        """See :meth:`ObjectStore.put_stream`."""
        if expected_digest is not None:
            validate_digest(expected_digest)
            if await self.exists(expected_digest):
                # Verify what the caller sent, but do not write it again.
                digest, size = await hash_stream(chunks, max_size)
                check_expected(digest, expected_digest)
                return PutResult(digest=digest, size=size, created=False)

        hasher = hashlib.sha256()
        size = 0
        tmp, fd = await asyncio.to_thread(self._new_temp)
        try:
            try:
                async for chunk in chunks:
                    if not chunk:
                        continue
                    size += len(chunk)
                    check_max_size(size, max_size)
                    await asyncio.to_thread(_hash_and_write, fd, hasher, chunk)
                if self._fsync:
                    await asyncio.to_thread(os.fsync, fd)
            finally:
                os.close(fd)
            digest = hasher.hexdigest()
            check_expected(digest, expected_digest)
            created = await asyncio.to_thread(self._publish, tmp, self.path_of(digest))
        except BaseException:
            # Synchronous on purpose: this also runs on cancellation, where
            # awaiting a thread could itself be cancelled and leak the file.
            _unlink_quietly(tmp)
            raise
        return PutResult(digest=digest, size=size, created=created)

    # --- reads ----------------------------------------------------------------------

    def _open(self, digest: str) -> int:
        try:
            return os.open(self.path_of(digest), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise errors.ObjectNotFound(f"no object {digest}") from None

    def _read_range(self, digest: str, offset: int, length: int | None) -> bytes:
        fd = self._open(digest)
        try:
            n = check_range(os.fstat(fd).st_size, offset, length)
            return pread_exact(fd, n, offset)
        finally:
            os.close(fd)

    async def get(self, digest: str, *, offset: int = 0, length: int | None = None) -> bytes:
        """See :meth:`ObjectStore.get`."""
        validate_digest(digest)
        return await asyncio.to_thread(self._read_range, digest, offset, length)

    async def iter_range(
        self,
        digest: str,
        *,
        offset: int = 0,
        length: int | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
    ) -> AsyncIterator[bytes]:
        """See :meth:`ObjectStore.iter_range`."""
        validate_digest(digest)
        if chunk_size <= 0:
            raise ValueError("chunk_size must be positive")
        fd = await asyncio.to_thread(self._open, digest)
        try:
            remaining = check_range(os.fstat(fd).st_size, offset, length)
            pos = offset
            while remaining:
                n = min(chunk_size, remaining)
                chunk = await asyncio.to_thread(pread_exact, fd, n, pos)
                pos += n
                remaining -= n
                yield chunk
        finally:
            os.close(fd)

    async def stat(self, digest: str) -> ObjectInfo:
        """See :meth:`ObjectStore.stat`."""
        path = self.path_of(digest)
        try:
            st = await asyncio.to_thread(os.stat, path)
        except FileNotFoundError:
            raise errors.ObjectNotFound(f"no object {digest}") from None
        return ObjectInfo(digest=digest, size=st.st_size, mtime=_mtime(st))

    async def exists(self, digest: str) -> bool:
        """See :meth:`ObjectStore.exists`."""
        path = self.path_of(digest)
        return await asyncio.to_thread(path.is_file)

    def _scan_leaf(self, leaf: Path, prefix: str) -> list[ObjectInfo]:
        found: list[ObjectInfo] = []
        try:
            entries = list(os.scandir(leaf))
        except FileNotFoundError:
            return found
        for entry in entries:
            name = entry.name
            # Only names that are digests and sit in their own fan-out
            # directory count; anything else is not ours.
            if not name.startswith(prefix) or len(name) != 64 or name[2:4] != leaf.name:
                continue
            try:
                validate_digest(name)
                st = entry.stat(follow_symlinks=False)
            except (errors.InvalidDigest, FileNotFoundError):
                continue
            found.append(ObjectInfo(digest=name, size=st.st_size, mtime=_mtime(st)))
        return found

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        """See :meth:`ObjectStore.list`."""
        validate_prefix(prefix)
        for top in await asyncio.to_thread(_subdirs, self._objects, prefix[:2]):
            for leaf in await asyncio.to_thread(_subdirs, top, prefix[2:4]):
                for info in await asyncio.to_thread(self._scan_leaf, leaf, prefix):
                    yield info

    async def delete(self, digest: str) -> None:
        """See :meth:`ObjectStore.delete`.

        The directory is not fsynced: a delete undone by a crash is re-run by the next GC.
        """
        path = self.path_of(digest)
        await asyncio.to_thread(_unlink_quietly, path)

    # --- maintenance ----------------------------------------------------------------

    def _cleanup_temp(self, older_than_s: float) -> int:
        cutoff = time.time() - older_than_s
        removed = 0
        try:
            entries = list(os.scandir(self._tmp))
        except FileNotFoundError:
            return 0
        for entry in entries:
            try:
                if entry.is_file(follow_symlinks=False) and entry.stat().st_mtime < cutoff:
                    os.unlink(entry.path)
                    removed += 1
            except FileNotFoundError:
                continue
        return removed

    async def cleanup_temp(self, older_than_s: float = 3600.0) -> int:
        """Delete temporary files older than ``older_than_s`` seconds; return how many.

        Temporary files are only left by crashed writers and are never visible
        as objects, so this is housekeeping, not repair. A live writer touches
        its file continuously, so pick a threshold longer than the slowest
        upload can stall.
        """
        return await asyncio.to_thread(self._cleanup_temp, older_than_s)


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _hash_and_write(fd: int, hasher: hashlib._Hash, chunk: bytes) -> None:
    hasher.update(chunk)
    view = memoryview(chunk)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _subdirs(parent: Path, prefix: str) -> list[Path]:
    """Fan-out directories of ``parent`` (two hex chars) compatible with ``prefix``."""
    try:
        entries = list(os.scandir(parent))
    except FileNotFoundError:
        return []
    return [
        Path(e.path)
        for e in entries
        if len(e.name) == 2 and e.name.startswith(prefix) and e.is_dir(follow_symlinks=False)
    ]
