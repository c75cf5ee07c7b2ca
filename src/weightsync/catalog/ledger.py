"""The replica ledger: what each subscriber holds (a version, or none while unhealthy), since when, at what cost."""

from __future__ import annotations

from datetime import datetime
from types import SimpleNamespace
from typing import Any

from sqlalchemy import func, insert, select
from sqlalchemy.orm import Session

from .. import errors
from . import leases
from .records import Replica
from .rows import committed_fields, model_key, model_row, replica_record
from .schema import ENGINES, REPLICA_MODES, REPLICA_STATUSES, ReplicaRow

__all__ = ["append", "check_report", "entries"]

_INSERT = insert(ReplicaRow)


def check_report(number: int | None, status: str, mode: str | None, engine: str | None) -> None:
    """Raise InvalidArgument unless the report's health fields are known values and agree with ``number``.

    An "unhealthy" report names no version (the engine holds none verified); every other one names the
    version held. ``mode`` and ``engine`` are None or one of ``REPLICA_MODES`` / ``ENGINES``.
    """
    for name, value, known in (("status", status, REPLICA_STATUSES), ("mode", mode, REPLICA_MODES)):
        if value is not None and value not in known:
            raise errors.InvalidArgument(f"{name} must be one of {', '.join(known)}, not {value!r}")
    if engine is not None and engine not in ENGINES:
        raise errors.InvalidArgument(f"engine must be one of {', '.join(ENGINES)}, not {engine!r}")
    if status == "unhealthy" and number is not None:
        raise errors.InvalidArgument("an unhealthy replica holds no verified version: report it without one")
    if status != "unhealthy" and number is None:
        raise errors.InvalidArgument(f"a replica reported {status} holds a version: report its number")


def append(
    s: Session,
    model: str,
    subscriber: str,
    number: int | None,
    applied_at: datetime,
    fields: dict[str, Any],
    *,
    release_leases: bool = False,
) -> Replica:
    """Append one entry; its version must have been committed (deleted since is fine), else VersionNotFound.

    ``number`` None: an unhealthy entry (``fields`` say so; :func:`check_report` has run), which names no
    version and releases nothing (the subscriber's leases keep the chain it is trying to reach).
    ``fields``: pause_ms, bytes_received, site, host, extra, status, mode, engine (already checked).
    ``release_leases``: the version must be committed still, and the subscriber's leases go as
    :func:`leases.release_applied` says.
    """
    m = model_key(s, model)  # Core reads and an insert: a report comes with every update of every replica
    if number is not None:
        applied = committed_fields(s, m, number, include_deleted=not release_leases)
        if release_leases:
            leases.release_applied(s, m, subscriber, applied)
    values = {"model_id": m.id, "subscriber": subscriber, "number": number, "applied_at": applied_at, **fields}
    s.connection().execute(_INSERT, values)
    return replica_record(SimpleNamespace(**values), m.name, m.head)


def entries(s: Session, model: str, subscriber: str | None, latest_only: bool) -> list[Replica]:
    """Entries of ``model`` (of one ``subscriber``), by subscriber then time; ``latest_only``: each one's newest.

    Each entry's ``lag`` is counted from the head read in the same transaction.
    """
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
    return [replica_record(r, m.name, m.head) for r in s.scalars(stmt)]
