"""The ``serve`` command (and ``migrate``, for a one-shot migration step), for the ``weightsync`` CLI.

The client-only install imports this module (``weightsync.cli`` calls :func:`register`),
so nothing here imports FastAPI, uvicorn or SQLAlchemy until a command runs.

Start-up order: settings (flags over ``WEIGHTSYNC_*``) → tokens and bind address →
catalog migration → store (bucket created if missing) → uvicorn with the import-string
factory, so ``--workers N`` processes each build the app from the same environment.
Any failure before uvicorn runs is one line on stderr and exit status 1, a missing ``server``
extra included (the client-only install has these commands too); a usage error (a flag
that does not parse) is one line and exit status 2 (weightsync/cliapp.py).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from weightsync.cliapp import new_app

__all__ = ["load_settings", "main", "register", "require_server_extra", "run_server"]

APP_FACTORY = "weightsync.service.app:app_from_env"
#: What a user without the server's dependencies is told to run.
SERVER_EXTRA_INSTALL = "pip install 'weightsync[server]'"


def _fail(message: str) -> NoReturn:
    typer.echo(f"weightsync: error: {message}", err=True)
    raise typer.Exit(1)


def _missing_extra(exc: ModuleNotFoundError) -> NoReturn:
    """Fail with one line naming the extra, unless the missing module is weightsync's own (a bug: re-raise)."""
    if (exc.name or "").partition(".")[0] in ("", "weightsync"):
        raise exc
    _fail(f"the server needs the 'server' extra ({exc.name} is not installed): {SERVER_EXTRA_INSTALL}")


def require_server_extra() -> None:
    """Import the service's stack now, so a client-only install fails with one line, not a traceback."""
    try:
        import uvicorn  # noqa: F401

        import weightsync.catalog.migrate  # noqa: F401 - alembic, SQLAlchemy
        import weightsync.service.app  # noqa: F401 - FastAPI, pydantic-settings, prometheus-client
    except ModuleNotFoundError as exc:
        _missing_extra(exc)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _migrate(settings) -> str:  # -> the schema revision
    from weightsync import errors
    from weightsync.catalog.migrate import head_revision
    from weightsync.service.app import open_catalog, redact_url

    url = redact_url(settings.catalog_url())
    try:
        open_catalog(settings, migrate=True).close()
        return head_revision()
    except errors.SchemaVersionError as exc:
        _fail(f"catalog {url}: {_first_line(exc)}")
    except errors.CatalogUnavailable as exc:
        _fail(f"catalog {url} is unreachable: {_first_line(exc)}")
    except ModuleNotFoundError as exc:  # the PostgreSQL driver loads only for a postgresql:// URL
        _missing_extra(exc)
    except Exception as exc:  # noqa: BLE001 - bad URL, missing driver, permissions: one line, no traceback
        _fail(f"catalog {url}: {_first_line(exc)}")


def _check_store(settings) -> None:
    import asyncio

    from weightsync.service.app import open_service_store, open_store_now

    async def probe() -> None:
        store = open_service_store(settings)
        try:
            await open_store_now(store)
            await store.exists("0" * 64)
        finally:
            await store.close()

    try:
        asyncio.run(probe())
    except ModuleNotFoundError as exc:  # aioboto3 loads only for an s3:// store
        _missing_extra(exc)
    except Exception as exc:  # noqa: BLE001
        _fail(f"store {settings.store_url()}: {_first_line(exc)}")


def _preflight(settings) -> None:
    """Everything that can be wrong with the configuration, checked before the server starts."""
    import logging

    from weightsync.service.auth import TokenTable
    from weightsync.service.settings import ConfigError, is_loopback

    log = logging.getLogger("weightsync.service")
    try:
        tokens = TokenTable.from_settings(settings)
    except ConfigError as exc:
        _fail(str(exc))
    if tokens.anonymous:
        if not is_loopback(settings.host):
            _fail(
                f"refusing to listen on {settings.host} without tokens: configure --tokens FILE or "
                "WEIGHTSYNC_TOKENS (docs/DEPLOY.md), or bind a loopback address"
            )
        log.warning("no tokens configured: anonymous development mode, listening on %s (loopback) only", settings.host)
    revision = _migrate(settings)
    log.info("catalog migrated to revision %s", revision)
    _check_store(settings)


def _export(overrides: dict[str, Any]) -> None:
    """Hand the flags to the worker processes, which read their settings from the environment."""
    for key, value in overrides.items():
        if value is not None:
            os.environ[f"WEIGHTSYNC_{key.upper()}"] = str(value)


