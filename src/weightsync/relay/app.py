"""The relay's app: the service's app (weightsync/service/app.py) with the relay's routes and its mirror.

``create_relay_app(settings)`` builds the service's app over the relay's own catalog and store,
with the routes of :mod:`weightsync.relay.routes` in place of the service's of the same path and
method, and a :class:`~weightsync.relay.mirror.Mirror` that follows the upstream for as long as
the app runs. ``app_from_env`` is the import-string factory (``weightsync relay`` runs one worker).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI
from fastapi.routing import APIRoute

from weightsync.relay.metrics import RelayMetrics
from weightsync.relay.mirror import Mirror
from weightsync.relay.routes import refusals, router
from weightsync.relay.settings import RelaySettings
from weightsync.relay.upstream import Upstream
from weightsync.service.app import create_app
from weightsync.service.routes import ROUTERS

__all__ = ["app_from_env", "create_relay_app", "relay_routers"]


def relay_routers() -> list[APIRouter]:
    """The relay's routes, then the service's, leaving out every service route a relay route replaces."""
    own = [router, refusals()]
    taken = {(r.path, m) for rt in own for r in rt.routes if isinstance(r, APIRoute) for m in r.methods or ()}
    kept = APIRouter()
    for service_router in ROUTERS:
        for r in service_router.routes:
            if isinstance(r, APIRoute) and any((r.path, m) in taken for m in r.methods or ()):
                continue
            kept.routes.append(r)
    return [*own, kept]


def create_relay_app(settings: RelaySettings) -> FastAPI:
    """Build the relay's ASGI app (ConfigError for bad tokens, before anything is opened)."""

    @asynccontextmanager
    async def mirror(app: FastAPI) -> AsyncIterator[None]:
        token = settings.upstream_token.get_secret_value() if settings.upstream_token else None
        upstream = Upstream(
            settings.upstream,
            token,
            timeout=settings.upstream_timeout_s,
            connections=settings.prefetch_concurrency + 12,  # fetches, HEADs, JSON calls and reports
        )
        app.state.mirror = Mirror(app.state.ops, upstream, settings, app.state.relay_metrics)
        app.state.mirror.start()
        try:
            yield
        finally:
            await app.state.mirror.stop()

    app = create_app(settings, routers=relay_routers(), extension=mirror)
    app.title = "weightsync relay"
    app.state.relay_metrics = RelayMetrics(app.state.metrics)
    return app


def app_from_env() -> FastAPI:
    """uvicorn factory: ``uvicorn --factory weightsync.relay.app:app_from_env`` (settings from the environment)."""
    return create_relay_app(RelaySettings())
