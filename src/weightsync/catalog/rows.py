"""Row plumbing every aggregate module shares: driver errors, chunking, row lookups, ORM rows → records.

Only the catalog package uses this module; callers see the frozen records of
:mod:`weightsync.catalog.records`, never ORM rows.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any, Protocol, TypeVar, cast

from sqlalchemy import CursorResult, Result, Table, bindparam, select
from sqlalchemy import exc as sa_exc
from sqlalchemy.orm import Session

from .. import errors
from .checks import validate_model_name
from .records import Lease, Model, ObjectInfo, Replica, Version
from .schema import ModelRow, ObjectRow, VersionObjectRow, VersionRow

__all__ = [
    "CHUNK",
    "MODELS",
    "OBJECTS",
    "VERSION_COLUMNS",
    "VERSION_OBJECTS",
    "VERSIONS",
    "ModelKey",
    "ModelPolicy",
    "VersionFields",
    "chunks",
    "committed_fields",
    "committed_row",
    "db_errors",
    "lease_record",
    "model_record",
    "model_key",
    "model_policy",
    "model_row",
    "object_record",
    "replica_record",
    "rowcount",
    "version_record",
]

#: Rows or IN-list values per statement, well under every driver's parameter limit.
CHUNK = 500

T = TypeVar("T")


def chunks(items: Sequence[T]) -> Iterator[Sequence[T]]:
    """Yield ``items`` in slices of at most :data:`CHUNK`."""
    for i in range(0, len(items), CHUNK):
        yield items[i : i + CHUNK]


def rowcount(result: Result[Any]) -> int:
    """Rows an UPDATE or DELETE without RETURNING matched (0 if the driver does not say)."""
    return cast(CursorResult[Any], result).rowcount or 0


@contextmanager
def db_errors() -> Iterator[None]:
    """Translate driver failures into the catalog's named errors (CatalogUnavailable, CatalogError)."""
    try:
        yield
    except errors.WeightsyncError:
        raise
    except (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.TimeoutError) as exc:
        # Connection refused or lost, pool exhausted, SQLite still locked after busy_timeout.
        detail = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0:1]
        raise errors.CatalogUnavailable(f"catalog database unavailable: {' '.join(detail)}") from exc
    except sa_exc.SQLAlchemyError as exc:
        detail = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0:1]
        raise errors.CatalogError(f"catalog database error: {' '.join(detail)}") from exc


# The hottest reads, built once with bound parameters: building a select() costs more Python than
# running it (every transaction of a publish and every plan reads a model row and a version row).
_MODEL = select(ModelRow).where(ModelRow.name == bindparam("name"), ModelRow.deleted_at.is_(None))
# Serializes writers of one model on PostgreSQL; SQLite ignores it (BEGIN IMMEDIATE).
_MODEL_LOCKED = _MODEL.with_for_update()
_COMMITTED = select(VersionRow).where(
    VersionRow.model_id == bindparam("model_id"),
    VersionRow.number == bindparam("number"),
    VersionRow.state.in_(bindparam("states", expanding=True)),
)


#: The tables, for Core statements: a statement on a table's columns skips the ORM's per-statement work
#: (entity loading, identity map, unit of work), several times the cost of the SQL itself on SQLite.
#: The hot paths (the commit, the reads behind every GET) run those; rows they return carry the ORM
#: rows' attribute names, so the record builders below take either.
MODELS = cast(Table, ModelRow.__table__)
VERSIONS = cast(Table, VersionRow.__table__)
VERSION_OBJECTS = cast(Table, VersionObjectRow.__table__)
OBJECTS = cast(Table, ObjectRow.__table__)
#: A version row's columns, named as VersionRow's attributes (``metadata`` is ``metadata_``).
VERSION_COLUMNS = tuple(c.label("metadata_") if c.name == "metadata" else c for c in VERSIONS.c)

_MODEL_KEY = select(MODELS.c.id, MODELS.c.name, MODELS.c.head, MODELS.c.pinned).where(
    MODELS.c.name == bindparam("name"), MODELS.c.deleted_at.is_(None)
)
_MODEL_KEY_LOCKED = _MODEL_KEY.with_for_update()
_MODEL_POLICY_LOCKED = (
    select(
        MODELS.c.id,
        MODELS.c.name,
        MODELS.c.head,
        MODELS.c.pinned,
        MODELS.c.keyframe_interval,
        MODELS.c.max_chain_ratio,
    )
    .where(MODELS.c.name == bindparam("name"), MODELS.c.deleted_at.is_(None))
    .with_for_update()
)


class ModelKey(Protocol):
    """What a Core read of a model row gives (:func:`model_key`): its id, name, head and pin."""

    @property
    def id(self) -> int: ...
    @property
    def name(self) -> str: ...
    @property
    def head(self) -> int | None: ...
    @property
    def pinned(self) -> int | None: ...


class ModelPolicy(ModelKey, Protocol):
    """:class:`ModelKey` with the chain settings the keyframe policy reads (:func:`model_policy`)."""

    @property
    def keyframe_interval(self) -> int: ...
    @property
    def max_chain_ratio(self) -> float: ...


