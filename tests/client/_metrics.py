"""Reading a test server's request counters (``GET /metrics``): what the server saw of a client."""

from __future__ import annotations

import httpx


def requests_seen(url: str, method: str, route: str, status: str | None = None) -> float:
    """How many `method` requests to the route template `route` the server at `url` has answered (with `status`)."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if not line.startswith("weightsync_http_requests_total{"):
            continue
        labels, _, value = line.rpartition(" ")
        wanted = [f'method="{method}"', f'route="{route}"'] + ([f'status="{status}"'] if status else [])
        if all(w in labels for w in wanted):
            total += float(value)
    return total
