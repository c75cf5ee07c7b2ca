"""The ``relay`` command of the ``weightsync`` CLI: a read-only regional mirror of an upstream server.

Like ``serve`` (weightsync/service/cli.py, whose options and start-up checks it shares), nothing
here imports the server's stack until the command runs, so the client-only install can list it.
One worker process: the mirror's follower and its single-flight fetches live in that process.
"""

from __future__ import annotations

from typing import Annotated

import typer

from weightsync.service.cli import (
    CatalogOption,
    DataOption,
    HostOption,
    LogLevelOption,
    PortOption,
    S3EndpointOption,
    StoreOption,
    TokensOption,
    load_settings,
    require_server_extra,
    run_server,
)

__all__ = ["register", "relay"]

APP_FACTORY = "weightsync.relay.app:app_from_env"


def relay(
    upstream: Annotated[
        str,
        typer.Option(
            "--upstream",
            envvar="WEIGHTSYNC_UPSTREAM",
            metavar="URL",
            help="Root URL of the server to mirror (an origin or another relay).",
        ),
    ],
    data: DataOption = None,
    host: HostOption = None,
    port: PortOption = None,
    catalog: CatalogOption = None,
    store: StoreOption = None,
    s3_endpoint: S3EndpointOption = None,
    tokens: TokensOption = None,
    models: Annotated[
        str | None,
        typer.Option(
            "--models",
            metavar="PATTERNS",
            help="Comma-separated model patterns to mirror (*, **, ? as in token patterns) [default: all].",
        ),
    ] = None,
    site: Annotated[
        str | None,
        typer.Option(
            "--site", metavar="NAME", help="This relay's site, for forwarded replica reports [default: host name]."
        ),
    ] = None,
    evict_keep: Annotated[
        int | None,
        typer.Option(
            "--evict-keep",
            metavar="N",
            min=1,
            help="Keep the bytes of each model's newest N versions' chains (and pinned, leased ones); "
            "evict the rest, fetched again on demand [default: keep all].",
        ),
    ] = None,
    log_level: LogLevelOption = None,
) -> None:
    """Run a read-only relay of UPSTREAM: the same read API, each version fetched once (docs/API.md "Relays").

    The upstream token (read scope) comes from WEIGHTSYNC_UPSTREAM_TOKEN; local clients use this
    relay's own --tokens, as with serve.
    """
    require_server_extra()
    from weightsync.relay.settings import RelaySettings

    overrides = {
        "upstream": upstream,
        "data": data,
        "host": host,
        "port": port,
        "catalog": catalog,
        "store": store,
        "s3_endpoint": s3_endpoint,
        "token_file": tokens,
        "models": models,
        "site": site,
        "evict_keep": evict_keep,
        "log_level": log_level,
    }
    run_server(load_settings(overrides, RelaySettings), overrides, APP_FACTORY)


def register(app: typer.Typer) -> None:
    """Add the ``relay`` command to ``app`` (the ``weightsync`` CLI)."""
    app.command(name="relay")(relay)
