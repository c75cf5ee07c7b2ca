"""The sidecar loop: watch a model, prepare each new version, switch the engine to it, report what it holds.

``weightsync follow MODEL --engine vllm|torch --engine-url URL --dir DIR`` is
this function behind a command line. The loop never reports a version the
engine does not hold: it starts from what the engine shows (:meth:`Engine.held`),
reports only verified switches, and after the engine restarts or a switch
leaves it unhealthy it asks the engine again before going on. The weightsync
server restarting is the subscriber's watch's business (it reconnects).

Ctrl-C never abandons a switch half way (the engine would stay paused on
weights that are no version): in the main thread, a first Ctrl-C during a
switch sets ``stop``, the switch finishes (verified, or put back) and is
reported, and then KeyboardInterrupt is raised; a second one raises at once.
Outside a switch Ctrl-C raises at once (a download is cancelled; the checkout
stays as it was).
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

from weightsync import errors
from weightsync.client.ledger import LedgerReporter
from weightsync.client.subscriber import Subscriber
from weightsync.common import Backoff
from weightsync.engines.base import Engine, SwitchReport
from weightsync.engines.errors import EngineUnhealthy, SwitchFailed, UnverifiableEngine

log = logging.getLogger("weightsync.engines")

ENGINE_RETRY = Backoff(attempts=1, base=0.5, cap=15.0)
"""How the loop waits before asking an unreachable or unhealthy engine again (full jitter, doubling)."""


FATAL: tuple[type[Exception], ...] = (UnverifiableEngine, errors.AuthError, errors.InvalidArgument)
"""Failures no wait repairs: the loop ends with them."""


class _Stopped(Exception):
    pass


class _DeferredInterrupt:
    """Inside ``with``: a first SIGINT sets ``stop`` and :attr:`hit` instead of raising; a second raises.

    Only in the main thread with a Python SIGINT handler installed (elsewhere it does nothing):
    signal handlers can be set there only.
    """

    def __init__(self, stop: threading.Event) -> None:
        self.stop, self.hit = stop, False
        self._previous: Callable[[int, FrameType | None], object] | int | None = None

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self.hit:
            raise KeyboardInterrupt
        self.hit = True
        self.stop.set()
        log.warning("interrupted: finishing the switch in progress first (Ctrl-C again leaves the engine paused)")

    def __enter__(self) -> _DeferredInterrupt:
        if threading.current_thread() is threading.main_thread():
            previous = signal.getsignal(signal.SIGINT)
            if previous is not None:  # None: a handler set outside Python, which could not be put back
                self._previous = previous
                signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None


def follow(
    engine: Engine,
    subscriber: Subscriber,
    *,
    stop: threading.Event | None = None,
    count: int | None = None,
    on_switch: Callable[[SwitchReport], None] | None = None,
    on_error: Callable[[Exception], None] | None = None,
    report: bool = True,
    watch_timeout: float = 30.0,
    retry: Backoff = ENGINE_RETRY,
) -> int | None:
    """Keep ``engine`` on the newest version of ``subscriber.model`` until ``stop`` is set or ``count``
    switches succeeded; return the version the engine holds then.

    At start, and after the engine was unreachable or unhealthy, the engine is
    asked what it holds and switched to the head when it holds something else.
    Then every new head is prepared and switched to. A SwitchFailed (the engine
    is back on the version it held) is passed to ``on_error`` and the loop waits
    for the next version; any other weightsync error (EngineUnavailable,
    EngineUnhealthy, ServerUnavailable, a checkout changed behind its back...) is
    passed to ``on_error`` too, and the loop waits (``retry``) and starts over from
    what the engine shows; :data:`FATAL` ones end it. ``on_switch`` gets each
    successful switch. With ``report``, what the engine holds is sent to the replica
    ledger under ``subscriber.name`` (unless the adapter's own subscriber reports it),
    each time it changes: every verified switch (status ``serving``, its mode, pause
    and bytes), a failed switch that could not be undone (``unhealthy``, no version),
    and the version the engine shows when the loop starts or the engine recovers
    without a switch (``serving``).
    ``on_error`` may raise to end the loop with its exception. A ``stop`` set while
    a version is prepared ends the loop before its switch; Ctrl-C during a switch:
    the module docstring.
    """
    stop = stop or threading.Event()
    interrupt = _DeferredInterrupt(stop)
    reporter = None
    if report and not engine.reports_itself:
        reporter = LedgerReporter(subscriber.api, subscriber.model, subscriber.name, site=subscriber.site)
    switches, failures = 0, 0
    reported: tuple[str, int | None] | None = None  # (status, version) this loop last sent to the ledger

    def held_now(version: int | None, status: str, *, extra: dict[str, Any] | None = None) -> None:
        """Report that the engine holds ``version`` (None: unhealthy) unless this loop said so last."""
        nonlocal reported
        if reporter is None or reported == (status, version):
            return
        reporter.report(version, status=status, engine=engine.kind, extra=extra)
        reported = (status, version)

    def switch_to(number: int) -> None:
        nonlocal switches, failures, reported
        update = engine.prepare(number)
        if stop.is_set():
            return
        try:
            with interrupt:
                done = engine.switch(update)
        except SwitchFailed as exc:
            log.error("%s", exc)
            if exc.held is not None:  # back on the version it held: serving it, whatever was reported before
                held_now(exc.held, "serving", extra={"failed_target": exc.target})
            if on_error is not None:
                on_error(exc)
            return
        switches, failures = switches + 1, 0
        log.info("engine %s holds %s v%d (paused %.3fs)", engine.kind, subscriber.model, done.version, done.pause_s)
        if reporter is not None:
            reporter.report(
                done.version,
                status="serving",
                mode=done.mode,
                engine=engine.kind,
                bytes_=done.bytes_received,
                pause_ms=done.pause_s * 1e3,
                extra=done.ledger_extra(),
            )
            reported = ("serving", done.version)
        if on_switch is not None:
            on_switch(done)
        if count is not None and switches >= count:
            raise _Stopped

    try:
        while not stop.is_set():
            try:
                held = engine.held()
                head = subscriber.api.head(subscriber.model)
                if head is not None and head.number != held:
                    switch_to(head.number)
                elif held is not None:  # at start, or recovered (restarted) without a switch
                    held_now(held, "serving")
                after = engine.version if engine.version is not None else (head.number if head else 0)
                for version in subscriber.watch(after=after, timeout=watch_timeout, stop=stop):
                    if version.number != engine.version:
                        switch_to(version.number)
            except FATAL:
                raise
            except errors.WeightsyncError as exc:  # engine or server unreachable, engine unhealthy, checkout changed
                log.error("%s", exc)
                if isinstance(exc, EngineUnhealthy):  # it holds no verified version: never report one
                    held_now(None, "unhealthy", extra={"target": exc.target, "error": str(exc)})
                if on_error is not None:
                    on_error(exc)
                stop.wait(retry.delay(failures))
                failures += 1
    except _Stopped:
        pass
    finally:
        if reporter is not None:
            reporter.close()
    if interrupt.hit:
        raise KeyboardInterrupt
    return engine.version
