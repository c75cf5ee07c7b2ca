"""The leases aggregate: a reader's hold on a version's chain, which retention and GC leave alone."""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from .records import Lease
from .rows import committed_row, lease_record, model_row, rowcount
from .schema import LeaseRow, ModelRow

__all__ = ["acquire", "active", "held_numbers", "purge_expired", "release"]


def held_numbers(s: Session, m: ModelRow, now: datetime) -> set[int]:
    """Numbers of ``m``'s versions an unexpired lease holds at ``now``."""
    return set(s.scalars(select(LeaseRow.number).where(LeaseRow.model_id == m.id, LeaseRow.expires_at > now)))


def acquire(s: Session, model: str, number: int, holder: str, ttl: timedelta, now: datetime) -> Lease:
    """Hold committed version ``number``'s chain for ``holder`` until ``now + ttl`` (extends an existing lease)."""
    m = model_row(s, model, lock=True)
    committed_row(s, m, number)
    row = s.scalars(
        select(LeaseRow).where(LeaseRow.model_id == m.id, LeaseRow.number == number, LeaseRow.holder == holder)
    ).one_or_none()
    if row is None:
        row = LeaseRow(model_id=m.id, number=number, holder=holder, acquired_at=now, expires_at=now + ttl)
        s.add(row)
    else:
        if row.expires_at <= now:
            row.acquired_at = now
        row.expires_at = now + ttl
    s.flush()
    return lease_record(row, m.name)


def release(s: Session, model: str, number: int, holder: str) -> bool:
    """Drop ``holder``'s lease on version ``number``; return whether there was one."""
    m = model_row(s, model, lock=True)
    res = s.execute(
        delete(LeaseRow).where(LeaseRow.model_id == m.id, LeaseRow.number == number, LeaseRow.holder == holder)
    )
    return rowcount(res) > 0


def active(s: Session, model: str | None, now: datetime) -> list[Lease]:
    """Leases unexpired at ``now`` (of ``model``, or all), by model, number and holder."""
    stmt = (
        select(LeaseRow, ModelRow.name)
        .join(ModelRow, ModelRow.id == LeaseRow.model_id)
        .where(LeaseRow.expires_at > now)
        .order_by(ModelRow.name, LeaseRow.number, LeaseRow.holder)
    )
    if model is not None:
        stmt = stmt.where(ModelRow.id == model_row(s, model).id)
    return [lease_record(r, name) for r, name in s.execute(stmt)]


def purge_expired(s: Session, now: datetime) -> int:
    """Delete leases expired at ``now`` (they protect nothing any more); return how many."""
    return rowcount(s.execute(delete(LeaseRow).where(LeaseRow.expires_at <= now)))
