"""A loopback TCP proxy in front of PostgreSQL that a test can cut, for the catalog-outage tests.

* :meth:`PgProxy.down` severs every connection (RST to both sides) and refuses new ones
  (accepted, then reset at once) until :meth:`PgProxy.up`: the database "goes away".
* :meth:`PgProxy.cut_commit` arms a one-shot cut of the transaction that runs a statement
  containing ``marker`` (e.g. the catalog's ``UPDATE models SET head``), at its COMMIT:
  ``deliver=False`` drops the connection before COMMIT reaches the server (the server rolls
  back); ``deliver=True`` lets COMMIT through and drops the server's answer (the server
  committed, the service cannot know): the ambiguous case an idempotent commit must survive.

Statements are found by parsing the frontend protocol (startup, then typed messages:
``Q`` simple query and ``P`` Parse carry SQL text), so the connection must not use TLS:
connect with ``sslmode=disable``.
"""

from __future__ import annotations

import asyncio
import struct
import threading
from dataclasses import dataclass, field

from _fault_proxy import LoopThread, reset

__all__ = ["Cut", "PgProxy"]

_SSL_REQUEST = 80877103
_GSSENC_REQUEST = 80877104


@dataclass
class Cut:
    """An armed commit cut: ``fired`` once it acted; ``server_committed`` once the server's own
    CommandComplete for that COMMIT was seen (and swallowed)."""

    marker: bytes
    deliver: bool
    fired: threading.Event = field(default_factory=threading.Event)
    server_committed: threading.Event = field(default_factory=threading.Event)


@dataclass(eq=False)
class _Pair:
    client: asyncio.StreamWriter
    server: asyncio.StreamWriter
    in_marked_tx: bool = False
    drop_reply: Cut | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


def _sql_of(kind: bytes, payload: bytes) -> bytes | None:
    if kind == b"Q":
        return payload.rstrip(b"\0")
    if kind == b"P":  # Parse: statement name \0 query \0 ...
        _, _, rest = payload.partition(b"\0")
        return rest.partition(b"\0")[0]
    return None


class PgProxy:
    """TCP proxy to ``upstream`` on a free loopback port; ``port`` once started."""

    def __init__(self, upstream: tuple[str, int] = ("127.0.0.1", 5432)) -> None:
        self.upstream = upstream
        self.port = 0
        #: Connections accepted, refused while down, and severed by down() or a cut.
        self.connections = 0
        self.refused = 0
        self.severed = 0
        self._down = False
        self._cut: Cut | None = None
        self._pairs: set[_Pair] = set()
        self._loop = LoopThread("pg-proxy")
        self._server: asyncio.AbstractServer | None = None

    def start(self) -> int:
        async def listen() -> asyncio.AbstractServer:
            return await asyncio.start_server(self._accept, "127.0.0.1", 0)

        self._server = self._loop.run(listen())
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    def stop(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()
            self._sever_all()
            tasks = [t for p in self._pairs for t in p.tasks]
            await asyncio.gather(*tasks, return_exceptions=True)

        self._loop.run(close())
        self._loop.stop()

    def down(self) -> None:
        """Sever every connection and refuse new ones until :meth:`up`."""

        async def go() -> None:
            self._down = True
            self._sever_all()

        self._loop.run(go())

    def up(self) -> None:
        async def go() -> None:
            self._down = False

        self._loop.run(go())

    def cut_commit(self, marker: bytes, *, deliver: bool) -> Cut:
        """Arm a one-shot cut at the COMMIT of the next transaction running a statement with ``marker``."""
        cut = Cut(marker, deliver)

        async def go() -> None:
            self._cut = cut

        self._loop.run(go())
        return cut

    # --- on the proxy's loop ------------------------------------------------------------

    def _sever_all(self) -> None:
        for pair in list(self._pairs):
            self._sever(pair)

    def _sever(self, pair: _Pair) -> None:
        if pair in self._pairs:
            self._pairs.discard(pair)
            self.severed += 1
        reset(pair.client)
        reset(pair.server)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._down:
            self.refused += 1
            reset(writer)
            return
        try:
            up_r, up_w = await asyncio.open_connection(*self.upstream)
        except OSError:
            reset(writer)
            return
        self.connections += 1
        pair = _Pair(writer, up_w)
        self._pairs.add(pair)
        pair.tasks = [asyncio.current_task()]  # type: ignore[list-item]
        back = asyncio.ensure_future(self._server_to_client(up_r, pair))
        pair.tasks.append(back)
        try:
            await self._client_to_server(reader, pair)
        except (ConnectionError, asyncio.IncompleteReadError, OSError):
            pass
        finally:
            self._sever(pair)
            await asyncio.gather(back, return_exceptions=True)

    async def _client_to_server(self, reader: asyncio.StreamReader, pair: _Pair) -> None:
        # Startup-phase messages carry no type byte; SSL/GSSENC requests are answered with one
        # byte and followed by the real startup message.
        while True:
            head = await reader.readexactly(8)
            length, code = struct.unpack("!ii", head)
            rest = await reader.readexactly(length - 8)
            pair.server.write(head + rest)
            await pair.server.drain()
            if code not in (_SSL_REQUEST, _GSSENC_REQUEST):
                break
        while True:
            kind = await reader.readexactly(1)
            (length,) = struct.unpack("!i", await reader.readexactly(4))
            payload = await reader.readexactly(length - 4)
            sql = _sql_of(kind, payload)
            cut = self._cut
            if sql is not None and cut is not None:
                if cut.marker in sql:
                    pair.in_marked_tx = True
                elif pair.in_marked_tx and sql.strip().upper() in (b"COMMIT", b"ROLLBACK"):
                    if sql.strip().upper() == b"COMMIT":
                        self._cut = None
                        cut.fired.set()
                        if not cut.deliver:
                            self._sever(pair)  # COMMIT never reaches the server: it rolls back
                            return
                        pair.drop_reply = cut  # the server commits; its answer is lost
                    pair.in_marked_tx = False
            pair.server.write(kind + struct.pack("!i", length) + payload)
            await pair.server.drain()

    async def _server_to_client(self, reader: asyncio.StreamReader, pair: _Pair) -> None:
        try:
            while data := await reader.read(65536):
                if pair.drop_reply is not None and b"COMMIT\0" in data:  # the server's CommandComplete
                    pair.drop_reply.server_committed.set()
                    self._sever(pair)
                    return
                pair.client.write(data)
                await pair.client.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            self._sever(pair)
