"""Phases of a request's work, timed for the service's ``Server-Timing`` answer header (docs/API.md).

The service starts a collection per request (:func:`start`, :func:`stop`); the ops methods that make up a
request's main phases are wrapped in :func:`timed`, which adds their wall time under a name. The
collection lives in a context variable, so a phase run in a task or a thread the request started
counts too; outside a collection (tests, the CLI's own calls) timing costs one lookup.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable, Callable
from contextvars import ContextVar, Token
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

_phases: ContextVar[dict[str, float] | None] = ContextVar("weightsync_phases", default=None)


def start() -> tuple[dict[str, float], Token[dict[str, float] | None]]:
    """Start collecting in this context: ({name: seconds} in the order phases first ran, a token for :func:`stop`)."""
    found: dict[str, float] = {}
    return found, _phases.set(found)


def stop(token: Token[dict[str, float] | None]) -> None:
    """Stop the collection :func:`start` began."""
    _phases.reset(token)


def timed(name: str) -> Callable[[Callable[P, Awaitable[T]]], Callable[P, Awaitable[T]]]:
    """Add the wall time of each call of the decorated coroutine function to phase `name` (when collecting)."""

    def wrap(fn: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T]]:
        @functools.wraps(fn)
        async def run(*args: P.args, **kwargs: P.kwargs) -> T:
            found = _phases.get()
            if found is None:
                return await fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return await fn(*args, **kwargs)
            finally:
                found[name] = found.get(name, 0.0) + time.perf_counter() - start

        return run

    return wrap


def header(found: dict[str, float]) -> bytes:
    """The ``Server-Timing`` value of `found`: ``name;dur=ms`` entries (W3C Server Timing), in order."""
    return ", ".join(f"{name};dur={seconds * 1e3:.2f}" for name, seconds in found.items()).encode()


__all__ = ["header", "start", "stop", "timed"]
