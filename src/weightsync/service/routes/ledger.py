"""The replica ledger: subscribers report which version they applied, operators see where the fleet is."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, status

from weightsync.service.deps import OpsDep, Reader
from weightsync.service.schemas import ReplicaIn, ReplicaList, ReplicaOut, replica_out

router = APIRouter(prefix="/v1/models/{model:model}/replicas", tags=["ledger"])


@router.post("", operation_id="reportReplica", status_code=status.HTTP_201_CREATED, response_model=ReplicaOut)
async def report_replica(model: str, body: ReplicaIn, ops: OpsDep, who: Reader) -> ReplicaOut:
    """Record that ``subscriber`` holds ``version``, or, ``status`` unhealthy, none (and release its leases)."""
    return replica_out(
        await ops.record_replica(
            model,
            body.subscriber,
            body.version,
            status=body.status,
            mode=body.mode,
            engine=body.engine,
            pause_ms=body.pause_ms,
            bytes_received=body.bytes,
            site=body.site,
            host=body.host,
            extra=body.extra,
        )
    )


@router.get("", operation_id="listReplicas", response_model=ReplicaList)
async def list_replicas(
    model: str,
    ops: OpsDep,
    who: Reader,
    subscriber: Annotated[str | None, Query(min_length=1, max_length=255)] = None,
    all: Annotated[bool, Query(description="the whole history, not each one's latest")] = False,
) -> ReplicaList:
    """Each subscriber's latest entry (``all=true``: every entry), by subscriber then time; ``lag``: from the head."""
    found = await ops.list_replicas(model, subscriber, latest_only=not all)
    return ReplicaList(replicas=[replica_out(r) for r in found])
