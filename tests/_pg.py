"""A fresh, uniquely named PostgreSQL database per test, on the local server (127.0.0.1:5432).

The server runs on the developer and CI machines with user ``postgres`` and trust auth.
When it cannot be reached, tests that need it are skipped with the reason, not failed.

Use the ``pg_url`` fixture (import it into a conftest.py: ``from _pg import pg_url``), or the
:func:`fresh_database` context manager directly. Override the server with
``WEIGHTSYNC_TEST_PG`` (a ``postgresql://`` URL of a database to connect to for CREATE DATABASE).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

ADMIN_URL = os.environ.get("WEIGHTSYNC_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")


def _connect_admin():  # -> psycopg.Connection
    try:
        import psycopg
    except ImportError:  # pragma: no cover - psycopg is a server dependency
        pytest.skip("psycopg is not installed")
    try:
        return psycopg.connect(ADMIN_URL, autocommit=True, connect_timeout=3)
    except psycopg.OperationalError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        pytest.skip(f"PostgreSQL not reachable at {ADMIN_URL}: {first}")


@contextmanager
def fresh_database(prefix: str = "ws_test") -> Iterator[str]:
    """Create an empty database, yield its ``postgresql+psycopg://`` URL, drop it afterwards."""
    from psycopg import sql

    name = f"{prefix}_{uuid.uuid4().hex[:16]}"
    admin = _connect_admin()
    try:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    finally:
        admin.close()
    base = ADMIN_URL.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://", 1)
    try:
        yield f"{base}/{name}"
    finally:
        admin = _connect_admin()
        try:
            # FORCE: a test that leaked a pooled connection must not leak the database too.
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
        finally:
            admin.close()


@pytest.fixture
def pg_url() -> Iterator[str]:
    """URL of a fresh empty PostgreSQL database, dropped after the test (skips if no server)."""
    with fresh_database() as url:
        yield url
