"""Engines for the two supported databases: SQLite (default) and PostgreSQL via psycopg 3."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.pool import StaticPool

from ..errors import CatalogError

#: Milliseconds a SQLite writer waits for the database lock before failing.
SQLITE_BUSY_TIMEOUT_MS = 30_000

#: Execution option naming the SQLite ``BEGIN`` mode of a connection's transactions.
SQLITE_BEGIN = "weightsync_sqlite_begin"


def normalize_url(url: str | URL) -> URL:
    """Return ``url`` as a SQLAlchemy URL, with driverless PostgreSQL URLs mapped to psycopg 3.

    ``postgresql://`` and ``postgres://`` become ``postgresql+psycopg://``; an explicit
    driver is kept. Only SQLite and PostgreSQL are supported (:class:`CatalogError` otherwise).
    """
    if isinstance(url, str) and url.startswith("postgres://"):
        url = "postgresql://" + url[len("postgres://") :]
    try:
        u = make_url(url)
    except Exception as exc:  # noqa: BLE001 - ArgumentError and others on garbage: all one answer
        raise CatalogError(f"invalid catalog URL: {exc}") from None
    backend = u.get_backend_name()
    if backend == "postgresql":
        if u.drivername == "postgresql":
            u = u.set(drivername="postgresql+psycopg")
    elif backend != "sqlite":
        raise CatalogError(f"unsupported catalog database {backend!r}: use sqlite:// or postgresql://")
    return u


def _is_memory(u: URL) -> bool:
    return u.database in (None, "", ":memory:") or (u.query.get("mode") == "memory")


def make_engine(url: str | URL, **kwargs: Any) -> Engine:
    """Create an engine configured for the catalog; safe to share between threads.

    SQLite: WAL journal (readers never block the writer), foreign keys on, a busy timeout,
    and transactions started explicitly so writers can ask for ``BEGIN IMMEDIATE``
    (see :func:`writer`). The database file's directory is created if missing.
    PostgreSQL: a pooled psycopg 3 engine with pre-ping, so dead connections are replaced.
    """
    u = normalize_url(url)
    if u.get_backend_name() == "postgresql":
        kwargs.setdefault("pool_pre_ping", True)
        return create_engine(u, **kwargs)

    connect_args = dict(kwargs.pop("connect_args", {}))
    connect_args.setdefault("check_same_thread", False)
    if _is_memory(u):
        # One shared connection, so every session sees the same in-memory database. Tests only.
        kwargs.setdefault("poolclass", StaticPool)
    elif u.database:
        Path(u.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(u, connect_args=connect_args, **kwargs)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Driver-level autocommit: pysqlite's own implicit BEGIN is disabled, so the
        # "begin" hook below decides the transaction mode.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        try:
            cur.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
            cur.execute("PRAGMA foreign_keys = ON")
            cur.execute("PRAGMA journal_mode = WAL")
            # A commit the caller was told about survives power loss, not only a process crash.
            cur.execute("PRAGMA synchronous = FULL")
        finally:
            cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        mode = conn.get_execution_options().get(SQLITE_BEGIN, "DEFERRED")
        conn.exec_driver_sql(f"BEGIN {mode}")

    return engine


def writer(engine: Engine) -> Engine:
    """Return a view of ``engine`` whose transactions take the write lock up front.

    On SQLite this is ``BEGIN IMMEDIATE``: two writers never both read the head and then
    race to write it (a deferred transaction would fail the second with SQLITE_BUSY at
    upgrade time instead of waiting). On PostgreSQL it is ``engine`` itself; writers lock
    the model row with ``SELECT … FOR UPDATE`` instead.
    """
    if engine.dialect.name == "sqlite":
        return engine.execution_options(**{SQLITE_BEGIN: "IMMEDIATE"})
    return engine
