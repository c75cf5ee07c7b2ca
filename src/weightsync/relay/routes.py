"""The relay's routes: the service's read API, with objects fetched on a miss and writes refused.

A relay serves the service's routes (weightsync/service/routes) over its own catalog and store.
Its own routes, listed here, take the place of the service's with the same path and method
(:func:`weightsync.relay.app.relay_routers`): each calls the service's route function after doing
what a relay adds (fetch a missing object once, forward a replica report), so the answer is the
service's own. Every route that would change a model (publishing, settings, pins, deletion,
object uploads) answers 405 ``read-only`` naming the upstream.
"""

from __future__ import annotations

import json
from typing import Annotated

from fastapi import APIRouter, Header, Query, Request, Response, status
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute

from weightsync import errors
from weightsync.relay.inflight import InFlight
from weightsync.relay.mirror import Mirror
from weightsync.service.deps import MetricsDep, OpsDep, Reader, SettingsDep
from weightsync.service.problems import ApiProblem
from weightsync.service.ranges import RangeNotSatisfiable, parse_range
from weightsync.service.routes import ROUTERS, health, ledger, objects, relays, versions
from weightsync.service.schemas import (
    INT64,
    PlanOut,
    PresignedGet,
    Readiness,
    RelayIn,
    RelayOut,
    ReplicaIn,
    ReplicaOut,
)
from weightsync.store import validate_digest

__all__ = ["READ_ONLY_OPERATIONS", "RelayReadiness", "refusals", "router"]

router = APIRouter(tags=["relay"])

#: The service's operations a relay refuses (405 read-only): everything that changes a model or the store.
READ_ONLY_OPERATIONS = frozenset(
    {
        "createModel",
        "updateModel",
        "deleteModel",
        "pinModel",
        "unpinModel",
        "beginPublish",
        "checkObjects",
        "commitPublish",
        "publishVersion",
        "commitPart",
        "abortPublish",
        "putObject",
    }
)


async def _mirror(request: Request) -> Mirror:
    return request.app.state.mirror


class RelayReadiness(Readiness):
    upstream: bool | None
    degraded: bool


@router.get(
    "/readyz",
    operation_id="ready",
    response_model=RelayReadiness,
    responses={503: {"model": RelayReadiness, "description": "catalog or store unreachable"}},
)
async def ready(request: Request, ops: OpsDep) -> JSONResponse:
    """Readiness: the service's (catalog, store), plus ``upstream`` (null: not asked yet) and ``degraded``.

    An unreachable upstream does not make the relay unready: it serves what it holds.
    """
    mirror = await _mirror(request)
    answer = await health.ready(ops)
    body = json.loads(bytes(answer.body))
    body["upstream"] = mirror.upstream_ok
    body["degraded"] = mirror.degraded
    headers = {k: v for k, v in answer.headers.items() if k.lower() == "retry-after"}
    return JSONResponse(body, status_code=answer.status_code, headers=headers)


@router.get(
    "/v1/objects/{digest}",
    operation_id="getObject",
    responses=objects.GET_OBJECT_RESPONSES,
)
async def get_object(
    digest: str,
    request: Request,
    ops: OpsDep,
    who: Reader,
    range_: Annotated[str | None, Header(alias="range")] = None,
    if_none_match: Annotated[str | None, Header()] = None,
) -> Response:
    """The service's getObject when the object is held here; on a miss, its bytes as the one upstream fetch
    brings them (the last byte once verified), or, for an object too large to stream, once it is held."""
    validate_digest(digest)
    mirror = await _mirror(request)
    inflight = await mirror.open_miss(digest)
    if inflight is None:
        answer = await objects.get_object(digest, ops, who, range_=range_, if_none_match=if_none_match)
    else:
        answer = _streamed(inflight, range_, if_none_match)
    mirror.metrics.served_bytes.inc(int(answer.headers.get("content-length", "0")) if answer.status_code < 300 else 0)
    return answer


def _streamed(inflight: InFlight, range_: str | None, if_none_match: str | None) -> Response:
    """getObject's answer (headers as the service's) for an object still arriving from the upstream."""
    assert inflight.size is not None
    size, etag = inflight.size, f'"{inflight.digest}"'
    headers = {"ETag": etag, "Accept-Ranges": "bytes", "Cache-Control": objects.IMMUTABLE_CACHE}
    if objects.etag_matches(if_none_match, etag):
        return Response(status_code=status.HTTP_304_NOT_MODIFIED, headers=headers)
    offset, length, code = 0, size, status.HTTP_200_OK
    if range_ is not None:
        try:
            offset, length = parse_range(range_, size)
        except RangeNotSatisfiable as exc:
            raise ApiProblem(
                416, "bad-range", "Range not satisfiable", str(exc), headers={"Content-Range": f"bytes */{size}"}
            ) from None
        code = status.HTTP_206_PARTIAL_CONTENT
        headers["Content-Range"] = f"bytes {offset}-{offset + length - 1}/{size}"
    headers["Content-Length"] = str(length)
    return StreamingResponse(
        inflight.read(offset, length), status_code=code, headers=headers, media_type="application/octet-stream"
    )


