"""What the followers of each model wait for (watchModel, streamEvents), read from the catalog once per poll for all.

A follower long-polls ``watch`` (or holds an event stream) until the version it must hold changes.
Commits through this process wake it at once; commits through another process sharing the catalog
(another worker of ``--workers N``, another replica) are found by reading the catalog every poll
interval. Each waiter used to read it on its own: a fleet of N idle followers cost N reads per
interval, which set the interval (0.5 s), and the interval is what a follower of another process
waits for a commit. Here one task per model (a *poller*, alive while someone waits on that model)
reads what followers hold every interval and wakes every waiter when it changed, so N followers
cost one read per interval plus one when each begins to wait.

A waiter's own first read is fresh (what it answers at once must not be older than its request:
a stale pin would send a follower back). After that, it takes the poller's readings that began
after its own read: each read is numbered when it starts, and a waiter keeps the newest it has.
The poller's failed reads (the catalog unreachable) are not passed on: the waiters keep waiting
and the next reading that succeeds tells them; their own first read reports such a failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from weightsync import errors
from weightsync.catalog.records import Target

log = logging.getLogger(__name__)

Reading = Target | errors.ModelNotFound
"""What a read of the catalog says followers of a model hold: a target, or that the model does not exist."""


@dataclass(eq=False)
class _Watched:
    """A model someone waits on: its poller and its newest reading."""

    polls: list[float] = field(default_factory=list)
    """Each waiter's poll interval: the poller reads at the shortest."""
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    """Set (and replaced) when a reading differs from the one before it."""
    kick: asyncio.Event = field(default_factory=asyncio.Event)
    """Set by a commit through this process: the poller reads at once."""
    reading: tuple[int, Reading] | None = None
    """The poller's newest reading, with the number it started under."""
    task: asyncio.Task[None] | None = None


class FollowTargets:
    """The waiting followers of every model in this process, each model's catalog reads shared (module doc)."""

    def __init__(self, read: Callable[[str], Awaitable[Target]]) -> None:
        self._read = read
        self._models: dict[str, _Watched] = {}
        self._numbers = itertools.count()

    def watched(self) -> list[str]:
        """The models someone waits on now (each with its poller)."""
        return list(self._models)

    def kick(self) -> None:
        """A commit (or pin) through this process: every poller reads now, so its waiters hear of it at once."""
        for w in self._models.values():
            w.kick.set()

    async def wait(
        self, model: str, *, after: int | None, timeout: float, poll: float, absent_ok: bool
    ) -> Target | None:
        """The target once a follower holding `after` must move (`Target.news_for`); None after `timeout` seconds.

        A model that does not exist is waited for like one without versions; with `absent_ok` False it
        raises ModelNotFound instead (then also when it is deleted while waited on).
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        w = self._join(model, poll)
        try:
            event = w.changed  # before the read: a change the poller finds from now on sets it
            number, reading = await self._reading(model)
            while True:
                if w.reading is not None and w.reading[0] > number:
                    number, reading = w.reading  # read after this waiter's newest: take it
                if isinstance(reading, errors.ModelNotFound):
                    if not absent_ok:
                        raise reading
                    target = Target(None, pinned=False)
                else:
                    target = reading
                if target.news_for(after):
                    return target
                left = deadline - loop.time()
                if left <= 0:
                    return None
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(left):  # awaited here: no task of its own to cancel unstarted
                        await event.wait()
                event = w.changed
        finally:
            self._leave(model, w, poll)

    async def _reading(self, model: str) -> tuple[int, Reading]:
        """A read of what followers of `model` hold, numbered as it begins (a later read, a larger number)."""
        number = next(self._numbers)
        try:
            return number, await self._read(model)
        except errors.ModelNotFound as exc:
            return number, exc

    def _join(self, model: str, poll: float) -> _Watched:
        w = self._models.get(model)
        if w is None:
            w = self._models[model] = _Watched()
            w.task = asyncio.get_running_loop().create_task(self._poller(model, w), name=f"follow {model}")
        w.polls.append(poll)
        return w

    def _leave(self, model: str, w: _Watched, poll: float) -> None:
        w.polls.remove(poll)
        if not w.polls:  # the last waiter: the poller goes with it
            if self._models.get(model) is w:
                del self._models[model]
            if w.task is not None:
                w.task.cancel()

    async def _poller(self, model: str, w: _Watched) -> None:
        """Read what followers of `model` hold every (shortest) interval, or at once when kicked; on a change,
        wake the waiters. The first read waits an interval: each waiter reads for itself as it begins."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(w.polls)):
                    await w.kick.wait()
            w.kick.clear()  # a kick during the read below makes the next one follow at once
            try:
                number, reading = await self._reading(model)
            except errors.WeightsyncError as exc:  # the catalog unreachable: the next reading tells them
                log.warning("following %s: %s", model, exc)
                continue
            before = w.reading
            w.reading = (number, reading)
            if before is None or not _same(before[1], reading):
                w.changed.set()
                w.changed = asyncio.Event()


def _same(a: Reading, b: Reading) -> bool:
    if isinstance(a, errors.ModelNotFound) or isinstance(b, errors.ModelNotFound):
        return isinstance(a, errors.ModelNotFound) and isinstance(b, errors.ModelNotFound)
    return a == b


__all__ = ["FollowTargets"]
