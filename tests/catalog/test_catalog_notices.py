"""Changes announced between processes on one catalog (catalog/notices.py): PostgreSQL's NOTIFY reaches every
listening connection of the database; SQLite announces nothing."""

from __future__ import annotations

import asyncio

import pytest

from weightsync import errors
from weightsync.catalog import Catalog
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
    listener = Listener("postgresql://postgres@127.0.0.1:1/none?connect_timeout=1", lambda _: None, states.append)
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