@router.head("/v1/objects/{digest}", operation_id="headObject", response_class=Response)
async def head_object(digest: str, request: Request, ops: OpsDep, who: Reader) -> Response:
    """The object's size: from the store when held, else from the catalog (no fetch for a HEAD)."""
    validate_digest(digest)
    try:
        return await objects.head_object(digest, ops, who)
    except errors.ObjectNotFound:
        known = (await ops.object_records([digest])).get(digest)
        if known is None or known.state == "deleting":
            raise
    return Response(
        status_code=status.HTTP_200_OK,
        media_type="application/octet-stream",
        headers={"Content-Length": str(known.size), "ETag": f'"{digest}"', "Accept-Ranges": "bytes"},
    )


@router.get("/v1/objects/{digest}/url", operation_id="presignObject", response_model=PresignedGet)
async def presign_object(
    digest: str, request: Request, ops: OpsDep, who: Reader, settings: SettingsDep
) -> PresignedGet:
    """The service's presignObject, after the object is held here (a URL of the relay's own store)."""
    validate_digest(digest)
    await (await _mirror(request)).ensure_held(digest)
    return await objects.presign_object(digest, ops, who, settings)


@router.post(
    "/v1/models/{model:model}/replicas",
    operation_id="reportReplica",
    status_code=status.HTTP_201_CREATED,
    response_model=ReplicaOut,
)
async def report_replica(model: str, body: ReplicaIn, request: Request, ops: OpsDep, who: Reader) -> ReplicaOut:
    """The service's reportReplica here, and the same report queued for the upstream (with this relay's site)."""
    out = await ledger.report_replica(model, body, ops, who)
    (await _mirror(request)).forward_report(model, body.model_dump(exclude_none=True))
    return out


@router.get(
    "/v1/models/{model:model}/plan", operation_id="getPlan", response_model=PlanOut, responses=versions.PLAN_RESPONSES
)
async def get_plan(
    model: str,
    request: Request,
    ops: OpsDep,
    who: Reader,
    have: Annotated[int | None, Query(ge=-INT64, le=INT64)] = None,
    want: Annotated[int | None, Query(ge=-INT64, le=INT64)] = None,
    holder: Annotated[str | None, Query(min_length=1, max_length=255)] = None,
    formats: Annotated[str | None, Query(max_length=64, pattern=r"^[0-9]{1,3}(,[0-9]{1,3})*$")] = None,
    inline: versions.InlineQuery = None,
) -> Response | PlanOut:
    """The service's getPlan; with ``holder``, the target's chain is also leased at the upstream (in the
    background) while the local lease lasts, so the upstream keeps what this relay may have to fetch. With
    ``inline``, the bundle carries only the objects this relay holds already: the reader gets the others
    through getObject, which mirrors them."""
    plan = await versions.read_plan(model, ops, have=have, want=want, holder=holder, formats=formats)
    if holder:
        mirror = await _mirror(request)
        mirror.spawn_logged(mirror.hold_upstream(model, plan.target))
    return await versions.plan_answer(
        ops, plan, inline
    )  # a bundle holds what this relay has; the reader fetches the rest


@router.put("/v1/relays/{name}", operation_id="relayHeartbeat", response_model=RelayOut)
async def relay_heartbeat(
    name: relays.RelayName, body: RelayIn, request: Request, ops: OpsDep, who: Reader
) -> RelayOut:
    """The service's relayHeartbeat here (a relay below this one), and the same heartbeat sent upstream with
    this relay's next one, so the origin lists every relay of the tree."""
    out = await relays.relay_heartbeat(name, body, ops, who)
    (await _mirror(request)).forward_heartbeat(name, body.model_dump(exclude_none=True))
    return out


async def _refuse(request: Request, who: Reader, metrics: MetricsDep) -> None:
    """Refuse a write: this server is a read-only relay (after authentication, so a caller learns the
    upstream only with a valid token)."""
    upstream = (await _mirror(request)).upstream.url
    raise errors.ReadOnly(
        f"this server is a read-only relay of {upstream}: publish and change models there", upstream=upstream
    )


def refusals() -> APIRouter:
    """A route answering 405 read-only for each service operation in :data:`READ_ONLY_OPERATIONS`."""
    refused = APIRouter(tags=["relay"])
    for service_router in ROUTERS:
        for route in service_router.routes:
            if isinstance(route, APIRoute) and route.operation_id in READ_ONLY_OPERATIONS:
                refused.add_api_route(
                    route.path,
                    _refuse,
                    methods=sorted(route.methods or ()),
                    operation_id=route.operation_id,
                    status_code=405,
                    response_class=Response,
                    summary=f"{route.operation_id} (refused: read-only relay)",
                    responses={405: {"description": "read-only relay: the problem names the upstream"}},
                )
    return refused
