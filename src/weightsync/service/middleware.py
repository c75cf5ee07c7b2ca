"""The edge middleware (pure ASGI, so streamed bodies stay streamed): request id, body cap, metrics, access log.

One line of access log per request, with the route *template* (``/v1/objects/{digest}``),
never headers or the query string: nothing a token could hide in is logged.
"""

from __future__ import annotations

import functools
import logging
import re
import time
import uuid
from typing import Any

from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from weightsync.ops import phases
from weightsync.service.logs import request_id_var
from weightsync.service.metrics import Metrics
from weightsync.service.problems import problem_response

__all__ = ["EdgeMiddleware"]

access_log = logging.getLogger("weightsync.access")
log = logging.getLogger("weightsync.service")

_RID_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")


_CONVERTOR = re.compile(r"\{(\w+):\w+\}")


@functools.lru_cache(maxsize=1024)
def _template(path: str) -> str:
    return _CONVERTOR.sub(r"{\1}", path)


def _route_of(scope: Scope) -> str:
    """The matched route's template as clients see it: ``{model:model}`` reads ``{model}``."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    return _template(path) if isinstance(path, str) else "unmatched"


class EdgeMiddleware:
    """Wraps the app: X-Request-ID in/out, the JSON body cap, metrics and the access log."""

    def __init__(self, app: ASGIApp, *, metrics: Metrics, max_json_body: int) -> None:
        self.app = app
        self.metrics = metrics
        self.max_json_body = max_json_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        rid = headers.get("x-request-id", "")
        if not _RID_RE.fullmatch(rid):
            rid = uuid.uuid4().hex
        token = request_id_var.set(rid)
        started = time.perf_counter()
        method = scope["method"]
        # Object uploads are capped by their own route (413 before reading); everything else is JSON.
        capped = not (method == "PUT" and scope["path"].startswith("/v1/objects/"))
        state: dict[str, Any] = {
            "status": None,
            "in": 0,
            "out": 0,
            "started": False,
            "over_cap": False,
            "replacing": False,
        }

        async def receive_counted() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                state["in"] += len(message.get("body", b""))
                if capped and state["in"] > self.max_json_body:
                    # Chunked bodies carry no Content-Length to check up front: stop reading here.
                    state["over_cap"] = True
                    return {"type": "http.disconnect"}
            return message

        async def send_counted(message: Message) -> None:
            if state["over_cap"] and not state["started"] and not state["replacing"]:
                return  # the app's own answer to a body we cut off (a 400): a 413 goes instead
            if message["type"] == "http.response.start":
                state["status"] = message["status"]
                state["started"] = True
                message = dict(message)
                extra = [(b"x-request-id", rid.encode())]
                if timings:  # the phases done by now (a streamed answer's body comes after)
                    extra.append((b"server-timing", phases.header(timings)))
                message["headers"] = [*message.get("headers", []), *extra]
            elif message["type"] == "http.response.body":
                state["out"] += len(message.get("body", b""))
            await send(message)

        async def refuse_too_large() -> None:
            state["replacing"] = True
            response = problem_response(
                413,
                "too-large",
                "Request body too large",
                f"request bodies are limited to {self.max_json_body} bytes",
                headers={"Connection": "close"},
                limit=self.max_json_body,
            )
            await response(scope, receive_counted, send_counted)

        timings, timing = phases.start()
        try:
            declared = headers.get("content-length")
            if capped and declared is not None and declared.isdigit() and int(declared) > self.max_json_body:
                await refuse_too_large()
                return
            await self.app(scope, receive_counted, send_counted)
            if state["over_cap"] and not state["started"]:
                await refuse_too_large()
        except ClientDisconnect:
            if state["over_cap"] and not state["started"]:
                await refuse_too_large()
            else:
                state["status"] = state["status"] or 499  # the client went away mid-request
        except Exception:
            log.exception("unhandled error in %s %s", method, _route_of(scope))
            if not state["started"]:
                response = problem_response(
                    500, "internal", "Internal error", "internal error; see the server log for this request id"
                )
                await response(scope, receive_counted, send_counted)
            else:
                state["status"] = 500
        finally:
            phases.stop(timing)
            self._record(scope, method, state, time.perf_counter() - started)
            request_id_var.reset(token)

    def _record(self, scope: Scope, method: str, state: dict[str, Any], elapsed: float) -> None:
        route = _route_of(scope)
        status = str(state["status"] or 499)
        m = self.metrics
        m.request_done(method, route, status, elapsed, state["in"], state["out"])
        if not access_log.isEnabledFor(logging.INFO):
            return
        client = scope.get("client")
        principal = (scope.get("state") or {}).get("principal")
        # Logger.info less its caller lookup (a walk up the stack, a good part of the line's cost):
        # the JSON line carries no source location. Level, filters and handlers apply as for info().
        access_log.handle(
            access_log.makeRecord(
                access_log.name,
                logging.INFO,
                "(unknown file)",
                0,
                "%s %s %s",
                (method, route, status),
                None,
                extra={
                    "method": method,
                    "route": route,
                    "path": scope.get("path"),
                    "status": int(status),
                    "duration_ms": round(elapsed * 1000, 3),
                    "bytes_in": state["in"],
                    "bytes_out": state["out"],
                    "client": client[0] if client else None,
                    "principal": principal,
                },
            )
        )
