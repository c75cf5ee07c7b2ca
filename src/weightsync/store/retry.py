"""Retry as a wrapper: bounded, jittered exponential backoff on StoreUnavailable only.

Backends make one attempt per call and report transient failures as
:class:`~weightsync.errors.StoreUnavailable`; this wrapper is the single place
that decides to try again, so retry policy is the same for every backend and
can be tested against :class:`~weightsync.store.faulty.FaultyStore`. Every
other error (ObjectNotFound, DigestMismatch, InvalidRange, StoreError…) is a
fact about the request, and is raised at once.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import TypeVar

from weightsync import errors
from weightsync.common import Backoff
from weightsync.store.base import (
    DEFAULT_CHUNK_SIZE,
    ForwardingStore,
    ObjectInfo,
    ObjectStore,
    PresignedRequest,
    PutResult,
    validate_prefix,
)

__all__ = ["RetryingStore"]

T = TypeVar("T")


async def _aclose(it: AsyncIterator[object]) -> None:
    aclose = getattr(it, "aclose", None)
    if aclose is not None:
        await aclose()


class RetryingStore(ForwardingStore):
    """Wrap ``inner`` so transient failures are retried up to ``attempts`` times in total.

    Delays use "full jitter": attempt *i* (from 0) waits a uniform random time
    in ``[0, min(max_delay, base_delay * 2**i)]``, which spreads out clients
    that failed together. Retried writes are safe because writes are
    idempotent; a write whose reply was lost reports ``created=False`` on the
    retry. Streaming reads and listings resume where they broke instead of
    starting over; their failure budget is reset whenever they make progress
    (new bytes or new entries), so they always terminate.

    ``put_stream`` is not retried: a consumed stream cannot be replayed. The
    producer of the stream (e.g. the HTTP client) must retry the whole upload.
    """

    def __init__(
        self,
        inner: ObjectStore,
        *,
        attempts: int = 5,
        base_delay: float = 0.1,
        max_delay: float = 5.0,
        seed: int | None = None,
        sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
    ) -> None:
        self.policy = Backoff(attempts=attempts, base=base_delay, cap=max_delay)
        super().__init__(inner)
        self.attempts = attempts
        self.base_delay = base_delay
        self.max_delay = max_delay
        self._rng = random.Random(seed)
        self._sleep = sleep
        #: How many retries this wrapper has made (for metrics and tests).
        self.retries = 0

    def __repr__(self) -> str:
        return f"RetryingStore({self.inner!r}, attempts={self.attempts})"

    def delay(self, attempt: int) -> float:
        """Return the wait before retry number ``attempt`` (0-based): full jitter, capped."""
        return self.policy.delay(attempt, rng=self._rng)

    async def _backoff(self, failures: int, error: errors.StoreUnavailable) -> None:
        """Sleep before the next try, or re-raise ``error`` once the budget is spent."""
        if failures >= self.attempts:
            raise error
        self.retries += 1
        await self._sleep(self.delay(failures - 1))

    async def _call(self, fn: Callable[[], Awaitable[T]]) -> T:
        failures = 0
        while True:
            try:
                return await fn()
            except errors.StoreUnavailable as e:
                failures += 1
                await self._backoff(failures, e)

    async def open(self) -> None:
        """Open the inner store now (S3: connect, bucket, probe); retried.

        Without this, a caller opening the store explicitly at start-up (``weightsync serve``)
        reached the backend's ``open`` past the retries, and one transient fault failed the start.
        """
        await self._call(self.inner.open)

    async def put(self, data: bytes, *, expected_digest: str | None = None) -> PutResult:
        """See :meth:`ObjectStore.put`; retried."""
        return await self._call(lambda: self.inner.put(data, expected_digest=expected_digest))

    async def put_stream(
        self,
        chunks: AsyncIterable[bytes],
        *,
        expected_digest: str | None = None,
        max_size: int | None = None,
    ) -> PutResult:
        """See :meth:`ObjectStore.put_stream`; not retried (a stream cannot be replayed)."""
        return await self.inner.put_stream(chunks, expected_digest=expected_digest, max_size=max_size)

    async def get(self, digest: str, *, offset: int = 0, length: int | None = None) -> bytes:
        """See :meth:`ObjectStore.get`; retried."""
        return await self._call(lambda: self.inner.get(digest, offset=offset, length=length))

    async def iter_range(
        self,
        digest: str,
        *,
        offset: int = 0,
        length: int | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
    ) -> AsyncIterator[bytes]:
        """See :meth:`ObjectStore.iter_range`; a broken transfer resumes at the first byte not yet yielded."""
        delivered = 0
        failures = 0
        while True:
            it = self.inner.iter_range(
                digest,
                offset=offset + delivered,
                length=None if length is None else length - delivered,
                chunk_size=chunk_size,
            ).__aiter__()
            try:
                while True:
                    try:
                        chunk = await it.__anext__()
                    except StopAsyncIteration:
                        return
                    except errors.StoreUnavailable as e:
                        failures += 1
                        await self._backoff(failures, e)
                        break
                    delivered += len(chunk)
                    failures = 0
                    yield chunk
            finally:
                await _aclose(it)

    async def stat(self, digest: str) -> ObjectInfo:
        """See :meth:`ObjectStore.stat`; retried."""
        return await self._call(lambda: self.inner.stat(digest))

    async def exists(self, digest: str) -> bool:
        """See :meth:`ObjectStore.exists`; retried."""
        return await self._call(lambda: self.inner.exists(digest))

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        """See :meth:`ObjectStore.list`; a listing that breaks midway resumes by sub-prefix.

        Listings have no cursor (order is unspecified), so a prefix whose
        listing broke after yielding something is split into its 16 one-hex-
        digit-longer sub-prefixes, each listed on its own: finished parts are
        never listed again and later failures cost less. Digests already
        yielded are remembered (64 bytes each) and skipped, keeping "each
        object at most once". A listing that fails before yielding anything
        is retried as is.
        """
        validate_prefix(prefix)
        seen: set[str] = set()
        pending = [prefix]
        failures = 0
        while pending:
            current = pending.pop()
            it = self.inner.list(current).__aiter__()
            got_any = False
            try:
                while True:
                    try:
                        info = await it.__anext__()
                    except StopAsyncIteration:
                        break
                    except errors.StoreUnavailable as e:
                        failures += 1
                        await self._backoff(failures, e)
                        if got_any and len(current) < 64:
                            pending.extend(current + c for c in "0123456789abcdef")
                        else:
                            pending.append(current)
                        break
                    got_any = True
                    if info.digest in seen:
                        continue
                    seen.add(info.digest)
                    failures = 0
                    yield info
            finally:
                await _aclose(it)

    async def delete(self, digest: str) -> None:
        """See :meth:`ObjectStore.delete`; retried (delete is idempotent)."""
        await self._call(lambda: self.inner.delete(digest))

    async def presign_get(self, digest: str, expires_s: int) -> str:
        """See :meth:`ObjectStore.presign_get`; retried."""
        return await self._call(lambda: self.inner.presign_get(digest, expires_s))

    async def presign_put(self, digest: str, size: int, expires_s: int) -> PresignedRequest:
        """See :meth:`ObjectStore.presign_put`; retried."""
        return await self._call(lambda: self.inner.presign_put(digest, size, expires_s))
