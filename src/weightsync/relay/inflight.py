"""An object on its way from the upstream: its bytes so far, readable by any number of local requests.

The relay's single fetch of a missing object (weightsync/relay/mirror.py) adds each chunk here as
it arrives, while the store hashes and writes the same chunks. Readers stream any range of it as
the bytes come, without waiting for the whole object, but the object's **last byte is released
only once the store has verified the SHA-256** and kept the object: a reader never receives a
complete object that is not the one named (a failed fetch cuts every stream short, so the client
sees a truncated body and retries). Held in memory for the fetch's duration only, so only objects
up to :data:`STREAM_MAX` are streamed; larger ones are served from the store once fetched.
"""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import AsyncIterator

from weightsync import errors

__all__ = ["STREAM_MAX", "InFlight"]

STREAM_MAX = 256 << 20
"""Largest object streamed to readers while it is fetched (objects are ~64 MiB by design)."""


class InFlight:
    """One fetch's bytes; written by the fetch task, read by request tasks, all on one event loop."""

    def __init__(self, digest: str) -> None:
        self.digest = digest
        self.size: int | None = None  # known once the upstream answered
        self.streamable: bool | None = None  # None: not decided yet (waiting for the upstream)
        self._chunks: list[bytes] = []
        self._starts: list[int] = []
        self.received = 0
        self.verified = False
        self.error: BaseException | None = None
        self._changed = asyncio.Event()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # --- the fetch's side ---------------------------------------------------------------

    def begin(self, size: int | None) -> None:
        """The upstream answered with ``size`` bytes to come (None: unknown, then not streamed)."""
        self.size = size
        self.streamable = size is not None and 0 < size <= STREAM_MAX
        self._notify()

    def add(self, chunk: bytes) -> None:
        if self.streamable and chunk:
            self._starts.append(self.received)
            self._chunks.append(chunk)
        self.received += len(chunk)
        self._notify()

    def finish(self, error: BaseException | None) -> None:
        """The fetch ended: the store verified and kept the object (None), or it failed."""
        if self.streamable is None:
            self.streamable = False
        self.error = error
        self.verified = error is None
        self._notify()

    # --- the readers' side --------------------------------------------------------------

    @property
    def done(self) -> bool:
        return self.verified or self.error is not None

    async def decided(self) -> bool:
        """Wait until it is known whether readers can stream it (else they wait for the store)."""
        while self.streamable is None:
            await self._changed.wait()
        return self.streamable

    async def read(self, offset: int, length: int) -> AsyncIterator[bytes]:
        """Bytes [offset, offset + length) as they arrive; the object's last byte only once it is verified.

        Raises the fetch's error (or StoreUnavailable) if the fetch fails before the range is complete.
        """
        assert self.size is not None
        end = offset + length
        pos = offset
        while pos < end:
            # Everything but the last byte may go out unverified: the client checks the whole object anyway,
            # and an unverified object can never be received complete.
            available = self.received if self.verified else min(self.received, self.size - 1)
            if pos < available:
                upto = min(end, available)
                for piece in self._pieces(pos, upto):
                    yield piece
                pos = upto
                continue
            if self.error is not None:
                raise errors.StoreUnavailable(f"object {self.digest}: the upstream fetch failed: {self.error}")
            await self._changed.wait()

    def _pieces(self, start: int, end: int) -> list[bytes]:
        """The held bytes [start, end), as slices of the chunks."""
        out = []
        i = max(0, bisect.bisect_right(self._starts, start) - 1)
        while start < end and i < len(self._chunks):
            c0 = self._starts[i]
            chunk = self._chunks[i]
            a = start - c0
            b = min(len(chunk), end - c0)
            if b > a:
                out.append(chunk[a:b])
                start = c0 + b
            i += 1
        return out
