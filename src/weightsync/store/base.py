"""The object store interface: immutable bytes addressed by their SHA-256.

This module is the whole contract every backend implements (docs/STORE.md is
its prose form). It imports no provider: ``fs.py`` and ``s3.py`` are parallel
modules with the same shape, and wrappers (``retry.py``, ``faulty.py``)
compose over any :class:`ObjectStore`.

Names used throughout:

* *digest*: 64 lowercase hex characters, the SHA-256 of the object's bytes,
  always computed by the store on write and never trusted from a caller.
* *range*: ``offset`` (>= 0) and ``length`` (>= 0, or ``None`` for "to the
  end"). A range must lie inside the object: a read returns exactly the bytes
  asked for or raises; it never silently returns fewer.
"""

from __future__ import annotations

import abc
import asyncio
import hashlib
import re
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime
from types import TracebackType

from weightsync import errors

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "Capabilities",
    "ForwardingStore",
    "ObjectInfo",
    "ObjectStore",
    "PresignedRequest",
    "PutResult",
    "check_expected",
    "check_max_size",
    "check_range",
    "hash_stream",
    "sha256_hex",
    "sha256_hex_async",
    "validate_digest",
    "validate_prefix",
]

#: Default size of the pieces :meth:`ObjectStore.iter_range` yields.
DEFAULT_CHUNK_SIZE = 1024 * 1024

_DIGEST_RE = re.compile(r"[0-9a-f]{64}")
_PREFIX_RE = re.compile(r"[0-9a-f]{0,64}")


def validate_digest(digest: object) -> str:
    """Return ``digest`` if it is 64 lowercase hex characters, else raise InvalidDigest.

    Every backend derives paths and keys only from strings that passed this
    check, so a digest can never name anything outside the store's namespace
    (no ``/``, ``..``, NUL or uppercase aliases).
    """
    if not isinstance(digest, str) or _DIGEST_RE.fullmatch(digest) is None:
        raise errors.InvalidDigest(f"not a lowercase hex SHA-256 digest: {digest!r:.80}")
    return digest


def validate_prefix(prefix: object) -> str:
    """Return ``prefix`` if it is 0-64 lowercase hex characters, else raise InvalidDigest."""
    if not isinstance(prefix, str) or _PREFIX_RE.fullmatch(prefix) is None:
        raise errors.InvalidDigest(f"not a lowercase hex digest prefix: {prefix!r:.80}")
    return prefix


def sha256_hex(data: bytes | bytearray | memoryview) -> str:
    """Return the lowercase hex SHA-256 of ``data`` (the name the store gives it)."""
    return hashlib.sha256(data).hexdigest()


def check_range(size: int, offset: int, length: int | None) -> int:
    """Return how many bytes the range (offset, length) covers in an object of ``size`` bytes.

    Raises InvalidRange if ``offset`` or ``length`` is negative, if ``offset``
    is past the end, or if ``offset + length`` is past the end. ``offset ==
    size`` is allowed and covers zero bytes, so an empty object can be read.
    """
    if offset < 0 or (length is not None and length < 0):
        raise errors.InvalidRange(f"negative range: offset={offset} length={length}")
    if offset > size:
        raise errors.InvalidRange(f"offset {offset} is past the end of a {size}-byte object")
    if length is None:
        return size - offset
    if length > size - offset:
        raise errors.InvalidRange(f"range {offset}+{length} is past the end of a {size}-byte object")
    return length


def check_max_size(size: int, max_size: int | None) -> None:
    """Raise LimitExceeded if ``size`` bytes is more than ``max_size`` (None: no limit)."""
    if max_size is not None and size > max_size:
        raise errors.LimitExceeded(f"object exceeds the size limit of {max_size} bytes")


def check_expected(digest: str, expected: str | None) -> None:
    """Raise DigestMismatch if ``expected`` is given and differs from the computed ``digest``."""
    if expected is not None and digest != expected:
        raise errors.DigestMismatch(f"bytes hash to {digest}, not to the claimed {expected}")


#: Hash in a worker thread above this size: hashlib releases the GIL, and a
#: multi-megabyte hash on the event loop would stall every other request.
HASH_OFF_LOOP = 1024 * 1024


async def sha256_hex_async(data: bytes | bytearray | memoryview) -> str:
    """Like :func:`sha256_hex`, off the event loop for large inputs."""
    if len(data) > HASH_OFF_LOOP:
        return await asyncio.to_thread(sha256_hex, data)
    return sha256_hex(data)


