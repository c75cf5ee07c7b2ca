"""Running a batch of jobs on a shared thread pool, all-or-nothing, and stopping it early.

A batch stops as soon as one job fails or the caller is interrupted (Ctrl-C reaches the
waiting thread as KeyboardInterrupt): jobs not started are cancelled, and jobs in flight
are told to stop through the batch's *scope*. Long waits inside a job (a transfer's
chunks, the bandwidth cap, a retry's backoff) call :func:`check_cancelled` or
:func:`pause`, so a stopped batch ends within a fraction of a second instead of after
every transfer in flight has finished.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_EXCEPTION, Executor, Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

T = TypeVar("T")

_SLICE = 0.05
"""How often a paused job looks at the scopes around its own (a nested batch's parent)."""

_local = threading.local()
_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()
_hasher: ThreadPoolExecutor | None = None
_releaser: ThreadPoolExecutor | None = None


def _forget_pools() -> None:
    """In a forked child: the parent's pools hold threads that do not exist there (a job given to one would
    never run), and a lock another thread held at the fork stays held; the child starts its own on first use."""
    global _pools_lock, _hasher, _releaser
    _pools.clear()
    _hasher = _releaser = None
    _pools_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_pools)


def cpu_pool() -> ThreadPoolExecutor:
    """The process's pool for CPU work that releases the GIL (decoding, checksums, patching tensors).

    One thread per core, started once and shared by every subscriber of the process:
    a pool per call started its threads anew each time, which on a busy 2-core box cost
    more than the work of a small update. Submit only from outside it: a job of this
    pool must never wait on another job of it.
    """
    return pool_of(None)


def threads_of(threads: int | None) -> int:
    """`threads`, or one per core for None: how many threads a batch asked to run on gets."""
    return threads if threads is not None else os.cpu_count() or 1


def helping_pool(threads: int) -> ThreadPoolExecutor:
    """The shared pool for batches whose calling thread helps (:func:`run_all`'s `caller_helps`): `threads` in
    all with the caller, so one fewer of the pool's, at least one.

    A pool of one thread per core and the caller put a thread more than the cores on CPU work: on the
    2-core VM the 45 MB step's verified apply took 0.3-1 ms longer than with one pool thread and the
    caller (docs/SCALE-RUNS.md, run AF).
    """
    return pool_of(max(1, threads - 1))


def hash_pool() -> ThreadPoolExecutor:
    """The process's one thread for hashing bytes as they arrive (a plan bundle's objects, bundle.Receiver).

    One thread, so that the steps of one object's hash run in order; started once: a thread started
    per answer cost about as much as hashing a small update's objects. Its jobs wait on nothing.
    """
    with _pools_lock:
        global _hasher
        if _hasher is None:
            _hasher = ThreadPoolExecutor(1, thread_name_prefix="weightsync-hash")
        return _hasher


def release_later(held: list[Any]) -> None:
    """Drop the objects in `held` (the list is emptied) on the process's one release thread, not this one.

    For what is costly to tear down and nobody waits for: a publish source's files mapped into memory,
    whose unmapping (Python's mmap lets go of the GIL for it) took 1.3 ms of a 45 MB delta's publish
    and 5 ms of a 436 MB one's on the caller's thread (docs/SCALE-RUNS.md, run AT). Only the
    caller's references move: where another holder keeps an object, the last of them drops it.
    """
    if not held:
        return
    with _pools_lock:
        global _releaser
        if _releaser is None:
            _releaser = ThreadPoolExecutor(1, thread_name_prefix="weightsync-release")
        releaser = _releaser
    releaser.submit(held.clear)


