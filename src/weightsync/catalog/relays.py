"""Relays: the heartbeats of those reporting here, and the fetch claims of replicas sharing this catalog
(docs/CATALOG.md "Relays")."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from .records import RelayInfo
from .rows import rowcount
from .schema import FetchClaimRow, RelayRow

__all__ = ["claim", "heartbeat", "listing", "release"]


def _record(row: RelayRow) -> RelayInfo:
    return RelayInfo(row.name, row.site, row.upstream, row.degraded, row.state, row.first_seen, row.last_seen)


def heartbeat(
    s: Session, name: str, site: str | None, upstream: str | None, degraded: bool, state: dict[str, Any], now: datetime
) -> RelayInfo:
    """Replace relay ``name``'s report with this one (``first_seen`` kept); return it."""
    row = s.get(RelayRow, name, with_for_update=True)
    if row is None:
        row = RelayRow(name=name, first_seen=now)
        s.add(row)
    row.site, row.upstream, row.degraded, row.state, row.last_seen = site, upstream, degraded, state, now
    s.flush()
    return _record(row)


def listing(s: Session) -> list[RelayInfo]:
    """Every relay's latest report, by name."""
    return [_record(r) for r in s.scalars(select(RelayRow).order_by(RelayRow.name))]


def claim(s: Session, digest: str, holder: str, ttl: timedelta, now: datetime) -> bool:
    """Claim the fetch of ``digest`` for ``holder`` until ``now + ttl``: True if it is ``holder``'s now (new,
    its own renewed, or another's expired and taken over), False while another holds it."""
    upsert = pg_insert if s.get_bind().dialect.name == "postgresql" else sqlite_insert
    s.execute(
        upsert(FetchClaimRow)
        .values(digest=digest, holder=holder, expires_at=now + ttl)
        .on_conflict_do_nothing(index_elements=["digest"])
    )
    row = s.get(FetchClaimRow, digest, with_for_update=True, populate_existing=True)
    assert row is not None
    if row.holder != holder and row.expires_at > now:
        return False
    row.holder, row.expires_at = holder, now + ttl
    s.flush()
    return True


def release(s: Session, digest: str, holder: str) -> bool:
    """End ``holder``'s claim on ``digest``; whether it held one."""
    res = s.execute(delete(FetchClaimRow).where(FetchClaimRow.digest == digest, FetchClaimRow.holder == holder))
    return rowcount(res) > 0
