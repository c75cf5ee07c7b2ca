"""The server's identity: what clients key their per-server caches by, and what it speaks."""

from __future__ import annotations

from fastapi import APIRouter

from weightsync.ops.admin import server_info
from weightsync.service.deps import OpsDep, Reader
from weightsync.service.schemas import InfoOut

router = APIRouter(prefix="/v1", tags=["server"])


@router.get("/info", operation_id="getInfo", response_model=InfoOut)
async def get_info(ops: OpsDep, who: Reader) -> InfoOut:
    """The catalog's server id (stable, shared by every service on the catalog), the release, the formats read."""
    return InfoOut.model_validate(await server_info(ops))
