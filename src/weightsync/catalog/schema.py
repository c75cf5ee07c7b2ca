"""The catalog's tables as typed SQLAlchemy 2.0 declarative models (docs/CATALOG.md).

These models are the reference the migrations are reviewed against: a test runs
``alembic upgrade head`` on an empty database and compares the result with this
``metadata`` (``alembic.autogenerate.compare_metadata``), expecting no differences.
Change a table here and in a new migration under ``migrations/versions/`` together.

Only the catalog package imports this module; other layers see plain records
(:mod:`weightsync.catalog.records`), never ORM objects.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    UniqueConstraint,
)
from sqlalchemy import DateTime as _DateTime
from sqlalchemy.dialects import postgresql
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

# Every constraint and index gets a deterministic name, so migrations can drop or alter
# it by name on every backend (SQLite batch mode needs names to recreate tables).
NAMING_CONVENTION: dict[str, str] = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

metadata = MetaData(naming_convention=NAMING_CONVENTION)

#: Allowed values of ``versions.kind`` and ``versions.state``.
KINDS = ("keyframe", "delta")
STATES = ("pending", "committed", "deleted")

#: Allowed values of ``objects.state`` (docs/CATALOG.md "Objects and GC"): ``deleting`` is GC's
#: tombstone, set before the bytes are deleted and never referenced by a non-deleted version.
OBJECT_STATES = ("live", "deleting")

#: Allowed values of ``replicas.status`` (docs/CATALOG.md "Replica ledger"): ``serving``: an engine holds
#: the version, verified, and serves it; ``applied``: a subscriber wrote the version (a pull into a
#: directory, an in-place apply) and says nothing of what serves it; ``unhealthy``: the engine holds no
#: verified version (a failed switch could not be undone), so the entry has no version.
REPLICA_STATUSES = ("serving", "applied", "unhealthy")

#: Known values of ``replicas.mode``, how the replica came to hold its version: ``disk`` (an engine
#: reloaded it from a checkout directory), ``in-place`` (the changed elements were written into the
#: live tensors), ``reload`` (the tensors were replaced whole from a pulled directory), ``pull`` (a
#: checkout directory was brought to it). Checked by the catalog, not by the database, so a new adapter's
#: mode needs no migration; likewise ``ENGINES``, the known values of ``replicas.engine``.
REPLICA_MODES = ("disk", "in-place", "reload", "pull")
ENGINES = ("vllm", "sglang", "torch")

#: Column type for free-form JSON: JSONB on PostgreSQL (indexable, compact), JSON text elsewhere.
JSONType = JSON().with_variant(postgresql.JSONB(), "postgresql")


class UTCDateTime(TypeDecorator[datetime]):
    """A timestamp that is always timezone-aware UTC in Python.

    PostgreSQL stores ``timestamptz``. SQLite has no time zone support, so values are
    stored as naive UTC text (which then sorts and compares correctly) and given back
    their UTC zone on the way out.
    """

    impl = _DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("catalog timestamps must be timezone-aware")
        value = value.astimezone(UTC)
        if dialect.name == "sqlite":
            return value.replace(tzinfo=None)
        return value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class Base(DeclarativeBase):
    metadata = metadata
    type_annotation_map = {datetime: UTCDateTime(), dict[str, Any]: JSONType}


class ModelRow(Base):
    """A named stream of versions, its head and its chain and retention settings."""

    __tablename__ = "models"
    __table_args__ = (
        CheckConstraint("keyframe_interval >= 1", name="keyframe_interval_positive"),
        CheckConstraint("max_chain_ratio > 0", name="max_chain_ratio_positive"),
        CheckConstraint("keep_last IS NULL OR keep_last >= 1", name="keep_last_positive"),
        # A deleted model follows nothing and has no head.
        CheckConstraint("deleted_at IS NULL OR (pinned IS NULL AND head IS NULL)", name="deleted_is_empty"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    created_at: Mapped[datetime]
    # Number of the committed head version; NULL until the first commit.
    head: Mapped[int | None] = mapped_column(Integer)
    keyframe_interval: Mapped[int] = mapped_column(Integer)
    # Cumulative delta bytes of a chain / its keyframe's bytes; above it, start a new keyframe.
    max_chain_ratio: Mapped[float] = mapped_column(Float)
    # Committed versions to keep; NULL keeps all.
    keep_last: Mapped[int | None] = mapped_column(Integer)
    # The version followers hold instead of the head (docs/CATALOG.md "Pins"); NULL: follow the head.
    pinned: Mapped[int | None] = mapped_column(Integer)
    # Set when the model was deleted: it is invisible, its name free; versions keep their numbers.
    deleted_at: Mapped[datetime | None]


class VersionRow(Base):
    """One version of a model: pending (reserved by a publish), committed, or deleted."""

    __tablename__ = "versions"
    __table_args__ = (
        UniqueConstraint("model_id", "number"),
        UniqueConstraint("model_id", "idempotency_key"),
        CheckConstraint(_in("kind", KINDS), name="kind"),
        CheckConstraint(_in("state", STATES), name="state"),
        # A committed version is complete: number, chain, sizes and manifest are known.
        CheckConstraint(
            "state <> 'committed' OR (number IS NOT NULL AND chain_base IS NOT NULL"
            " AND manifest_digest IS NOT NULL AND raw_bytes IS NOT NULL"
            " AND stored_bytes IS NOT NULL AND committed_at IS NOT NULL)",
            name="committed_complete",
        ),
        CheckConstraint("state <> 'pending' OR expires_at IS NOT NULL", name="pending_expires"),
        CheckConstraint("kind <> 'delta' OR state = 'pending' OR parent IS NOT NULL", name="delta_parent"),
        Index(None, "state", "expires_at"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id"))
    # Assigned at commit (docs/CATALOG.md "Numbers"); NULL while pending.
    number: Mapped[int | None] = mapped_column(Integer)
    parent: Mapped[int | None] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(16))
    chain_base: Mapped[int | None] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16))
    step: Mapped[int | None] = mapped_column(BigInteger)
    # "metadata" is reserved on declarative classes, hence the attribute name.
    metadata_: Mapped[dict[str, Any]] = mapped_column("metadata")
    raw_bytes: Mapped[int | None] = mapped_column(BigInteger)
    stored_bytes: Mapped[int | None] = mapped_column(BigInteger)
    manifest_digest: Mapped[str | None] = mapped_column(String(64), index=True)
    publish_id: Mapped[str] = mapped_column(String(128), unique=True)
    idempotency_key: Mapped[str | None] = mapped_column(String(128))
    created_at: Mapped[datetime]
    committed_at: Mapped[datetime | None]
    expires_at: Mapped[datetime | None]
    deleted_at: Mapped[datetime | None]


class ObjectRow(Base):
    """An object the catalog knows of, with the bookkeeping GC's grace period needs."""

    __tablename__ = "objects"
    __table_args__ = (
        CheckConstraint("size >= 0", name="size_nonnegative"),
        CheckConstraint(_in("state", OBJECT_STATES), name="state"),
        # A tombstone says since when, so a later GC can finish one a crashed GC left behind.
        CheckConstraint("(state = 'deleting') = (deleting_since IS NOT NULL)", name="deleting_since"),
    )

    digest: Mapped[str] = mapped_column(String(64), primary_key=True)
    size: Mapped[int] = mapped_column(BigInteger)
    first_seen: Mapped[datetime]
    # When the object last became unreferenced by every non-deleted version (or was
    # recorded without a reference yet); NULL while some non-deleted version refers to it.
    unreferenced_since: Mapped[datetime | None] = mapped_column(index=True)
    # "deleting" from the moment GC decides to delete the bytes until it has (then the row
    # goes); such a row is never referenced, and never revived in place.
    state: Mapped[str] = mapped_column(String(16), server_default="live")
    deleting_since: Mapped[datetime | None] = mapped_column(index=True)


