"""Subscribing: pull versions into directories, or prepare and apply them in place into tensors.

A facade over the rooms that do the work: client/pull.py (plan, fetch,
decode, and the atomic switch of client/checkout.py) for directories;
client/inplace.py (decode and compose into per-tensor changes, then change
tensors on their device) for in-place updates. The subscriber records which
version its caller holds and reports each update to the replica ledger.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from weightsync import errors
from weightsync.client import inplace
from weightsync.client._http import Api
from weightsync.client._objects import DEFAULT_RANGE_BYTES
from weightsync.client.checkout import Checkout
from weightsync.client.inplace import Prepared, TensorUpdate
from weightsync.client.ledger import LedgerReporter
from weightsync.client.models import PullResult, Version
from weightsync.client.pull import DEFAULT_INLINE_BYTES, FetchOptions, Meter, Progress, prepare_update, pull
from weightsync.client.selection import Selection, selector
from weightsync.client.watch import WATCH_RECONNECT, follow
from weightsync.client.wire import Retry, TokenBucket
from weightsync.common import gc_paused

log = logging.getLogger("weightsync.client")

__all__ = ["WATCH_RECONNECT", "Prepared", "Progress", "Subscriber", "TensorUpdate"]


class Subscriber:
    """Pulls versions of one model into directories, or applies them in place into tensors.

    ``name`` identifies this subscriber in the replica ledger and holds a lease
    on the chain it reads (default: the host name). ``cache_dir`` keeps
    downloaded objects across pulls and directories (default: each checkout's
    own ``.weightsync/objects``, emptied after a successful pull). ``bandwidth``
    caps downloads in bytes/s. ``version`` tells the subscriber which version
    the caller's tensors hold (`pull` and `apply` keep it up to date).

    ``tensors`` makes it a slice subscriber: it prepares and applies only the tensors
    the selection takes (glob patterns over tensor names, or a predicate:
    client/selection.py), fetching only the frames that change them.

    ``inline_bytes``: `prepare` asks for an update of at most this many bytes in the plan's own
    answer (one request per update instead of a plan and then a batch of reads; 0: never).

    One operation at a time per instance (calls are serialized by a lock);
    `prepare` may run in a background thread while the caller serves.
    """

    def __init__(
        self,
        server: str,
        model: str,
        *,
        token: str | None = None,
        name: str | None = None,
        cache_dir: str | os.PathLike | None = None,
        concurrency: int = 8,
        bandwidth: float | None = None,
        version: int | None = None,
        site: str | None = None,
        keep_objects: bool = False,
        deep_verify: bool = True,
        range_bytes: int = DEFAULT_RANGE_BYTES,
        decode_threads: int | None = None,
        timeout: float = 60.0,
        retry: Retry | None = None,
        transport: Any = None,
        progress: Progress | None = None,
        report: bool = True,
        tensors: Selection | None = None,
        inline_bytes: int = DEFAULT_INLINE_BYTES,
    ) -> None:
        self.model = model
        self.select = selector(tensors)
        """The tensors this subscriber holds (None: all); `prepare` takes only these unless told otherwise."""
        self.name = name or socket.gethostname()
        self.site = site
        self.concurrency = max(1, concurrency)
        self.version = version
        self.options = FetchOptions(
            Path(cache_dir) if cache_dir is not None else None,
            keep_objects,
            deep_verify,
            range_bytes,
            decode_threads,
            max(0, inline_bytes),
        )
        self.progress = progress
        self.report = report
        limiter = TokenBucket(bandwidth) if bandwidth else None
        self.api = Api(
            server,
            token,
            timeout=timeout,
            concurrency=self.concurrency,
            retry=retry,
            limiter=limiter,
            transport=transport,
        )
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="weightsync-fetch")
        self._ledger = LedgerReporter(self.api, model, self.name, site=site, enabled=report)
        self.timings: dict[str, float] = {}
        """Seconds per phase of the last `prepare` (plan_s, download_s, decode_s) and `apply` (apply_s)."""

    @property
    def engine(self) -> str | None:
        """The engine this subscriber's replica reports name (None: none); an engine adapter sets it."""
        return self._ledger.engine

    @engine.setter
    def engine(self, kind: str | None) -> None:
        self._ledger.engine = kind

    def wait_reported(self, timeout: float | None = None) -> None:
        """Wait until the replica reports made so far are sent: `apply` queues its report and returns
        before it is (the caller serves meanwhile). A report that fails is logged, not raised
        (the ledger is informative). TimeoutError when `timeout` seconds pass first."""
        self._ledger.flush(timeout)

    def close(self) -> None:
        self._ledger.close()
        self._pool.shutdown(wait=True)
        self.api.close()

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- directories --------------------------------------------------------------------

    def pull(
        self,
        dir: str | os.PathLike,
        version: int | None = None,
        *,
        adopt: bool = False,
        include: Sequence[str] | None = None,
    ) -> PullResult:
        """Make `dir` hold `version` (default: the head) byte for byte, incrementally from what it holds.

        Before an incremental pull the directory is checked against its state
        file (sizes and every segment's xxh3); a directory changed behind its
        back is pulled in full (``repaired`` in the result). The version is
        switched in atomically: every ``dir/<file>`` is a link through
        ``dir/.weightsync/current``, replaced in one rename (docs/DESIGN.md
        "Checkouts"). Files not part of the model are left alone. A directory
        weightsync does not manage that already has files where the version puts
        its own raises UnmanagedFiles (nothing is changed) unless `adopt`: files
        that already are the version are then taken over without a download
        (``mode == "adopted"`` when all are), the others rebuilt from only their own
        frames (``mode == "full"``, ``adopted`` counting the files kept). `include` (file
        globs: ``*`` crosses ``/``) makes `dir` hold only the version's files they take,
        fetched from only their frames; the checkout remembers them, so later pulls keep the
        slice (client/pull.py `pull`). Sets :attr:`version`. Raises ModelNotFound,
        VersionNotFound, AuthError, ServerUnavailable, DigestMismatch, InvalidArgument, ...
        """
        with self._lock:
            meter = Meter(self.progress)
            self.api.on_bytes = meter
            try:
                checkout = Checkout(dir)
                result = pull(
                    self.api,
                    self.model,
                    checkout,
                    version=version,
                    holder=self.name,
                    options=self.options,
                    pool=self._pool,
                    meter=meter,
                    adopt=adopt,
                    include=include,
                )
            finally:
                self.api.on_bytes = None
            self.version = result.version
            self._ledger.pulled(result, dir)
            return result

    # --- tensors ------------------------------------------------------------------------

    def prepare(self, version: int | None = None, *, device: Any = None, tensors: Selection | None = None) -> Prepared:
        """Download and decode the update from :attr:`version` to `version` (default: head), off the critical path.

        Nothing is applied. With `device`, the changes are staged on that device
        too (e.g. "cuda:0") so `apply` moves nothing. A plan that starts a new
        chain (keyframe) yields whole-tensor replacements. `tensors` (default: the
        subscriber's selection) limits the update to the tensors it selects: only the
        byte ranges of the frames that change them are fetched, and `apply` expects
        only those tensors.
        """
        select = self.select if tensors is None else selector(tensors)
        with self._lock, gc_paused():
            meter = Meter(self.progress)
            self.api.on_bytes = meter
            try:
                prepared, self.timings = prepare_update(
                    self.api,
                    self.model,
                    self.options,
                    have=self.version,
                    want=version,
                    holder=self.name,
                    pool=self._pool,
                    meter=meter,
                    device=device,
                    select=select,
                )
            finally:
                self.api.on_bytes = None
            return prepared

    def apply(
        self, tensors: Mapping[str, Any], prepared: Prepared, *, verify: bool = True, strict: bool = True
    ) -> float:
        """Apply `prepared` in place into `tensors` (name → torch tensor); return the pause in seconds.

        Refuses (BaseMismatch, nothing changed) an update whose base is not
        :attr:`version`. Every tensor of the new version must be in `tensors`
        with its dtype and shape (else ReloadRequired, nothing changed) unless
        ``strict=False``, which skips tensors the caller does not hold. With
        `verify`, every tensor about to change is checked against the base before
        any tensor changes, and the result before this returns, on the tensors' own
        device (client/inplace.py): a result that fails raises ChecksumMismatch with
        the changes undone, so :attr:`version` stays (unless a tensor was replaced
        whole: then :attr:`version` becomes None and the caller must reload).
        An update read from byte ranges (a tensor selection: the ranges cannot be
        hashed against their objects' names) is verified even with ``verify=False``.

        The returned pause runs from the first write until the result check passed.
        Tensors must be contiguous.
        """
        with self._lock, gc_paused():
            t0 = time.perf_counter()
            try:
                applied = inplace.apply(
                    tensors, prepared, model=self.model, version=self.version, verify=verify, strict=strict
                )
            except errors.FormatError as exc:  # ChecksumMismatch, or a frame read from a range that went bad
                cache = self.options.cache()
                if cache is not None and prepared.partial_objects:
                    cache.drop_parts(prepared.partial_objects)  # ranges the checks refused: fetched again next time
                if not isinstance(exc, errors.ChecksumMismatch):
                    raise
                if any(u.replace is not None for u in prepared.updates.values()):
                    self.version = None  # replaced whole: the tensors hold neither version
                raise
            self.version = prepared.target
            self.timings["apply_s"] = time.perf_counter() - t0
            self._ledger.applied(
                prepared.target,
                bytes_=prepared.bytes_received,
                pause_s=applied.pause,
                prepare_s=prepared.seconds,
                tensors=applied.tensors,
                elements=prepared.changed_elements,
            )
            return applied.pause

    def watch(
        self, after: int | None = None, *, timeout: float = 30.0, stop: threading.Event | None = None
    ) -> Iterator[Version]:
        """Yield each new head as it commits (long-poll `watchModel`), reconnecting on errors.

        Starts after `after`, else after :attr:`version`, else after the current
        head. When several versions commit between two polls only the newest is
        yielded. A failed poll (server unavailable, model or version not found yet)
        is retried after :data:`WATCH_RECONNECT`'s wait, which grows with consecutive
        failures and starts over after a successful poll. Ends when `stop` is set
        (checked between polls and during a reconnect wait).
        """
        if after is None:
            after = self.version
        if after is None:
            head = self.api.head(self.model)
            after = head.number if head is not None else 0
        return follow(self.api, self.model, after, timeout=timeout, stop=stop, backoff=WATCH_RECONNECT)
