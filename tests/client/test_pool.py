"""client/_pool.py: a batch of jobs is all-or-nothing, and a stopped batch stops the jobs in flight."""

from __future__ import annotations

import multiprocessing
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest

from weightsync.client._pool import (
    Batch,
    Cancelled,
    HelpingPool,
    check_cancelled,
    cpu_pool,
    hash_pool,
    pause,
    pool_of,
    release_later,
    run_all,
)
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


def test_a_helping_caller_runs_jobs_from_the_back_and_each_job_runs_once() -> None:
    # One pool thread holds job 0 until job 19 ran: only the caller, taking jobs from the back, gets there.
    ran: list[tuple[int, int]] = []
    lock = threading.Lock()
    last_ran = threading.Event()

    def job(i: int) -> int:
        if i == 0:
            assert last_ran.wait(LONG_S)
        if i == 19:
            last_ran.set()
        with lock:
            ran.append((i, threading.get_ident()))
        return i * 10

    with ThreadPoolExecutor(1) as pool:
        assert run_all(pool, job, range(20), caller_helps=True) == [i * 10 for i in range(20)]
    assert sorted(i for i, _ in ran) == list(range(20))
    assert dict(ran)[19] == threading.get_ident()


def test_a_helping_callers_failure_stops_the_pool_jobs_in_flight() -> None:
    stopped: list[int] = []
    started = threading.Event()

    def job(i: int) -> None:
        if i == 0:  # the pool's thread
            started.set()
            try:
                pause(LONG_S)
            except Cancelled:
                stopped.append(i)
                raise
        assert started.wait(LONG_S)
        raise ValueError(f"job {i} failed")

    with ThreadPoolExecutor(1) as pool, pytest.raises(ValueError, match="job 3 failed"):
        run_all(pool, job, range(4), caller_helps=True)
    assert stopped == [0]


def test_a_pool_jobs_failure_stops_a_helping_caller() -> None:
    class Recording(ThreadPoolExecutor):
        def __init__(self) -> None:
            super().__init__(1)
            self.futures: list[Future[Any]] = []

        def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future[Any]:
            f = super().submit(fn, *args, **kwargs)
            self.futures.append(f)
            return f

    ran: list[int] = []
    caller = threading.get_ident()
    caller_in = threading.Event()

    def job(i: int) -> None:
        if i == 0:  # the pool's thread, once the caller runs a job
            assert caller_in.wait(LONG_S)
            raise ValueError("job 0 failed")
        if threading.get_ident() != caller:
            pause(LONG_S)  # the pool's thread after job 0: held until the batch stops
        ran.append(i)
        caller_in.set()
        # The caller's first job returns once job 0 has failed and run_all has seen it (its own callback on the
        # future was added before this one, and callbacks run in order).
        seen = threading.Event()
        pool.futures[0].add_done_callback(lambda _: seen.set())
        assert seen.wait(LONG_S)

    with Recording() as pool, pytest.raises(ValueError, match="job 0 failed"):
        run_all(pool, job, range(50), caller_helps=True)
    assert ran == [49]  # the caller took no job after the failure


def test_a_helping_pool_maps_in_order_with_the_caller_running_jobs() -> None:
    # As test_a_helping_caller_runs_jobs_from_the_back...: only the caller can run job 19 while job 0 waits.
    last_ran = threading.Event()
    runners: dict[int, int] = {}

    def job(i: int, j: int) -> int:
        if i == 0:
            assert last_ran.wait(LONG_S)
        if i == 19:
            last_ran.set()
        runners[i] = threading.get_ident()
        return i + j

    with ThreadPoolExecutor(1) as pool:
        helping = HelpingPool(pool)
        assert list(helping.map(job, range(20), range(100, 125))) == [i + 100 + i for i in range(20)]
        assert helping.submit(job, 5, 1).result() == 6
        helping.shutdown()  # leaves the shared pool running
        assert pool.submit(lambda: 7).result() == 7
    assert runners[19] == threading.get_ident()


def test_a_helping_pools_map_raises_the_failure() -> None:
    def job(i: int) -> int:
        if i == 3:
            raise ValueError("job 3 failed")
        return i

    with ThreadPoolExecutor(2) as pool, pytest.raises(ValueError, match="job 3 failed"):
        list(HelpingPool(pool).map(job, range(10)))


def test_a_helping_pools_map_refuses_a_timeout_and_runs_nothing() -> None:
    ran: list[int] = []
    with ThreadPoolExecutor(1) as pool, pytest.raises(ValueError, match="no timeout"):
        HelpingPool(pool).map(ran.append, range(3), timeout=1.0)
    assert ran == []