class VersionFields(Protocol):
    """A version row as an ORM row or a Core row of :data:`VERSION_COLUMNS` (what :func:`version_record` reads)."""

    @property
    def id(self) -> int: ...
    @property
    def model_id(self) -> int: ...
    @property
    def number(self) -> int | None: ...
    @property
    def parent(self) -> int | None: ...
    @property
    def kind(self) -> str: ...
    @property
    def chain_base(self) -> int | None: ...
    @property
    def state(self) -> str: ...
    @property
    def step(self) -> int | None: ...
    @property
    def metadata_(self) -> dict[str, Any] | None: ...
    @property
    def raw_bytes(self) -> int | None: ...
    @property
    def stored_bytes(self) -> int | None: ...
    @property
    def manifest_digest(self) -> str | None: ...
    @property
    def publish_id(self) -> str: ...
    @property
    def idempotency_key(self) -> str | None: ...
    @property
    def created_at(self) -> datetime: ...
    @property
    def committed_at(self) -> datetime | None: ...
    @property
    def expires_at(self) -> datetime | None: ...
    @property
    def deleted_at(self) -> datetime | None: ...


def model_key(s: Session, name: str, *, lock: bool = False) -> ModelKey:
    """:func:`model_row` as a Core read (id, name, head, pinned): for transactions that do not change the model
    through the ORM. ModelNotFound; ``lock`` takes the row lock."""
    validate_model_name(name)
    row = s.connection().execute(_MODEL_KEY_LOCKED if lock else _MODEL_KEY, {"name": name}).first()
    if row is None:
        raise errors.ModelNotFound(f"no model named {name!r}")
    return cast(ModelKey, row)


def model_policy(s: Session, name: str) -> ModelPolicy:
    """:func:`model_key` with the row lock, and the model's chain settings (a publish's begin). ModelNotFound."""
    validate_model_name(name)
    row = s.connection().execute(_MODEL_POLICY_LOCKED, {"name": name}).first()
    if row is None:
        raise errors.ModelNotFound(f"no model named {name!r}")
    return cast(ModelPolicy, row)


def model_row(s: Session, name: str, *, lock: bool = False) -> ModelRow:
    """Return the row of model ``name``; ModelNotFound (a deleted model too). ``lock`` takes its row lock."""
    validate_model_name(name)
    row = s.scalars(_MODEL_LOCKED if lock else _MODEL, {"name": name}).one_or_none()
    if row is None:
        raise errors.ModelNotFound(f"no model named {name!r}")
    return row


def committed_row(s: Session, m: ModelKey, number: int, *, include_deleted: bool = False) -> VersionRow:
    """Return committed version ``number`` of ``m`` (deleted too if asked); VersionNotFound."""
    states = ["committed", "deleted"] if include_deleted else ["committed"]
    row = s.scalars(_COMMITTED, {"model_id": m.id, "number": number, "states": states}).one_or_none()
    if row is None:
        raise errors.VersionNotFound(f"model {m.name!r} has no committed version {number}")
    return row


_COMMITTED_FIELDS = select(*VERSION_COLUMNS).where(
    VERSIONS.c.model_id == bindparam("model_id"),
    VERSIONS.c.number == bindparam("number"),
    VERSIONS.c.state.in_(bindparam("states", expanding=True)),
)


def committed_fields(s: Session, m: ModelKey, number: int, *, include_deleted: bool = False) -> VersionFields:
    """:func:`committed_row` as a Core read, for records only (the row is not the ORM's); VersionNotFound."""
    states = ["committed", "deleted"] if include_deleted else ["committed"]
    row = s.connection().execute(_COMMITTED_FIELDS, {"model_id": m.id, "number": number, "states": states}).first()
    if row is None:
        raise errors.VersionNotFound(f"model {m.name!r} has no committed version {number}")
    return cast(VersionFields, row)


def model_record(row: ModelRow) -> Model:
    """The frozen record of a model row."""
    return Model(
        name=row.name,
        created_at=row.created_at,
        head=row.head,
        keyframe_interval=row.keyframe_interval,
        max_chain_ratio=row.max_chain_ratio,
        keep_last=row.keep_last,
        pinned=row.pinned,
    )


def version_record(row: VersionFields, model: str) -> Version:
    """The frozen record of a version row of ``model``."""
    return Version(
        model=model,
        number=row.number,
        parent=row.parent,
        kind=row.kind,
        chain_base=row.chain_base,
        state=row.state,
        step=row.step,
        metadata=dict(row.metadata_ or {}),
        raw_bytes=row.raw_bytes,
        stored_bytes=row.stored_bytes,
        manifest_digest=row.manifest_digest,
        publish_id=row.publish_id,
        idempotency_key=row.idempotency_key,
        created_at=row.created_at,
        committed_at=row.committed_at,
        expires_at=row.expires_at,
        deleted_at=row.deleted_at,
    )


def object_record(row: ObjectRow) -> ObjectInfo:
    """The frozen record of an object row."""
    return ObjectInfo(
        digest=row.digest,
        size=row.size,
        first_seen=row.first_seen,
        unreferenced_since=row.unreferenced_since,
        state=row.state,
        deleting_since=row.deleting_since,
    )


def lease_record(row: Any, model: str) -> Lease:
    """The frozen record of a lease row of ``model`` (an ORM row, or a Core row of its columns)."""
    return Lease(model, row.number, row.holder, row.acquired_at, row.expires_at)


def replica_record(row: Any, model: str, head: int | None) -> Replica:
    """The frozen record of a ledger row of ``model`` (an ORM row, or the values a Core insert wrote, as
    attributes), its lag counted from ``head`` (the model's head now)."""
    return Replica(
        model=model,
        subscriber=row.subscriber,
        number=row.number,
        applied_at=row.applied_at,
        pause_ms=row.pause_ms,
        bytes_received=row.bytes_received,
        site=row.site,
        host=row.host,
        extra=dict(row.extra or {}),
        status=row.status,
        mode=row.mode,
        engine=row.engine,
        lag=None if row.number is None or head is None else head - row.number,
    )
