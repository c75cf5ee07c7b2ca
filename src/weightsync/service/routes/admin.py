"""Maintenance: fsck and gc (admin scope)."""

from __future__ import annotations

from datetime import timedelta

from fastapi import APIRouter

from weightsync.ops import fsck as run_fsck
from weightsync.ops import gc as run_gc
from weightsync.service.deps import Admin, OpsDep
from weightsync.service.schemas import FsckIn, FsckOut, GcIn, GcOut, fsck_out, gc_out

router = APIRouter(prefix="/v1/admin", tags=["admin"])


@router.post("/fsck", operation_id="fsck", response_model=FsckOut)
async def fsck(body: FsckIn, ops: OpsDep, who: Admin) -> FsckOut:
    """Check that every committed version can be served; with ``repair``, fix what is safe to fix."""
    return fsck_out(await run_fsck(ops, read_data=body.read_data, repair=body.repair))


@router.post("/gc", operation_id="gc", response_model=GcOut)
async def gc(body: GcIn, ops: OpsDep, who: Admin) -> GcOut:
    """Apply retention, then delete objects unreferenced for longer than the grace period."""
    grace = None if body.grace_s is None else timedelta(seconds=body.grace_s)
    return gc_out(await run_gc(ops, grace=grace, dry_run=body.dry_run))
