"""The relay's own Prometheus series, registered next to the service's (``weightsync_relay_*``).

Hit ratio: ``weightsync_relay_object_requests{result="hit"}`` over all object requests; a miss is a
request that waited for an upstream fetch (its own or one already running).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from weightsync.service.metrics import Metrics

__all__ = ["RelayMetrics"]

_LAG_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1800)


class RelayMetrics:
    """Upstream bytes and fetches, bytes served here, hits and misses, prefetch lag, upstream reachability."""

    def __init__(self, metrics: Metrics) -> None:
        reg = metrics.registry
        self.upstream_bytes = Counter(
            "weightsync_relay_upstream_bytes", "Bytes received from the upstream (objects and manifests).", registry=reg
        )
        self.upstream_fetches = Counter(
            "weightsync_relay_upstream_fetches", "Objects fetched from the upstream (each once).", registry=reg
        )
        self.fetches_deferred = Counter(
            "weightsync_relay_fetches_deferred",
            "Objects this replica waited for because another replica on its catalog was fetching them.",
            registry=reg,
        )
        self.served_bytes = Counter(
            "weightsync_relay_served_bytes", "Object bytes served to local clients.", registry=reg
        )
        self.object_requests = Counter(
            "weightsync_relay_object_requests",
            "Local object requests: hit (held here) or miss (waited for an upstream fetch).",
            ["result"],
            registry=reg,
        )
        self.versions_mirrored = Counter(
            "weightsync_relay_versions_mirrored", "Versions recorded in this relay's catalog.", registry=reg
        )
        self.prefetch_lag = Histogram(
            "weightsync_relay_prefetch_lag_seconds",
            "Seconds from a version's commit upstream to its availability here.",
            buckets=_LAG_BUCKETS,
            registry=reg,
        )
        self.last_lag = Gauge(
            "weightsync_relay_last_prefetch_lag_seconds",
            "Prefetch lag of the model's latest mirrored version.",
            ["model"],
            registry=reg,
        )
        self.upstream_up = Gauge(
            "weightsync_relay_upstream_up", "1 when the upstream answered the last request, else 0.", registry=reg
        )
        self.upstream_leases = Gauge(
            "weightsync_relay_upstream_leases", "Chains this relay holds a lease on at the upstream.", registry=reg
        )
        self.evicted_bytes = Counter(
            "weightsync_relay_evicted_bytes",
            "Object bytes evicted (catalog rows stay; refetched on demand).",
            registry=reg,
        )
        self.reports_forwarded = Counter(
            "weightsync_relay_reports_forwarded", "Replica reports forwarded to the upstream.", registry=reg
        )
        self.reports_dropped = Counter(
            "weightsync_relay_reports_dropped",
            "Replica reports the upstream refused or the queue dropped.",
            registry=reg,
        )