def pool_of(threads: int | None) -> ThreadPoolExecutor:
    """The process's pool of `threads` threads (at least one; None: one per core, :func:`cpu_pool`), started
    on first use and shared from then on.

    For work asked to run on a given number of threads (a subscriber's ``decode_threads``, the
    decode for a GPU): a pool made per call started its threads each time and threw away what
    they keep between frames (a zstd context and scratch planes per thread). `cpu_pool`'s rule
    holds: a job of a pool never waits on another job of the same pool.
    """
    n = max(1, threads_of(threads))
    with _pools_lock:
        pool = _pools.get(n)
        if pool is None:
            name = "weightsync-cpu" if n == (os.cpu_count() or 1) else f"weightsync-{n}t"
            pool = _pools[n] = ThreadPoolExecutor(n, thread_name_prefix=name)
        return pool


class Cancelled(Exception):  # noqa: N818 - a signal between threads, not an error a caller sees
    """A job stopped because its batch was stopped; :func:`run_all` never lets it escape to its caller."""


class _Scope:
    """The stop flag of one batch; a batch started inside a job of another sees the outer flag too."""

    def __init__(self, parent: _Scope | None) -> None:
        self.parent = parent
        self.event = threading.Event()

    def stopped(self) -> bool:
        scope: _Scope | None = self
        while scope is not None:
            if scope.event.is_set():
                return True
            scope = scope.parent
        return False


def _current() -> _Scope | None:
    return getattr(_local, "scope", None)