async def hash_stream(chunks: AsyncIterable[bytes], max_size: int | None) -> tuple[str, int]:
    """Consume ``chunks`` and return their SHA-256 and total length, storing nothing.

    Used when the object already exists: the caller's bytes are still
    verified, but not written again. LimitExceeded past ``max_size``.
    """
    hasher = hashlib.sha256()
    size = 0
    async for chunk in chunks:
        size += len(chunk)
        check_max_size(size, max_size)
        if len(chunk) > HASH_OFF_LOOP:
            await asyncio.to_thread(hasher.update, chunk)
        else:
            hasher.update(chunk)
    return hasher.hexdigest(), size


@dataclass(frozen=True)
class PutResult:
    """What a write stored: the object's digest and size, and whether this call created it."""

    digest: str
    size: int
    #: False if the object already existed (nothing was rewritten). Advisory,
    #: never proof of who wrote first: a retried write whose first reply was
    #: lost reports False, and racing multipart writers on a server that does
    #: not serialise conditional completions (SeaweedFS) may all report True.
    created: bool


@dataclass(frozen=True)
class ObjectInfo:
    """Metadata of one stored object."""

    digest: str
    size: int
    #: When the object was written, timezone-aware (UTC).
    mtime: datetime


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do, as data: callers branch on this, never on the backend type."""

    #: presign_get / presign_put are available.
    presigned_urls: bool = False
    #: Largest object the backend accepts, or None for "no limit of its own".
    max_object_size: int | None = None
    #: Size of the parts of a multipart upload, or None if the backend has none.
    multipart_part_size: int | None = None
    #: Writes are create-once at the storage layer (link-if-absent, or
    #: If-None-Match honoured by the server). None: not verified yet.
    atomic_create: bool | None = True


@dataclass(frozen=True)
class PresignedRequest:
    """An HTTP request a third party may send without credentials until ``expires_at``.

    The sender must send every header in ``headers`` unchanged: they are part
    of the signature, and that is what binds the request to one object's bytes.
    """

    method: str
    url: str
    headers: dict[str, str] = field(default_factory=dict)
    expires_at: datetime | None = None


class ObjectStore(abc.ABC):
    """A content-addressed store of immutable objects.

    Thread-safety: an instance belongs to one event loop; any number of tasks
    on that loop may call it concurrently. Several processes may share the
    same underlying storage: every write is create-once and objects are never
    modified, so concurrent writers of the same object cannot corrupt it.
    Use as ``async with store:`` or call :meth:`close`.
    """

    @property
    @abc.abstractmethod
    def capabilities(self) -> Capabilities:
        """What this backend supports (see :class:`Capabilities`)."""

    @abc.abstractmethod
    async def put(self, data: bytes, *, expected_digest: str | None = None) -> PutResult:
        """Store ``data`` under its SHA-256 once; idempotent, nothing partial is ever visible.

        If ``expected_digest`` is given and ``data`` does not hash to it, raise
        DigestMismatch and leave nothing behind. An invalid ``expected_digest``
        raises InvalidDigest before any IO. Writing an object that already
        exists does not rewrite it and returns ``created=False``.
        """

    @abc.abstractmethod
    async def put_stream(
        self,
        chunks: AsyncIterable[bytes],
        *,
        expected_digest: str | None = None,
        max_size: int | None = None,
    ) -> PutResult:
        """Store the concatenation of ``chunks`` under its SHA-256, hashing while writing.

        Same contract as :meth:`put`. The stream is always consumed to its end
        and verified, even when the object already exists (then nothing is
        written and ``created=False``). More than ``max_size`` bytes (or more
        than ``capabilities.max_object_size``) raises LimitExceeded as soon as
        the limit is crossed. On any failure, including cancellation, nothing
        is left behind: no object, no temporary file, no pending upload.
        """

    async def get(self, digest: str, *, offset: int = 0, length: int | None = None) -> bytes:
        """Return exactly the bytes of the range; ObjectNotFound if absent, InvalidRange if outside.

        The bytes are not re-hashed: callers that need integrity verify them
        (a full read can be checked against ``digest``).
        """
        parts = [c async for c in self.iter_range(digest, offset=offset, length=length)]
        return b"".join(parts)

    @abc.abstractmethod
    def iter_range(
        self,
        digest: str,
        *,
        offset: int = 0,
        length: int | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
    ) -> AsyncIterator[bytes]:
        """Yield the bytes of the range in pieces of at most ``chunk_size``, never buffering it whole.

        Errors are the same as :meth:`get` and are raised on the first
        iteration. If the transfer breaks midway the iterator raises
        StoreUnavailable; it never ends early without an error.
        """

    @abc.abstractmethod
    async def stat(self, digest: str) -> ObjectInfo:
        """Return the object's size and mtime; ObjectNotFound if absent."""

    async def exists(self, digest: str) -> bool:
        """Return whether the object exists (InvalidDigest for a malformed digest)."""
        try:
            await self.stat(digest)
        except errors.ObjectNotFound:
            return False
        return True

    @abc.abstractmethod
    def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        """Yield every object whose digest starts with the hex ``prefix``, in no particular order.

        Each object appears at most once. Objects written or deleted while
        the listing runs may or may not appear. A malformed prefix raises
        InvalidDigest.
        """

    @abc.abstractmethod
    async def delete(self, digest: str) -> None:
        """Remove the object; idempotent: deleting an absent object is not an error.

        Only garbage collection should call this (objects are otherwise immutable).
        """

    async def presign_get(self, digest: str, expires_s: int) -> str:
        """Return a URL that GETs the object without credentials for ``expires_s`` seconds.

        Needs ``capabilities.presigned_urls``; otherwise raises Unsupported.
        """
        raise errors.Unsupported(f"{type(self).__name__} cannot presign URLs")

    async def presign_put(self, digest: str, size: int, expires_s: int) -> PresignedRequest:
        """Return a request that uploads exactly the object ``digest`` of ``size`` bytes, once.

        The request is bound to the bytes: the server refuses a body that does
        not hash to ``digest`` or is not ``size`` bytes long. Needs
        ``capabilities.presigned_urls``; otherwise raises Unsupported.
        """
        raise errors.Unsupported(f"{type(self).__name__} cannot presign URLs")

    async def open(self) -> None:  # noqa: B027 - an optional hook: most backends have nothing to open
        """Connect and check the backend now, so bad settings fail at start rather than at the first call.

        Idempotent, and optional: every other call opens lazily what it needs. A backend
        opens its connections and checks what it can (S3: the HTTP client, the bucket, created
        if allowed, and the If-None-Match probe that sets ``capabilities.atomic_create``); the
        filesystem store has nothing to open. A wrapper opens its inner store. Transient
        failures raise StoreUnavailable (RetryingStore retries them); :meth:`close` releases
        what ``open`` acquired, after which the store may be opened again.
        """

    async def close(self) -> None:  # noqa: B027 - an optional hook: most backends hold nothing
        """Release connections and other resources; the store is unusable afterwards."""

    async def __aenter__(self) -> ObjectStore:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


