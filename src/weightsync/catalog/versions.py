"""Committed versions: reading them (head, follow target, lineage, chain), retention, and deleting them.

docs/CATALOG.md "States and transitions". Deleting never breaks a materialization unless
forced: the head, the pinned version, the chains of versions that stay, and leased chains (whole
chains: see the leases module) are kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import bindparam, delete, func, select
from sqlalchemy.orm import Session

from .. import errors
from . import leases, objects
from .records import Lease, Target, Version, VersionTotals
from .rows import (
    VERSION_COLUMNS,
    VERSIONS,
    ModelKey,
    VersionFields,
    chunks,
    committed_fields,
    model_key,
    model_row,
    version_record,
)
from .schema import ModelRow, VersionObjectRow, VersionRow

__all__ = [
    "chain_rows",
    "drop",
    "get",
    "head",
    "lineage",
    "listing",
    "totals",
    "mark_deleted",
    "reading",
    "retention_candidates",
    "target",
]


def drop(s: Session, rows: Sequence[VersionRow], now: datetime) -> None:
    """Mark ``rows`` deleted and release their object references (which starts those objects' grace)."""
    if not rows:
        return
    ids = [r.id for r in rows]
    digests = {r.manifest_digest for r in rows if r.manifest_digest}
    for chunk in chunks(ids):
        digests.update(s.scalars(select(VersionObjectRow.digest).where(VersionObjectRow.version_id.in_(chunk))))
        s.execute(delete(VersionObjectRow).where(VersionObjectRow.version_id.in_(chunk)))
    for r in rows:
        r.state = "deleted"
        r.deleted_at = now
    s.flush()
    objects.mark_unreferenced(s, digests, now)


def get(s: Session, model: str, number: int, include_deleted: bool) -> Version:
    """Committed version ``number`` (deleted too if asked); VersionNotFound."""
    m = model_key(s, model)
    return version_record(committed_fields(s, m, number, include_deleted=include_deleted), m.name)


def listing(
    s: Session,
    model: str,
    states: tuple[str, ...],
    limit: int | None,
    before: int | None,
    after: int | None,
    descending: bool,
) -> list[Version]:
    """Versions in ``states`` by number, pending (unnumbered) last; see Catalog.list_versions."""
    m = model_row(s, model)
    stmt = select(VersionRow).where(VersionRow.model_id == m.id, VersionRow.state.in_(states))
    if before is not None:
        stmt = stmt.where(VersionRow.number < before)
    if after is not None:
        stmt = stmt.where(VersionRow.number > after)
    unnumbered = VersionRow.number.is_(None)
    if descending:
        stmt = stmt.order_by(unnumbered.desc(), VersionRow.number.desc(), VersionRow.id.desc())
    else:
        stmt = stmt.order_by(unnumbered, VersionRow.number, VersionRow.id)
    if limit is not None:
        stmt = stmt.limit(limit)
    return [version_record(r, m.name) for r in s.scalars(stmt)]


def totals(s: Session, model: str) -> VersionTotals:
    """How many committed versions ``model`` has (keyframes among them) and their raw and stored bytes, in one query."""
    m = model_row(s, model)
    count, keyframes, raw, stored = s.execute(
        select(
            func.count(VersionRow.id),
            func.count(VersionRow.id).filter(VersionRow.kind == "keyframe"),
            func.coalesce(func.sum(VersionRow.raw_bytes), 0),
            func.coalesce(func.sum(VersionRow.stored_bytes), 0),
        ).where(VersionRow.model_id == m.id, VersionRow.state == "committed")
    ).one()
    return VersionTotals(
        versions=int(count or 0), keyframes=int(keyframes or 0), raw_bytes=int(raw or 0), stored_bytes=int(stored or 0)
    )


def head(s: Session, model: str) -> Version | None:
    """The model's head version, or None before its first commit."""
    m = model_key(s, model)
    return None if m.head is None else version_record(committed_fields(s, m, m.head), m.name)


def target(s: Session, model: str) -> Target:
    """What followers of ``model`` hold: its pinned version if pinned, else its head (docs/CATALOG.md "Pins")."""
    m = model_key(s, model)
    number = m.head if m.pinned is None else m.pinned
    found = None if number is None else version_record(committed_fields(s, m, number), m.name)
    return Target(found, pinned=m.pinned is not None)


def lineage(s: Session, model: str, number: int) -> list[Version]:
    """The chain from ``number``'s keyframe to it, keyframe first; VersionNotFound if a link is missing."""
    m = model_key(s, model)
    return _lineage(s, m, number)


def reading(
    s: Session, model: str, number: int | None, holder: str | None, now: datetime
) -> tuple[list[Version], Lease | None]:
    """What a reader of ``number`` (None: what followers hold) fetches from, and ``holder``'s lease on it.

    The chain from the keyframe to the version, keyframe first (VersionNotFound if the model has no
    such committed version), and ``holder``'s unexpired lease on that chain (None without a holder).
    """
    m = model_key(s, model)
    if number is None:
        number = m.head if m.pinned is None else m.pinned
        if number is None:
            raise errors.VersionNotFound(f"model {m.name!r} has no committed version")
    chain = _lineage(s, m, number)
    base = chain[0].chain_base
    lease = None if holder is None or base is None else leases.on_chain(s, m, holder, base, now)
    return chain, lease


def _lineage(s: Session, m: ModelKey, number: int) -> list[Version]:
    """:func:`lineage` of a model row, as records."""
    return [version_record(r, m.name) for r in chain_rows(s, m, number)]


_CHAIN = select(*VERSION_COLUMNS).where(
    VERSIONS.c.model_id == bindparam("model_id"),
    VERSIONS.c.state == "committed",
    VERSIONS.c.number.between(bindparam("first"), bindparam("last")),
)


def chain_rows(s: Session, m: ModelKey, number: int) -> list[VersionFields]:
    """The rows of committed ``number``'s chain, keyframe first, in two reads; VersionNotFound if a link is missing.

    Core reads (for records and decisions: the rows are not the ORM's)."""
    top = committed_fields(s, m, number)
    bounds = {"model_id": m.id, "first": top.chain_base, "last": number - 1}
    rows: dict[int | None, VersionFields] = {r.number: r for r in s.connection().execute(_CHAIN, bounds)}
    chain = [top]
    while chain[-1].kind == "delta":
        p = chain[-1].parent
        if p not in rows:
            raise errors.VersionNotFound(
                f"model {m.name!r}: version {chain[-1].number} needs version {p}, which is not committed"
            )
        chain.append(rows[p])
    return chain[::-1]


def retention_candidates(s: Session, model: str) -> list[int]:
    """Committed numbers beyond the model's ``keep_last`` newest, oldest first."""
    m = model_row(s, model)
    if m.keep_last is None:
        return []
    nums = s.scalars(
        select(VersionRow.number)
        .where(VersionRow.model_id == m.id, VersionRow.state == "committed")
        .order_by(VersionRow.number.desc())
        .offset(m.keep_last)
    )
    return sorted(n for n in nums if n is not None)


def _parents(s: Session, m: ModelRow) -> dict[int, tuple[int | None, str, int | None]]:
    """number -> (parent, kind, chain base) of every committed version of ``m``."""
    rows = s.execute(
        select(VersionRow.number, VersionRow.parent, VersionRow.kind, VersionRow.chain_base).where(
            VersionRow.model_id == m.id, VersionRow.state == "committed"
        )
    )
    return {n: (p, k, b) for n, p, k, b in rows if n is not None}


def _chain(parents: dict[int, tuple[int | None, str, int | None]], number: int) -> list[int]:
    """Numbers from ``number`` back to its keyframe (newest first); stops early at a missing link."""
    out = [number]
    while True:
        parent, kind, _ = parents[out[-1]]
        if kind == "keyframe" or parent is None or parent not in parents:
            return out
        out.append(parent)


def mark_deleted(s: Session, model: str, asked: set[int], force: bool, now: datetime) -> list[int]:
    """Delete committed ``asked`` numbers; see Catalog.mark_deleted for what is kept without ``force``."""
    m = model_row(s, model, lock=True)
    rows = {
        r.number: r
        for r in s.scalars(select(VersionRow).where(VersionRow.model_id == m.id, VersionRow.number.in_(sorted(asked))))
        if r.number is not None
    }
    missing = asked - set(rows)
    if missing:
        raise errors.VersionNotFound(f"model {m.name!r} has no versions {sorted(missing)}")
    targets = {n for n, r in rows.items() if r.state == "committed"}
    if not force:
        parents = _parents(s, m)
        roots = set(parents) - targets
        roots.update(n for n in (m.head, m.pinned) if n is not None)
        keep: set[int] = set()
        for root in roots & set(parents):
            keep.update(_chain(parents, root))
        leased = leases.held_chains(s, m, now)  # a lease holds its whole chain (leases module)
        keep.update(n for n, (_, _, base) in parents.items() if base in leased)
        targets -= keep
    drop(s, [rows[n] for n in sorted(targets)], now)
    if m.head in targets:
        m.head = s.scalar(
            select(func.max(VersionRow.number)).where(VersionRow.model_id == m.id, VersionRow.state == "committed")
        )
    if m.pinned in targets:  # forced: followers go back to the head
        m.pinned = None
    return sorted(targets)
