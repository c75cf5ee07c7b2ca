"""Relays that heartbeat to this server: their latest report, one row each (docs/CATALOG.md "Relays")."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from .records import RelayInfo
from .schema import RelayRow

__all__ = ["heartbeat", "listing"]


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
