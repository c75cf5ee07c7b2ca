"""Changes announced between processes on one catalog (catalog/notices.py): PostgreSQL's NOTIFY reaches every
listening connection of the database; SQLite announces nothing."""

from __future__ import annotations

import asyncio

import pytest

from weightsync import errors
from weightsync.catalog import Catalog, make_engine
from weightsync.catalog.notices import MAX_PAYLOAD

pytestmark = pytest.mark.anyio


async def test_announcements_reach_a_listener_of_another_catalog_in_order_and_only_once_listening(db_url):
    first, second = Catalog.open(db_url), Catalog.open(db_url, migrate=False)  # two processes
    try:
        heard: list[str] = []
        states: list[bool] = []
        listener = second.listener(heard.append, states.append)
        if not first.announces:
            assert listener is None
            first.announce("m")  # nothing, and no error
            return
        assert listener is not None
        first.announce("before anyone listens")  # nobody to tell
        task = asyncio.create_task(listener.run())
        try:
            for _ in range(2000):
                if states == [True]:
                    break
                await asyncio.sleep(0.005)
            assert states == [True]
            for payload in ("a m", "b m", "a other/model"):
                first.announce(payload)
            for _ in range(2000):
                if len(heard) >= 3:
                    break
                await asyncio.sleep(0.005)
            assert heard == ["a m", "b m", "a other/model"]
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        assert states == [True, False]
    finally:
        first.close()
        second.close()


def test_a_payload_over_postgresqls_limit_is_refused(catalog):
    if not catalog.announces:
        catalog.announce("x" * (MAX_PAYLOAD + 1))  # SQLite sends nothing, whatever the size
        return
    catalog.announce("x" * MAX_PAYLOAD)
    with pytest.raises(ValueError, match="at most"):
        catalog.announce("x" * (MAX_PAYLOAD + 1))


async def test_a_listener_of_an_unreachable_database_keeps_trying_and_says_so(caplog):
    from weightsync.catalog.notices import Listener

    states: list[bool] = []
    where = {"host": "127.0.0.1", "port": 1, "dbname": "none", "user": "postgres", "connect_timeout": 1}
    listener = Listener(where, lambda _: None, states.append)
    task = asyncio.create_task(listener.run())
    await asyncio.sleep(0.5)
    assert not task.done() and states == []  # still trying, never listening
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert any("listening for follower changes" in r.getMessage() for r in caplog.records)


def test_announce_on_an_unreachable_postgresql_is_catalog_unavailable():
    from sqlalchemy import create_engine

    from weightsync.catalog.notices import announce

    engine = create_engine("postgresql+psycopg://postgres@127.0.0.1:1/none?connect_timeout=1")
    try:
        with pytest.raises(errors.CatalogUnavailable):
            announce(engine, "m")
    finally:
        engine.dispose()


def test_the_listeners_options_are_the_engines_own_for_failover_urls_and_passwords_with_spaces():
    """libpq reads a URL's text otherwise than the engine's dialect: built from the dialect, the listener
    connects wherever the pool does (several hosts, a password with a space: both once broke it)."""
    from sqlalchemy import create_engine

    from weightsync.catalog.notices import listen_args

    engine = create_engine(
        "postgresql+psycopg://u:s3cret%20pass@/ws?host=h1:5432&host=h2:5433&target_session_attrs=read-write"
    )
    try:
        args = listen_args(engine)
    finally:
        engine.dispose()
    assert args == {
        "dbname": "ws",
        "user": "u",
        "password": "s3cret pass",
        "host": "h1,h2",
        "port": "5432,5433",
        "target_session_attrs": "read-write",
    }
    lite = create_engine("sqlite://")
    try:
        assert listen_args(lite) is None
    finally:
        lite.dispose()


async def test_a_listener_connects_with_a_password_that_holds_a_space(db_url):
    """A role whose password has a space, reached through a URL that quotes it (as the pool is)."""
    import uuid

    from sqlalchemy import text

    if not db_url.startswith("postgresql"):
        pytest.skip("SQLite has no listener")
    role = f"ws_space_{uuid.uuid4().hex[:8]}"
    admin = Catalog.open(db_url)
    try:
        with admin.engine.begin() as conn:
            conn.execute(text(f"CREATE ROLE {role} LOGIN PASSWORD 'two words'"))
        host_db = db_url.split("@", 1)[1]
        spaced = Catalog(make_engine(f"postgresql+psycopg://{role}:two%20words@{host_db}"))  # no migration check
        try:
            states: list[bool] = []
            listener = spaced.listener(lambda _: None, states.append)
            assert listener is not None
            task = asyncio.create_task(listener.run())
            for _ in range(2000):
                if states:
                    break
                await asyncio.sleep(0.005)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert states[:1] == [True]
        finally:
            spaced.close()
    finally:
        with admin.engine.begin() as conn:
            conn.execute(text(f"DROP ROLE IF EXISTS {role}"))
        admin.close()
