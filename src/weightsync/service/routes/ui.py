"""The fleet dashboard (docs/UI.md): server-rendered pages under ``/ui`` and their one live stream.

Pages read through :mod:`weightsync.service.dashboard` and render Jinja2 templates shipped in
the package (``service/templates``, ``service/static``). Auth is the API's token table, but the
token comes from the ``weightsync_ui`` cookie a login form sets (HttpOnly, SameSite=Strict,
``Path=/ui``): EventSource cannot send a bearer header, and a token never goes into a URL.
The cookie is read here only; the ``/v1`` routes take the Authorization header alone. A model
the token may not read answers 404, as one that does not exist. Nothing here changes the fleet.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from typing import Annotated, Any
from urllib.parse import parse_qs, quote, urlencode

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response, StreamingResponse
from jinja2 import Environment, PackageLoader, select_autoescape

from weightsync import errors
from weightsync.common import VERSION, human_bytes
from weightsync.ops import Ops
from weightsync.service import dashboard
from weightsync.service.auth import AuthDenied, Principal, TokenTable
from weightsync.service.metrics import Metrics
from weightsync.service.settings import Settings

__all__ = ["COOKIE", "router"]

log = logging.getLogger("weightsync.service")
router = APIRouter(include_in_schema=False)

COOKIE = "weightsync_ui"
MAX_FORM = 8192
_SECURITY_HEADERS = {
    # Every script and style is a file of ours (the chart is inline SVG markup, styled by class).
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def _ago(seconds: float | None) -> str:
    """A duration for people: ``12 s``, ``4 min``, ``3 h 5 min``, ``2 d 4 h``."""
    if seconds is None:
        return "–"
    if seconds < 1:
        return f"{seconds:.2g} s"
    s = int(seconds)
    if s < 90:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min"
    if s < 86400:
        return f"{s // 3600} h {s % 3600 // 60} min"
    return f"{s // 86400} d {s % 86400 // 3600} h"


def _ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:.1f}×"


def _when(at: datetime | None) -> str:
    return "–" if at is None else at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _pause(ms: float | None) -> str:
    if ms is None:
        return "–"
    return f"{ms:.0f} ms" if ms < 10_000 else f"{ms / 1000:.1f} s"


_env = Environment(
    loader=PackageLoader("weightsync.service", "templates"),
    autoescape=select_autoescape(["html"]),
    trim_blocks=True,
    lstrip_blocks=True,
)
_env.filters.update(
    bytes=lambda n: "–" if n is None else human_bytes(n),
    ago=_ago,
    ratio=_ratio,
    when=_when,
    pause=_pause,
    iso=lambda at: "" if at is None else at.astimezone(UTC).isoformat(),
    quote_path=lambda s: quote(s, safe="/"),
    groupby_site=dashboard.by_site,
)


def _now() -> datetime:
    return datetime.now(UTC)


def _render(request: Request, template: str, status: int = 200, **context: Any) -> HTMLResponse:
    tokens: TokenTable = request.app.state.tokens
    html = _env.get_template(template).render(
        request=request,
        release=VERSION,
        logged_in=not tokens.anonymous and COOKIE in request.cookies,
        anonymous=tokens.anonymous,
        **context,
    )
    return HTMLResponse(html, status_code=status, headers=_SECURITY_HEADERS)


def _principal(request: Request) -> Principal:
    """Who the cookie names (anonymous mode: everyone, on loopback only); AuthDenied(401/403)."""
    table: TokenTable = request.app.state.tokens
    table.check_server_address(request.scope.get("server"))
    principal = table.authenticate(request.cookies.get(COOKIE))
    request.state.principal = principal.name
    principal.require("read")
    return principal


def _login_page(request: Request, denied: AuthDenied) -> HTMLResponse:
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    return _render(
        request,
        "login.html",
        status=denied.status,
        title="Sign in",
        message=denied.detail if COOKIE in request.cookies or request.method == "POST" else None,
        next=_safe_next(target),
    )


def _not_found(request: Request, what: str) -> HTMLResponse:
    return _render(request, "error.html", status=404, title="Not found", message=what)


async def _page(
    request: Request, build: Callable[[Principal, Ops, Settings], Awaitable[tuple[str, dict[str, Any]]]]
) -> Response:
    """Authenticate from the cookie, build a page; 401 login page, 404 page for a missing model or version."""
    try:
        who = _principal(request)
    except AuthDenied as denied:
        return _login_page(request, denied)
    try:
        template, context = await build(who, request.app.state.ops, request.app.state.settings)
    except errors.NotFound as exc:
        return _not_found(request, str(exc))
    return _render(request, template, **context)


def _hidden(who: Principal, model: str) -> bool:
    return not who.may_use(model)


# --- pages -------------------------------------------------------------------------------------


@router.get("/")
async def root(request: Request) -> Response:
    """Browsers go to the dashboard; API clients get the usual 404 problem."""
    if "text/html" in request.headers.get("accept", ""):
        return RedirectResponse("/ui/", status_code=307)
    raise errors.NotFound("nothing here: the API is under /v1, the dashboard under /ui")


@router.get("/ui")
async def ui_root() -> Response:
    return RedirectResponse("/ui/", status_code=307)


@router.get("/ui/")
async def models_page(request: Request) -> Response:
    async def build(who: Principal, ops: Ops, settings: Settings) -> tuple[str, dict[str, Any]]:
        now = _now()
        rows = await dashboard.models_overview(ops, who, now, settings.ui_stale_after_s)
        relays = await dashboard.relay_views(ops, who, now, settings.ui_stale_after_s)
        return "models.html", {"title": "Models", "nav": "models", "rows": rows, "relays": relays, "live_models": []}

    return await _page(request, build)


def _keyset(value: str | None) -> int | None:
    if value is None or not value.isascii() or not value.isdigit() or len(value) > 18:
        return None
    return int(value)


@router.get("/ui/models/{model:model}")
async def model_view(
    request: Request,
    model: str,
    before: Annotated[str | None, Query()] = None,
    after: Annotated[str | None, Query()] = None,
) -> Response:
    async def build(who: Principal, ops: Ops, settings: Settings) -> tuple[str, dict[str, Any]]:
        if _hidden(who, model):
            raise errors.ModelNotFound(f"no model named {model!r}")  # as the catalog says: no hint it exists
        page = await dashboard.model_page(
            ops, model, _now(), settings.ui_stale_after_s, before=_keyset(before), after=_keyset(after)
        )
        return "model.html", {"title": model, "page": page, "live_models": [model]}

    return await _page(request, build)


@router.get("/ui/models/{model:model}/versions/{number}")
async def version_view(request: Request, model: str, number: str) -> Response:
    async def build(who: Principal, ops: Ops, settings: Settings) -> tuple[str, dict[str, Any]]:
        n = _keyset(number)
        if _hidden(who, model):
            raise errors.ModelNotFound(f"no model named {model!r}")  # as the catalog says: no hint it exists
        if n is None:
            raise errors.VersionNotFound(f"no version {number!r} of {model!r}")
        server = str(request.base_url).rstrip("/")
        page = await dashboard.version_page(ops, model, n, server, _now(), settings.ui_stale_after_s)
        return "version.html", {"title": f"{model} v{n}", "page": page, "live_models": [model]}

    return await _page(request, build)


# --- signing in and out --------------------------------------------------------------------------


def _safe_next(target: str | None) -> str:
    """Only a path of the dashboard itself: never another site, never the API."""
    if not target or not target.startswith("/ui/") or target.startswith("//") or "\\" in target:
        return "/ui/"
    return target


@router.get("/ui/login")
async def login_form(request: Request, next: Annotated[str | None, Query()] = None) -> Response:
    tokens: TokenTable = request.app.state.tokens
    if tokens.anonymous:
        return RedirectResponse("/ui/", status_code=303)
    return _render(request, "login.html", title="Sign in", message=None, next=_safe_next(next))


@router.post("/ui/login")
async def login(request: Request) -> Response:
    """Check the posted token (read scope), keep it in the cookie, go back to the page asked for."""
    tokens: TokenTable = request.app.state.tokens
    body = await request.body()
    form = parse_qs(body[:MAX_FORM].decode("utf-8", "replace"), max_num_fields=4)
    token = (form.get("token") or [""])[0].strip()
    asked = form.get("next")
    target = _safe_next(asked[0] if asked else None)
    try:
        tokens.check_server_address(request.scope.get("server"))
        principal = tokens.authenticate(token or None)
        principal.require("read")
    except AuthDenied as denied:
        return _render(request, "login.html", status=denied.status, title="Sign in", message=denied.detail, next=target)
    request.state.principal = principal.name
    response = RedirectResponse(target, status_code=303)
    if not tokens.anonymous:
        response.set_cookie(
            COOKIE,
            token,
            path="/ui",
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )
    return response


@router.post("/ui/logout")
async def logout() -> Response:
    response = RedirectResponse("/ui/login", status_code=303)
    response.delete_cookie(COOKIE, path="/ui", httponly=True, samesite="strict")
    return response


# --- live updates --------------------------------------------------------------------------------


@router.get("/ui/events")
async def events(request: Request, model: Annotated[list[str] | None, Query(max_length=200)] = None) -> Response:
    """One Server-Sent Events stream for the models a page shows (all it may read when none is named).

    ``event: change`` with ``{"model", "what": "version" | "replica" | "model"}`` whenever a
    version commits, a replica reports, or (no model named) a model appears or goes; a page then
    fetches itself again and swaps its live regions. ``event: ready`` first, once the state the
    changes are counted from is read: a page fetches itself then too, for what changed before.
    """
    try:
        who = _principal(request)
    except AuthDenied as denied:
        return Response(denied.detail, status_code=denied.status, media_type="text/plain")
    settings: Settings = request.app.state.settings
    wanted = [m for m in (model or []) if who.may_use(m)]
    return StreamingResponse(
        _changes(_watcher(request), who, wanted or None, settings.sse_keepalive_s, request.app.state.metrics),
        media_type="text/event-stream",
        headers={**_SECURITY_HEADERS, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def _watcher(request: Request) -> dashboard.ChangeWatcher:
    """The process's one :class:`~weightsync.service.dashboard.ChangeWatcher`, made on first use."""
    state = request.app.state
    if getattr(state, "ui_watcher", None) is None:
        settings: Settings = state.settings
        state.ui_watcher = dashboard.ChangeWatcher(state.ops, max(settings.watch_poll_s, 1.0))
    watcher: dashboard.ChangeWatcher = state.ui_watcher
    return watcher


