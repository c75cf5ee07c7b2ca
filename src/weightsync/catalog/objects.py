"""The objects aggregate: which objects exist, who references them, and GC's tombstones.

docs/CATALOG.md "Objects and GC". An object row is ``live`` or ``deleting``. GC turns an
unreferenced row ``deleting`` (:func:`begin_deletion`, re-checking in that transaction that no
non-deleted version refers to it), deletes the bytes, then removes the row
(:func:`finish_deletion`). A ``deleting`` row is never referenced: :func:`attach` refuses it,
so a publisher cannot commit a version whose object's deletion is in flight (DESIGN invariant 7).

Lock order: every writer that touches several object rows locks them sorted by digest
(``SELECT … ORDER BY digest FOR UPDATE``) before changing them, so concurrent writers on
PostgreSQL never deadlock; on SQLite ``BEGIN IMMEDIATE`` serializes writers anyway.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import fields, replace
from datetime import datetime, timedelta
from typing import Any, cast

from sqlalchemy import ColumnElement, Row, Table, bindparam, delete, exists, insert, or_, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session

from .. import errors
from .records import ObjectInfo, Pinned
from .rows import OBJECTS, VERSION_OBJECTS, chunks, rowcount
from .schema import GcFenceRow, ObjectRow, VersionObjectRow, VersionRow

__all__ = [
    "FENCE_MARGIN",
    "attach",
    "begin_deletion",
    "finish_deletion",
    "get_many",
    "insert_ignore",
    "lock_rows",
    "mark_unreferenced",
    "record",
    "referenced",
    "referenced_digests",
    "take_over_stale",
    "written_after_fence",
]


def referenced(digest_col: Any) -> ColumnElement[bool]:
    """SQL condition: some non-deleted version refers to ``digest_col`` (as a frame pack or its manifest)."""
    live = VersionRow.state != "deleted"
    by_ref = exists().where(VersionObjectRow.digest == digest_col, VersionObjectRow.version_id == VersionRow.id, live)
    by_manifest = exists().where(VersionRow.manifest_digest == digest_col, live)
    return or_(by_ref, by_manifest)


# Per dialect, built once: one statement run with many parameter sets (executemany), on the table (the
# ORM's bulk-insert path adds its own work to every call).
_INSERT_IGNORE = {
    "postgresql": pg_insert(OBJECTS).on_conflict_do_nothing(index_elements=["digest"]),
    "sqlite": sqlite_insert(OBJECTS).on_conflict_do_nothing(index_elements=["digest"]),
}


def insert_ignore(s: Session, rows: list[dict[str, Any]]) -> None:
    """Insert object ``rows`` (dicts of column values), leaving rows that already exist untouched."""
    if not rows:
        return
    # Compiled once and cached, where a multi-row VALUES list is compiled anew for every row count
    # (most of a commit's CPU time once).
    conn = s.connection()
    stmt = _INSERT_IGNORE["postgresql" if conn.dialect.name == "postgresql" else "sqlite"]
    for chunk in chunks(rows):
        conn.execute(stmt, list(chunk))


# attach's statements, built once (Core, on the tables: attach runs in every beginPublish with objects
# and every checkObjects, and the ORM's per-statement work cost several times the SQL's).
_LOCK = (
    select(OBJECTS.c.digest, OBJECTS.c.size, OBJECTS.c.state)
    .where(OBJECTS.c.digest.in_(bindparam("digests", expanding=True)))
    .order_by(OBJECTS.c.digest)
    .with_for_update()
)
_STOP_GRACE = (
    update(OBJECTS).where(OBJECTS.c.digest.in_(bindparam("digests", expanding=True))).values(unreferenced_since=None)
)
_HELD = select(VERSION_OBJECTS.c.digest).where(VERSION_OBJECTS.c.version_id == bindparam("version_id"))
_REFERENCE = insert(VERSION_OBJECTS)


def lock_rows(s: Session, digests: Sequence[str]) -> list[Row[Any]]:
    """Lock the existing rows of ``digests`` in digest order (see the module's lock order); return their
    ``digest``, ``size`` and ``state``, read under the lock."""
    out: list[Row[Any]] = []
    conn = s.connection()
    for chunk in chunks(sorted(set(digests))):
        out.extend(conn.execute(_LOCK, {"digests": list(chunk)}))
    return out


def attach(s: Session, version_id: int, refs: dict[str, int], now: datetime, *, fresh: bool = False) -> Pinned:
    """Make ``refs`` (digest -> size) referenced by version ``version_id``, recording unknown objects; say what changed.

    A ``deleting`` object is left out (it is in ``deleting`` of the result): its bytes may vanish
    at any moment, so the publisher must upload it again after GC removed the row. Raises
    IncompletePublish if an object is recorded with another size. ``fresh``: the version's row
    was inserted in this transaction, so it references nothing yet (one read fewer).
    """
    if not refs:
        return Pinned(added=(), deleting=())
    conn = s.connection()
    digests = sorted(refs)
    insert_ignore(s, [{"digest": d, "size": refs[d], "first_seen": now, "unreferenced_since": None} for d in digests])
    usable: list[str] = []
    deleting: list[str] = []
    for chunk in chunks(digests):
        live: list[str] = []
        for row in lock_rows(s, chunk):
            if row.size != refs[row.digest]:
                raise errors.IncompletePublish(
                    f"object {row.digest} has {row.size} bytes, the commit says {refs[row.digest]}"
                )
            (deleting if row.state == "deleting" else live).append(row.digest)
        usable.extend(live)
        if live:
            conn.execute(_STOP_GRACE, {"digests": live})
    have = set() if fresh else set(conn.scalars(_HELD, {"version_id": version_id}))
    added = [d for d in usable if d not in have]
    for rows in chunks([{"version_id": version_id, "digest": d, "size": refs[d]} for d in added]):
        conn.execute(_REFERENCE, list(rows))
    return Pinned(added=tuple(added), deleting=tuple(deleting))


def mark_unreferenced(s: Session, digests: Iterable[str], now: datetime) -> None:
    """Start the GC grace clock of those ``digests`` no non-deleted version refers to any more."""
    for chunk in chunks(sorted(set(digests))):
        s.execute(
            update(ObjectRow)
            .where(
                ObjectRow.digest.in_(chunk),
                ObjectRow.state == "live",
                ObjectRow.unreferenced_since.is_(None),
                ~referenced(ObjectRow.digest),
            )
            .values(unreferenced_since=now)
            .execution_options(synchronize_session=False)
        )


# ObjectInfo's fields, by name (ObjectInfo(**row._asdict())).
_OBJECTS_IN = select(*(OBJECTS.c[f.name] for f in fields(ObjectInfo))).where(
    OBJECTS.c.digest.in_(bindparam("digests", expanding=True))
)
_RESTART_GRACE = (
    update(OBJECTS).where(OBJECTS.c.digest == bindparam("v_digest")).values(unreferenced_since=bindparam("v_now"))
)


def record(s: Session, digest: str, size: int, now: datetime) -> ObjectInfo:
    """Record object ``digest`` of ``size`` bytes (idempotent) and return its row as a record.

    A live unreferenced object's grace clock restarts. A ``deleting`` row is returned unchanged:
    the caller must not rely on the bytes (see :func:`attach`). DigestMismatch on another size.
    """
    insert_ignore(s, [{"digest": digest, "size": size, "first_seen": now, "unreferenced_since": now}])
    found = s.connection().execute(_OBJECTS_IN, {"digests": [digest]}).first()
    assert found is not None
    info = ObjectInfo(**found._asdict())
    if info.size != size:
        raise errors.DigestMismatch(f"object {digest} is recorded with {info.size} bytes, not {size}")
    if info.state == "live" and info.unreferenced_since is not None and info.unreferenced_since < now:
        s.connection().execute(_RESTART_GRACE, {"v_digest": digest, "v_now": now})
        info = replace(info, unreferenced_since=now)
    return info


def get_many(s: Session, digests: Sequence[str]) -> dict[str, ObjectInfo]:
    """Return the records of those ``digests`` the catalog knows, by digest."""
    out: dict[str, ObjectInfo] = {}
    conn = s.connection()
    for chunk in chunks(sorted(set(digests))):
        for row in conn.execute(_OBJECTS_IN, {"digests": list(chunk)}):
            out[row.digest] = ObjectInfo(**row._asdict())
    return out


def referenced_digests(s: Session) -> set[str]:
    """Return every digest a non-deleted version (pending included) refers to, manifests included."""
    live = VersionRow.state != "deleted"
    out = set(
        s.scalars(
            select(VersionObjectRow.digest)
            .join(VersionRow, VersionRow.id == VersionObjectRow.version_id)
            .where(live)
            .distinct()
        )
    )
    out.update(s.scalars(select(VersionRow.manifest_digest).where(live, VersionRow.manifest_digest.is_not(None))))
    return out


def begin_deletion(
    s: Session, candidates: Sequence[tuple[str, int, datetime]], unreferenced_before: datetime, now: datetime
) -> list[str]:
    """Turn the eligible ``candidates`` [(digest, size, stored_at)] ``deleting``; return the digests turned.

    Eligible: live, unreferenced by every non-deleted version, and unreferenced since at or
    before ``unreferenced_before``. An object the catalog has no row for gets one first, dated
    ``stored_at`` (when the store says it was written), so that GC deletes no bytes without a
    tombstone a publisher can see. ``deleting_since`` is set to ``now``: the caller's stamp for
    :func:`finish_deletion`.
    """
    if not candidates:
        return []
    insert_ignore(
        s, [{"digest": d, "size": size, "first_seen": now, "unreferenced_since": at} for d, size, at in candidates]
    )
    turned: list[str] = []
    for chunk in chunks(sorted({d for d, _, _ in candidates})):
        lock_rows(s, chunk)
        res = s.execute(
            update(ObjectRow)
            .where(
                ObjectRow.digest.in_(chunk),
                ObjectRow.state == "live",
                ObjectRow.unreferenced_since <= unreferenced_before,
                ~referenced(ObjectRow.digest),
            )
            .values(state="deleting", deleting_since=now)
            .returning(ObjectRow.digest)
            .execution_options(synchronize_session=False)
        )
        turned.extend(res.scalars())
    return sorted(turned)


FENCE_MARGIN = timedelta(minutes=5)
"""How far the clocks of GC and of a publishing server may disagree: a publish trusts the fence only when its
writes began at least this long after it."""


def _raise_fence(s: Session, at: datetime) -> None:
    """Raise GC's fence to ``at`` (never lower it), in the transaction forgetting tombstones whose bytes went."""
    res = s.execute(
        update(GcFenceRow)
        .where(GcFenceRow.id == 1, or_(GcFenceRow.deleted_at.is_(None), GcFenceRow.deleted_at < at))
        .values(deleted_at=at)
        .execution_options(synchronize_session=False)
    )
    if rowcount(res) == 0 and s.get(GcFenceRow, 1) is None:  # the row migration 0007 made is gone: made again
        s.add(GcFenceRow(id=1, deleted_at=at))
        s.flush()


def written_after_fence(s: Session, since: datetime) -> bool:
    """Whether no GC can have deleted bytes written at or after ``since``: GC's fence lies more than
    :data:`FENCE_MARGIN` before it (False when the fence's row is missing: nothing is known).

    Bytes GC deletes are under a tombstone until the transaction that forgets it, which raises the
    fence to its own time, after the delete. So the transaction that references objects written
    since ``since`` and then reads this either meets the tombstone (:func:`attach` leaves a
    ``deleting`` object out), or a fence newer than their writes when GC deleted them, or neither
    when no GC did: a GC that tombstones them later finds them referenced (:func:`begin_deletion`
    locks the rows first).
    """
    row = s.connection().execute(_FENCE).first()
    if row is None:
        return False
    fence = row[0]
    return fence is None or fence < since - FENCE_MARGIN


# Core on the table, built once: read inside every publishVersion's transaction (the ORM's get cost five times the SQL).
_FENCE = select(cast(Table, GcFenceRow.__table__).c.deleted_at).where(GcFenceRow.id == 1)


def take_over_stale(s: Session, before: datetime, now: datetime) -> list[tuple[str, int]]:
    """Re-stamp tombstones left ``deleting`` since at or before ``before`` (a GC died) with ``now``; return them.

    The caller then deletes their bytes and calls :func:`finish_deletion` with ``now``.
    """
    stale = list(
        s.scalars(
            select(ObjectRow.digest)
            .where(ObjectRow.state == "deleting", ObjectRow.deleting_since <= before)
            .order_by(ObjectRow.digest)
            .with_for_update()
        )
    )
    out: list[tuple[str, int]] = []
    for chunk in chunks(stale):
        res = s.execute(
            update(ObjectRow)
            .where(ObjectRow.digest.in_(chunk), ObjectRow.state == "deleting", ObjectRow.deleting_since <= before)
            .values(deleting_since=now)
            .returning(ObjectRow.digest, ObjectRow.size)
            .execution_options(synchronize_session=False)
        )
        out.extend((d, size) for d, size in res)
    return sorted(out)


def finish_deletion(s: Session, digests: Sequence[str], stamp: datetime, now: datetime) -> int:
    """Remove the tombstones of ``digests`` stamped ``stamp`` (their bytes are gone); return how many.

    A tombstone another GC took over (re-stamped) is left to that GC. GC's fence rises to ``now``
    (it deleted bytes before this: :func:`written_after_fence`).
    """
    if digests:
        _raise_fence(s, now)
    n = 0
    for chunk in chunks(sorted(set(digests))):
        res = s.execute(
            delete(ObjectRow)
            .where(ObjectRow.digest.in_(chunk), ObjectRow.state == "deleting", ObjectRow.deleting_since == stamp)
            .execution_options(synchronize_session=False)
        )
        n += rowcount(res)
    return n