def test_a_pool_of_a_size_is_started_once_and_shared() -> None:
    """pool_of(n) is one pool per size for the process (a decode asked for n threads does not start n
    threads per call); the CPU pool is the one of the core count."""
    import os

    three = pool_of(3)
    assert pool_of(3) is three and pool_of(2) is not three
    assert pool_of(0) is pool_of(1)
    assert cpu_pool() is pool_of(os.cpu_count() or 1) is pool_of(None)
    for _ in range(3):
        assert run_all(three, lambda _: threading.current_thread().name, range(12))
    started = [t for t in threading.enumerate() if t.name.startswith("weightsync-3t")]
    assert 1 <= len(started) <= 3


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_gets_pools_of_its_own() -> None:
    """The process's pools are started once and shared, but a child forked after they started has none of
    their threads: its jobs run on pools of its own (a job given to the parent's would never run)."""
    assert cpu_pool().submit(lambda: 1).result(LONG_S) == 1
    assert hash_pool().submit(lambda: 2).result(LONG_S) == 2
    assert pool_of(1).submit(lambda: 3).result(LONG_S) == 3
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1) as child:
        got = child.apply_async(_jobs_on_the_pools).get(LONG_S)
    assert got == [1, 2, 3]


def _jobs_on_the_pools() -> list[int]:
    return [
        pool().submit(lambda i=i: i).result(10) for i, pool in enumerate([cpu_pool, hash_pool, lambda: pool_of(1)], 1)
    ]


def test_a_batch_fed_one_job_at_a_time_runs_them_all_and_finishes_after_the_last() -> None:
    done: list[int] = []
    with ThreadPoolExecutor(3) as pool:
        batch = Batch(pool)
        for i in range(10):
            batch.submit(done.append, i)
        batch.finish()
    assert sorted(done) == list(range(10))


def test_a_batch_s_failure_stops_its_jobs_in_flight_and_refuses_more() -> None:
    """One job fails while two others wait: both are stopped (their waits raise Cancelled), a submit after
    the failure raises it (whoever feeds the batch stops), and finish raises it, not a Cancelled."""
    stopped: list[int] = []
    waiting = threading.Barrier(3)
    failed = threading.Event()

    def job(i: int) -> None:
        waiting.wait(LONG_S)
        if i == 0:
            failed.set()
            raise ValueError("upload 0 refused")
        try:
            pause(LONG_S)
        except Cancelled:
            stopped.append(i)
            raise

    with ThreadPoolExecutor(3) as pool:
        batch = Batch(pool)
        for i in range(3):
            batch.submit(job, i)
        assert failed.wait(LONG_S)
        for _ in range(int(LONG_S / 0.01)):  # the failure is the batch's once its future is done
            if batch.failure() is not None:
                break
            threading.Event().wait(0.01)
        with pytest.raises(ValueError, match="upload 0 refused"):
            batch.submit(job, 3)
        with pytest.raises(ValueError, match="upload 0 refused"):
            batch.finish()
    assert sorted(stopped) == [1, 2]


def test_a_stopped_batch_cancels_what_has_not_started_and_waits_for_what_has() -> None:
    ran: list[int] = []
    started = threading.Event()

    def job(i: int) -> None:
        ran.append(i)
        started.set()
        try:
            pause(LONG_S)
        except Cancelled:
            ran.append(-i - 1)  # what a job does after its stop is over before stop() returns
            raise

    with ThreadPoolExecutor(1) as pool:
        batch = Batch(pool)
        for i in range(4):
            batch.submit(job, i)
        assert started.wait(LONG_S)
        batch.stop()
        assert ran == [0, -1]  # the one in flight stopped and finished; the others never ran


class _Held:
    """An object whose end (its last reference dropped) records the thread it ended on."""

    def __init__(self, ended: dict[str, str], name: str) -> None:
        self.name = name
        self._ended = ended

    def __del__(self) -> None:
        self._ended[self.name] = threading.current_thread().name


def test_release_later_drops_the_objects_on_the_release_thread_and_leaves_those_held_elsewhere() -> None:
    ended: dict[str, str] = {}
    kept = _Held(ended, "kept")
    held: list[Any] = [_Held(ended, "given"), kept]
    release_later(held)
    pool_of(1)  # a batch on another pool meanwhile is not held up by the release
    deadline = threading.Event()
    for _ in range(200):
        if "given" in ended:
            break
        deadline.wait(0.01)
    assert ended == {"given": ended["given"]}  # `kept` lives on: the test still holds it
    assert ended["given"].startswith("weightsync-release")
    assert held == []  # emptied: the caller's list no longer holds them
    del kept
    assert ended["kept"] == threading.current_thread().name  # its last holder dropped it, here


def test_release_later_of_nothing_starts_no_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    from weightsync.client import _pool

    monkeypatch.setattr(_pool, "_releaser", None)  # as in a process that has released nothing yet
    release_later([])
    assert _pool._releaser is None
    release_later([object()])
    assert _pool._releaser is not None
