"""Dependencies of the routes, as ``Annotated`` aliases: the Ops, the settings, who is calling."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.openapi.models import HTTPBearer as HTTPBearerModel
from fastapi.security.base import SecurityBase

from weightsync.ops import Ops
from weightsync.service.auth import Principal, TokenTable
from weightsync.service.metrics import Metrics
from weightsync.service.settings import Settings

__all__ = ["Admin", "MetricsDep", "OpsDep", "Publisher", "Reader", "Require", "SettingsDep", "bearer_token"]

BEARER_DESCRIPTION = "A token from the server's token file (docs/DEPLOY.md)."


# Coroutines, not plain functions: FastAPI runs a plain-function dependency in its thread pool,
# a thread hop per dependency per request for what is an attribute read.
async def _ops(request: Request) -> Ops:
    return request.app.state.ops


async def _settings(request: Request) -> Settings:
    return request.app.state.settings


async def _metrics(request: Request) -> Metrics:
    return request.app.state.metrics


class Require(SecurityBase):
    """A dependency admitting callers with ``scope`` whose patterns match the path's ``{model}`` (if any).

    It is the bearer scheme itself (a ``SecurityBase``: the OpenAPI document lists the routes under
    the ``HTTPBearer`` scheme), so each request resolves one dependency for who is calling, not a
    scheme and a check on its answer: FastAPI's work per dependency costs more than the check.
    The ``Authorization`` header is read as ``HTTPBearer(auto_error=False)`` reads it.
    """

    def __init__(self, scope: str) -> None:
        self.model = HTTPBearerModel(description=BEARER_DESCRIPTION)
        self.scheme_name = "HTTPBearer"
        self.scope = scope

    async def __call__(self, request: Request) -> Principal:
        table: TokenTable = request.app.state.tokens
        table.check_server_address(request.scope.get("server"))
        principal = table.authenticate(bearer_token(request.headers.get("authorization")))
        request.state.principal = principal.name
        principal.require(self.scope, request.path_params.get("model"))
        return principal


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` value; None when missing or of another scheme."""
    scheme, _, token = (authorization or "").partition(" ")
    token = token.strip()
    if not (scheme and token) or scheme.lower() != "bearer":
        return None
    return token


OpsDep = Annotated[Ops, Depends(_ops)]
SettingsDep = Annotated[Settings, Depends(_settings)]
MetricsDep = Annotated[Metrics, Depends(_metrics)]
Reader = Annotated[Principal, Depends(Require("read"))]
Publisher = Annotated[Principal, Depends(Require("publish"))]
Admin = Annotated[Principal, Depends(Require("admin"))]
