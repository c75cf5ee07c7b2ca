"""Request and response bodies (docs/API.md "Shapes"), and the renderers from ops/catalog records.

Field names are the contract the client SDK is written against: change them only with
docs/API.md (a test holds them equal to ``weightsync.client.models``). Response models
are validated from the ops/catalog objects' attributes (``from_attributes``); where a
record's attribute has another name than the wire field, the field says so with a
``validation_alias`` that also accepts the wire name.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from pydantic import AliasChoices, AliasPath, BaseModel, ConfigDict, Field, field_validator

from weightsync.catalog import DeletedModel, Model, RelayInfo, Replica, Version
from weightsync.catalog.schema import ENGINES, REPLICA_MODES, REPLICA_STATUSES
from weightsync.ops import BeginResult, FsckReport, GcReport, Plan

_LABEL = Field(min_length=1, max_length=255)
# The catalog stores integers as signed 64-bit (SQLite INTEGER, PostgreSQL BIGINT): anything larger is a
# malformed request (422), not an OverflowError inside the database driver (500).
INT64 = (1 << 63) - 1
# GC's grace period must keep `now - grace` a representable datetime: 100 years is plenty.
MAX_GRACE_S = 100 * 365.25 * 86400


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Out(BaseModel):
    """A response body, rendered with ``model_validate(record)`` from an ops/catalog object.

    A field whose record attribute has another name lists both in ``AliasChoices``: the wire
    name first (FastAPI re-validates a rendered body), then the record's.
    """

    model_config = ConfigDict(from_attributes=True)


# --- models -------------------------------------------------------------------------


class ModelOut(_Out):
    name: str
    head: int | None
    created_at: datetime
    keyframe_interval: int
    max_chain_ratio: float
    keep_last: int | None
    pinned: int | None = Field(description="The version followers hold instead of the head; null: the head.")


class ModelList(_Out):
    models: list[ModelOut]


class CreateModelIn(_In):
    name: str = Field(max_length=128)
    keyframe_interval: int | None = Field(None, ge=1, le=INT64)
    max_chain_ratio: float | None = Field(None, gt=0, allow_inf_nan=False)
    keep_last: int | None = Field(None, ge=1, le=INT64, description="null: keep every version")


class UpdateModelIn(_In):
    """Only the fields given change; null is refused for the first two (422) and keeps every version for keep_last."""

    keyframe_interval: int | None = Field(None, ge=1, le=INT64)
    max_chain_ratio: float | None = Field(None, gt=0, allow_inf_nan=False)
    keep_last: int | None = Field(None, ge=1, le=INT64, description="null: keep every version")


class PinIn(_In):
    version: int = Field(ge=1, le=INT64, description="A committed version: followers hold it while the head moves on.")


class DeletedModelOut(_Out):
    name: str
    versions_deleted: list[int]
    publishes_aborted: int
    deleted_at: datetime


class InfoOut(_Out):
    id: str = Field(description="The catalog's server id: the same for every service on one catalog, stable.")
    version: str
    formats: list[int] = Field(description="Manifest format versions this server reads (FORMAT §5).")


# --- versions -------------------------------------------------------------------------


class VersionOut(_Out):
    """A committed version (the catalog's CHECK constraint: its sizes, manifest and commit time are set)."""

    model: str
    number: int
    parent: int | None
    kind: str
    chain_base: int | None
    step: int | None
    metadata: dict[str, Any]
    raw_bytes: int
    stored_bytes: int
    manifest: str = Field(validation_alias=AliasChoices("manifest", "manifest_digest"))
    committed_at: datetime


class VersionList(_Out):
    versions: list[VersionOut]


class ObjectRef(_In):
    digest: str = Field(max_length=1024)
    size: int = Field(ge=0, le=INT64)


class PlanObject(_Out):
    digest: str
    size: int


class PlanStepOut(_Out):
    number: int
    kind: str
    manifest: str
    manifest_bytes: int
    stored_bytes: int
    objects: list[PlanObject]

    @field_validator("objects", mode="before")
    @classmethod
    def _objects(cls, value: Any) -> Any:
        # ops.PlanStep holds {digest: size}; the wire lists them, by digest.
        if isinstance(value, dict):
            return [{"digest": d, "size": n} for d, n in sorted(value.items())]
        return value


class PlanOut(_Out):
    # lease_expires_at has a default only for a plan without a lease; the body always carries it.
    model_config = ConfigDict(from_attributes=True, json_schema_serialization_defaults_required=True)

    model: str
    have: int | None
    target: int
    bytes: int
    full_bytes: int
    lease_expires_at: datetime | None = Field(
        None, validation_alias=AliasChoices("lease_expires_at", AliasPath("lease", "expires_at"))
    )
    steps: list[PlanStepOut]


# --- publishing -------------------------------------------------------------------------


class PresignedPut(_Out):
    method: str
    url: str
    headers: dict[str, str]


class PartRef(_In):
    rank: int = Field(ge=0, le=1_000_000, description="This rank, from 0 to world - 1.")
    world: int = Field(ge=1, le=1_000_000, description="How many parts make the version.")


class BeginIn(_In):
    part: PartRef | None = Field(
        None,
        description="Join the multi-part publish of (model, parent, step) as this part (step required): every "
        "rank's begin answers the same pending publish.",
    )
    parent: int | None = Field(
        ge=-INT64, le=INT64, description="The head the publisher holds; null for a model's first version."
    )
    step: int | None = Field(None, ge=0, le=INT64)
    metadata: dict[str, Any] | None = None
    keyframe: bool = False
    objects: list[ObjectRef] | None = Field(
        None,
        max_length=1_000_000,
        description="The objects of an encoding made before beginning (a delta on parent; a keyframe when "
        "keyframe is true): checked as checkObjects would, when the answered kind is that encoding's.",
    )


class PublishIn(_In):
    """publishVersion's JSON part: beginPublish's fields, the version's objects and commitPublish's."""

    parent: int | None = Field(
        ge=-INT64, le=INT64, description="The head the publisher holds; null for a model's first version."
    )
    step: int | None = Field(None, ge=0, le=INT64)
    metadata: dict[str, Any] | None = None
    keyframe: bool = Field(False, description="The objects encode a keyframe (else a delta on parent).")
    objects: list[ObjectRef] = Field(
        min_length=1,
        max_length=1_000_000,
        description="Every object of the version, the manifest among them, in the order the body carries them.",
    )
    manifest: str = Field(max_length=1024, description="Digest of the version's manifest (one of the objects).")
    idempotency_key: str | None = Field(None, min_length=1, max_length=128)
    allow_removals: bool = Field(
        False, description="Commit even if the version drops files or tensors its parent had (else 409)."
    )


class BeginOut(_Out):
    model: str
    publish_id: str
    kind: str
    parent: int | None
    parent_manifest: str | None
    expires_at: datetime | None
    missing: list[str] | None = Field(None, description="Present when the request's objects were checked.")
    formats: list[int] | None = Field(
        None, description="The manifest formats this server reads: encode in one of them (always set)."
    )
    uploads: dict[str, PresignedPut] | None = Field(
        None, description="Present only when objects were checked and the store presigns uploads."
    )


class CheckIn(_In):
    objects: list[ObjectRef] = Field(max_length=1_000_000)


class CheckOut(_Out):
    missing: list[str]
    uploads: dict[str, PresignedPut] | None = Field(
        None, description="Present only when the store presigns uploads: a request per missing digest."
    )


class CommitIn(_In):
    manifest: str = Field(max_length=1024, description="Digest of the uploaded manifest object.")
    idempotency_key: str | None = Field(None, min_length=1, max_length=128)
    allow_removals: bool = Field(
        False, description="Commit even if the version drops files or tensors its parent had (else 409)."
    )


class PartIn(_In):
    world: int = Field(ge=1, le=1_000_000)
    manifest: str = Field(max_length=1024, description="Digest of the uploaded part manifest.")
    allow_removals: bool = Field(False, description="Every part must say the same.")


class PartOut(_Out):
    state: str = Field(description="pending: parts are missing; committed: the version is visible.")
    world: int
    ranks: list[int] = Field(description="The parts recorded (all of them once committed).")
    version: VersionOut | None = Field(None, description="The committed version, once committed.")


# --- objects -------------------------------------------------------------------------


class PutObjectOut(_Out):
    digest: str
    size: int
    created: bool


class PresignedGet(_Out):
    url: str
    expires_at: datetime


# --- ledger -------------------------------------------------------------------------


class ReplicaIn(_In):
    subscriber: str = _LABEL
    version: int | None = Field(
        None, ge=1, le=INT64, description="The version held; omitted or null only when status is unhealthy."
    )
    # Checked by the catalog (InvalidArgument, 422 invalid-argument): one error code for every unknown value.
    status: str = Field(
        "applied",
        description="serving | applied | unhealthy (docs/API.md, Replica).",
        json_schema_extra={"enum": list(REPLICA_STATUSES)},
    )
    mode: str | None = Field(
        None, description="disk | in-place | reload | pull.", json_schema_extra={"enum": [*REPLICA_MODES, None]}
    )
    engine: str | None = Field(None, description="vllm | sglang | torch.", json_schema_extra={"enum": [*ENGINES, None]})
    pause_ms: float | None = Field(None, ge=0, allow_inf_nan=False)
    bytes: int | None = Field(None, ge=0, le=INT64)
    site: str | None = Field(None, min_length=1, max_length=255)
    host: str | None = Field(None, min_length=1, max_length=255)
    extra: dict[str, Any] | None = None


class ReplicaOut(_Out):
    model: str
    subscriber: str
    version: int | None = Field(
        validation_alias=AliasChoices("version", "number"), description="The version held; null while unhealthy."
    )
    applied_at: datetime
    pause_ms: float | None
    bytes: int | None = Field(validation_alias=AliasChoices("bytes", "bytes_received"))
    site: str | None
    host: str | None
    extra: dict[str, Any]
    status: str
    mode: str | None
    engine: str | None
    lag: int | None = Field(description="The head now minus the version held (null while unhealthy).")


class ReplicaList(_Out):
    replicas: list[ReplicaOut]


# --- relays ------------------------------------------------------------------------


class RelayModel(BaseModel):
    """What a relay holds of one model: the newest version mirrored and how long after its commit."""

    model_config = ConfigDict(extra="forbid")
    version: int = Field(ge=1, le=INT64)
    prefetch_lag_s: float | None = Field(None, ge=0, allow_inf_nan=False)


class RelayIn(_In):
    site: str | None = Field(None, min_length=1, max_length=255)
    upstream: str | None = Field(None, min_length=1, max_length=1024, description="The URL the relay follows.")
    degraded: bool = Field(False, description="Its upstream did not answer its last request.")
    models: dict[str, RelayModel] = Field(default_factory=dict, max_length=100_000)


class RelayOut(_Out):
    name: str
    site: str | None
    upstream: str | None
    degraded: bool
    models: dict[str, RelayModel]
    first_seen: datetime
    last_seen: datetime
    age_s: float = Field(description="Seconds since the last heartbeat, at read time.")


class RelayList(_Out):
    relays: list[RelayOut]


# --- admin -------------------------------------------------------------------------


class FsckIn(_In):
    read_data: bool = False
    repair: bool = False


class ProblemOut(_Out):
    code: str
    detail: str
    model: str | None
    number: int | None
    digest: str | None
    repaired: bool


class FsckOut(_Out):
    ok: bool
    versions_checked: int
    objects_checked: int
    bytes_verified: int
    problems: list[ProblemOut]


class GcIn(_In):
    dry_run: bool = False
    grace_s: float | None = Field(None, ge=0, le=MAX_GRACE_S)


class GcOut(_Out):
    versions_deleted: dict[str, list[int]]
    pending_expired: int
    objects_deleted: int
    bytes_deleted: int
    objects_kept_in_grace: int
    leases_purged: int = Field(description="Expired chain leases deleted (0 in a dry run: it changes nothing).")


class ProblemDoc(BaseModel):
    """Every 4xx/5xx body (``application/problem+json``); some add members such as ``current_head``."""

    model_config = ConfigDict(extra="allow")
    type: str
    title: str
    status: int
    detail: str
    request_id: str | None = None


class Health(_Out):
    status: str


class Readiness(_Out):
    catalog: bool
    store: bool


# --- renderers: validation from the records' attributes --------------------------------------


def model_out(m: Model) -> ModelOut:
    return ModelOut.model_validate(m)


def deleted_model_out(d: DeletedModel) -> DeletedModelOut:
    return DeletedModelOut(
        name=d.name,
        versions_deleted=[v.number for v in d.versions if v.number is not None],
        publishes_aborted=len(d.aborted),
        deleted_at=d.deleted_at,
    )


def version_out(v: Version) -> VersionOut:
    assert v.number is not None, "only committed versions are rendered"
    return VersionOut.model_validate(v)


def begin_out(b: BeginResult) -> BeginOut:
    return BeginOut.model_validate(b)


def plan_out(p: Plan) -> PlanOut:
    return PlanOut.model_validate(p)


def replica_out(r: Replica) -> ReplicaOut:
    return ReplicaOut.model_validate(r)


def fsck_out(r: FsckReport) -> FsckOut:
    return FsckOut.model_validate(r)


def gc_out(r: GcReport) -> GcOut:
    return GcOut.model_validate(r)


def relay_out(r: RelayInfo, now: datetime, *, visible: Callable[[str], bool] | None = None) -> RelayOut:
    """A relay's heartbeat as answered: its state's ``models`` (those ``visible`` says the reader may
    read: a token scoped to some models learns nothing of the others), and its age at ``now``."""
    held = r.state.get("models", {})
    return RelayOut(
        name=r.name,
        site=r.site,
        upstream=r.upstream,
        degraded=r.degraded,
        models={k: RelayModel.model_validate(v) for k, v in held.items() if visible is None or visible(k)},
        first_seen=r.first_seen,
        last_seen=r.last_seen,
        age_s=max(0.0, (now - r.last_seen).total_seconds()),
    )
