"""The relay's side of the API toward its upstream: the read calls of docs/API.md, asynchronous.

Built on the client SDK's wire rules (answers parsed by :mod:`weightsync.client.models`,
problems mapped to the named exceptions by :func:`weightsync.client.wire.problem_error`), over an
``httpx.AsyncClient``, so that following many models (one event stream each) and fetching
objects run on the relay's event loop instead of a thread each. No retries here: a failure is
``ServerUnavailable`` (connection errors, 5xx) or the problem's exception, and the
:class:`~weightsync.relay.mirror.Mirror` decides when to try again.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Any

import httpx

from weightsync import __version__, errors
from weightsync.client import models
from weightsync.client.wire import problem_error

__all__ = ["Upstream"]

# An event stream sends a keep-alive every 15 s (the service's default): silence this long is a dead link.
EVENTS_READ_TIMEOUT_S = 90.0


class Upstream:
    """Read calls to the upstream server (an origin or another relay). Safe for concurrent tasks."""

    def __init__(self, url: str, token: str | None = None, *, timeout: float = 60.0, connections: int = 16) -> None:
        self.url = url
        headers = {"User-Agent": f"weightsync-relay/{__version__}"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self._http = httpx.AsyncClient(
            base_url=url,
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
            limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
        )
        # Event streams stay open (one per mirrored model): a pool of their own, unbounded, so however
        # many models are followed they never take the connections object fetches need.
        self._streams = httpx.AsyncClient(
            base_url=url,
            headers=headers,
            timeout=httpx.Timeout(EVENTS_READ_TIMEOUT_S, connect=10.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=0),
        )
        self.bytes_received = 0

    async def close(self) -> None:
        await self._http.aclose()
        await self._streams.aclose()

    def _unavailable(self, exc: Exception) -> errors.ServerUnavailable:
        what = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return errors.ServerUnavailable(f"upstream {self.url} unavailable: {what}")

    def _raise_for(self, resp: httpx.Response, not_found: type[errors.WeightsyncError]) -> None:
        if resp.status_code >= 500 or resp.status_code == 429:
            raise errors.ServerUnavailable(
                f"upstream {self.url} unavailable: {problem_error(resp, not_found=not_found)}"
            )
        raise problem_error(resp, not_found=not_found, server=self.url)

    async def _get(
        self,
        path: str,
        *,
        params: dict[str, Any] | None = None,
        not_found: type[errors.WeightsyncError] = errors.ModelNotFound,
        method: str = "GET",
        json_body: Any = None,
        ok: tuple[int, ...] = (200,),
    ) -> httpx.Response:
        try:
            resp = await self._http.request(method, path, params=params, json=json_body)
        except httpx.TransportError as exc:
            raise self._unavailable(exc) from None
        if resp.status_code not in ok:
            self._raise_for(resp, not_found)
        return resp

    async def _json(self, path: str, **kwargs: Any) -> Any:
        resp = await self._get(path, **kwargs)
        try:
            return resp.json()
        except ValueError:
            raise errors.BadResponse(f"upstream {self.url}: {path} did not answer JSON") from None

    async def list_models(self) -> list[models.Model]:
        return models.ModelList.from_json(await self._json("/v1/models")).models

    async def get_model(self, model: str) -> models.Model:
        return models.Model.from_json(await self._json(f"/v1/models/{model}"))

    async def list_versions(self, model: str, *, after: int, limit: int = 1000) -> list[models.Version]:
        """Committed versions above ``after``, ascending, at most ``limit``."""
        answer = await self._json(f"/v1/models/{model}/versions", params={"after": after, "limit": limit})
        return models.VersionList.from_json(answer).versions

    async def lineage(self, model: str, number: int) -> list[models.Version]:
        """The chain version ``number`` is rebuilt from, keyframe first."""
        answer = await self._json(f"/v1/models/{model}/versions/{number}/lineage", not_found=errors.VersionNotFound)
        return models.VersionList.from_json(answer).versions

    async def hold(self, model: str, number: int, holder: str) -> datetime | None:
        """Lease version ``number``'s chain at the upstream for ``holder`` (a plan from and to ``number``,
        which fetches nothing); when the lease ends."""
        answer = await self._json(
            f"/v1/models/{model}/plan",
            params={"have": number, "want": number, "holder": holder},
            not_found=errors.VersionNotFound,
        )
        return models.Plan.from_json(answer).lease_expires_at

    async def manifest(self, model: str, number: int) -> bytes:
        """Version ``number``'s stored manifest bytes (not checked here: the caller hashes them)."""
        resp = await self._get(f"/v1/models/{model}/versions/{number}/manifest", not_found=errors.VersionNotFound)
        self.bytes_received += len(resp.content)
        return resp.content

    async def object_size(self, digest: str) -> int:
        """The size of object ``digest`` (HEAD); ObjectNotFound."""
        resp = await self._get(f"/v1/objects/{digest}", method="HEAD", not_found=errors.ObjectNotFound)
        try:
            return int(resp.headers["content-length"])
        except (KeyError, ValueError):
            raise errors.BadResponse(f"upstream {self.url}: HEAD of object {digest} without a size") from None

    @asynccontextmanager
    async def open_object(self, digest: str) -> AsyncIterator[tuple[int | None, AsyncIterator[bytes]]]:
        """The whole object's size (None if not said) and its bytes as they arrive (not checked here: the
        store hashes them while writing)."""
        try:
            async with self._http.stream("GET", f"/v1/objects/{digest}") as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    self._raise_for(resp, errors.ObjectNotFound)

                async def chunks() -> AsyncIterator[bytes]:
                    try:
                        async for chunk in resp.aiter_bytes():  # as they arrive: readers stream them
                            self.bytes_received += len(chunk)
                            yield chunk
                    except httpx.TransportError as exc:
                        raise self._unavailable(exc) from None

                length = resp.headers.get("content-length", "")
                yield (int(length) if length.isdigit() else None), chunks()
        except httpx.TransportError as exc:
            raise self._unavailable(exc) from None

    async def events(self, model: str, *, after: int | None) -> AsyncIterator[models.Version]:
        """The model's ``streamEvents``: each Version as its event arrives; ends when the upstream ends it."""
        params = {} if after is None else {"after": after}
        try:
            async with self._streams.stream("GET", f"/v1/models/{model}/events", params=params) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    self._raise_for(resp, errors.ModelNotFound)
                event, data = "", list[str]()
                async for line in resp.aiter_lines():
                    if line == "":
                        if event == "version" and data:
                            try:
                                yield models.Version.from_json(json.loads("\n".join(data)))
                            except ValueError:
                                raise errors.BadResponse(f"upstream {self.url}: an event that is not JSON") from None
                        event, data = "", []
                    elif line.startswith("event:"):
                        event = line[6:].strip()
                    elif line.startswith("data:"):
                        data.append(line[5:].lstrip())
        except httpx.TransportError as exc:
            raise self._unavailable(exc) from None

    async def heartbeat(self, name: str, body: dict[str, Any]) -> None:
        """Send relay ``name``'s heartbeat (relayHeartbeat's body)."""
        await self._get(f"/v1/relays/{name}", method="PUT", json_body=body, not_found=errors.NotFound)

    async def report_replica(self, model: str, body: dict[str, Any]) -> None:
        """Forward one replica report (reportReplica's body)."""
        await self._get(
            f"/v1/models/{model}/replicas",
            method="POST",
            json_body=body,
            ok=(200, 201),
            not_found=errors.VersionNotFound,
        )
