"""The replica ledger: which subscriber applied which version, when, and at what cost."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from . import leases
from .records import Replica
from .rows import committed_row, model_row, replica_record
from .schema import ReplicaRow

__all__ = ["append", "entries"]


def append(
    s: Session,
    model: str,
    subscriber: str,
    number: int,
    applied_at: datetime,
    fields: dict[str, Any],
    *,
    release_leases: bool = False,
) -> Replica:
    """Append one entry; the version must have been committed (deleted since is fine), else VersionNotFound.

    ``fields``: pause_ms, bytes_received, site, host, extra (already checked). ``release_leases``: the
    version must be committed still, and the subscriber's leases go as :func:`leases.release_applied` says.
    """
    m = model_row(s, model)
    applied = committed_row(s, m, number, include_deleted=not release_leases)
    if release_leases:
        leases.release_applied(s, m, subscriber, applied)
    row = ReplicaRow(model_id=m.id, subscriber=subscriber, number=number, applied_at=applied_at, **fields)
    s.add(row)
    s.flush()
    return replica_record(row, m.name)


def entries(s: Session, model: str, subscriber: str | None, latest_only: bool) -> list[Replica]:
    """Entries of ``model`` (of one ``subscriber``), by subscriber then time; ``latest_only``: each one's newest."""
    m = model_row(s, model)
    conds = [ReplicaRow.model_id == m.id]
    if subscriber is not None:
        conds.append(ReplicaRow.subscriber == subscriber)
    if latest_only:
        ranked = (
            select(
                ReplicaRow.id,
                func.row_number()
                .over(partition_by=ReplicaRow.subscriber, order_by=(ReplicaRow.applied_at.desc(), ReplicaRow.id.desc()))
                .label("rn"),
            )
            .where(*conds)
            .subquery()
        )
        conds.append(ReplicaRow.id.in_(select(ranked.c.id).where(ranked.c.rn == 1)))
    stmt = select(ReplicaRow).where(*conds).order_by(ReplicaRow.subscriber, ReplicaRow.applied_at, ReplicaRow.id)
    return [replica_record(r, m.name) for r in s.scalars(stmt)]
