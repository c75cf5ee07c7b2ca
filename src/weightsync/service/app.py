"""The app factory: ``create_app(settings)`` wires Ops (catalog + store), auth, errors, metrics and routes.

The process keeps no state of its own beyond caches of immutable data: the catalog and the
store are the whole truth, so any number of replicas (and workers) can serve behind a
balancer. ``app_from_env`` is the import-string factory uvicorn workers use
(``weightsync.service.app:app_from_env``, settings from ``WEIGHTSYNC_*``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractAsyncContextManager, asynccontextmanager

from fastapi import APIRouter, FastAPI
from fastapi.staticfiles import StaticFiles

from weightsync.catalog import Catalog
from weightsync.ops import Ops
from weightsync.service import problems
from weightsync.service.auth import TokenTable
from weightsync.service.metrics import Metrics
from weightsync.service.middleware import EdgeMiddleware
from weightsync.service.routes import ROUTERS
from weightsync.service.schemas import ProblemDoc
from weightsync.service.settings import Settings
from weightsync.store import ObjectStore, RetryingStore, open_store

__all__ = ["app_from_env", "create_app", "open_catalog", "open_service_store", "redact_url"]

log = logging.getLogger("weightsync.service")

try:
    from importlib.metadata import version as _dist_version

    VERSION = _dist_version("weightsync")
except Exception:  # noqa: BLE001 - running from a source tree without metadata
    VERSION = "0"


def redact_url(url: str) -> str:
    """``url`` without its password, for logs."""
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - not a database URL
        return url


def open_catalog(settings: Settings, *, migrate: bool = True) -> Catalog:
    """Open (and by default migrate) the catalog; SchemaVersionError / CatalogUnavailable on failure."""
    url = settings.catalog_url()
    kwargs = {}
    if not url.startswith("sqlite") or ":memory:" not in url:
        kwargs = {"pool_size": settings.db_pool_size, "max_overflow": settings.db_pool_size}
    return Catalog.open(url, migrate=migrate, **kwargs)


def open_service_store(settings: Settings) -> ObjectStore:
    """The store the settings name, wrapped in retries; unopened (call ``open_store_now``)."""
    url = settings.store_url()
    options: dict = {}
    if settings.is_s3():
        secret = settings.s3_secret_access_key
        options = {
            "endpoint_url": settings.s3_endpoint,
            "region": settings.s3_region,
            "access_key_id": settings.s3_access_key_id,
            "secret_access_key": secret.get_secret_value() if secret else None,
            "create_bucket": True,
            "connect_timeout_s": settings.s3_connect_timeout_s,
            "read_timeout_s": settings.s3_read_timeout_s,
        }
    return RetryingStore(open_store(url, **options))


async def open_store_now(store: ObjectStore) -> None:
    """Connect (S3: create the bucket if missing, probe If-None-Match) so bad settings fail at start.

    ``ObjectStore.open`` (docs/STORE.md): wrappers open their inner store, retried by RetryingStore.
    """
    await store.open()


def create_app(
    settings: Settings | None = None,
    *,
    routers: Sequence[APIRouter] | None = None,
    extension: Callable[[FastAPI], AbstractAsyncContextManager[None]] | None = None,
) -> FastAPI:
    """Build the ASGI app. Bad token configuration raises ConfigError here, before anything is opened.

    ``routers`` replace the service's (``ROUTERS``); ``extension(app)`` is entered once
    ``app.state.ops`` exists and left before it is drained and closed: an edge built on the
    service (the relay, weightsync/relay) adds its routes and its background work that way.
    """
    settings = settings or Settings()
    tokens = TokenTable.from_settings(settings)
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Catalog calls and large hashes run in threads: size the pool for concurrent requests.
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(settings.threads, thread_name_prefix="weightsync")
        )
        catalog = await asyncio.to_thread(open_catalog, settings)
        store = open_service_store(settings)
        ops: Ops | None = None
        try:
            await open_store_now(store)
            ops = app.state.ops = Ops(catalog, store, settings.ops_settings())
            if tokens.anonymous:
                log.warning("no tokens configured: anonymous development mode, answering on loopback only")
            else:
                log.info("bearer tokens configured: %s", ", ".join(tokens.names))
            log.info("serving catalog %s, store %s", redact_url(settings.catalog_url()), settings.store_url())
            if extension is None:
                yield
            else:
                async with extension(app):
                    yield
            await ops.drain()  # commit records written after their commits' answers
        finally:
            if ops is not None:
                await ops.aclose()  # the followers' listening connection, whatever ended the service
            await store.close()
            catalog.close()

    problem_doc = {"model": ProblemDoc, "content": {"application/problem+json": {}}}
    app = FastAPI(
        title="weightsync",
        version=VERSION,
        lifespan=lifespan,
        openapi_url="/openapi.json",
        docs_url=None,
        redoc_url=None,
        description="Storage and replication of model weights (docs/API.md).",
        responses={
            "4XX": {**problem_doc, "description": "problem (docs/API.md, Errors)"},
            "5XX": {**problem_doc, "description": "problem; 503 comes with Retry-After"},
        },
    )
    app.state.settings = settings
    app.state.tokens = tokens
    app.state.metrics = metrics
    problems.install(app)
    for router in ROUTERS if routers is None else routers:
        app.include_router(router)
    # The dashboard's stylesheet and script (docs/UI.md), shipped in the package.
    app.mount("/ui/static", StaticFiles(packages=[("weightsync.service", "static")]), name="ui-static")
    app.add_middleware(EdgeMiddleware, metrics=metrics, max_json_body=settings.max_json_body)
    return app


def app_from_env() -> FastAPI:
    """uvicorn factory: ``uvicorn --factory weightsync.service.app:app_from_env`` (settings from the environment)."""
    return create_app(Settings())
