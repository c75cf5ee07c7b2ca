"""Reporting to the replica ledger: which version a subscriber holds (or that it holds none), how it came, its pause."""

from __future__ import annotations

import logging
import os
import socket
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from weightsync import errors
from weightsync.client._http import Api
from weightsync.client.models import PullResult

log = logging.getLogger("weightsync.client")


class LedgerReporter:
    """Sends one subscriber's replica reports, in order, on a background thread of its own.

    The ledger is informative: a failed report is logged and never fails the update it
    describes. ``enabled=False`` sends nothing. Thread-safe.
    """

    def __init__(self, api: Api, model: str, subscriber: str, *, site: str | None, enabled: bool = True) -> None:
        self.api, self.model, self.subscriber, self.site, self.enabled = api, model, subscriber, site, enabled
        self.engine: str | None = None
        """The engine a report names when its caller names none (set by an engine adapter that holds the subscriber)."""
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="weightsync-report")

    def report(
        self,
        version: int | None,
        *,
        status: str,
        mode: str | None = None,
        engine: str | None = None,
        bytes_: int | None = None,
        pause_ms: float | None = None,
        extra: dict[str, Any] | None = None,
        wait: bool = True,
    ) -> None:
        """Report what the subscriber holds now: `version` with `status` ``serving`` or ``applied``, or no
        version with ``unhealthy`` (docs/API.md, Replica); ``wait=False`` returns before it is sent."""
        if not self.enabled:
            return
        engine = engine or self.engine
        fields = {"status": status, "mode": mode, "engine": engine, "bytes": bytes_, "pause_ms": pause_ms}
        fut = self._pool.submit(self._send, version, fields, extra or {})
        if wait:
            fut.result()

    def pulled(self, result: PullResult, directory: str | os.PathLike[str]) -> None:
        """Report a pull into `directory` (nothing when it found the directory current): applied, mode pull."""
        if result.mode == "current":
            return
        extra = {"transfer": result.mode, "dir": str(Path(directory).resolve()), "steps": result.steps}
        extra.update({"repaired": result.repaired, **{k: round(v, 4) for k, v in result.timings.items()}})
        self.report(result.version, status="applied", mode="pull", bytes_=result.bytes_received, extra=extra)

    def applied(
        self, target: int, *, bytes_: int, pause_s: float, prepare_s: float, tensors: int, elements: int
    ) -> None:
        """Report an in-place update to `target` without waiting for it to be sent (the caller serves)."""
        extra = {"prepare_s": round(prepare_s, 4), "tensors": tensors, "elements": elements}
        self.report(
            target,
            status="applied",
            mode="in-place",
            bytes_=bytes_,
            pause_ms=pause_s * 1000.0,
            wait=False,
            extra=extra,
        )

    def _send(self, version: int | None, fields: dict[str, Any], extra: dict[str, Any]) -> None:
        try:
            self.api.report_replica(
                self.model,
                subscriber=self.subscriber,
                version=version,
                site=self.site or None,
                host=socket.gethostname(),
                extra=extra,
                **fields,
            )
        except errors.WeightsyncError as exc:
            held = "unhealthy" if version is None else f"v{version}"
            log.warning("replica report for %s (%s) failed: %s", self.model, held, exc)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every report queued before this call has been sent (or failed, which is logged).

        TimeoutError when `timeout` seconds pass first; the reports stay queued."""
        self._pool.submit(lambda: None).result(timeout)

    def close(self) -> None:
        """Send what is queued, then stop."""
        self._pool.shutdown(wait=True)
