"""Errors as ``application/problem+json`` (RFC 9457), mapped from weightsync.errors (docs/API.md "Errors").

Routes raise the named exceptions of :mod:`weightsync.errors` (or :class:`ApiProblem`
for HTTP-only cases such as a missing Content-Length). A weightsync error's status, code,
title and ``resource`` are its class's attributes (the one error table, in errors.py);
the handlers here only render them. Any other exception, a ``ValueError`` included, is
a server fault: 500 ``internal`` (rendered by the edge middleware), never a client error.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from weightsync import errors
from weightsync.service.auth import AuthDenied
from weightsync.service.logs import request_id_var

__all__ = ["PROBLEM_BASE", "ApiProblem", "install", "problem_response"]

PROBLEM_BASE = errors.PROBLEM_BASE
MEDIA_TYPE = "application/problem+json"
RETRY_AFTER_S = "2"

log = logging.getLogger("weightsync.service")


class ApiProblem(Exception):
    """An HTTP problem raised by a route for a case no weightsync error names (411, 413, 416, …)."""

    def __init__(
        self, status: int, code: str, title: str, detail: str, *, headers: dict[str, str] | None = None, **extra: Any
    ) -> None:
        super().__init__(detail)
        self.status, self.code, self.title, self.detail = status, code, title, detail
        self.headers = headers or {}
        self.extra = extra


def problem_response(
    status: int, code: str, title: str, detail: str, *, headers: dict[str, str] | None = None, **extra: Any
) -> JSONResponse:
    body: dict[str, Any] = {"type": PROBLEM_BASE + code, "title": title, "status": status, "detail": detail}
    body.update(extra)
    rid = request_id_var.get()
    if rid:
        body["request_id"] = rid
    return JSONResponse(body, status_code=status, headers=headers, media_type=MEDIA_TYPE)


def classify(exc: BaseException) -> tuple[int, str, str]:
    """(status, code, title) of an error, from its class's attributes; 500 for anything else."""
    if isinstance(exc, errors.WeightsyncError):
        return exc.status, exc.code, exc.title
    return 500, "internal", "Internal error"


async def _weightsync_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, errors.WeightsyncError)
    status, code, title = classify(exc)
    extra = exc.problem_members()
    if exc.resource is not None:
        # 404s share one problem type; this member says which thing is missing, so clients need
        # not parse the detail text.
        extra["resource"] = exc.resource
    headers: dict[str, str] = {}
    if status == 503:
        headers["Retry-After"] = RETRY_AFTER_S
        log.warning("%s: %s", code, exc)
    if status >= 500 and status != 503:
        log.error("%s %s failed: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
        detail = "internal error; see the server log for this request id"
    else:
        detail = str(exc)
    return problem_response(status, code, title, detail, headers=headers, **extra)


async def _api_problem(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiProblem)
    return problem_response(exc.status, exc.code, exc.title, exc.detail, headers=exc.headers, **exc.extra)


async def _auth_denied(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, AuthDenied)
    if exc.status == 401:
        cls: type[errors.AuthError] = errors.AuthError
        headers = {"WWW-Authenticate": 'Bearer realm="weightsync"'}
    else:
        cls, headers = errors.Forbidden, {}
    return problem_response(cls.status, cls.code, cls.title, exc.detail, headers=headers)


async def _validation(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    problems = []
    for e in exc.errors():
        loc = ".".join(str(p) for p in e.get("loc", ()))
        problems.append({"loc": loc, "msg": e.get("msg", "")})
    detail = "; ".join(f"{p['loc']}: {p['msg']}" for p in problems[:5]) or "malformed request"
    return problem_response(422, "validation", "Invalid request", detail, errors=problems)


async def _http_exception(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    codes = {404: "not-found", 405: "method-not-allowed", 400: "bad-request", 413: "too-large"}
    code = codes.get(exc.status_code, f"http-{exc.status_code}")
    title = code.replace("-", " ").capitalize()
    return problem_response(exc.status_code, code, title, str(exc.detail), headers=dict(exc.headers or {}))


def install(app: FastAPI) -> None:
    """Register the handlers on ``app``."""
    app.add_exception_handler(errors.WeightsyncError, _weightsync_error)
    app.add_exception_handler(ApiProblem, _api_problem)
    app.add_exception_handler(AuthDenied, _auth_denied)
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(StarletteHTTPException, _http_exception)