class VersionObjectRow(Base):
    """A version's reference to an object (a frame pack) it needs."""

    __tablename__ = "version_objects"

    version_id: Mapped[int] = mapped_column(ForeignKey("versions.id"), primary_key=True)
    digest: Mapped[str] = mapped_column(ForeignKey("objects.digest"), primary_key=True, index=True)
    size: Mapped[int] = mapped_column(BigInteger)


class PartRow(Base):
    """One part of a multi-part publish, recorded against its pending version (issue 14)."""

    __tablename__ = "version_parts"
    __table_args__ = (CheckConstraint("rank >= 0 AND rank < world", name="rank_in_world"),)

    version_id: Mapped[int] = mapped_column(ForeignKey("versions.id"), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    world: Mapped[int] = mapped_column(Integer)
    manifest_digest: Mapped[str] = mapped_column(String(64))
    allow_removals: Mapped[bool] = mapped_column(Boolean)
    created_at: Mapped[datetime]


class ReplicaRow(Base):
    """One ledger entry: what a subscriber holds from ``applied_at`` on (a version, or none while unhealthy)."""

    __tablename__ = "replicas"
    __table_args__ = (
        Index(None, "model_id", "subscriber", "applied_at"),
        CheckConstraint(_in("status", REPLICA_STATUSES), name="status"),
        # An unhealthy engine holds no verified version, and every other entry names the one it holds:
        # the ledger never says a replica holds a version it does not.
        CheckConstraint("(number IS NULL) = (status = 'unhealthy')", name="unhealthy_no_version"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id"))
    subscriber: Mapped[str] = mapped_column(String(255))
    # The version held; NULL exactly when ``status`` is "unhealthy".
    number: Mapped[int | None] = mapped_column(Integer)
    applied_at: Mapped[datetime]
    pause_ms: Mapped[float | None] = mapped_column(Float)
    bytes_received: Mapped[int | None] = mapped_column(BigInteger)
    site: Mapped[str | None] = mapped_column(String(255))
    host: Mapped[str | None] = mapped_column(String(255))
    extra: Mapped[dict[str, Any]]
    status: Mapped[str] = mapped_column(String(16), server_default="applied")
    # How the version came (REPLICA_MODES); NULL: not said (an older client, or no switch happened).
    mode: Mapped[str | None] = mapped_column(String(16))
    # The inference engine the subscriber keeps on the version (ENGINES); NULL: none, or not said.
    engine: Mapped[str | None] = mapped_column(String(32))


class LeaseRow(Base):
    """A reader's hold on a version's chain; GC and retention leave held chains alone."""

    __tablename__ = "leases"
    __table_args__ = (UniqueConstraint("model_id", "number", "holder"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id"))
    number: Mapped[int] = mapped_column(Integer)
    holder: Mapped[str] = mapped_column(String(255))
    acquired_at: Mapped[datetime]
    expires_at: Mapped[datetime] = mapped_column(index=True)


class RelayRow(Base):
    """A relay that reported to this server (``weightsync relay``, directly or through relays below it):
    its latest heartbeat. One row per relay name, replaced by each heartbeat."""

    __tablename__ = "relays"

    name: Mapped[str] = mapped_column(String(255), primary_key=True)
    site: Mapped[str | None] = mapped_column(String(255))
    # The relay's own upstream (the URL it follows) and whether it is degraded (its upstream unreachable).
    upstream: Mapped[str | None] = mapped_column(String(1024))
    degraded: Mapped[bool] = mapped_column(Boolean)
    # What it says of itself: per model the version it holds and the prefetch lag of it, and the rest.
    state: Mapped[dict[str, Any]]
    first_seen: Mapped[datetime]
    last_seen: Mapped[datetime] = mapped_column(index=True)


class FetchClaimRow(Base):
    """A relay replica fetching an object from its upstream: the others sharing this catalog wait for it
    (one fetch per object per region). Deleted when the fetch ends; an expired claim may be taken over."""

    __tablename__ = "fetch_claims"

    digest: Mapped[str] = mapped_column(String(64), primary_key=True)
    holder: Mapped[str] = mapped_column(String(255))
    expires_at: Mapped[datetime]


class ServerIdentityRow(Base):
    """The one row naming this catalog: every service on it reports ``server_id`` (``GET /v1/info``)."""

    __tablename__ = "server_identity"
    __table_args__ = (CheckConstraint("id = 1", name="single_row"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    # uuid4 hex, made by the migration that created the table: one per catalog, never changed.
    server_id: Mapped[str] = mapped_column(String(32))
    created_at: Mapped[datetime]


class GcFenceRow(Base):
    """The one row of GC's fence: when GC last forgot tombstones whose bytes it had deleted (DESIGN invariant 7).

    GC deletes bytes only under a tombstone, and the transaction that forgets the tombstones after
    the delete raises ``deleted_at`` to its time. A publish that wrote its objects itself after the
    fence (with a margin for clocks) and references them before reading it knows no GC has deleted
    them: it may reference and commit them in one transaction (publishVersion,
    :func:`weightsync.catalog.objects.written_after_fence`).
    """

    __tablename__ = "gc_fence"
    __table_args__ = (CheckConstraint("id = 1", name="single_row"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    # NULL: no GC has deleted anything on this catalog since migration 0007 made the row.
    deleted_at: Mapped[datetime | None]
