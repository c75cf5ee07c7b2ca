"""Running a batch of jobs on a shared thread pool, all-or-nothing."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Executor, wait
from typing import Any, TypeVar

T = TypeVar("T")


def run_all(pool: Executor, fn: Callable[[T], Any], items: Iterable[T]) -> list[Any]:
    """Run `fn` on every item; on the first failure cancel what has not started, wait for what has, re-raise.

    Waiting matters: a job still writing a cache file or a temporary after the
    caller has given up would race with the caller's clean-up or its retry.
    """
    futures = [pool.submit(fn, item) for item in items]
    try:
        return [f.result() for f in futures]
    except BaseException:
        for f in futures:
            f.cancel()
        wait(futures)
        raise
