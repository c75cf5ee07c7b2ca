"""Dependencies of the routes, as ``Annotated`` aliases: the Ops, the settings, who is calling."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated

from fastapi import Depends, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from weightsync.ops import Ops
from weightsync.service.auth import Principal, TokenTable
from weightsync.service.metrics import Metrics
from weightsync.service.settings import Settings

__all__ = ["Admin", "MetricsDep", "OpsDep", "Publisher", "Reader", "SettingsDep"]

_bearer = HTTPBearer(auto_error=False, description="A token from the server's token file (docs/DEPLOY.md).")


# Coroutines, not plain functions: FastAPI runs a plain-function dependency in its thread pool,
# a thread hop per dependency per request for what is an attribute read.
async def _ops(request: Request) -> Ops:
    return request.app.state.ops


async def _settings(request: Request) -> Settings:
    return request.app.state.settings


async def _metrics(request: Request) -> Metrics:
    return request.app.state.metrics


def require(scope: str) -> Callable[..., Awaitable[Principal]]:
    """A dependency admitting callers with ``scope`` whose patterns match the path's ``{model}`` (if any)."""

    async def dependency(
        request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Security(_bearer)]
    ) -> Principal:
        table: TokenTable = request.app.state.tokens
        table.check_server_address(request.scope.get("server"))
        principal = table.authenticate(credentials.credentials if credentials else None)
        request.state.principal = principal.name
        principal.require(scope, request.path_params.get("model"))
        return principal

    dependency.__name__ = f"require_{scope}"
    return dependency


OpsDep = Annotated[Ops, Depends(_ops)]
SettingsDep = Annotated[Settings, Depends(_settings)]
MetricsDep = Annotated[Metrics, Depends(_metrics)]
Reader = Annotated[Principal, Depends(require("read"))]
Publisher = Annotated[Principal, Depends(require("publish"))]
Admin = Annotated[Principal, Depends(require("admin"))]
