"""Followers waiting in one process (ops/follow.py): what they hear of commits, pins and deletions made
through this process and through another one on the same catalog, and the catalog reads they cost."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest
from _publish import publish

from weightsync import errors
from weightsync.catalog import Catalog
from weightsync.ops import Ops, OpsSettings
from weightsync.ops.admin import delete_model, pin_model

pytestmark = pytest.mark.anyio


@pytest.fixture
async def other(backends, ops, clock):
    """A second Ops on the same catalog and store: another worker process, or another replica."""
    url, _ = backends
    catalog = Catalog.open(url)
    o = Ops(catalog, ops.store, OpsSettings(gc_grace=timedelta(minutes=5)), clock=clock)
    try:
        yield o
    finally:
        await o.aclose()
        catalog.close()


class _CountedReads:
    """The real catalog's follow_target, counted (on this Ops' catalog only)."""

    def __init__(self, ops: Ops) -> None:
        self.real = ops.catalog.follow_target
        self.calls = 0
        ops.catalog.follow_target = self  # type: ignore[method-assign]

    def __call__(self, model: str):
        self.calls += 1
        return self.real(model)


async def _waiting(ops: Ops, model: str, n: int, reads: _CountedReads | None = None, **kw) -> list[asyncio.Task]:
    """`n` waiters of `model` (`wait_for_version` with `kw`), once each is registered (and, with `reads`, has
    begun its own first read)."""
    tasks = [asyncio.ensure_future(ops.wait_for_version(model, **kw)) for _ in range(n)]
    for _ in range(2000):
        await asyncio.sleep(0.005)
        joined = len(getattr(ops._followers._models.get(model), "polls", ()))
        if joined == n and (reads is None or reads.calls >= n):
            break
    await asyncio.sleep(0.05)
    return tasks


async def test_a_commit_through_another_process_reaches_every_waiter_with_one_read_per_poll(ops, other, versions):
    first, _, _ = await publish(ops, "m", versions[0], None, None)
    reads = _CountedReads(ops)
    poll = 0.05
    waiters = await _waiting(ops, "m", 20, reads, after=first.number, timeout=30, poll=poll)
    assert reads.calls >= 20  # each waiter's own first read
    reads.calls = 0
    sleep = 0.5
    await asyncio.sleep(sleep)
    assert not any(t.done() for t in waiters)
    # One poller for the model, reading at most once an interval however many wait (20 each would be ~200).
    assert reads.calls <= sleep / poll + 2
    second, _, _ = await publish(other, "m", versions[1], versions[0], first.number)  # not through `ops`
    got = await asyncio.wait_for(asyncio.gather(*waiters), 30)
    assert {t.version.number for t in got} == {second.number} and not any(t.pinned for t in got)
    assert ops._followers.watched() == []  # the poller went with the last waiter


async def test_a_commit_through_this_process_wakes_its_waiters_without_waiting_for_the_poll(ops, versions):
    first, _, _ = await publish(ops, "m", versions[0], None, None)
    waiters = await _waiting(ops, "m", 3, after=first.number, timeout=60, poll=30.0)  # a poll far away
    second, _, _ = await publish(ops, "m", versions[1], versions[0], first.number)
    got = await asyncio.wait_for(asyncio.gather(*waiters), 20)  # well before the first poll
    assert [t.version.number for t in got] == [second.number] * 3


async def test_a_pin_and_an_unpin_elsewhere_reach_waiters_and_a_stale_reading_never_answers(ops, other, versions):
    first, _, _ = await publish(ops, "m", versions[0], None, None)
    second, _, _ = await publish(ops, "m", versions[1], versions[0], first.number)
    waiters = await _waiting(ops, "m", 2, after=second.number, timeout=30, poll=0.05)
    await pin_model(other, "m", first.number)  # a rollback, through the other process
    got = await asyncio.wait_for(asyncio.gather(*waiters), 30)
    assert all(t.pinned and t.version.number == first.number for t in got)
    # The poller may still hold the pin when the model is unpinned; a waiter that begins now reads for
    # itself first, so it is not sent back to the pin it no longer has.
    waiters = await _waiting(ops, "m", 1, after=first.number, timeout=30, poll=0.05)
    await pin_model(other, "m", None)
    (back,) = await asyncio.wait_for(asyncio.gather(*waiters), 30)
    assert not back.pinned and back.version.number == second.number
    await pin_model(other, "m", None)
    assert await ops.wait_for_version("m", after=second.number, timeout=0.2, poll=0.05) is None


async def test_a_model_deleted_while_waited_on_ends_the_waits_that_must_see_it(ops, other, versions):
    """An event stream that has seen the model (absent_ok False) ends when it is deleted elsewhere; a long
    poll (absent_ok True) goes on waiting for a model of that name, and hears of its first version."""
    first, _, _ = await publish(ops, "m", versions[0], None, None)
    seen = asyncio.ensure_future(ops.wait_for_version("m", after=first.number, timeout=30, poll=0.05, absent_ok=False))
    patient = asyncio.ensure_future(ops.wait_for_version("m", after=first.number, timeout=30, poll=0.05))
    await asyncio.sleep(0.1)
    await delete_model(other, "m")
    with pytest.raises(errors.ModelNotFound):
        await asyncio.wait_for(seen, 30)
    await asyncio.sleep(0.2)
    assert not patient.done()
    again, _, _ = await publish(other, "m", versions[0], None, None)
    assert (await asyncio.wait_for(patient, 30)).version.number == again.number


async def test_a_waiter_that_goes_away_leaves_the_others_waiting_and_the_last_takes_the_poller(ops, versions):
    first, _, _ = await publish(ops, "m", versions[0], None, None)
    leaving, staying = await _waiting(ops, "m", 2, after=first.number, timeout=30, poll=0.05)
    leaving.cancel()  # its client went away
    with pytest.raises(asyncio.CancelledError):
        await leaving
    assert ops._followers.watched() == ["m"] and not staying.done()
    second, _, _ = await publish(ops, "m", versions[1], versions[0], first.number)
    assert (await asyncio.wait_for(staying, 20)).version.number == second.number
    assert ops._followers.watched() == []


# --- announcements between processes (PostgreSQL's LISTEN/NOTIFY: catalog/notices.py) ---------------------------

FAR = 3600.0
"""A poll interval no test waits for: what reaches a waiter then came through an announcement."""


def _needs_announcements(ops: Ops) -> None:
    if not ops.catalog.announces:
        pytest.skip("SQLite has no announcements: its processes poll (tested above)")


async def _listening(ops: Ops) -> None:
    for _ in range(2000):
        if ops._followers.listening:
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the followers' listener did not begin to listen")


async def test_a_commit_pin_and_deletion_elsewhere_reach_waiters_through_announcements_not_the_poll(
    ops, other, versions
):
    _needs_announcements(ops)
    first, _, _ = await publish(ops, "m", versions[0], None, None)
    waiters = await _waiting(ops, "m", 3, after=first.number, timeout=60, poll=FAR)
    await _listening(ops)
    second, _, _ = await publish(other, "m", versions[1], versions[0], first.number)  # not through `ops`
    got = await asyncio.wait_for(asyncio.gather(*waiters), 30)
    assert [t.version.number for t in got] == [second.number] * 3
    waiters = await _waiting(ops, "m", 1, after=second.number, timeout=60, poll=FAR)
    await pin_model(other, "m", first.number)
    (pinned,) = await asyncio.wait_for(asyncio.gather(*waiters), 30)
    assert pinned.pinned and pinned.version.number == first.number
    seen = asyncio.ensure_future(ops.wait_for_version("m", after=first.number, timeout=60, poll=FAR, absent_ok=False))
    await asyncio.sleep(0.1)
    await delete_model(other, "m")
    with pytest.raises(errors.ModelNotFound):
        await asyncio.wait_for(seen, 30)


async def test_while_listening_the_poll_slows_and_a_process_does_not_read_again_for_its_own_announcement(ops, versions):
    from weightsync.ops.follow import LISTENING_POLL_S

    _needs_announcements(ops)
    first, _, _ = await publish(ops, "m", versions[0], None, None)
    waiter = asyncio.ensure_future(ops.wait_for_version("m", after=first.number, timeout=60, poll=0.05))
    await _listening(ops)
    await asyncio.sleep(0.2)  # the reads on beginning to listen are over
    reads = _CountedReads(ops)
    await asyncio.sleep(1.0)
    assert reads.calls <= 1.0 / LISTENING_POLL_S + 1  # ~20 at the waiter's 0.05 s without the listener
    second, _, _ = await publish(ops, "m", versions[1], versions[0], first.number)
    assert (await asyncio.wait_for(waiter, 20)).version.number == second.number
    later = asyncio.ensure_future(ops.wait_for_version("m", after=second.number, timeout=60, poll=FAR))
    await asyncio.sleep(0.2)
    reads.calls = 0
    ops.catalog.announce(f"{ops._followers._token} m")  # this process's own announcement, come back
    other_token = "0" * 16
    await asyncio.sleep(0.3)
    assert reads.calls == 0
    ops.catalog.announce(f"{other_token} m")  # another process's: the poller reads
    for _ in range(400):
        if reads.calls:
            break
        await asyncio.sleep(0.005)
    assert reads.calls >= 1 and not later.done()
    later.cancel()


async def test_a_listener_whose_connection_is_killed_listens_again_and_reads_what_it_missed(ops, other, versions):
    from sqlalchemy import text

    _needs_announcements(ops)
    first, _, _ = await publish(ops, "m", versions[0], None, None)
    waiters = await _waiting(ops, "m", 2, after=first.number, timeout=60, poll=FAR)
    await _listening(ops)
    with other.catalog.engine.begin() as conn:  # the listening connection goes, as in a failover
        killed = conn.execute(
            text(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE datname = current_database() AND query LIKE 'LISTEN %' AND pid <> pg_backend_pid()"
            )
        ).scalar_one()
    assert killed == 1
    for _ in range(2000):  # it notices
        if not ops._followers.listening:
            break
        await asyncio.sleep(0.005)
    # Committed while this process may not listen: the announcement can be lost, the read after
    # listening again finds it.
    second, _, _ = await publish(other, "m", versions[1], versions[0], first.number)
    got = await asyncio.wait_for(asyncio.gather(*waiters), 30)
    assert [t.version.number for t in got] == [second.number] * 2
    await _listening(ops)


async def test_with_announcements_off_a_process_neither_listens_nor_announces(backends, ops, clock, versions):
    """WEIGHTSYNC_ANNOUNCE=false (behind a pooler that drops LISTEN): a second process polls only."""
    _needs_announcements(ops)
    url, _ = backends
    catalog = Catalog.open(url)
    quiet = Ops(catalog, ops.store, OpsSettings(gc_grace=timedelta(minutes=5), announce=False), clock=clock)
    try:
        first, _, _ = await publish(quiet, "m", versions[0], None, None)
        waiter = asyncio.ensure_future(quiet.wait_for_version("m", after=first.number, timeout=60, poll=FAR))
        elsewhere = asyncio.ensure_future(ops.wait_for_version("m", after=first.number, timeout=60, poll=FAR))
        await _listening(ops)
        await asyncio.sleep(0.3)
        assert not quiet._followers.listening
        second, _, _ = await publish(ops, "m", versions[1], versions[0], first.number)  # announced by `ops`
        assert (await asyncio.wait_for(elsewhere, 20)).version.number == second.number
        await asyncio.sleep(0.5)
        assert not waiter.done()  # not heard: it polls only (and its poll is far away)
        third, _, _ = await publish(quiet, "m", versions[2], versions[1], second.number)  # not announced
        assert (await asyncio.wait_for(waiter, 20)).version.number == third.number  # its own commit wakes it
        later = asyncio.ensure_future(ops.wait_for_version("m", after=third.number, timeout=1.5, poll=FAR))
        await asyncio.sleep(0.3)  # it has read v3 for itself
        fourth, _, _ = await publish(quiet, "m", versions[3], versions[2], third.number)
        assert await later is None and fourth.number == third.number + 1  # `ops` was not told
    finally:
        await quiet.aclose()
        catalog.close()


# --- FollowTargets alone, its reads scripted (the orders a real catalog gives only by chance) ---------------------


class _Head:
    """A stand-in for a Target: the head version `n` (equal when `n` is)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def news_for(self, after: int | None) -> bool:
        return after is None or self.n > after

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Head) and other.n == self.n

    __hash__ = None  # type: ignore[assignment]


