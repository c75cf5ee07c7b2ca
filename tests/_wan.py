"""A WAN emulator for tests and benchmarks: a TCP proxy with a shared bandwidth cap and a one-way delay.

One :class:`WanLink` stands for one region's link: every connection through it shares the cap of
each direction (all connections together, as on a real link), each chunk is delivered ``delay_s``
after it was read, and the proxy counts the bytes it carried in each direction itself. It runs an
asyncio loop in a thread of its own, so a test or a benchmark uses it from synchronous code::

    with WanLink(("127.0.0.1", origin_port), mbit_s=200, delay_s=0.040) as link:
        url = f"http://127.0.0.1:{link.port}"   # the origin, across the link
        ...
        link.down_bytes   # bytes the far side sent back (origin → region)

``sever()`` cuts every connection and refuses new ones until ``restore()`` (an upstream outage).
Not part of the package: tests/ and benchmarks/ only.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time

CHUNK = 64 << 10


class _Pacer:
    """One direction of a link: a virtual clock that serializes every connection's bytes at `rate` B/s."""

    def __init__(self, rate: float | None) -> None:
        self.rate = rate
        self.next = 0.0
        self.bytes = 0

    def slot(self, n: int) -> float:
        """Seconds until `n` bytes have crossed, counted from now, behind everything already queued."""
        self.bytes += n
        if not self.rate:
            return 0.0
        now = time.monotonic()
        start = max(now, self.next)
        self.next = start + n / self.rate
        return self.next - now


class WanLink:
    """A TCP proxy on a free loopback port to `target`, shaping both directions (see the module doc)."""

    def __init__(self, target: tuple[str, int], *, mbit_s: float | None = None, delay_s: float = 0.0) -> None:
        self.target = target
        self.delay_s = delay_s
        rate = None if mbit_s is None else mbit_s * 1e6 / 8
        self._up = _Pacer(rate)  # client → target
        self._down = _Pacer(rate)  # target → client
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="wan-link", daemon=True)
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task] = set()
        self._severed = False
        self.connections = 0
        self.port = 0

    # -- the synchronous surface ------------------------------------------------------------
    @property
    def up_bytes(self) -> int:
        """Bytes carried from the clients to the target."""
        return self._up.bytes

    @property
    def down_bytes(self) -> int:
        """Bytes carried from the target back to the clients."""
        return self._down.bytes

    def start(self) -> WanLink:
        self._thread.start()
        self._call(self._listen())
        return self

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        with contextlib.suppress(Exception):
            self._call(self._close(), timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def sever(self) -> None:
        """Cut every open connection and refuse new ones (the link is down) until :meth:`restore`."""
        self._call(self._sever())

    def restore(self) -> None:
        self._severed = False

    def __enter__(self) -> WanLink:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _call(self, coro, timeout: float = 30):  # type: ignore[no-untyped-def]
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # -- the loop's side ----------------------------------------------------------------------
    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0, family=socket.AF_INET)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        await self._sever()
        self._severed = False

    async def _sever(self) -> None:
        self._severed = True
        for t in list(self._conns):
            t.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._severed:
            writer.close()
            return
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        self.connections += 1
        far_w = None
        try:
            far_r, far_w = await asyncio.open_connection(*self.target)
            await asyncio.gather(self._pipe(reader, far_w, self._up), self._pipe(far_r, writer, self._down))
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            self._conns.discard(task)
            for w in (writer, far_w):
                if w is not None:
                    with contextlib.suppress(Exception):
                        w.close()

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, pacer: _Pacer) -> None:
        """Copy src → dst: each chunk leaves `delay_s` after it was read, paced by the direction's cap."""
        # Bounded: a full queue stops reading, so TCP's own flow control holds the sender back.
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(maxsize=64)

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    with contextlib.suppress(OSError):
                        if dst.can_write_eof():
                            dst.write_eof()
                    return
                wait = max(due - time.monotonic(), 0.0) + pacer.slot(len(data))
                if wait > 0:
                    await asyncio.sleep(wait)
                dst.write(data)
                await dst.drain()

        sender = asyncio.ensure_future(deliver())
        try:
            while True:
                data = await src.read(CHUNK)
                await queue.put((time.monotonic() + self.delay_s, data))
                if not data:
                    break
            await sender
        finally:
            sender.cancel()
