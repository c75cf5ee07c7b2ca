"""The models aggregate: a named stream of versions, its settings, its pin, and deleting it.

docs/CATALOG.md "Pins" and "Deleting a model". A deleted model keeps its row (``deleted_at`` set)
and its version rows (state ``deleted``): it is invisible to every lookup, its name is free, and a
model created again under that name revives the row and continues the numbering, so a version
number never names two different versions of one name (commit records, replicas' checkouts).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import delete as sql_delete
from sqlalchemy import select
from sqlalchemy.orm import Session

from .. import errors
from . import versions
from .checks import DEFAULT_SETTINGS
from .records import DeletedModel, Model
from .rows import committed_row, model_record, model_row, version_record
from .schema import LeaseRow, ModelRow, ReplicaRow, VersionRow

__all__ = ["create", "delete", "find", "list_all", "pin", "update_settings"]


def _same(row: ModelRow, given: dict[str, Any]) -> Model:
    """The live model ``row`` as a record; Conflict if a setting in ``given`` differs from its value."""
    differ = {k: v for k, v in given.items() if getattr(row, k) != v}
    if differ:
        raise errors.Conflict(f"model {row.name!r} exists with other settings ({', '.join(sorted(differ))})")
    return model_record(row)


def find(s: Session, name: str, given: dict[str, Any]) -> Model | None:
    """Return live model ``name`` or None; Conflict if it exists and a setting in ``given`` differs."""
    row = s.scalars(select(ModelRow).where(ModelRow.name == name, ModelRow.deleted_at.is_(None))).one_or_none()
    return None if row is None else _same(row, given)


def create(s: Session, name: str, given: dict[str, Any], now: datetime) -> Model:
    """Create model ``name`` with ``given`` settings over the defaults, or revive a deleted one; see find."""
    # Locked: two creations reviving one deleted row must not both reset it.
    row = s.scalars(select(ModelRow).where(ModelRow.name == name).with_for_update()).one_or_none()
    settings = {**DEFAULT_SETTINGS, **given}
    if row is None:
        row = ModelRow(name=name, created_at=now, head=None, **settings)
        s.add(row)
    elif row.deleted_at is None:
        return _same(row, given)
    else:
        row.created_at, row.deleted_at = now, None
        for k, v in settings.items():
            setattr(row, k, v)
    s.flush()
    return model_record(row)


def list_all(s: Session) -> list[Model]:
    """Every live model, by name."""
    stmt = select(ModelRow).where(ModelRow.deleted_at.is_(None)).order_by(ModelRow.name)
    return [model_record(r) for r in s.scalars(stmt)]


def update_settings(s: Session, name: str, given: dict[str, Any]) -> Model:
    """Set the ``given`` settings of model ``name`` (others unchanged); ModelNotFound."""
    row = model_row(s, name, lock=True)
    for k, v in given.items():
        setattr(row, k, v)
    s.flush()
    return model_record(row)


def pin(s: Session, name: str, number: int | None) -> Model:
    """Make followers of ``name`` hold committed version ``number`` (None: the head again); VersionNotFound."""
    row = model_row(s, name, lock=True)
    if number is not None:
        committed_row(s, row, number)
    row.pinned = number
    s.flush()
    return model_record(row)


def delete(s: Session, name: str, now: datetime) -> DeletedModel:
    """Delete model ``name``: every version deleted, pending publishes aborted, leases and ledger gone.

    The versions' objects become unreferenced now (unless other versions refer to them), which
    starts their GC grace period; the version rows stay, numbered. ModelNotFound.
    """
    m = model_row(s, name, lock=True)
    rows = list(
        s.scalars(
            select(VersionRow)
            .where(VersionRow.model_id == m.id, VersionRow.state.in_(("pending", "committed")))
            .order_by(VersionRow.id)
        )
    )
    was_pending = {r.id for r in rows if r.state == "pending"}
    versions.drop(s, rows, now)
    s.execute(sql_delete(LeaseRow).where(LeaseRow.model_id == m.id))
    s.execute(sql_delete(ReplicaRow).where(ReplicaRow.model_id == m.id))
    m.head, m.pinned, m.deleted_at = None, None, now
    s.flush()
    return DeletedModel(
        name=m.name,
        versions=tuple(version_record(r, m.name) for r in rows if r.id not in was_pending),
        aborted=tuple(version_record(r, m.name) for r in rows if r.id in was_pending),
        deleted_at=now,
    )