def _in_scope(scope: _Scope, fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn(*args)`` as a job of the batch whose scope is `scope` (not at all once the batch is stopped)."""
    outer = _current()
    _local.scope = scope
    try:
        check_cancelled()
        return fn(*args)
    finally:
        _local.scope = outer


def check_cancelled() -> None:
    """Raise Cancelled if the batch the calling job belongs to was stopped (a no-op outside a batch)."""
    scope = _current()
    if scope is not None and scope.stopped():
        raise Cancelled


def pause(seconds: float) -> None:
    """Sleep `seconds`, waking early with Cancelled when the calling job's batch is stopped.

    Outside a batch this is ``time.sleep`` (the main thread is interrupted by Ctrl-C itself).
    """
    scope = _current()
    if scope is None:
        time.sleep(seconds)
        return
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if scope.event.wait(min(left, _SLICE)) or scope.stopped():
            raise Cancelled
    check_cancelled()


def run_all(pool: Executor, fn: Callable[[T], Any], items: Iterable[T], *, caller_helps: bool = False) -> list[Any]:
    """Run `fn` on every item and return the results in order; stop everything at the first failure.

    On a failure (or an interrupt of the calling thread) jobs not yet started are
    cancelled, jobs in flight are stopped (see the module docstring), and, once all have
    returned, the first failure is raised (the interrupt, if that came first). Waiting for
    the jobs in flight matters: a job still writing a cache file or a temporary after the
    caller has given up would race with the caller's clean-up or its retry.

    With `caller_helps` the calling thread runs jobs too, from the last one back, while the
    pool's threads take them from the first (a job either of them took is not run again): the
    batch starts at once instead of after the pool's threads wake, which on a virtual machine
    whose cores idled costs the better part of a millisecond (docs/SCALE-RUNS.md, run Q). For short
    CPU batches a caller would wait on anyway (an update's apply).
    """
    scope = _Scope(_current())

    def job(item: T) -> Any:
        return _in_scope(scope, fn, item)

    items = list(items)
    futures = [pool.submit(job, item) for item in items]
    mine: dict[int, Any] = {}  # results of the jobs this thread ran
    try:
        if caller_helps:
            failing = threading.Event()  # a pool job failed: stop taking jobs, the wait below raises it

            def watch(f: Future[Any]) -> None:
                if not f.cancelled() and f.exception() is not None:
                    failing.set()

            for f in futures:
                f.add_done_callback(watch)
            for i in range(len(futures) - 1, -1, -1):
                if failing.is_set():
                    break
                if futures[i].cancel():  # not started by the pool: this thread's now
                    mine[i] = job(items[i])
        wait(futures, return_when=FIRST_EXCEPTION)
        failed = _first_failure(futures)
        if failed is None:
            return [mine[i] if i in mine else f.result() for i, f in enumerate(futures)]
        raise failed
    except BaseException:
        scope.event.set()
        for f in futures:
            f.cancel()
        wait(futures)
        raise


class Batch:
    """A batch whose jobs are submitted one at a time, as their inputs come (uploads of objects packed while
    an encode goes on), with :func:`run_all`'s all-or-nothing rule: the first failure, an interrupt of the
    waiting thread or :meth:`stop` stops the jobs in flight (their waits raise Cancelled) and cancels
    those not started. Thread-safe: jobs may be submitted from any thread, also from the pool's."""

    def __init__(self, pool: Executor) -> None:
        self.pool = pool
        self.scope = _Scope(_current())
        self._futures: list[Future[Any]] = []
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], /, *args: Any) -> None:
        """Run ``fn(*args)`` in the batch; the batch's first failure instead once one is known."""
        failed = self.failure()
        if failed is not None:
            raise failed
        future = self.pool.submit(_in_scope, self.scope, fn, *args)
        future.add_done_callback(self._done)
        with self._lock:
            self._futures.append(future)

    def _done(self, future: Future[Any]) -> None:
        if not future.cancelled() and future.exception() is not None:
            self.scope.event.set()  # the others stop at their next check

    def failure(self) -> BaseException | None:
        """The batch's first failure so far (None: none yet): known as soon as the job that failed is done."""
        with self._lock:
            futures = list(self._futures)
        return _first_failure(futures)

    def finish(self) -> None:
        """Wait for every job; on a failure (or an interrupt of this wait) stop the rest and raise it."""
        try:
            while True:
                with self._lock:
                    futures = list(self._futures)
                wait(futures, return_when=FIRST_EXCEPTION)
                failed = _first_failure(futures)
                if failed is not None:
                    raise failed
                with self._lock:
                    if len(self._futures) == len(futures):  # none submitted meanwhile
                        return
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop the jobs in flight, cancel the others, and wait until none runs."""
        self.scope.event.set()
        with self._lock:
            futures = list(self._futures)
        for f in futures:
            f.cancel()
        wait(futures)


class HelpingPool(Executor):
    """`pool` for a caller that waits on each batch anyway (the publisher's encode, whose `Encoder` only maps):
    ``map`` is :func:`run_all` with the calling thread helping, so a batch starts without waiting for the
    pool's threads to wake (on this project's 2-core VM, an encode after an idle spell ~2 ms sooner:
    docs/SCALE-RUNS.md, run Q). Its results come all at once, after the batch, not one by one as they finish;
    a failure stops the batch. ``submit`` goes to `pool`; ``shutdown`` leaves the shared pool running.
    ``map`` takes no `timeout` (the calling thread runs jobs itself: ValueError) and, as a thread pool's,
    ignores `chunksize`."""

    def __init__(self, pool: Executor) -> None:
        self._pool = pool

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        return self._pool.submit(fn, *args, **kwargs)

    def map(
        self, fn: Callable[..., T], *iterables: Iterable[Any], timeout: float | None = None, chunksize: int = 1
    ) -> Iterator[T]:
        if timeout is not None:
            raise ValueError("HelpingPool.map has no timeout: the calling thread runs jobs of the batch itself")
        jobs = list(zip(*iterables, strict=False))  # as Executor.map: the shortest iterable ends it
        return iter(run_all(self._pool, lambda args: fn(*args), jobs, caller_helps=True))

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        return None


def _first_failure(futures: list[Future[Any]]) -> BaseException | None:
    """The exception of the first failed job in submission order, a real failure before a Cancelled."""
    raised = [e for f in futures if f.done() and not f.cancelled() and (e := f.exception()) is not None]
    real = [e for e in raised if not isinstance(e, Cancelled)]
    return next(iter(real or raised), None)
