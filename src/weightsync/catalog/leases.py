"""The leases aggregate: a reader's hold on a version's chain, which retention and GC leave alone.

A lease on version N holds N's whole chain (every version with N's chain base): the keyframe and
deltas up to N that a reader fetches now, and the later deltas of that chain it fetches next. So a
follower's lease taken once serves every plan along the chain (``Ops.plan`` renews it only when it
runs low), and the ledger report that says it applied a version keeps it while its chain is the
head's (:func:`release_applied`), where it costs nothing: retention keeps the head's chain anyway.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import and_, bindparam, delete, select
from sqlalchemy.orm import Session

from .records import Lease
from .rows import ModelKey, VersionFields, committed_row, lease_record, model_row, rowcount
from .schema import LeaseRow, ModelRow, VersionRow

__all__ = ["acquire", "active", "held_chains", "on_chain", "purge_expired", "release", "release_applied"]

# A lease row joined to the version it names (any state: a forced deletion keeps the row's chain base).
_LEASED_VERSION = and_(VersionRow.model_id == LeaseRow.model_id, VersionRow.number == LeaseRow.number)


def held_chains(s: Session, m: ModelRow, now: datetime) -> set[int]:
    """Chain bases of ``m``'s chains an unexpired lease holds at ``now``."""
    stmt = (
        select(VersionRow.chain_base)
        .join(LeaseRow, _LEASED_VERSION)
        .where(LeaseRow.model_id == m.id, LeaseRow.expires_at > now, VersionRow.chain_base.is_not(None))
        .distinct()
    )
    return {b for b in s.scalars(stmt) if b is not None}


# on_chain's read, built once and run as Core: every plan a follower asks for (Ops.plan) runs it, and the
# ORM's per-statement work (entity rows, identity map) cost about as much as the rest of the plan's read.
_ON_CHAIN = (
    select(LeaseRow.number, LeaseRow.holder, LeaseRow.acquired_at, LeaseRow.expires_at)
    .join(VersionRow, _LEASED_VERSION)
    .where(
        LeaseRow.model_id == bindparam("model_id"),
        LeaseRow.holder == bindparam("holder"),
        LeaseRow.expires_at > bindparam("now"),
        VersionRow.chain_base == bindparam("chain_base"),
    )
    .order_by(LeaseRow.expires_at.desc())
    .limit(1)
)


def on_chain(s: Session, m: ModelKey, holder: str, chain_base: int, now: datetime) -> Lease | None:
    """``holder``'s unexpired lease on the chain based at ``chain_base`` (the one expiring last), or None."""
    params = {"model_id": m.id, "holder": holder, "now": now, "chain_base": chain_base}
    row = s.connection().execute(_ON_CHAIN, params).first()
    return None if row is None else lease_record(row, m.name)


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


# release_applied's statements, built once and run as Core (a replica report of every update of every
# subscriber runs them; through the ORM Session a bulk delete cost more Python than the report's insert).
_HEAD_BASE = select(VersionRow.chain_base).where(
    VersionRow.model_id == bindparam("model_id"), VersionRow.number == bindparam("number")
)
_RELEASE = delete(LeaseRow).where(LeaseRow.model_id == bindparam("model_id"), LeaseRow.holder == bindparam("holder"))
_RELEASE_OFF_CHAIN = _RELEASE.where(
    LeaseRow.number.not_in(
        select(VersionRow.number).where(
            VersionRow.model_id == bindparam("model_id"), VersionRow.chain_base == bindparam("chain_base")
        )
    )
)


def release_applied(s: Session, m: ModelKey, holder: str, applied: VersionFields) -> int:
    """Drop ``holder``'s leases once it applied ``applied``, but for one on the head's chain when that is ``applied``'s.

    It needs nothing of a chain up to the version it holds. Its lease on that chain is kept while the
    chain is the head's: its next plan fetches the chain's later deltas, and retention keeps the head's
    chain anyway, so the lease holds nothing more until a new keyframe starts another chain (it then
    protects the deltas being fetched). Returns how many leases went.
    """
    conn = s.connection()
    head_base = None if m.head is None else conn.execute(_HEAD_BASE, {"model_id": m.id, "number": m.head}).scalar()
    if head_base is not None and head_base == applied.chain_base:
        params = {"model_id": m.id, "holder": holder, "chain_base": head_base}
        return rowcount(conn.execute(_RELEASE_OFF_CHAIN, params))
    return rowcount(conn.execute(_RELEASE, {"model_id": m.id, "holder": holder}))


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