async def _changes(
    watcher: dashboard.ChangeWatcher, who: Principal, models: list[str] | None, keepalive: float, metrics: Metrics
) -> AsyncIterator[str]:
    """The stream: compares the models' fingerprints every poll; runs until the client goes."""
    metrics.sse_streams.inc()
    try:
        async for chunk in _change_events(watcher, who, models, keepalive):
            yield chunk
    finally:
        metrics.sse_streams.dec()


async def _change_events(
    watcher: dashboard.ChangeWatcher, who: Principal, models: list[str] | None, keepalive: float
) -> AsyncIterator[str]:
    poll = watcher.poll
    yield f"retry: {int(poll * 3000)}\n: watching\n\n"
    seen: dict[str, tuple[object, ...] | None] = {}
    first = True
    idle = 0.0
    while True:
        try:
            names = models
            if names is None:
                names = [name for name in await watcher.models() if who.may_use(name)]
            now = {name: await watcher.fingerprint(name) for name in names}
        except errors.CatalogUnavailable as exc:
            log.warning("dashboard events: %s", exc)
            now = seen
        if first:
            # The baseline is taken: what changed between the page's render and now is not sent, so
            # the page fetches itself once on this event (on every reconnect too).
            yield f"event: ready\ndata: {json.dumps({'models': len(now)})}\n\n"
        else:
            for name in sorted(set(now) | set(seen)):
                old, new = seen.get(name), now.get(name)
                if old == new:
                    continue
                what = "model" if old is None or new is None else ("version" if old[0] != new[0] else "replica")
                yield f"event: change\ndata: {json.dumps({'model': name, 'what': what})}\n\n"
                idle = 0.0
        seen, first = now, False
        await asyncio.sleep(poll)
        idle += poll
        if idle >= keepalive:
            yield ": keep-alive\n\n"
            idle = 0.0


def page_query(**params: int | None) -> str:
    """``?before=N`` and the like, for the templates' pagination links."""
    kept = {k: v for k, v in params.items() if v is not None}
    return f"?{urlencode(kept)}" if kept else ""


_env.globals["page_query"] = page_query