# The options `serve` and `relay` (weightsync/relay/cli.py) share, as Annotated aliases.
DataOption = Annotated[
    Path | None,
    typer.Option(
        "--data",
        metavar="DIR",
        help="Data directory for the embedded SQLite catalog and filesystem store [default: ./weightsync-data].",
    ),
]
HostOption = Annotated[str | None, typer.Option(metavar="HOST", help="Address to bind [default: 127.0.0.1].")]
PortOption = Annotated[int | None, typer.Option(metavar="PORT", help="Port to bind [default: 8400].")]
CatalogOption = Annotated[
    str | None,
    typer.Option(metavar="URL", help="Catalog: sqlite:///… or postgresql://… [default: sqlite:///DATA/catalog.db]."),
]
StoreOption = Annotated[
    str | None, typer.Option(metavar="URL", help="Store: a directory or s3://bucket/prefix [default: DATA/store].")
]
S3EndpointOption = Annotated[
    str | None, typer.Option("--s3-endpoint", metavar="URL", help="S3 endpoint URL (MinIO, SeaweedFS, …).")
]
TokensOption = Annotated[
    Path | None,
    typer.Option(
        "--tokens",
        metavar="FILE",
        help="Token file (JSON or TOML); without tokens the server is anonymous and loopback-only.",
    ),
]
LogLevelOption = Annotated[
    str | None,
    typer.Option("--log-level", metavar="LEVEL", help="debug, info, warning or error [default: info]."),
]


def serve(
    data: DataOption = None,
    host: HostOption = None,
    port: PortOption = None,
    catalog: CatalogOption = None,
    store: StoreOption = None,
    s3_endpoint: S3EndpointOption = None,
    workers: Annotated[int | None, typer.Option(metavar="N", help="Worker processes [default: 1].")] = None,
    tokens: TokensOption = None,
    log_level: LogLevelOption = None,
) -> None:
    """Run the HTTP service (settings also from WEIGHTSYNC_* variables; flags win)."""
    require_server_extra()
    overrides = {
        "data": data,
        "host": host,
        "port": port,
        "catalog": catalog,
        "store": store,
        "s3_endpoint": s3_endpoint,
        "workers": workers,
        "token_file": tokens,
        "log_level": log_level,
    }
    run_server(load_settings(overrides), overrides, APP_FACTORY)


def load_settings(overrides: dict[str, Any], settings_class: Any = None):  # -> Settings
    """The settings (``settings_class``, default the service's) from the flags given over ``WEIGHTSYNC_*``.

    A bad value fails with one line naming the setting.
    """
    from pydantic import ValidationError

    from weightsync.service.settings import Settings, describe_validation_error

    cls = settings_class or Settings
    try:
        return cls(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        _fail(describe_validation_error(exc))


def run_server(settings, overrides: dict[str, Any], factory: str) -> None:
    """Check the configuration (tokens, bind address, catalog, store), then run uvicorn on ``factory``.

    ``factory`` is an import string (``module:function``) each worker builds its app with, from
    the environment the flags are exported to.
    """
    import logging.config

    import uvicorn

    from weightsync.service.logs import logging_config

    log_config = logging_config(settings.log_level)
    logging.config.dictConfig(log_config)
    _preflight(settings)
    _export(overrides)
    metrics_dir = None
    if settings.workers > 1 and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        # Workers are separate processes: their metrics meet in files (metrics.py).
        metrics_dir = tempfile.mkdtemp(prefix="weightsync-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    try:
        uvicorn.run(
            factory,
            factory=True,
            host=settings.host,
            port=settings.port,
            workers=settings.workers,
            log_config=log_config,
            access_log=False,
            lifespan="on",
            # uvloop when installed (the server extra has it); HTTP always h11: httptools, which uvicorn would
            # otherwise pick when present, accepts request headers far past h11's limit (tests/reliability).
            loop="auto",
            http="h11",
            server_header=False,
            timeout_graceful_shutdown=settings.shutdown_grace_s,
        )
    finally:
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)


def migrate(
    data: Annotated[
        Path | None, typer.Option("--data", metavar="DIR", help="Data directory (for the default SQLite catalog).")
    ] = None,
    catalog: Annotated[str | None, typer.Option(metavar="URL", help="Catalog URL.")] = None,
) -> None:
    """Bring the catalog database to this release's schema and exit (a deployment's one-shot step)."""
    require_server_extra()
    settings = load_settings({"data": data, "catalog": catalog})
    revision = _migrate(settings)
    typer.echo(f"catalog at schema revision {revision}")


def register(app: typer.Typer) -> None:
    """Add the ``serve`` command to ``app`` (the ``weightsync`` CLI)."""
    app.command(name="serve")(serve)


def main() -> None:
    """``python -m weightsync.service serve|migrate …`` (usage errors in one line, as ``weightsync``'s)."""
    app = new_app("python -m weightsync.service", help="The weightsync HTTP service.")
    register(app)
    app.command(name="migrate")(migrate)
    app()
