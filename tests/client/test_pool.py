"""client/_pool.py: a batch of jobs is all-or-nothing, and a stopped batch stops the jobs in flight."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from weightsync.client._pool import Cancelled, check_cancelled, pause, run_all
from weightsync.client.wire import TokenBucket

LONG_S = 60.0
"""A wait no test sits through: a job still in it when the batch stops must be woken."""


def test_results_come_back_in_order() -> None:
    with ThreadPoolExecutor(4) as pool:
        assert run_all(pool, lambda x: x * x, range(20)) == [x * x for x in range(20)]
        assert run_all(pool, lambda x: x, []) == []


def test_a_failure_stops_the_jobs_in_flight_and_is_what_the_caller_gets() -> None:
    stopped: list[int] = []
    waiting = threading.Barrier(4)

    def job(i: int) -> None:
        if i == 0:
            waiting.wait(LONG_S)  # the other three are in their long waits
            raise ValueError("job 0 failed")
        waiting.wait(LONG_S)
        try:
            pause(LONG_S)
        except Cancelled:
            stopped.append(i)
            raise

    with ThreadPoolExecutor(4) as pool, pytest.raises(ValueError, match="job 0 failed"):
        run_all(pool, job, range(4))
    assert sorted(stopped) == [1, 2, 3]


def test_jobs_not_started_are_not_run() -> None:
    ran: list[int] = []

    def job(i: int) -> None:
        ran.append(i)
        raise ValueError(f"job {i}")

    with ThreadPoolExecutor(1) as pool, pytest.raises(ValueError, match="job 0"):
        run_all(pool, job, range(50))
    assert len(ran) < 50


def test_a_stopped_batch_stops_a_batch_started_inside_it() -> None:
    inner_stopped = threading.Event()
    inner_waiting = threading.Event()

    def inner(_: int) -> None:
        inner_waiting.set()
        try:
            pause(LONG_S)
        except Cancelled:
            inner_stopped.set()
            raise

    def outer(i: int) -> None:
        if i == 0:
            inner_waiting.wait(LONG_S)
            raise ValueError("outer job failed")
        with ThreadPoolExecutor(1) as nested:
            run_all(nested, inner, [0])

    with ThreadPoolExecutor(2) as pool, pytest.raises(ValueError, match="outer job failed"):
        run_all(pool, outer, [0, 1])
    assert inner_stopped.is_set()


def test_the_bandwidth_cap_wait_ends_when_the_batch_stops() -> None:
    """A transfer held back by --limit-rate does not keep Ctrl-C waiting for its turn."""
    bucket = TokenBucket(1000.0)  # 1000 bytes/s: a 1 MB chunk would wait ~17 minutes
    in_wait = threading.Event()
    outcome: list[str] = []

    def job(i: int) -> None:
        if i == 0:
            in_wait.wait(LONG_S)
            raise KeyboardInterrupt  # what Ctrl-C raises in the thread that waits for the batch
        in_wait.set()
        try:
            bucket.acquire(1_000_000)
            bucket.acquire(1_000_000)
        except Cancelled:
            outcome.append("cancelled")
            raise

    with ThreadPoolExecutor(2) as pool, pytest.raises(KeyboardInterrupt):
        run_all(pool, job, [0, 1])
    assert outcome == ["cancelled"]


def test_outside_a_batch_nothing_is_cancelled() -> None:
    check_cancelled()
    pause(0.0)
