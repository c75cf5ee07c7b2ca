"""Prometheus metrics of one app: requests, latency, bytes, commits, open streams.

Each app gets its own registry, so several apps in one process (tests) do not collide.
With several worker processes (``PROMETHEUS_MULTIPROC_DIR`` set, which ``serve --workers
N`` does), values live in files shared by the workers and ``/metrics`` aggregates them.
"""

from __future__ import annotations

import os
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

__all__ = ["Metrics"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_PUBLISH_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200)


def _multiprocess() -> bool:
    return bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ.get("prometheus_multiproc_dir"))  # noqa: SIM112 - the legacy name


class Metrics:
    """The service's metrics; ``render()`` gives the exposition for ``GET /metrics``."""

    def __init__(self) -> None:
        disable_created_metrics()  # the *_created series only double the exposition
        self.multiprocess = _multiprocess()
        # In multiprocess mode the values are written to files; a registry is built per scrape.
        reg = None if self.multiprocess else CollectorRegistry()
        self.registry = reg
        self.requests = Counter(
            "weightsync_http_requests",
            "HTTP requests by route template and status.",
            ["method", "route", "status"],
            registry=reg,
        )
        self.latency = Histogram(
            "weightsync_http_request_duration_seconds",
            "HTTP request latency (to the last byte) by route template and status.",
            ["method", "route", "status"],
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        self.bytes_in = Counter(
            "weightsync_http_received_bytes", "Request body bytes received, by route.", ["route"], registry=reg
        )
        self.bytes_out = Counter(
            "weightsync_http_sent_bytes", "Response body bytes sent, by route.", ["route"], registry=reg
        )
        self.versions_committed = Counter(
            "weightsync_versions_committed", "Versions committed (not replays).", registry=reg
        )
        self.publish_to_commit = Histogram(
            "weightsync_publish_to_commit_seconds",
            "Time from beginPublish to commit of committed versions.",
            buckets=_PUBLISH_BUCKETS,
            registry=reg,
        )
        self.sse_streams = Gauge(
            "weightsync_event_streams", "Open Server-Sent-Events streams.", registry=reg, multiprocess_mode="livesum"
        )
        self.watchers = Gauge(
            "weightsync_watch_waiting",
            "Long polls waiting for a new version.",
            registry=reg,
            multiprocess_mode="livesum",
        )

        # Each label set's series, looked up once: ``labels()`` checks and locks on every call.
        self._request_series: dict[tuple[str, str, str], tuple[Any, Any]] = {}
        self._byte_series: dict[str, tuple[Any, Any]] = {}

    def request_done(self, method: str, route: str, status: str, seconds: float, bytes_in: int, bytes_out: int) -> None:
        """Count one answered request: its count and latency by method, route and status; its bytes by route."""
        key = (method, route, status)
        series = self._request_series.get(key)
        if series is None:
            series = (self.requests.labels(*key), self.latency.labels(*key))
            self._request_series[key] = series
        series[0].inc()
        series[1].observe(seconds)
        if bytes_in or bytes_out:
            sized = self._byte_series.get(route)
            if sized is None:
                sized = (self.bytes_in.labels(route), self.bytes_out.labels(route))
                self._byte_series[route] = sized
            if bytes_in:
                sized[0].inc(bytes_in)
            if bytes_out:
                sized[1].inc(bytes_out)

    def render(self) -> tuple[bytes, str]:
        if self.multiprocess:
            from prometheus_client import multiprocess

            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            return generate_latest(registry), CONTENT_TYPE_LATEST
        assert self.registry is not None
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
