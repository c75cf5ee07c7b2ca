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

MISSING_POLL_S = 2.0
"""The longest wait between polls for a model that does not exist yet (a replica started before the
trainer's first push): the reconnect backoff, capped so the first version is seen soon after it commits."""

PAGE = 500
"""Versions asked for per listing when a watch reports every version."""


def follow(
    api: Api,
    model: str,
    after: int,
    *,
    timeout: float = 30.0,
    stop: threading.Event | None = None,
    backoff: Backoff = WATCH_RECONNECT,
    every: bool = False,
) -> Iterator[Version]:
    """Yield each version of `model` to hold as it comes, reconnecting on errors: each head newer than
    `after` as it commits, or, while the model is pinned, the pinned version (a rollback below
    `after` too; after an unpin, the head again).

    When several versions commit between two polls only the newest is yielded, unless
    `every`: then each committed version after `after` is yielded, in order. A model that
    does not exist yet is waited for (polled at least every :data:`MISSING_POLL_S`). A failed
    poll (server unavailable, version not found) is retried after `backoff`'s wait, which
    grows with consecutive failures and starts over after a successful poll. Ends when
    `stop` is set (checked between polls and during a reconnect wait).
    """
    failures = 0
    while stop is None or not stop.is_set():
        try:
            head = api.watch(model, after=after, timeout=timeout)
            found = _since(api, model, after, head) if every and head is not None else [head]
            failures = 0
        except (errors.ServerUnavailable, errors.ModelNotFound, errors.VersionNotFound) as exc:
            delay = backoff.delay(failures)
            if isinstance(exc, errors.ModelNotFound):
                delay = min(delay, MISSING_POLL_S)
            failures += 1
            log.debug("watch %s: %s; polling again in %.1fs", model, exc, delay)
            if _wait(stop, delay):
                return
            continue
        for version in found:
            if version is not None and version.number != after:  # a pin below `after` is a rollback to follow
                after = version.number
                yield version


def _since(api: Api, model: str, after: int, head: Version) -> list[Version]:
    """The committed versions after `after` up to `head`, oldest first (`head` alone when it is the next)."""
    if head.number <= after + 1:
        return [head]
    out: list[Version] = []
    while after < head.number:
        page = [v for v in api.list_versions(model, after=after, limit=PAGE) if v.number <= head.number]
        out += page
        if len(page) < PAGE:
            break
        after = page[-1].number
    return out if out and out[-1].number == head.number else [*out, head]


def _wait(stop: threading.Event | None, seconds: float) -> bool:
    """Sleep `seconds` or until `stop` is set; True when stopped."""
    if stop is None:
        time.sleep(seconds)
        return False
    return stop.wait(seconds)
