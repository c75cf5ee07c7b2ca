"""The models aggregate: a named stream of versions with its chain and retention settings."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from .. import errors
from .checks import DEFAULT_SETTINGS
from .records import Model
from .rows import model_record, model_row
from .schema import ModelRow

__all__ = ["create", "find", "list_all", "update_settings"]


def find(s: Session, name: str, given: dict[str, Any]) -> Model | None:
    """Return model ``name`` or None; Conflict if it exists and a setting in ``given`` differs."""
    row = s.scalars(select(ModelRow).where(ModelRow.name == name)).one_or_none()
    if row is None:
        return None
    differ = {k: v for k, v in given.items() if getattr(row, k) != v}
    if differ:
        raise errors.Conflict(f"model {name!r} exists with other settings ({', '.join(sorted(differ))})")
    return model_record(row)


def create(s: Session, name: str, given: dict[str, Any], now: datetime) -> Model:
    """Create model ``name`` with ``given`` settings over the defaults; an existing one is returned (see find)."""
    found = find(s, name, given)
    if found is not None:
        return found
    row = ModelRow(name=name, created_at=now, head=None, **{**DEFAULT_SETTINGS, **given})
    s.add(row)
    s.flush()
    return model_record(row)


def list_all(s: Session) -> list[Model]:
    """Every model, by name."""
    return [model_record(r) for r in s.scalars(select(ModelRow).order_by(ModelRow.name))]


def update_settings(s: Session, name: str, given: dict[str, Any]) -> Model:
    """Set the ``given`` settings of model ``name`` (others unchanged); ModelNotFound."""
    row = model_row(s, name, lock=True)
    for k, v in given.items():
        setattr(row, k, v)
    s.flush()
    return model_record(row)
