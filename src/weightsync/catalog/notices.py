"""Changes of what followers hold, announced between the processes sharing a PostgreSQL catalog.

Followers wait at one server process (``watch``, event streams); a commit, pin or deletion may go
through another (another worker of ``--workers N``, another replica behind a load balancer). Each
process reads the catalog every poll interval to find such changes (ops/follow.py). On PostgreSQL
the process that made the change also announces it with ``NOTIFY`` on :data:`CHANNEL`, and every
process with followers holds one connection that ``LISTEN``\\ s there, so their followers hear of it
at once instead of an interval later. PostgreSQL delivers a notification to every listening
connection of the database, once, in the order they were sent, and drops nothing while a
connection listens; what a dead connection missed is covered by reading again after reconnecting
(``on_listening(True)``). SQLite has no such channel: its processes keep polling.

The payload is opaque here: ops/follow.py puts the model's name and the sending process in it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine, func, select

from .rows import db_errors

log = logging.getLogger(__name__)

CHANNEL = "weightsync_followers"
"""The NOTIFY channel of follower changes (an identifier: lower case, no quoting needed)."""

MAX_PAYLOAD = 7999
"""PostgreSQL's limit on a notification's payload, in bytes, less one."""

RETRY_S = (0.1, 0.5, 1.0, 2.0, 5.0)
"""Seconds between attempts to (re)connect the listening connection: growing, then the last one."""

KEEPALIVE = {"keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5, "keepalives_count": 3}
"""libpq's TCP keepalives on the listening connection, which otherwise sends nothing: a peer gone without a
word (a host or network failure) is noticed in about 25 s and the connection made again."""


def announces(engine: Engine) -> bool:
    """Whether `engine`'s database can announce (PostgreSQL) or announce() does nothing there (SQLite)."""
    return engine.dialect.name == "postgresql"


def announce(engine: Engine, payload: str) -> None:
    """Send `payload` on :data:`CHANNEL` in a transaction of its own (PostgreSQL); nothing on other databases.

    ValueError for a payload over PostgreSQL's limit; CatalogUnavailable when the database is unreachable.
    """
    if not announces(engine):
        return
    if len(payload.encode()) > MAX_PAYLOAD:
        raise ValueError(f"a notification's payload holds at most {MAX_PAYLOAD} bytes")
    with db_errors(), engine.begin() as conn:
        conn.execute(select(func.pg_notify(CHANNEL, payload)))


def listen_args(engine: Engine) -> dict[str, Any] | None:
    """libpq's connection options of `engine`'s database for a listening connection, or None (not PostgreSQL).

    Taken as the engine's own dialect makes them from its URL (several hosts of a failover URL, a
    password with spaces, query options), not by turning the URL back into text.
    """
    if not announces(engine):
        return None
    _, params = engine.dialect.create_connect_args(engine.url)
    return {k: v for k, v in params.items() if k != "context"}  # psycopg's adapters: not a libpq option


class Listener:
    """One connection that LISTENs on :data:`CHANNEL` and hands every payload to `on_notice`, reconnecting.

    `on_listening(True)` is called each time the connection listens (first, and after every
    reconnection: the caller reads again what it may have missed), `on_listening(False)` when it
    stops. Both callbacks run on the event loop of :meth:`run`, which runs until cancelled.
    """

    def __init__(
        self, connect: dict[str, Any], on_notice: Callable[[str], None], on_listening: Callable[[bool], None]
    ) -> None:
        """`connect`: libpq's connection options (:func:`listen_args`); KEEPALIVE's unless they set their own."""
        self._connect = {**KEEPALIVE, **connect}
        self._on_notice = on_notice
        self._on_listening = on_listening

    async def run(self) -> None:
        """Listen until cancelled; a lost or refused connection is logged and made again (:data:`RETRY_S`)."""
        import psycopg  # the server extra's driver: imported only where PostgreSQL is in use
        import psycopg.conninfo

        failures = 0
        while True:
            try:
                conninfo = psycopg.conninfo.make_conninfo("", **self._connect)
                conn = await psycopg.AsyncConnection.connect(conninfo, autocommit=True)
                async with conn:
                    await conn.execute(f"LISTEN {CHANNEL}")
                    failures = 0
                    self._on_listening(True)
                    try:
                        async for notice in conn.notifies():
                            self._on_notice(notice.payload)
                    finally:
                        self._on_listening(False)
            except (psycopg.Error, OSError) as exc:
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                log.warning("listening for follower changes: %s", first)
            await asyncio.sleep(RETRY_S[min(failures, len(RETRY_S) - 1)])
            failures += 1


__all__ = ["CHANNEL", "Listener", "announce", "announces", "listen_args"]
