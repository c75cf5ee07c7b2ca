"""The HTTP side every engine client shares: one connection, named failures, readiness.

A transport failure is EngineUnavailable, a missing route an EngineError with
the engine's own hint (its routes need a flag or a version), any other error
answer an EngineError carrying the engine's message on one line. Calls that
touch every weight (reload, update, checksum) take ``slow_timeout``.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar

import httpx

from weightsync import errors
from weightsync.engines.errors import EngineError, EngineUnavailable


def check_url(url: str) -> str:
    """``url`` as the root of an engine server, else InvalidArgument saying what to write instead.

    The routes weightsync calls sit at the server's root: the OpenAI base URL (``…/v1``) that
    clients are given is refused with the root to use.
    """
    if not url.startswith(("http://", "https://")):
        raise errors.InvalidArgument(f"engine URL {url!r} needs a scheme: http://{url}")
    root = url.rstrip("/")
    if root.endswith("/v1"):
        raise errors.InvalidArgument(
            f"engine URL {url!r} is the OpenAI base URL: use the server's root, {root.removesuffix('/v1')}"
        )
    return url


def message(r: httpx.Response) -> str:
    """The error an engine answered, on one line (its JSON ``error``/``detail``/``message``, else its text)."""
    try:
        body = r.json()
    except ValueError:
        return r.text[:300].replace("\n", " ")
    if isinstance(body, dict):
        err = body.get("error", body.get("detail", body))
        if isinstance(err, dict):
            err = err.get("message", err)
        return str(err)[:300].replace("\n", " ")
    return str(body)[:300]


class EngineHttp:
    """One engine server's HTTP API (thread-safe: httpx.Client); subclasses name the engine and its routes."""

    engine: ClassVar[str]
    """The engine's name in messages (``vLLM``, ``SGLang``)."""
    missing_route: ClassVar[str]
    """What a 404 from one of its routes means: how to start the engine so that it has them."""
    fresh_slow_connections: ClassVar[bool] = False
    """Send each slow call on a connection of its own (an engine that drops the connection after a failed one)."""

    def __init__(
        self,
        url: str,
        *,
        token: str | None = None,
        timeout: float = 30.0,
        slow_timeout: float = 1800.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        check_url(url)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.url = url.rstrip("/")
        self.slow_timeout = slow_timeout
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout, transport=transport)

    def close(self) -> None:
        self._http.close()

    def _request(self, method: str, path: str, *, slow: bool = False, **kwargs: Any) -> httpx.Response:
        """The answer, whatever its status but 404 (EngineError with the hint); EngineUnavailable on transport."""
        if slow:
            kwargs["timeout"] = self.slow_timeout
            if self.fresh_slow_connections:
                kwargs["headers"] = {"Connection": "close"}
        try:
            r = self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise EngineUnavailable(f"{self.engine} at {self.url} cannot be reached: {exc}") from exc
        if r.status_code == 404:
            raise EngineError(f"{self.engine} at {self.url} has no {path} route: {self.missing_route}")
        return r

    def _call(self, method: str, path: str, *, slow: bool = False, **kwargs: Any) -> Any:
        """The JSON answer (None when empty); EngineError for an error status."""
        r = self._request(method, path, slow=slow, **kwargs)
        if r.status_code >= 400:
            raise EngineError(f"{self.engine} {method} {path} answered {r.status_code}: {message(r)}")
        return r.json() if r.content else None

    def health(self) -> bool:
        """True when the server answers ``GET /health`` with 200 (not while it loads its model)."""
        try:
            return self._http.get("/health").status_code == 200
        except httpx.TransportError:
            return False

    def wait_ready(self, timeout: float, *, poll: float = 1.0) -> None:
        """Wait up to ``timeout`` s for ``GET /health`` to answer 200, then check that the engine's routes are
        there (:meth:`_check_routes`): EngineUnavailable when it never answered, EngineError when they are not."""
        deadline = time.monotonic() + timeout
        while not self.health():
            if time.monotonic() >= deadline:
                raise EngineUnavailable(
                    f"{self.engine} at {self.url} cannot be reached (waited {timeout:g}s for /health)"
                )
            time.sleep(min(poll, max(0.0, deadline - time.monotonic())))
        self._check_routes()

    def _check_routes(self) -> None:
        """Call one of the routes weightsync needs (a 404 raises EngineError with :attr:`missing_route`)."""
        raise NotImplementedError
