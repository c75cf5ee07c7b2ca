"""Building blocks of the client's HTTP edge: the bandwidth cap, the retry policy, problem → exception.

The problem → exception mapping is derived from :mod:`weightsync.errors` (the one table of problem
codes); nothing here guesses from message text.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx

from weightsync import errors
from weightsync.client._pool import pause
from weightsync.common import Backoff


class TokenBucket:
    """A shared bandwidth cap: `acquire(n)` blocks until n bytes may pass at `rate` bytes/s. Thread-safe.

    The bucket holds at most `burst` bytes (default a quarter second of traffic,
    at least 64 KiB), so an idle period does not let a later burst exceed the cap.
    A wait inside a stopped batch of transfers ends at once (client/_pool.py ``pause``).
    """

    def __init__(self, rate: float, *, burst: float | None = None) -> None:
        if rate <= 0:
            raise ValueError("rate must be positive (bytes per second)")
        self.rate = float(rate)
        self.burst = float(burst if burst is not None else max(rate / 4, 64 << 10))
        self._tokens = self.burst
        self._last = time.monotonic()
        self._lock = threading.Lock()

    def acquire(self, n: int) -> None:
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            self._tokens -= n  # may go negative: the debt is paid by waiting, so large chunks work too
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            pause(wait)


Retry = Backoff
"""The client's retry policy for transient failures: :class:`weightsync.common.Backoff` (``attempts`` tries
in all, full-jitter backoff from ``base`` s capped at ``cap`` s, honouring ``Retry-After``)."""


# Answers that are not a weightsync problem (a proxy's or the object store's error page, a code this
# client does not know) are mapped by their status; 404 falls back to what the endpoint looks up.
_BY_STATUS: dict[int, type[errors.WeightsyncError]] = {
    401: errors.AuthError,
    403: errors.Forbidden,
    409: errors.Conflict,
    503: errors.ServerUnavailable,
}


def problem_error(
    resp: httpx.Response, *, not_found: type[errors.WeightsyncError], server: str | None = None
) -> errors.WeightsyncError:
    """The named exception for an error response: the class errors.problem_class names for its problem code.

    The problem's ``resource`` member says which thing a 404 is about; ``not_found`` (what the
    endpoint looks up) is used only for a 404 that is not a weightsync problem (the object store,
    a proxy). The exception's ``status`` is the status received and ``problem`` the body.

    ``server`` is the weightsync server's URL when the request went to it (not to a presigned
    URL): a 404 from there that names no missing resource means the route itself is unknown,
    so the URL most likely points at something else, and the message says so.
    """
    problem: dict[str, Any] = {}
    try:
        if "json" in resp.headers.get("content-type", ""):
            body = resp.json()
            if isinstance(body, dict):
                problem = body
    except ValueError:
        pass
    type_ = problem.get("type")
    code = type_.removeprefix(errors.PROBLEM_BASE) if isinstance(type_, str) else ""
    resource = problem.get("resource")
    detail = problem.get("detail") or problem.get("title") or resp.reason_phrase or "error"
    if not isinstance(detail, str):
        detail = str(detail)
    message = f"{detail} (HTTP {resp.status_code})"
    ours = isinstance(type_, str) and type_.startswith(errors.PROBLEM_BASE)
    if resp.status_code == 404 and server is not None and (not ours or (code == "not-found" and resource is None)):
        message += f"{_route(resp)}: is {server} the root URL of a weightsync server?"
    # A resource this client does not know (a newer server's) is still that code's problem.
    cls = errors.problem_class(code, resource if isinstance(resource, str) else None) or errors.problem_class(code)
    if cls is None and resp.status_code == 404:
        cls = not_found
    if cls is None:
        cls = _BY_STATUS.get(resp.status_code, errors.ClientError)
    exc = cls.from_problem(message, problem)
    exc.status = resp.status_code
    exc.problem = problem
    return exc


def _route(resp: httpx.Response) -> str:
    """`` from GET /v1/models`` (what was asked for), or nothing when the response has no request."""
    try:
        return f" from {resp.request.method} {resp.request.url.path}"
    except RuntimeError:
        return ""
