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
Reads run in worker threads, so a poller's read numbered before a waiter's may still see a later
state of the catalog (a commit between the two statements). When a waiter's own read disagrees
with the poller's newest, it cannot tell which is newer: it asks the poller for a reading at once,
numbered after its own, which wakes the waiters whatever it finds (it would otherwise wake them
only on a change, and the poller's reading had the change already).
The poller's failed reads (the catalog unreachable) are not passed on: the waiters keep waiting
and the next reading that succeeds tells them; their own first read reports such a failure.

Where the catalog can announce changes (PostgreSQL's LISTEN/NOTIFY: catalog/notices.py), a change
made through this process is announced to the others, and while this process listens, an
announcement from another makes that model's poller read at once: a follower of another process
hears of a commit in milliseconds, not an interval later. Polling then only guards against an
announcement lost with a connection, so it slows to :data:`LISTENING_POLL_S`. The listening
connection is made when the first follower begins to wait and kept until :meth:`FollowTargets.aclose`;
each time it (re)connects every poller reads once, for what was missed while it did not listen.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from weightsync import errors
from weightsync.catalog.records import Target

log = logging.getLogger(__name__)

Reading = Target | errors.ModelNotFound
"""What a read of the catalog says followers of a model hold: a target, or that the model does not exist."""

LISTENING_POLL_S = 2.0
"""The pollers' interval while this process listens for other processes' announcements (the waiters' own,
shorter, interval otherwise): an announcement makes the poller read at once, so the poll only bounds
how late a follower hears of a change whose announcement was lost with a connection."""


class Listening(Protocol):
    """What the catalog's listener is to this module (catalog/notices.py Listener): run until cancelled."""

    async def run(self) -> None: ...


ListenerFactory = Callable[[Callable[[str], None], Callable[[bool], None]], Listening | None]
"""Makes a listener from (on each payload, on listening or not), or None where the catalog cannot announce."""


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
    recheck: bool = False
    """A waiter's reading disagreed with the poller's newest, numbered before it: the poller's next reading
    wakes the waiters whatever it finds (module doc: reads that overlap)."""
    task: asyncio.Task[None] | None = None


class FollowTargets:
    """The waiting followers of every model in this process, each model's catalog reads shared (module doc)."""

    def __init__(
        self,
        read: Callable[[str], Awaitable[Target]],
        *,
        announce: Callable[[str], Awaitable[None]] | None = None,
        listener: ListenerFactory | None = None,
    ) -> None:
        """`read`: what followers of a model hold, from the catalog. `announce` sends a payload to the other
        processes on the catalog, `listener` makes what hears theirs (module doc); without them, polling alone."""
        self._read = read
        self._announce = announce
        self._listener = listener
        self._models: dict[str, _Watched] = {}
        self._numbers = itertools.count()
        self._token = secrets.token_hex(8)
        """Names this process in its announcements, so it skips its own when they come back."""
        self._listen_task: asyncio.Task[None] | None = None
        self._listening = False
        self._announcing: set[asyncio.Task[None]] = set()

    def watched(self) -> list[str]:
        """The models someone waits on now (each with its poller)."""
        return list(self._models)

    @property
    def listening(self) -> bool:
        """Whether this process hears other processes' announcements now."""
        return self._listening

    def kick(self) -> None:
        """Every poller reads now, so its waiters hear at once of whatever changed."""
        for w in self._models.values():
            w.kick.set()

    def changed(self, model: str) -> None:
        """What followers of `model` hold changed through this process (a commit, a pin, a deletion): its waiters
        here hear of it at once, and the other processes on the catalog are told (in the background)."""
        w = self._models.get(model)
        if w is not None:
            w.kick.set()
        if self._announce is not None:
            task = asyncio.get_running_loop().create_task(self._announcing_one(f"{self._token} {model}"))
            self._announcing.add(task)
            task.add_done_callback(self._announcing.discard)

    async def aclose(self) -> None:
        """Stop listening and wait for announcements under way (the service's shutdown)."""
        if self._listen_task is not None:
            self._listen_task.cancel()
            await asyncio.gather(self._listen_task, return_exceptions=True)  # a failure was logged as it restarted
            self._listen_task = None
        if self._announcing:
            await asyncio.gather(*self._announcing, return_exceptions=True)

    async def _announcing_one(self, payload: str) -> None:
        try:
            assert self._announce is not None, "only scheduled with one"
            await self._announce(payload)
        except errors.WeightsyncError as exc:  # the others find the change by polling
            log.warning("announcing a change to followers elsewhere: %s", exc)

    def _heard(self, payload: str) -> None:
        """Another process's announcement: that model's poller, if any, reads now."""
        token, _, model = payload.partition(" ")
        if token == self._token:
            return
        w = self._models.get(model)
        if w is not None:
            w.kick.set()

    def _listens(self, listening: bool) -> None:
        """The listening connection began (or stopped) listening: every poller reads once, for what was
        missed meanwhile (or to take up its own interval again)."""
        self._listening = listening
        self.kick()

    def _ensure_listening(self) -> None:
        """Start the listener (again, if it ended: it only ends by a fault of its own, which is logged)."""
        task = self._listen_task
        if self._listener is None or (task is not None and not task.done()):
            return
        if task is not None and not task.cancelled() and task.exception() is not None:
            log.error("the followers' listener failed; starting it again", exc_info=task.exception())
        listener = self._listener(self._heard, self._listens)
        if listener is None:
            self._listener = None  # this catalog cannot announce: never asked again
            return
        self._listen_task = asyncio.get_running_loop().create_task(listener.run(), name="follow listener")

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
            asked: tuple[int, Reading] | None = None
            while True:
                seen = w.reading
                if seen is not None and seen[0] > number:
                    number, reading = seen  # read after this waiter's newest: take it
                elif seen is not None and seen is not asked and not _same(seen[1], reading):
                    # Read before this waiter's newest, yet it differs: the reads overlapped and either may be
                    # the newer. Ask for a reading numbered after this one, which wakes the waiters even when
                    # it finds what the poller's last one found.
                    asked = seen
                    w.recheck = True
                    w.kick.set()
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
        self._ensure_listening()
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
        wake the waiters. The first read waits an interval: each waiter reads for itself as it begins. While
        this process listens for announcements the interval is at least LISTENING_POLL_S."""
        while True:
            interval = min(w.polls)
            if self._listening:
                interval = max(interval, LISTENING_POLL_S)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await w.kick.wait()
            w.kick.clear()  # a kick during the read below makes the next one follow at once
            recheck, w.recheck = w.recheck, False  # one asked for during the read: the next reading
            try:
                number, reading = await self._reading(model)
            except errors.WeightsyncError as exc:  # the catalog unreachable: the next reading tells them
                log.warning("following %s: %s", model, exc)
                w.recheck = w.recheck or recheck
                continue
            before = w.reading
            w.reading = (number, reading)
            if recheck or before is None or not _same(before[1], reading):
                w.changed.set()
                w.changed = asyncio.Event()


def _same(a: Reading, b: Reading) -> bool:
    if isinstance(a, errors.ModelNotFound) or isinstance(b, errors.ModelNotFound):
        return isinstance(a, errors.ModelNotFound) and isinstance(b, errors.ModelNotFound)
    return a == b


__all__ = ["LISTENING_POLL_S", "FollowTargets", "ListenerFactory", "Listening"]