class ForwardingStore(ObjectStore):
    """An ObjectStore that passes every call to ``inner``: the base of wrappers.

    A wrapper overrides only the calls it changes (retry, fault injection,
    metrics), which keeps such behaviour out of the backends.
    """

    def __init__(self, inner: ObjectStore) -> None:
        self.inner = inner

    @property
    def capabilities(self) -> Capabilities:
        """The inner store's capabilities."""
        return self.inner.capabilities

    async def put(self, data: bytes, *, expected_digest: str | None = None) -> PutResult:
        """See :meth:`ObjectStore.put`."""
        return await self.inner.put(data, expected_digest=expected_digest)

    async def put_stream(
        self,
        chunks: AsyncIterable[bytes],
        *,
        expected_digest: str | None = None,
        max_size: int | None = None,
    ) -> PutResult:
        """See :meth:`ObjectStore.put_stream`."""
        return await self.inner.put_stream(chunks, expected_digest=expected_digest, max_size=max_size)

    async def get(self, digest: str, *, offset: int = 0, length: int | None = None) -> bytes:
        """See :meth:`ObjectStore.get`."""
        return await self.inner.get(digest, offset=offset, length=length)

    def iter_range(
        self,
        digest: str,
        *,
        offset: int = 0,
        length: int | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
    ) -> AsyncIterator[bytes]:
        """See :meth:`ObjectStore.iter_range`."""
        return self.inner.iter_range(digest, offset=offset, length=length, chunk_size=chunk_size)

    async def stat(self, digest: str) -> ObjectInfo:
        """See :meth:`ObjectStore.stat`."""
        return await self.inner.stat(digest)

    async def exists(self, digest: str) -> bool:
        """See :meth:`ObjectStore.exists`."""
        return await self.inner.exists(digest)

    def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        """See :meth:`ObjectStore.list`."""
        return self.inner.list(prefix)

    async def delete(self, digest: str) -> None:
        """See :meth:`ObjectStore.delete`."""
        await self.inner.delete(digest)

    async def presign_get(self, digest: str, expires_s: int) -> str:
        """See :meth:`ObjectStore.presign_get`."""
        return await self.inner.presign_get(digest, expires_s)

    async def presign_put(self, digest: str, size: int, expires_s: int) -> PresignedRequest:
        """See :meth:`ObjectStore.presign_put`."""
        return await self.inner.presign_put(digest, size, expires_s)

    async def open(self) -> None:
        """Open the inner store (see :meth:`ObjectStore.open`)."""
        await self.inner.open()

    async def close(self) -> None:
        """Close the inner store."""
        await self.inner.close()
