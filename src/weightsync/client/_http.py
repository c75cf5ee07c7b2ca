"""The HTTP edge of the client: one method per operation of docs/API.md, retries, errors, rate limit.

Every call goes through :meth:`Api.request`, which retries connection errors,
429 and 5xx with jittered exponential backoff (honouring ``Retry-After``) and
maps ``application/problem+json`` answers to the named exceptions of
:mod:`weightsync.errors`. Thread-safe: one :class:`Api` (one connection pool)
serves the transfer threads of a publisher or subscriber. A transfer running in a
batch of :func:`~weightsync.client._pool.run_all` stops between two chunks (and
during a retry's wait) once its batch is stopped: Ctrl-C ends a push or pull at once.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import re
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from typing import Any, TypeVar
from urllib.parse import urlsplit

import httpx
import numpy as np

from weightsync import __version__, bundle, errors
from weightsync.client import _direct, models
from weightsync.client._pool import check_cancelled, hash_pool, pause
from weightsync.client.wire import Retry, TokenBucket, problem_error
from weightsync.codec.manifest import DIGEST_KINDS

log = logging.getLogger("weightsync.client")
READ_FORMATS = ",".join(str(v) for v in sorted(DIGEST_KINDS))
"""The manifest formats this client reads, as the plan's ``formats`` query (FORMAT §5.4)."""

T = TypeVar("T")
DEFAULT_SERVER = "http://127.0.0.1:8400"
_RETRY_STATUS = {429, 500, 502, 503, 504}
UPLOAD_CHUNK = 256 << 10
READ_BYTES = 1 << 20
"""Bytes asked of the socket per read of an answer's body (httpcore's own is 64 KiB)."""


def _read_size(size: int) -> None:
    """Have httpcore read answers `size` bytes per receive call (never fewer than its own default).

    httpcore fixes its read size in a class constant (``HTTP11Connection.READ_NUM_BYTES``, 64 KiB,
    chosen for answers of about 1 MB: encode/httpcore#135) with no per-client setting. Our answers
    are objects and plan bundles of megabytes, and the Python around each read (h11's parser,
    httpcore, httpx, our hashing) costs more than the bytes: on the 2-core box a 13.8 MB plan
    bundle took 30-39 ms at 64 KiB a read and 18-22 ms at 1 MiB (the server's own limit, per curl,
    16-20 ms). A read returns what has arrived, up to `size`, so small answers are unchanged.
    The constant is process-wide: other httpcore users in the process read larger pieces too.
    """
    from httpcore._sync import http11

    http11.HTTP11Connection.READ_NUM_BYTES = max(http11.HTTP11Connection.READ_NUM_BYTES, size)


def check_server_url(server: str) -> str:
    """Return `server` without a trailing slash if it is a server's root URL, else raise InvalidArgument.

    The URL needs a scheme (http or https) and a host, and no path, query or fragment: the
    API lives at ``/v1/…`` under the root. The message says what to write instead.
    """
    text = server.strip()
    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError as exc:
        raise errors.InvalidArgument(f"not a server URL: {server!r} ({exc})") from None
    if parts.scheme not in ("http", "https"):
        if "://" in text:
            raise errors.InvalidArgument(f"not a server URL: {server!r}: the scheme must be http or https")
        hint = "http://" + text.partition("/")[0]
        raise errors.InvalidArgument(f"not a server URL: {server!r} has no scheme: use {hint}")
    if not parts.hostname:
        raise errors.InvalidArgument(f"not a server URL: {server!r} has no host")
    if parts.path.strip("/") or parts.query or parts.fragment:
        root = f"{parts.scheme}://{parts.netloc}"
        raise errors.InvalidArgument(f"not a server URL: {server!r} has a path: use the server's root, {root}")
    return f"{parts.scheme}://{parts.netloc}"


def server_timing(headers: httpx.Headers) -> dict[str, float]:
    """The phases of a ``Server-Timing`` header as ``{"server_<name>_s": seconds}``; entries without a
    duration, or whose name or duration does not parse, are left out (the header is informative)."""
    out: dict[str, float] = {}
    for entry in headers.get("server-timing", "").split(","):
        name, *params = (p.strip() for p in entry.split(";"))
        if not _TIMING_NAME.fullmatch(name):
            continue
        for p in params:
            key, _, value = p.partition("=")
            if key.strip().lower() == "dur":
                try:
                    ms = float(value.strip().strip('"'))
                except ValueError:
                    break
                if math.isfinite(ms) and ms >= 0:
                    out[f"server_{name}_s"] = ms / 1e3
                break
    return out


_TIMING_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")


def _bundle_length(resp: httpx.Response | _direct.DirectResponse, inline: int) -> int | None:
    """A plan bundle's length from its header, when the bytes arrive as sent and the length is one a bundle
    of at most `inline` object bytes can have (the receiver then lays them out in one buffer of that size)."""
    n = _identity_length(resp)
    return n if n is not None and n <= inline + (1 << 20) else None  # + the plan's JSON and the parts' headers


