"""Fault injection as a wrapper: real failures, deterministic for a seed (like kopia's blobtesting/faulty.go).

FaultyStore sits in front of any real backend and makes it misbehave the way
networks and disks do: transient errors before a call reaches the backend or
after it succeeded (a lost reply), added latency, bit flips and silent
truncation in the bytes read, transfers that break midway, and writes whose
connection dies halfway through. The injected failures go through the inner
backend's real code paths (a short write really streams a partial object
into the backend and then fails), so the tests exercise real cleanup.

Determinism: every decision draws from one ``random.Random(seed)``, so the
same sequence of calls produces the same faults. Concurrent tasks interleave
draws in scheduling order, which asyncio keeps stable for a given program.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import AsyncIterable, AsyncIterator, Collection

from weightsync import errors
from weightsync.store.base import (
    DEFAULT_CHUNK_SIZE,
    ForwardingStore,
    ObjectInfo,
    ObjectStore,
    PresignedRequest,
    PutResult,
)

__all__ = ["FaultyStore", "OPERATIONS"]

#: Operation names accepted in ``ops`` and used as keys of ``calls``.
OPERATIONS = frozenset(
    {"put", "put_stream", "get", "iter_range", "stat", "exists", "list", "delete", "presign_get", "presign_put"}
)

# A short write feeds the backend this much at a time, so a large object
# really crosses multipart part boundaries before the connection "dies".
_WRITE_PIECE = 1024 * 1024


def _check_rate(name: str, value: float) -> float:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be within [0, 1]")
    return value


class FaultyStore(ForwardingStore):
    """Wrap ``inner`` and inject faults at the given rates (each a probability per call or per chunk).

    * ``fail_first``: the first N calls of each operation raise StoreUnavailable.
    * ``error_rate``: a call raises StoreUnavailable before reaching ``inner``.
    * ``lost_reply_rate``: a call reaches ``inner``, succeeds, then raises
      StoreUnavailable (the reply was lost); writes are then already done.
    * ``latency_s``: each call first sleeps a uniform time in ``[0, latency_s]``.
    * ``bitflip_rate``: one random bit of the bytes a read returns is flipped
      (per ``get`` call or per ``iter_range`` chunk).
    * ``short_read_rate``: a read silently returns only a prefix of its bytes:
      a misbehaving server, which callers must catch by size or hash.
    * ``stream_error_rate``: per chunk of ``iter_range`` / entry of ``list``,
      the transfer breaks with StoreUnavailable.
    * ``short_write_rate``: a write streams part of its bytes into ``inner``
      and then dies with StoreUnavailable; no object may become visible.

    ``ops`` limits injection to those operation names (default: all).
    ``calls`` counts calls per operation and ``faults`` injected faults per
    kind; ``events`` lists (operation, fault kind) in order.
    """

    def __init__(
        self,
        inner: ObjectStore,
        *,
        seed: int,
        fail_first: int = 0,
        error_rate: float = 0.0,
        lost_reply_rate: float = 0.0,
        latency_s: float = 0.0,
        bitflip_rate: float = 0.0,
        short_read_rate: float = 0.0,
        stream_error_rate: float = 0.0,
        short_write_rate: float = 0.0,
        ops: Collection[str] | None = None,
    ) -> None:
        super().__init__(inner)
        unknown = set(ops or ()) - OPERATIONS
        if unknown:
            raise ValueError(f"unknown operations: {sorted(unknown)}")
        self._rng = random.Random(seed)
        self.fail_first = fail_first
        self.error_rate = _check_rate("error_rate", error_rate)
        self.lost_reply_rate = _check_rate("lost_reply_rate", lost_reply_rate)
        self.latency_s = latency_s
        self.bitflip_rate = _check_rate("bitflip_rate", bitflip_rate)
        self.short_read_rate = _check_rate("short_read_rate", short_read_rate)
        self.stream_error_rate = _check_rate("stream_error_rate", stream_error_rate)
        self.short_write_rate = _check_rate("short_write_rate", short_write_rate)
        self.ops = frozenset(ops) if ops is not None else OPERATIONS
        self.calls: Counter[str] = Counter()
        self.faults: Counter[str] = Counter()
        self.events: list[tuple[str, str]] = []

    def __repr__(self) -> str:
        return f"FaultyStore({self.inner!r})"

    # --- decisions ------------------------------------------------------------------

    def _roll(self, op: str, rate: float) -> bool:
        # Always draw, even at rate 0 or for excluded ops, so enabling one
        # fault kind does not shift the pattern of the others.
        hit = self._rng.random() < rate
        return hit and op in self.ops

    def _inject(self, op: str, kind: str) -> errors.StoreUnavailable:
        self.faults[kind] += 1
        self.events.append((op, kind))
        return errors.StoreUnavailable(f"injected fault: {kind} in {op}")

    async def _before(self, op: str) -> None:
        self.calls[op] += 1
        if self.latency_s > 0 and op in self.ops:
            await asyncio.sleep(self._rng.uniform(0.0, self.latency_s))
        if op in self.ops and self.calls[op] <= self.fail_first:
            raise self._inject(op, "fail_first")
        if self._roll(op, self.error_rate):
            raise self._inject(op, "error")

    def _after(self, op: str) -> None:
        if self._roll(op, self.lost_reply_rate):
            raise self._inject(op, "lost_reply")

    def _damage(self, op: str, data: bytes) -> bytes:
        """Apply read faults (truncation, bit flip) to bytes on their way to the caller."""
        truncate = self._roll(op, self.short_read_rate)
        flip = self._roll(op, self.bitflip_rate)
        if truncate and data:
            data = data[: self._rng.randrange(len(data))]
            self.faults["short_read"] += 1
            self.events.append((op, "short_read"))
        if flip and data:
            buf = bytearray(data)
            bit = self._rng.randrange(len(buf) * 8)
            buf[bit // 8] ^= 1 << (bit % 8)
            data = bytes(buf)
            self.faults["bitflip"] += 1
            self.events.append((op, "bitflip"))
        return data

    async def _dying(self, op: str, chunks: AsyncIterable[bytes], die_at_chunk: int) -> AsyncIterator[bytes]:
        """Pass ``chunks`` through, then break before chunk ``die_at_chunk`` (or before the end)."""
        n = 0
        async for chunk in chunks:
            if n == die_at_chunk:
                break
            n += 1
            yield chunk
        raise self._inject(op, "short_write")

    # --- operations -----------------------------------------------------------------

    async def put(self, data: bytes, *, expected_digest: str | None = None) -> PutResult:
        """See :meth:`ObjectStore.put`; may fail before, after, or midway (short write)."""
        await self._before("put")
        if self._roll("put", self.short_write_rate):
            # Feed a strict prefix, in pieces, then die: the backend sees a
            # real partial upload it must clean up.
            cut = self._rng.randrange(len(data)) if data else 0
            pieces = [data[i : min(i + _WRITE_PIECE, cut)] for i in range(0, cut, _WRITE_PIECE)]

            async def prefix() -> AsyncIterator[bytes]:
                for p in pieces:
                    yield p

            await self.inner.put_stream(self._dying("put", prefix(), len(pieces)), expected_digest=expected_digest)
            raise AssertionError("unreachable: the dying stream always raises")
        result = await self.inner.put(data, expected_digest=expected_digest)
        self._after("put")
        return result

    async def put_stream(
        self,
        chunks: AsyncIterable[bytes],
        *,
        expected_digest: str | None = None,
        max_size: int | None = None,
    ) -> PutResult:
        """See :meth:`ObjectStore.put_stream`; a short write breaks the stream after 0-3 chunks."""
        await self._before("put_stream")
        if self._roll("put_stream", self.short_write_rate):
            chunks = self._dying("put_stream", chunks, self._rng.randint(0, 3))
        result = await self.inner.put_stream(chunks, expected_digest=expected_digest, max_size=max_size)
        self._after("put_stream")
        return result

    async def get(self, digest: str, *, offset: int = 0, length: int | None = None) -> bytes:
        """See :meth:`ObjectStore.get`; the bytes may come back flipped or truncated."""
        await self._before("get")
        data = await self.inner.get(digest, offset=offset, length=length)
        self._after("get")
        return self._damage("get", data)

    async def iter_range(
        self,
        digest: str,
        *,
        offset: int = 0,
        length: int | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
    ) -> AsyncIterator[bytes]:
        """See :meth:`ObjectStore.iter_range`; may break midway, flip bits or end early without error."""
        await self._before("iter_range")
        ends_early = self._roll("iter_range", self.short_read_rate)
        inner = self.inner.iter_range(digest, offset=offset, length=length, chunk_size=chunk_size).__aiter__()
        try:
            first = True
            while True:
                try:
                    chunk = await inner.__anext__()
                except StopAsyncIteration:
                    return
                # The first chunk always gets through once the stream is
                # open: a break here is a mid-transfer failure, not a refusal.
                if not first and self._roll("iter_range", self.stream_error_rate):
                    raise self._inject("iter_range", "stream_error")
                if ends_early and not first:
                    self.faults["short_read"] += 1
                    self.events.append(("iter_range", "short_read"))
                    return
                first = False
                if self._roll("iter_range", self.bitflip_rate) and chunk:
                    buf = bytearray(chunk)
                    bit = self._rng.randrange(len(buf) * 8)
                    buf[bit // 8] ^= 1 << (bit % 8)
                    chunk = bytes(buf)
                    self.faults["bitflip"] += 1
                    self.events.append(("iter_range", "bitflip"))
                yield chunk
        finally:
            aclose = getattr(inner, "aclose", None)
            if aclose is not None:
                await aclose()

    async def stat(self, digest: str) -> ObjectInfo:
        """See :meth:`ObjectStore.stat`."""
        await self._before("stat")
        info = await self.inner.stat(digest)
        self._after("stat")
        return info

    async def exists(self, digest: str) -> bool:
        """See :meth:`ObjectStore.exists`."""
        await self._before("exists")
        found = await self.inner.exists(digest)
        self._after("exists")
        return found

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        """See :meth:`ObjectStore.list`; the listing may break after any entry."""
        await self._before("list")
        inner = self.inner.list(prefix).__aiter__()
        try:
            while True:
                try:
                    info = await inner.__anext__()
                except StopAsyncIteration:
                    return
                yield info
                if self._roll("list", self.stream_error_rate):
                    raise self._inject("list", "stream_error")
        finally:
            aclose = getattr(inner, "aclose", None)
            if aclose is not None:
                await aclose()

    async def delete(self, digest: str) -> None:
        """See :meth:`ObjectStore.delete`; a lost reply leaves the object deleted."""
        await self._before("delete")
        await self.inner.delete(digest)
        self._after("delete")

    async def presign_get(self, digest: str, expires_s: int) -> str:
        """See :meth:`ObjectStore.presign_get`."""
        await self._before("presign_get")
        return await self.inner.presign_get(digest, expires_s)

    async def presign_put(self, digest: str, size: int, expires_s: int) -> PresignedRequest:
        """See :meth:`ObjectStore.presign_put`."""
        await self._before("presign_put")
        return await self.inner.presign_put(digest, size, expires_s)
