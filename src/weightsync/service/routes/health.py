"""Liveness, readiness and Prometheus metrics: unauthenticated, for load balancers and scrapers."""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse

from weightsync import errors
from weightsync.service.deps import MetricsDep, OpsDep
from weightsync.service.schemas import Health, Readiness

router = APIRouter(tags=["health"])
log = logging.getLogger("weightsync.service")

PROBE_TIMEOUT_S = 5.0


@router.get("/healthz", operation_id="health", response_model=Health)
async def health() -> Health:
    """Liveness: the process serves requests."""
    return Health(status="ok")


@router.get(
    "/readyz",
    operation_id="ready",
    response_model=Readiness,
    responses={503: {"model": Readiness, "description": "catalog or store unreachable"}},
)
async def ready(ops: OpsDep) -> JSONResponse:
    """Readiness: a catalog query answers and the store is reachable."""

    async def probe(name: str, check) -> bool:
        try:
            await asyncio.wait_for(check(), PROBE_TIMEOUT_S)
            return True
        except (TimeoutError, errors.WeightsyncError, OSError) as exc:
            log.warning("readiness: %s not ready: %s", name, exc or type(exc).__name__)
            return False

    catalog_ok, store_ok = await asyncio.gather(probe("catalog", ops.check_catalog), probe("store", ops.check_store))
    body = Readiness(catalog=catalog_ok, store=store_ok)
    return JSONResponse(
        body.model_dump(),
        status_code=200 if catalog_ok and store_ok else 503,
        headers={} if catalog_ok and store_ok else {"Retry-After": "2"},
    )


@router.get(
    "/metrics",
    operation_id="metrics",
    response_class=Response,
    responses={200: {"content": {"text/plain": {}}, "description": "Prometheus exposition"}},
)
async def metrics(m: MetricsDep) -> Response:
    """Prometheus metrics of this process (of every worker with ``--workers``)."""
    body, content_type = m.render()
    return Response(body, media_type=content_type)
