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
