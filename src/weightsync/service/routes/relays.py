"""Relays: each reports itself here every few seconds; operators see every region's relays (docs/API.md "Relays")."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Path

from weightsync.service.deps import OpsDep, Reader
from weightsync.service.schemas import RelayIn, RelayList, RelayOut, relay_out

router = APIRouter(prefix="/v1/relays", tags=["relays"])

RelayName = Annotated[str, Path(min_length=1, max_length=255, pattern=r"^[A-Za-z0-9][A-Za-z0-9._@:-]*$")]


@router.put("/{name}", operation_id="relayHeartbeat", response_model=RelayOut)
async def relay_heartbeat(name: RelayName, body: RelayIn, ops: OpsDep, who: Reader) -> RelayOut:
    """Record relay ``name``'s heartbeat (read scope: the token a relay follows its upstream with)."""
    state = {"models": {k: v.model_dump() for k, v in body.models.items()}}
    info = await ops.record_relay(name, site=body.site, upstream=body.upstream, degraded=body.degraded, state=state)
    return relay_out(info, datetime.now(UTC))


@router.get("", operation_id="listRelays", response_model=RelayList)
async def list_relays(ops: OpsDep, who: Reader) -> RelayList:
    """Every relay that reported here (its relays' reports forwarded too), with the age of its last heartbeat."""
    now = datetime.now(UTC)
    return RelayList(relays=[relay_out(r, now, visible=who.may_use) for r in await ops.list_relays()])