async def test_a_waiter_whose_read_overlapped_an_older_numbered_newer_reading_is_not_left_behind():
    """The poller's read begins first but sees a commit a waiter's read, begun after it, did not (reads run in
    threads): the waiter keeps its own, newer-numbered reading, and must still hear of the commit at once."""
    from weightsync.ops.follow import FollowTargets

    head = 1
    gate = asyncio.Event()
    script: list[asyncio.Event | None] = []  # per read, in order: an event it waits for before it reads

    async def read(model: str):
        hold = script.pop(0) if script else None
        if hold is not None:
            await hold.wait()
        return _Head(head)

    ft = FollowTargets(read)  # type: ignore[arg-type]
    script.append(None)  # the first waiter's own read: v1
    first = asyncio.ensure_future(ft.wait("m", after=1, timeout=30, poll=FAR, absent_ok=True))
    await asyncio.sleep(0.05)
    script.append(gate)  # the poller's next read: begins now, reads once the gate opens
    ft.kick()
    await asyncio.sleep(0.05)
    script.append(None)  # the second waiter's own read, numbered after the poller's: still v1
    second = asyncio.ensure_future(ft.wait("m", after=1, timeout=30, poll=FAR, absent_ok=True))
    await asyncio.sleep(0.05)
    head = 2  # committed between the two statements: the poller's read, begun first, sees it
    gate.set()
    got = await asyncio.wait_for(asyncio.gather(first, second), 10)  # not the FAR poll, not the 30 s timeout
    assert [t.n for t in got] == [2, 2]
    assert ft.watched() == []


async def test_a_listener_that_failed_is_logged_and_started_again_by_the_next_waiter(caplog):
    from weightsync.ops.follow import FollowTargets

    runs: list[str] = []

    class Flaky:
        async def run(self) -> None:
            runs.append("run")
            if len(runs) == 1:
                raise RuntimeError("listener bug")
            await asyncio.Event().wait()  # listens until cancelled

    async def read(model: str):
        return _Head(1)

    ft = FollowTargets(read, listener=lambda on_notice, on_listening: Flaky())  # type: ignore[arg-type]
    assert await ft.wait("m", after=1, timeout=0.1, poll=FAR, absent_ok=True) is None
    await asyncio.sleep(0.01)
    assert runs == ["run"]
    assert await ft.wait("m", after=1, timeout=0.1, poll=FAR, absent_ok=True) is None
    assert runs == ["run", "run"]
    assert any("listener failed" in r.getMessage() for r in caplog.records)
    await ft.aclose()