class Api:
    """Typed calls for docs/API.md over one httpx connection pool. Thread-safe.

    Each JSON answer comes back as its :mod:`weightsync.client.models` type (lists as
    lists of it), parsed strictly: a known field missing or mistyped is BadResponse.

    ``limiter`` (a :class:`TokenBucket`) caps object and manifest bytes both
    ways; ``transport`` replaces httpx's (tests inject faults with it).
    ``on_bytes`` is called with every body chunk moved (progress reporting).
    ``server`` must be a root URL (:func:`check_server_url`; InvalidArgument otherwise).
    """

    def __init__(
        self,
        server: str,
        token: str | None = None,
        *,
        timeout: float = 60.0,
        concurrency: int = 8,
        retry: Retry | None = None,
        limiter: TokenBucket | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.server = check_server_url(server)
        _read_size(READ_BYTES)
        self.retry = retry or Retry()
        self.limiter = limiter
        self.on_bytes: Callable[[int], None] | None = None
        self.publish_version_missing = False
        """Set once the server answered publishVersion 405 (it predates it): publishes take three requests."""
        self.publish_version_ok = False
        """Set once a publishVersion was answered 201 or 202: the server has the route."""
        self.publish_version_cap: int | None = None
        """Versions whose objects add up to more bytes than this are not sent in one request: a 413 named the
        server's body cap (its problem's ``limit``), or at least that a body of that size was too large."""
        headers = {"User-Agent": f"weightsync/{__version__}"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        limits = httpx.Limits(
            max_connections=max(concurrency, 1) + 4, max_keepalive_connections=max(concurrency, 1) + 4
        )
        t = httpx.Timeout(timeout, connect=min(timeout, 10.0))
        # A plain-HTTP server never needs TLS (redirects are not followed): no certificate store is loaded
        # for it, which is most of what building a client costs (~90 ms for the two on the 2-core box).
        verify: Any = _tls_context() if urlsplit(self.server).scheme == "https" else False
        self._http = httpx.Client(
            base_url=self.server, headers=headers, timeout=t, limits=limits, transport=transport, verify=verify
        )
        self._direct = (
            _direct.Direct(
                self.server,
                connect_timeout=min(timeout, 10.0),
                read_timeout=timeout,
                tls=verify or None,
                keep=limits.max_keepalive_connections or 1,
                expiry=limits.keepalive_expiry,
            )
            if _direct.usable(self._http, self.server, transport)
            else None
        )
        """Large answers (plan bundles, object ranges) are read through this, straight into their buffers
        (:mod:`weightsync.client._direct`); None where it would not behave as httpx: a transport injected, a proxy."""
        self._bare_args: dict[str, Any] = {"timeout": t, "limits": limits, "transport": transport}
        self._bare_client: httpx.Client | None = None
        self._bare_lock = threading.Lock()

    @property
    def _bare(self) -> httpx.Client:
        """The client for presigned URLs (object storage, often HTTPS), made on first use: they carry their own
        authorization, so our token is never sent there."""
        with self._bare_lock:
            if self._bare_client is None:
                self._bare_client = httpx.Client(verify=_tls_context(), **self._bare_args)
            return self._bare_client

    def close(self) -> None:
        self._http.close()
        if self._direct is not None:
            self._direct.close()
        with self._bare_lock:
            if self._bare_client is not None:
                self._bare_client.close()

    def __enter__(self) -> Api:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the one request loop -----------------------------------------------------------

    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: dict | None = None,
        headers: dict | None = None,
        content: Callable[[], Any] | None = None,
        ok: tuple[int, ...] = (200, 201, 204),
        not_found: type[errors.WeightsyncError] = errors.ModelNotFound,
        stream_to: Callable[[Any], Any] | None = None,
        bare: bool = False,
        timeout: float | None = None,
        large: bool = False,
        direct_body: bool = False,
    ) -> Any:
        """Send with retries; return the response (or `stream_to(response)`'s result for streamed bodies).

        `content` is a factory so every attempt gets a fresh body iterator.
        Transient failures are retried; the last one raises ServerUnavailable.
        Other errors raise their named exception at once. A `large` streamed answer to our server
        comes through :mod:`~weightsync.client._direct` where it is usable: `stream_to` then gets a
        :class:`~weightsync.client._direct.DirectResponse` (``headers``, ``iter_bytes``, ``readinto``),
        and an error answer takes httpx's path as an httpx Response. With `direct_body` (a `content` whose
        Content-Length `headers` give) the request goes that way too, its body sent by the standard library,
        and its answer comes back read, as an httpx Response: httpx's own work cost ~0.4-0.6 ms a request
        on the 2-core box (docs/SCALE-RUNS.md, run AT).
        """
        client = self._bare if bare else self._http
        body = content if direct_body and content is not None and not bare else None
        direct = self._direct if not bare and ((large and stream_to is not None) or body is not None) else None
        last: str = ""
        retry_after: str | None = None
        for attempt in range(self.retry.attempts):
            if attempt:
                pause(self.retry.delay(attempt - 1, retry_after))
            check_cancelled()
            started = time.monotonic()
            retry_after = None
            try:
                req = client.build_request(
                    method,
                    path,
                    json=json,
                    params=params,
                    headers=headers,
                    content=content() if content is not None and direct is None else None,
                    timeout=httpx.USE_CLIENT_DEFAULT if timeout is None else timeout,
                )
                resp: Any
                if direct is not None:
                    answer = direct.send(req, timeout=timeout, body=body)
                    streamed = stream_to is not None and answer.status_code in ok
                    resp = answer if streamed else answer.buffered(req)
                else:
                    resp = client.send(req, stream=stream_to is not None)
                try:
                    if resp.status_code in ok:
                        if stream_to is not None:
                            return stream_to(resp)
                        return resp
                    if stream_to is not None:
                        resp.read()
                finally:
                    if stream_to is not None:
                        resp.close()
            except httpx.TransportError as exc:  # connection refused/reset, timeouts, protocol errors
                last = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                log.debug("%s %s: %s (attempt %d, %.1fs)", method, path, last, attempt + 1, time.monotonic() - started)
                continue
            if resp.status_code in _RETRY_STATUS:
                retry_after = resp.headers.get("retry-after")
                last = str(problem_error(resp, not_found=not_found))
                log.debug("%s %s: %s (attempt %d, %.1fs)", method, path, last, attempt + 1, time.monotonic() - started)
                continue
            raise problem_error(resp, not_found=not_found, server=None if bare else self.server)
        where = self.server if not bare else "object storage"
        raise errors.ServerUnavailable(f"{where} unavailable after {self.retry.attempts} attempts: {last}")

    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        """The JSON body of a successful answer (None for an empty one); BadResponse if it is not JSON."""
        return _decoded(self.request(method, path, **kwargs), f"{method} {path}")

    # --- models and versions ------------------------------------------------------------

    def health(self) -> models.Health:
        return models.Health.from_json(self._json("GET", "/healthz"))

    def list_models(self) -> list[models.Model]:
        return models.ModelList.from_json(self._json("GET", "/v1/models")).models

    def get_model(self, model: str) -> models.Model:
        return models.Model.from_json(self._json("GET", f"/v1/models/{model}"))

    def info(self) -> models.Info:
        """The server's identity: its id (stable, shared by every service on one catalog), release, formats."""
        return models.Info.from_json(self._json("GET", "/v1/info"))

    def update_model(self, model: str, **settings: int | float | None) -> models.Model:
        """Change the settings given (keyframe_interval, max_chain_ratio, keep_last; keep_last=None keeps all)."""
        return models.Model.from_json(self._json("PATCH", f"/v1/models/{model}", json=settings))

    def delete_model(self, model: str) -> models.DeletedModel:
        """Delete the model (admin scope); GC reclaims its objects after its grace period."""
        return models.DeletedModel.from_json(self._json("DELETE", f"/v1/models/{model}"))

    def pin(self, model: str, version: int) -> models.Model:
        """Make followers hold committed `version` while the head moves on (VersionNotFound if not committed)."""
        return models.Model.from_json(
            self._json("PUT", f"/v1/models/{model}/pin", json={"version": version}, not_found=errors.VersionNotFound)
        )

    def unpin(self, model: str) -> models.Model:
        """Make followers follow the head again."""
        return models.Model.from_json(self._json("DELETE", f"/v1/models/{model}/pin"))

    def list_versions(
        self, model: str, *, limit: int | None = None, before: int | None = None, after: int | None = None
    ) -> list[models.Version]:
        params = {k: v for k, v in (("limit", limit), ("before", before), ("after", after)) if v is not None}
        return models.VersionList.from_json(self._json("GET", f"/v1/models/{model}/versions", params=params)).versions

    def get_version(self, model: str, number: int | str = "latest") -> models.Version:
        return models.Version.from_json(
            self._json("GET", f"/v1/models/{model}/versions/{number}", not_found=errors.VersionNotFound)
        )

    def head(self, model: str) -> models.Version | None:
        """The head Version, or None when the model does not exist or has no version yet."""
        try:
            return self.get_version(model, "latest")
        except (errors.ModelNotFound, errors.VersionNotFound):
            return None

    def get_plan(
        self, model: str, *, have: int | None, want: int | None = None, holder: str | None = None
    ) -> models.Plan:
        return models.Plan.from_json(
            self._json(
                "GET",
                f"/v1/models/{model}/plan",
                params=_plan_params(have, want, holder),
                not_found=errors.VersionNotFound,
            )
        )

    def get_plan_bundle(
        self,
        model: str,
        *,
        have: int | None,
        want: int | None = None,
        holder: str | None = None,
        inline: int,
        timings: dict[str, float] | None = None,
    ) -> tuple[models.Plan, dict[str, tuple[memoryview, str | Future[str] | None]]]:
        """The plan and, when its bytes are at most `inline`, its manifests and objects in the same answer.

        Returns (plan, {digest: (bytes, their SHA-256 hex or None)} of the objects that came with it). The
        hashes are taken on the process's hashing thread as the bytes arrive (`_pool.hash_pool`); one still being
        taken when the body has ended is a Future of it, so the caller can read the plan and the first
        objects (the manifests come first) while the rest still hash: :func:`checked` gives the objects
        whose bytes hash to their names. An object the server did not send (a larger update, an older
        server, a relay lacking some objects) is not there: the caller fetches those as usual.
        Bytes received are rate-limited; `on_bytes` counts the objects' bytes. `timings` gets the
        server's phases (``server_plan_s``, from its Server-Timing header).

        Every part is checked here, after its transfer, whatever the server says it checked: the apply's result
        checks do not cover every damaged frame (docs/FORMAT.md §10.3). A part the answer gives an xxh3-128
        for (``Weightsync-Xxh3``, with ``Weightsync-Checked: sha256``: the server took it of bytes it had just
        checked against their name) is checked with that, ~10x faster than its SHA-256, and comes back with its
        name as its hash when it matches (or "" when it does not, so :func:`checked` leaves it out).
        """
        params = {**_plan_params(have, want, holder), "inline": inline}
        across: dict[str, str] = {}  # the parts checked by their transfer digest, and that digest

        def consume(resp: httpx.Response | _direct.DirectResponse) -> tuple[str, bundle.Receiver | bytearray]:
            if timings is not None:
                timings.update(server_timing(resp.headers))
            kind = resp.headers.get("content-type", "")
            sink: bundle.Receiver | bytearray = bytearray()
            if kind.startswith(bundle.MEDIA_TYPE):
                across.clear()  # an attempt starts over
                if resp.headers.get(bundle.CHECKED_HEADER, "").strip().lower() == "sha256":
                    across.update(bundle.parse_transfer_digests(resp.headers.get(bundle.XXH3_HEADER, "")))
                sink = bundle.Receiver(size=_bundle_length(resp, inline), hasher=hash_pool(), unhashed=across)
                space = sink.space()
                if isinstance(resp, _direct.DirectResponse) and space is not None:
                    # Received straight into the bundle's buffer: the Receiver parses and hashes it in place.
                    self._receive_into(resp, space, sink.took)
                    return kind, sink
            for chunk in resp.iter_bytes():
                self._pay(len(chunk))
                if isinstance(sink, bytearray):
                    sink += chunk
                else:
                    sink.feed(chunk)
            return kind, sink

        path = f"/v1/models/{model}/plan"
        kind, sink = self.request(
            "GET", path, params=params, ok=(200,), stream_to=consume, not_found=errors.VersionNotFound, large=True
        )
        if isinstance(sink, bytearray):
            try:
                return models.Plan.from_json(json.loads(sink)), {}
            except ValueError:
                raise errors.BadResponse(f"GET {path}: the answer is neither a plan nor a plan bundle") from None
        plan_json, received = sink.finish_pending()
        for name, want_xxh3 in across.items():
            if name in received:
                data, _ = received[name]
                received[name] = (data, _checked_across(name, data, want_xxh3))
        try:
            plan = models.Plan.from_json(json.loads(bytes(plan_json)))
        except ValueError:
            raise errors.BadResponse(f"GET {path}: the bundle's plan is not JSON") from None
        if self.on_bytes is not None:
            self.on_bytes(sum(len(v) for v, _ in received.values()))
        return plan, received

    def watch(self, model: str, *, after: int, timeout: float) -> models.Version | None:
        """The head once it is newer than ``after``; None when ``timeout`` s pass first (a 204)."""
        resp = self.request(
            "GET",
            f"/v1/models/{model}/watch",
            params={"after": after, "timeout": timeout},
            ok=(200, 204),
            timeout=timeout + 30.0,
        )
        if resp.status_code != 200:
            return None
        return models.Version.from_json(_decoded(resp, f"GET /v1/models/{model}/watch"))

    def report_replica(
        self,
        model: str,
        *,
        subscriber: str,
        version: int | None,
        status: str | None = None,
        mode: str | None = None,
        engine: str | None = None,
        bytes: int | None = None,
        pause_ms: float | None = None,
        site: str | None = None,
        host: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> models.Replica:
        """Record in the ledger that ``subscriber`` holds ``version`` (``bytes`` received, ``pause_ms`` paused).

        ``status``: ``serving`` | ``applied`` (the server's default) | ``unhealthy`` (``version`` None: the
        engine holds no verified version); ``mode``, ``engine``: docs/API.md, Replica. An unknown value, or
        a version on an unhealthy report, is InvalidArgument (422); an uncommitted version VersionNotFound.
        """
        body: dict[str, Any] = {"subscriber": subscriber, "version": version}
        optional = {
            "status": status,
            "mode": mode,
            "engine": engine,
            "bytes": bytes,
            "pause_ms": pause_ms,
            "site": site,
            "host": host,
            "extra": extra,
        }
        body.update((k, v) for k, v in optional.items() if v is not None)
        return models.Replica.from_json(self._json("POST", f"/v1/models/{model}/replicas", json=body))

    def list_replicas(self, model: str, *, subscriber: str | None = None, all: bool = False) -> list[models.Replica]:
        """Each subscriber's latest ledger entry (``all``: every entry), by subscriber then time."""
        params: dict[str, Any] = {"all": str(all).lower()}
        if subscriber:
            params["subscriber"] = subscriber
        return models.ReplicaList.from_json(self._json("GET", f"/v1/models/{model}/replicas", params=params)).replicas

    def list_relays(self) -> list[models.Relay]:
        """Every relay that reports to this server (and those below them), with its last heartbeat's age."""
        return models.RelayList.from_json(self._json("GET", "/v1/relays")).relays

    # --- publishing ---------------------------------------------------------------------

    def begin_publish(
        self,
        model: str,
        *,
        parent: int | None,
        step: int | None,
        metadata: dict[str, Any] | None,
        keyframe: bool,
        objects: list[tuple[str, int]] | None = None,
        part: tuple[int, int] | None = None,
    ) -> models.PublishBegin:
        """Begin a publish; with `objects` (an encoding made first) the answer may carry their check too.

        With `part` (rank, world) it joins the multi-part publish of (model, parent, step)."""
        body = _begin_fields(parent, keyframe, step, metadata, objects)
        if part is not None:
            body["part"] = {"rank": part[0], "world": part[1]}
        return models.PublishBegin.from_json(self._json("POST", f"/v1/models/{model}/publishes", json=body))

    def check_objects(self, model: str, publish_id: str, objects: list[tuple[str, int]]) -> models.CheckObjects:
        body = {"objects": [{"digest": d, "size": s} for d, s in objects]}
        return models.CheckObjects.from_json(
            self._json(
                "POST",
                f"/v1/models/{model}/publishes/{publish_id}/objects",
                json=body,
                not_found=errors.PublishNotFound,
            )
        )

    def commit_publish(
        self, model: str, publish_id: str, *, manifest: str, idempotency_key: str, allow_removals: bool = False
    ) -> models.Version:
        body: dict[str, Any] = {"manifest": manifest, "idempotency_key": idempotency_key}
        if allow_removals:
            body["allow_removals"] = True
        return models.Version.from_json(
            self._json(
                "POST",
                f"/v1/models/{model}/publishes/{publish_id}/commit",
                json=body,
                headers={"Idempotency-Key": idempotency_key},
                not_found=errors.PublishNotFound,
            )
        )

    def commit_part(
        self, model: str, publish_id: str, *, rank: int, world: int, manifest: str, allow_removals: bool = False
    ) -> models.Version | None:
        """Record one part of a multi-part publish: the committed version, or None while parts are missing."""
        body: dict[str, Any] = {"world": world, "manifest": manifest, "allow_removals": allow_removals}
        answer = self._json(
            "POST",
            f"/v1/models/{model}/publishes/{publish_id}/parts/{rank}",
            json=body,
            not_found=errors.PublishNotFound,
        )
        if not isinstance(answer, dict) or answer.get("state") not in ("pending", "committed"):
            raise errors.BadResponse(f"commitPart answered {answer!r}")
        if answer["state"] == "pending":
            return None
        return models.Version.from_json(answer.get("version"))

    def publish_version(
        self,
        model: str,
        *,
        parent: int | None,
        step: int | None,
        metadata: dict[str, Any] | None,
        keyframe: bool,
        objects: dict[str, bytes],
        manifest: str,
        idempotency_key: str,
        allow_removals: bool = False,
        timings: dict[str, float] | None = None,
    ) -> models.Version | models.PublishBegin | None:
        """Publish a version in one request (publishVersion): `objects` by digest, the manifest among them
        (sent in their order). The committed version; or the begun publish when the server wants another kind (encode
        that, then check, upload and commit as usual); or None from a server without publishVersion
        (405, :attr:`publish_version_missing` set) or whose body cap the request exceeds (413,
        :attr:`publish_version_cap` lowered below its size). `timings` gets the server's phases
        (``server_store_s``, ``server_commit_s``, and ``server_begin_s`` when the begin was a catalog transaction
        of its own; from its Server-Timing header)."""
        body = _begin_fields(parent, keyframe, step, metadata, [(d, len(b)) for d, b in objects.items()])
        body.update(manifest=manifest, idempotency_key=idempotency_key)
        if allow_removals:
            body["allow_removals"] = True
        pieces = bundle.chunks(json.dumps(body).encode(), objects, first=bundle.PUBLISH)
        size = sum(len(p) for p in pieces)

        def content() -> Iterator[bytes]:
            for piece in pieces:
                yield from self._body(piece)()

        resp = self.request(
            "POST",
            f"/v1/models/{model}/versions",
            headers={"Content-Type": bundle.PUBLISH_MEDIA_TYPE, "Content-Length": str(size)},
            content=content,
            ok=(201, 202, 405, 413),
            direct_body=True,
        )
        if resp.status_code == 413:  # over the server's body cap: versions this large go in three requests
            limit = _problem_member(resp, "limit")
            body_cap = limit if isinstance(limit, int) and 0 <= limit < size else size - 1
            objects_cap = body_cap - (size - sum(len(b) for b in objects.values()))  # less this request's framing
            self.publish_version_cap = min(objects_cap, self.publish_version_cap or objects_cap)
            return None
        if resp.status_code == 405:
            err = problem_error(resp, not_found=errors.ModelNotFound, server=self.server)
            if isinstance(err, errors.ReadOnly):  # a relay: publish to its upstream
                raise err
            self.publish_version_missing = True
            return None  # a server that predates publishVersion (GET /versions only)
        self.publish_version_ok = True
        if timings is not None:
            timings.update(server_timing(resp.headers))
        answer = _decoded(resp, "publishVersion")
        if resp.status_code == 202:
            return models.PublishBegin.from_json(answer)
        return models.Version.from_json(answer)

    def abort_publish(self, model: str, publish_id: str) -> None:
        self.request("DELETE", f"/v1/models/{model}/publishes/{publish_id}", not_found=errors.PublishNotFound)

    def _body(self, data: bytes | memoryview) -> Callable[[], Iterator[bytes]]:
        view = memoryview(data)

        def chunks() -> Iterator[bytes]:
            for pos in range(0, len(view), UPLOAD_CHUNK):
                check_cancelled()
                piece = view[pos : pos + UPLOAD_CHUNK]
                if self.limiter is not None:
                    self.limiter.acquire(len(piece))
                yield bytes(piece)
                if self.on_bytes is not None:
                    self.on_bytes(len(piece))

        return chunks

    def put_object(self, digest: str, data: bytes | memoryview, presigned: models.PresignedPut | None = None) -> None:
        """Upload one object (the presigned request when given, else putObject)."""
        if presigned is not None:
            headers = dict(presigned.headers)
            headers.setdefault("Content-Length", str(len(data)))
            ok: tuple[int, ...] = (200, 201, 204)
            if any(k.lower() == "if-none-match" and v.strip() == "*" for k, v in headers.items()):
                # Create-once under the object's own digest: 412 says it is there already. That is
                # also what a retry meets when the first attempt's reply was lost after the store acted.
                ok += (412,)
            self.request(
                presigned.method,
                presigned.url,
                headers=headers,
                content=self._body(data),
                ok=ok,
                bare=True,
                not_found=errors.ObjectNotFound,
            )
            return
        self.request(
            "PUT",
            f"/v1/objects/{digest}",
            headers={"Content-Length": str(len(data)), "Content-Type": "application/octet-stream"},
            content=self._body(data),
            ok=(200, 201),
            not_found=errors.ObjectNotFound,
        )

    # --- reading objects ----------------------------------------------------------------

    def get_object(
        self, digest: str, sink: Callable[[bytes | memoryview], None], *, start: int = 0, end: int | None = None
    ) -> int:
        """Stream object bytes [start, end) into `sink` (rate-limited); returns the bytes received.

        A retried attempt restarts the range, so `sink` must accept a restart:
        it is called with ``b""`` (meaning "discard what you have") before each attempt. A chunk may be
        a view of a buffer that the next chunk overwrites: `sink` copies what it keeps.
        """

        def consume(resp: httpx.Response | _direct.DirectResponse) -> int:
            sink(b"")
            n = 0
            for chunk in resp.iter_bytes(UPLOAD_CHUNK):
                self._pay(len(chunk))
                sink(chunk)
                n += len(chunk)
                if self.on_bytes is not None:
                    self.on_bytes(len(chunk))
            return n

        return self._get_range(digest, start, end, consume)

    def read_object(
        self,
        digest: str,
        *,
        start: int = 0,
        end: int | None = None,
        watch: Callable[[memoryview | bytes], None] | None = None,
        into: memoryview | None = None,
    ) -> memoryview:
        """Object bytes [start, end) (rate-limited, counted by `on_bytes`) in one buffer of their length when the
        answer states it, received straight into it where :mod:`~weightsync.client._direct` is usable.

        `watch` sees the bytes as they arrive, in order (to hash them while the rest is on its way): each piece
        once, and ``b""`` before each attempt (a retried one starts the range over). `into`: a writable buffer
        the answer must fill exactly (BadResponse if it is another length), received into and returned (the
        ranges of one object read into slices of one buffer need no join)."""

        def arrived(piece: memoryview | bytes) -> None:
            if self.on_bytes is not None:
                self.on_bytes(len(piece))
            if watch is not None:
                watch(piece)

        def consume(resp: httpx.Response | _direct.DirectResponse) -> memoryview:
            if watch is not None:
                watch(b"")
            length = _identity_length(resp)
            if length is None:  # no length stated (or an encoding): gathered as it comes
                gathered = bytearray()
                for chunk in resp.iter_bytes():
                    self._pay(len(chunk))
                    arrived(chunk)
                    gathered += chunk
                if into is None:
                    return memoryview(gathered).toreadonly()
                if len(gathered) != len(into):
                    raise errors.BadResponse(
                        f"GET /v1/objects/{digest}: {len(gathered)} bytes answered for a range of {len(into)}"
                    )
                into[:] = gathered
                return into.toreadonly()
            asked = len(into) if into is not None else None if end is None else end - start
            if asked is not None and (length > asked or into is not None and length != asked):
                raise errors.BadResponse(f"GET /v1/objects/{digest}: {length} bytes answered for a range of {asked}")
            # A buffer of its own has its pages touched once, by the bytes arriving.
            buf = into if into is not None else np.empty(length, dtype=np.uint8).data
            at = 0

            def took(n: int) -> None:
                nonlocal at
                arrived(buf[at : at + n])
                at += n

            if isinstance(resp, _direct.DirectResponse):
                self._receive_into(resp, buf, took)
            else:
                for chunk in resp.iter_bytes():
                    if at + len(chunk) > length:
                        raise errors.BadResponse(f"GET /v1/objects/{digest}: longer than its {length} bytes")
                    self._pay(len(chunk))
                    buf[at : at + len(chunk)] = chunk
                    took(len(chunk))
                buf = buf[:at]
            return buf.toreadonly()

        return self._get_range(digest, start, end, consume)

    def _get_range(self, digest: str, start: int, end: int | None, consume: Callable[[Any], T]) -> T:
        """getObject for bytes [start, end) (the whole object from `start` when `end` is None), its body given to
        `consume`; a range from byte N answered as the whole object is BadResponse (:func:`_check_range_answer`)."""
        headers = {}
        if start or end is not None:
            headers["Range"] = f"bytes={start}-{'' if end is None else end - 1}"

        def checked_consume(resp: httpx.Response | _direct.DirectResponse) -> T:
            _check_range_answer(resp, digest, start, end)
            return consume(resp)

        return self.request(
            "GET",
            f"/v1/objects/{digest}",
            headers=headers,
            ok=(200, 206),
            stream_to=checked_consume,
            not_found=errors.ObjectNotFound,
            large=True,
        )

    def _pay(self, n: int) -> None:
        """`n` object bytes arrived: stop here if the transfer was cancelled, and pay the rate limit."""
        check_cancelled()
        if self.limiter is not None:
            self.limiter.acquire(n)

    def _receive_into(self, resp: _direct.DirectResponse, buf: memoryview, took: Callable[[int], None]) -> None:
        """Receive `resp`'s body into `buf`, READ_BYTES per read (rate-limited, cancellable between reads), then
        `took(n)` after each. `buf` is the answer's stated length (its Content-Length, no Transfer-Encoding):
        http.client reads no further, and a body that ends short is RemoteProtocolError (retried)."""
        at = 0
        while at < len(buf):
            n = resp.readinto(buf[at : at + READ_BYTES])
            if not n:
                break
            self._pay(n)
            took(n)
            at += n
        if at != len(buf):
            raise httpx.RemoteProtocolError(f"the answer ended after {at} of its {len(buf)} bytes")

    def head_object(self, digest: str) -> int:
        resp = self.request("HEAD", f"/v1/objects/{digest}", not_found=errors.ObjectNotFound, ok=(200,))
        return int(resp.headers.get("content-length", "0"))

    def get_manifest(self, model: str, number: int) -> bytes:
        return self.request(
            "GET", f"/v1/models/{model}/versions/{number}/manifest", not_found=errors.VersionNotFound, ok=(200,)
        ).content

    # --- admin --------------------------------------------------------------------------

    def fsck(self, *, read_data: bool, repair: bool) -> models.FsckReport:
        return models.FsckReport.from_json(
            self._json("POST", "/v1/admin/fsck", json={"read_data": read_data, "repair": repair})
        )

    def gc(self, *, dry_run: bool, grace_s: float | None = None) -> models.GcReport:
        body: dict[str, Any] = {"dry_run": dry_run}
        if grace_s is not None:
            body["grace_s"] = grace_s
        return models.GcReport.from_json(self._json("POST", "/v1/admin/gc", json=body))


def _checked_across(name: str, data: memoryview, want_xxh3: str) -> str | Future[str]:
    """`name` if `data` has the xxh3-128 `want_xxh3` (its transfer digest), else "": a large part's check as a
    Future on the hashing thread (xxhash lets go of the GIL), so it runs while the caller decodes the
    manifests that came before it (:func:`checked` waits for it); a small one's at once."""

    def check() -> str:
        return name if bundle.transfer_digest(data) == want_xxh3 else ""

    if len(data) < bundle.HASH_AHEAD:
        return check()
    return hash_pool().submit(check)


def checked(
    received: dict[str, tuple[memoryview, str | Future[str] | None]], digests: Iterable[str]
) -> dict[str, memoryview]:
    """Of `digests`, the objects of `received` (:meth:`Api.get_plan_bundle`) whose bytes hash to their names,
    waiting for hashes still being taken (one that came without a hash is hashed now). One that came with
    other bytes is left out, with a warning: the caller fetches it again."""
    out = {}
    for digest in digests:
        got = received.get(digest)
        if got is None:
            continue
        data, sha256 = got
        if sha256 is None:
            sha256 = hashlib.sha256(data).hexdigest()
        if (sha256.result() if isinstance(sha256, Future) else sha256) == digest:
            out[digest] = data
        else:
            log.warning("object %s came with the plan with other bytes: fetching it again", digest)
    return out


def _plan_params(have: int | None, want: int | None, holder: str | None) -> dict[str, Any]:
    """getPlan's query. ``formats``: a version in a format this client cannot read is a 406, not a crash."""
    params: dict[str, Any] = {"formats": READ_FORMATS}
    if have is not None:
        params["have"] = have
    if want is not None:
        params["want"] = want
    if holder:
        params["holder"] = holder
    return params


def _begin_fields(
    parent: int | None,
    keyframe: bool,
    step: int | None,
    metadata: dict[str, Any] | None,
    objects: list[tuple[str, int]] | None,
) -> dict[str, Any]:
    """The JSON fields beginPublish and publishVersion share (optional ones only when set)."""
    body: dict[str, Any] = {"parent": parent, "keyframe": keyframe}
    if step is not None:
        body["step"] = step
    if metadata:
        body["metadata"] = metadata
    if objects is not None:
        body["objects"] = [{"digest": d, "size": n} for d, n in objects]
    return body


def _identity_length(resp: httpx.Response | _direct.DirectResponse) -> int | None:
    """The body's length from its Content-Length, when its bytes arrive as sent: no content encoding, and no
    transfer encoding (which frames the body instead; its Content-Length, if any, says nothing)."""
    length = resp.headers.get("content-length", "")
    if (
        resp.headers.get("content-encoding", "identity") != "identity"
        or "transfer-encoding" in resp.headers
        or not length.isdigit()
    ):
        return None
    return int(length)


def _check_range_answer(
    resp: httpx.Response | _direct.DirectResponse, digest: str, start: int, end: int | None
) -> None:
    """A range that does not start at 0 must be answered as one (206): a 200 is the whole object from its first
    byte, which would be taken for the bytes from `start` on (BadResponse). A 206 that says which bytes it holds
    (Content-Range) must hold those asked for: from `start`, and to `end` unless the object ends first."""
    if start and resp.status_code != 206:
        raise errors.BadResponse(
            f"GET /v1/objects/{digest}: range from byte {start} answered {resp.status_code}, not 206"
        )
    said = resp.headers.get("content-range", "") if resp.status_code == 206 else ""
    first, _, rest = said.removeprefix("bytes ").partition("-")
    last, _, size = rest.partition("/")
    if first.strip().isdigit() and last.strip().isdigit():
        a, b = int(first), int(last) + 1
        ends = end if end is None or not size.strip().isdigit() else min(end, int(size))
        if a != start or ends is not None and b != ends:
            raise errors.BadResponse(
                f"GET /v1/objects/{digest}: bytes {start}-{'' if end is None else end - 1} asked for, {said!r} answered"
            )


def _problem_member(resp: httpx.Response, name: str) -> Any:
    """A member of a problem+json answer (None when absent, or the body is not a JSON object)."""
    try:
        body = resp.json()
    except ValueError:
        return None
    return body.get(name) if isinstance(body, dict) else None


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """The process's one TLS context with the default certificate store (httpx's default, built once)."""
    return httpx.create_ssl_context()


def _decoded(resp: httpx.Response, what: str) -> Any:
    """The JSON body of ``resp`` (None when empty); BadResponse when it is not JSON."""
    if resp.status_code == 204 or not resp.content:
        return None
    try:
        return resp.json()
    except ValueError:
        raise errors.BadResponse(f"bad response from the server: {what}: the answer is not JSON") from None
