"""Request and response bodies (docs/API.md "Shapes"), and the renderers from ops/catalog records.

Field names are the contract the client SDK is written against: change them only with
docs/API.md.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from weightsync.catalog import Model, Replica, Version
from weightsync.ops import BeginResult, FsckReport, GcReport, Plan

_LABEL = Field(min_length=1, max_length=255)
# The catalog stores integers as signed 64-bit (SQLite INTEGER, PostgreSQL BIGINT): anything larger is a
# malformed request (422), not an OverflowError inside the database driver (500).
INT64 = (1 << 63) - 1
# GC's grace period must keep `now - grace` a representable datetime: 100 years is plenty.
MAX_GRACE_S = 100 * 365.25 * 86400


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")


# --- models -------------------------------------------------------------------------


class ModelOut(BaseModel):
    name: str
    head: int | None
    created_at: datetime
    keyframe_interval: int
    max_chain_ratio: float
    keep_last: int | None


class ModelList(BaseModel):
    models: list[ModelOut]


class CreateModelIn(_In):
    name: str = Field(max_length=128)
    keyframe_interval: int | None = Field(None, ge=1, le=INT64)
    max_chain_ratio: float | None = Field(None, gt=0, allow_inf_nan=False)
    keep_last: int | None = Field(None, ge=1, le=INT64, description="null: keep every version")


# --- versions -------------------------------------------------------------------------


class VersionOut(BaseModel):
    model: str
    number: int
    parent: int | None
    kind: str
    chain_base: int | None
    step: int | None
    metadata: dict[str, Any]
    raw_bytes: int | None
    stored_bytes: int | None
    manifest: str | None
    committed_at: datetime | None


class VersionList(BaseModel):
    versions: list[VersionOut]


class ObjectRef(_In):
    digest: str = Field(max_length=1024)
    size: int = Field(ge=0, le=INT64)


class PlanObject(BaseModel):
    digest: str
    size: int


class PlanStepOut(BaseModel):
    number: int
    kind: str
    manifest: str
    manifest_bytes: int
    stored_bytes: int
    objects: list[PlanObject]


class PlanOut(BaseModel):
    model: str
    have: int | None
    target: int
    bytes: int
    full_bytes: int
    lease_expires_at: datetime | None
    steps: list[PlanStepOut]


# --- publishing -------------------------------------------------------------------------


class BeginIn(_In):
    parent: int | None = Field(ge=-INT64, le=INT64,
                               description="The head the publisher holds; null for a model's first version.")
    step: int | None = Field(None, ge=0, le=INT64)
    metadata: dict[str, Any] | None = None
    keyframe: bool = False


class BeginOut(BaseModel):
    model: str
    publish_id: str
    kind: str
    parent: int | None
    parent_manifest: str | None
    expires_at: datetime | None


class CheckIn(_In):
    objects: list[ObjectRef] = Field(max_length=1_000_000)


class PresignedPut(BaseModel):
    method: str
    url: str
    headers: dict[str, str]


class CheckOut(BaseModel):
    missing: list[str]
    uploads: dict[str, PresignedPut] | None = Field(
        None, description="Present only when the store presigns uploads: a request per missing digest.")


class CommitIn(_In):
    manifest: str = Field(max_length=1024, description="Digest of the uploaded manifest object.")
    idempotency_key: str | None = Field(None, min_length=1, max_length=128)


# --- objects -------------------------------------------------------------------------


class PutObjectOut(BaseModel):
    digest: str
    size: int
    created: bool


class PresignedGet(BaseModel):
    url: str
    expires_at: datetime


# --- ledger -------------------------------------------------------------------------


class ReplicaIn(_In):
    subscriber: str = _LABEL
    version: int = Field(ge=1, le=INT64)
    pause_ms: float | None = Field(None, ge=0, allow_inf_nan=False)
    bytes: int | None = Field(None, ge=0, le=INT64)
    site: str | None = Field(None, min_length=1, max_length=255)
    host: str | None = Field(None, min_length=1, max_length=255)
    extra: dict[str, Any] | None = None


class ReplicaOut(BaseModel):
    model: str
    subscriber: str
    version: int
    applied_at: datetime
    pause_ms: float | None
    bytes: int | None
    site: str | None
    host: str | None
    extra: dict[str, Any]


class ReplicaList(BaseModel):
    replicas: list[ReplicaOut]


# --- admin -------------------------------------------------------------------------


class FsckIn(_In):
    read_data: bool = False
    repair: bool = False


class ProblemOut(BaseModel):
    code: str
    detail: str
    model: str | None
    number: int | None
    digest: str | None
    repaired: bool


class FsckOut(BaseModel):
    ok: bool
    versions_checked: int
    objects_checked: int
    bytes_verified: int
    problems: list[ProblemOut]


class GcIn(_In):
    dry_run: bool = False
    grace_s: float | None = Field(None, ge=0, le=MAX_GRACE_S)


class GcOut(BaseModel):
    versions_deleted: dict[str, list[int]]
    pending_expired: int
    objects_deleted: int
    bytes_deleted: int
    objects_kept_in_grace: int


class ProblemDoc(BaseModel):
    """Every 4xx/5xx body (``application/problem+json``); some add members such as ``current_head``."""

    model_config = ConfigDict(extra="allow")
    type: str
    title: str
    status: int
    detail: str
    request_id: str | None = None


class Health(BaseModel):
    status: str


class Readiness(BaseModel):
    catalog: bool
    store: bool


# --- renderers -------------------------------------------------------------------------


def model_out(m: Model) -> ModelOut:
    return ModelOut(name=m.name, head=m.head, created_at=m.created_at, keyframe_interval=m.keyframe_interval,
                    max_chain_ratio=m.max_chain_ratio, keep_last=m.keep_last)


def version_out(v: Version) -> VersionOut:
    assert v.number is not None, "only committed versions are rendered"
    return VersionOut(model=v.model, number=v.number, parent=v.parent, kind=v.kind, chain_base=v.chain_base,
                      step=v.step, metadata=v.metadata, raw_bytes=v.raw_bytes, stored_bytes=v.stored_bytes,
                      manifest=v.manifest_digest, committed_at=v.committed_at)


def begin_out(b: BeginResult) -> BeginOut:
    return BeginOut(model=b.model, publish_id=b.publish_id, kind=b.kind, parent=b.parent,
                    parent_manifest=b.parent_manifest, expires_at=b.expires_at)


def plan_out(p: Plan) -> PlanOut:
    steps = [PlanStepOut(number=s.number, kind=s.kind, manifest=s.manifest, manifest_bytes=s.manifest_bytes,
                         stored_bytes=s.stored_bytes,
                         objects=[PlanObject(digest=d, size=n) for d, n in sorted(s.objects.items())])
             for s in p.steps]
    return PlanOut(model=p.model, have=p.have, target=p.target, bytes=p.bytes, full_bytes=p.full_bytes,
                   lease_expires_at=p.lease.expires_at if p.lease else None, steps=steps)


def replica_out(r: Replica) -> ReplicaOut:
    return ReplicaOut(model=r.model, subscriber=r.subscriber, version=r.number, applied_at=r.applied_at,
                      pause_ms=r.pause_ms, bytes=r.bytes_received, site=r.site, host=r.host, extra=r.extra)


def fsck_out(r: FsckReport) -> FsckOut:
    return FsckOut(ok=r.ok, versions_checked=r.versions_checked, objects_checked=r.objects_checked,
                   bytes_verified=r.bytes_verified,
                   problems=[ProblemOut(code=p.code, detail=p.detail, model=p.model, number=p.number,
                                        digest=p.digest, repaired=p.repaired) for p in r.problems])


def gc_out(r: GcReport) -> GcOut:
    return GcOut(versions_deleted=r.versions_deleted, pending_expired=r.pending_expired,
                 objects_deleted=r.objects_deleted, bytes_deleted=r.bytes_deleted,
                 objects_kept_in_grace=r.objects_kept_in_grace)
