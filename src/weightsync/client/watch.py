"""Following a model's head: long-poll `watchModel` and reconnect with the client's one backoff policy."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

from weightsync import errors
from weightsync.client._http import Api
from weightsync.client.models import Version
from weightsync.common import Backoff

log = logging.getLogger("weightsync.client")

WATCH_RECONNECT = Backoff(attempts=1, base=0.5, cap=10.0)
"""How a watch waits before reconnecting after a failed poll: full jitter up to 0.5 s doubling to
10 s (the client's one backoff policy; ``attempts`` is unused: a watch never gives up)."""


def follow(
    api: Api,
    model: str,
    after: int,
    *,
    timeout: float = 30.0,
    stop: threading.Event | None = None,
    backoff: Backoff = WATCH_RECONNECT,
) -> Iterator[Version]:
    """Yield each head of `model` newer than `after` as it commits, reconnecting on errors.

    When several versions commit between two polls only the newest is yielded. A
    failed poll (server unavailable, model or version not found yet) is retried
    after `backoff`'s wait, which grows with consecutive failures and starts over
    after a successful poll. Ends when `stop` is set (checked between polls and
    during a reconnect wait).
    """
    failures = 0
    while stop is None or not stop.is_set():
        try:
            version = api.watch(model, after=after, timeout=timeout)
            failures = 0
        except (errors.ServerUnavailable, errors.ModelNotFound, errors.VersionNotFound) as exc:
            delay = backoff.delay(failures)
            failures += 1
            log.debug("watch %s: %s; reconnecting in %.1fs", model, exc, delay)
            if stop is not None and stop.wait(delay):
                return
            if stop is None:
                time.sleep(delay)
            continue
        if version is not None and version.number > after:
            after = version.number
            yield version
