"""The publishes aggregate: pending → committed (the compare-and-swap commit) or → deleted (abort, expiry).

docs/CATALOG.md "Commit: the compare-and-swap rule" and "Idempotency".
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, TypeVar, cast

from sqlalchemy import and_, bindparam, delete, insert, or_, select, update
from sqlalchemy.orm import Session

from .. import errors
from . import objects, versions
from .records import Pinned, Version
from .rows import (
    MODELS,
    VERSION_COLUMNS,
    VERSION_OBJECTS,
    VERSIONS,
    ModelKey,
    VersionFields,
    chunks,
    committed_fields,
    model_key,
    model_policy,
    model_row,
    version_record,
)
from .schema import ModelRow, ObjectRow, PartRow, VersionRow

__all__ = [
    "abort",
    "begin",
    "commit",
    "expire",
    "list_pending",
    "open_",
    "Opened",
    "pending",
    "pending_row",
    "reference",
    "record_part",
    "Parts",
]

R = TypeVar("R", bound=VersionFields)


def begin(
    s: Session,
    model: str,
    *,
    parent: int | None,
    kind: str,
    publish_id: str,
    step: int | None,
    metadata: dict[str, Any],
    expires: datetime,
    now: datetime,
) -> Version:
    """Open a pending publish (or return the pending one of that id); Conflict if the id is used otherwise."""
    m = model_key(s, model, lock=True)
    version, _, _ = _begin(
        s, m, parent=parent, kind=kind, publish_id=publish_id, step=step, metadata=metadata, expires=expires, now=now
    )
    return version


# The begin's statements, built once (Core, on the tables, as the commit's below: a begin is on every
# publish's path). The publish id's row, unlocked (a begun-again publish is locked by _PUBLISH when its
# objects are referenced), and the pending row's insert.
_PUBLISH_ID = select(*VERSION_COLUMNS).where(VERSIONS.c.publish_id == bindparam("publish_id"))
# The same, locked (see pending_row): the row a commit or a reference works on.
_PUBLISH = _PUBLISH_ID.with_for_update()
_NEW_PUBLISH = (
    insert(VERSIONS)
    .values(
        model_id=bindparam("v_model_id"),
        number=None,
        parent=bindparam("v_parent"),
        kind=bindparam("v_kind"),
        chain_base=None,
        state="pending",
        step=bindparam("v_step"),
        metadata=bindparam("v_metadata"),
        publish_id=bindparam("v_publish_id"),
        created_at=bindparam("v_created_at"),
        expires_at=bindparam("v_expires_at"),
    )
    .returning(VERSIONS.c.id)
)


def _begin(
    s: Session,
    m: ModelKey,
    *,
    parent: int | None,
    kind: str,
    publish_id: str,
    step: int | None,
    metadata: dict[str, Any],
    expires: datetime,
    now: datetime,
    parent_checked: bool = False,
) -> tuple[Version, int, bool]:
    """:func:`begin` on the (locked) model row ``m``: (the new pending publish, its row's id, True), or (the
    pending one of that id, its row's id, False). ``parent_checked``: the caller read ``parent`` as committed
    in this transaction."""
    conn = s.connection()
    prior = cast(VersionFields | None, conn.execute(_PUBLISH_ID, {"publish_id": publish_id}).first())
    if prior is not None:
        if prior.model_id == m.id and prior.state == "pending":
            return version_record(prior, m.name), prior.id, False
        raise errors.Conflict(f"publish id {publish_id!r} is already used")
    if parent is not None and not parent_checked:
        committed_fields(s, m, parent)
    row_id = conn.execute(
        _NEW_PUBLISH,
        {
            "v_model_id": m.id,
            "v_parent": parent,
            "v_kind": kind,
            "v_step": step,
            "v_metadata": metadata,
            "v_publish_id": publish_id,
            "v_created_at": now,
            "v_expires_at": expires,
        },
    ).scalar_one()
    version = Version(
        model=m.name,
        number=None,
        parent=parent,
        kind=kind,
        chain_base=None,
        state="pending",
        step=step,
        metadata=dict(metadata),
        raw_bytes=None,
        stored_bytes=None,
        manifest_digest=None,
        publish_id=publish_id,
        idempotency_key=None,
        created_at=now,
        committed_at=None,
        expires_at=expires,
        deleted_at=None,
    )
    return version, row_id, True


@dataclass(frozen=True)
class Opened:
    """What :func:`open_` did: the pending publish, its parent's manifest, and the objects it now references."""

    version: Version
    parent_manifest: str | None
    pinned: Pinned | None
    """None when no objects were given, or they were for another kind than the one answered."""
    fresh: Pending | None = None
    """The pending row this call inserted, referencing every object given, as :func:`commit` works on it
    (``held``: the references inserted, the manifest's among them; None: it was begun before, nothing was
    referenced, or GC is deleting one of the objects): what a commit in the same transaction need not read
    again."""


@dataclass(frozen=True)
class Pending:
    """The publish a commit works on: the model (its row locked), the publish's record and row id, and its
    references when known ({digest: size}; None: read them)."""

    model: ModelKey
    record: Version
    row_id: int
    held: dict[str, int] | None


def open_(
    s: Session,
    model: str,
    *,
    parent: int | None,
    keyframe: bool,
    publish_id: str,
    step: int | None,
    metadata: dict[str, Any],
    expires: datetime,
    now: datetime,
    refs: dict[str, int] | None = None,
) -> Opened:
    """Begin a publish on ``parent`` in one transaction: the head check, the keyframe policy, the pending
    row, and the references to ``refs`` when they were encoded as the kind answered.

    The model must exist (ModelNotFound) and ``parent`` be its head (StaleParent, carrying it).
    The kind is a keyframe when ``keyframe`` is forced, without a parent, when the parent's chain
    holds ``keyframe_interval`` versions or its deltas add up to more than ``max_chain_ratio`` of
    its keyframe; else a delta. ``refs`` were encoded as a keyframe when ``keyframe`` is set, else
    as a delta on ``parent``: they are referenced (objects.attach) only when that is the kind the
    publish has (a pending publish begun again keeps the kind it was begun with).

    Core statements built once, as the commit's (beginPublish is on every publish's path): the model's
    lock, its chain's two reads, the publish id's read, the insert, and attach's four statements. The
    checks of a multi-part group (``parts-`` ids) keep their ORM reads.
    """
    m = model_policy(s, model)
    if parent != m.head:
        raise errors.StaleParent(f"model {model!r}: parent {parent} is not the head ({m.head})", current_head=m.head)
    if publish_id.startswith(PARTS_PREFIX):
        _no_other_group(s, m, parent, publish_id, now)
    kind, parent_manifest = "keyframe", None
    if parent is not None:
        chain = versions.chain_rows(s, m, parent)
        if publish_id.startswith(PARTS_PREFIX) and step is not None and chain[-1].step == step:
            # A rank that sends a step its group already committed (restarted after its answer was lost)
            # would open a group on top of that version which no other rank joins: it never commits and
            # blocks the model's next step (parent-pending) until it expires.
            raise errors.PartConflict(
                f"model {model!r}: step {step} is already committed as v{parent}: publish the next step"
            )
        parent_manifest = chain[-1].manifest_digest
        keyframe_bytes = chain[0].stored_bytes or 0
        delta_bytes = sum(r.stored_bytes or 0 for r in chain[1:])
        long_chain = len(chain) >= m.keyframe_interval
        heavy = keyframe_bytes > 0 and delta_bytes > m.max_chain_ratio * keyframe_bytes
        kind = "keyframe" if keyframe or long_chain or heavy else "delta"
    version, row_id, made = _begin(
        s,
        m,
        parent=parent,
        kind=kind,
        publish_id=publish_id,
        step=step,
        metadata=metadata,
        expires=expires,
        now=now,
        parent_checked=parent is not None,  # its chain was read above
    )
    pinned = fresh = None
    if refs is not None and version.kind == ("keyframe" if keyframe else "delta") and version.parent == parent:
        # A row made here is the pending publish; one begun again is checked (still pending, unexpired).
        if not made:
            row_id = _pending_fields(s, m, version.publish_id, now).id
        pinned = objects.attach(s, row_id, refs, now, fresh=made)
        if made and not pinned.deleting:  # every object referenced: what a commit may take as held
            fresh = Pending(m, version, row_id, dict(refs))
    return Opened(version, parent_manifest, pinned, fresh)


PARTS_PREFIX = "parts-"
"""The publish id of a multi-part publish starts so: ``parts-`` + a hash of (model, parent, step) (ops.parts_id)."""


def _no_other_group(s: Session, m: ModelKey, parent: int | None, publish_id: str, now: datetime) -> None:
    """ParentPending when another multi-part publish (another step) is pending on ``parent``: its parts
    were sent first, so the version they make is the parent this step must wait for."""
    other = s.scalars(
        select(VersionRow.publish_id).where(
            VersionRow.model_id == m.id,
            VersionRow.state == "pending",
            VersionRow.publish_id.startswith(PARTS_PREFIX),
            VersionRow.publish_id != publish_id,
            VersionRow.expires_at > now,
            VersionRow.parent.is_(None) if parent is None else VersionRow.parent == parent,
        )
    ).first()
    if other is not None:
        raise errors.ParentPending(
            f"model {m.name!r}: the parts of another step ({other}) are pending on v{parent}: retry once it commits"
        )


def pending_row(s: Session, m: ModelRow, publish_id: str, now: datetime, *, lock: bool = True) -> VersionRow:
    """The pending, unexpired publish ``publish_id`` of ``m``; PublishNotFound."""
    stmt = select(VersionRow).where(VersionRow.publish_id == publish_id)
    if lock:
        # expire_pending does not lock the model: on PostgreSQL the row lock (and its
        # re-read of the row once a concurrent sweep commits) keeps a commit from
        # resurrecting a publish being expired, or the sweep from deleting a commit.
        stmt = stmt.with_for_update()
    return _still_pending(s.scalars(stmt).one_or_none(), m, publish_id, now)


def _still_pending(row: R | None, m: ModelKey, publish_id: str, now: datetime) -> R:
    """``row`` if it is the pending, unexpired publish ``publish_id`` of ``m``; PublishNotFound otherwise."""
    if row is None or row.model_id != m.id:
        raise errors.PublishNotFound(f"no publish {publish_id!r} for model {m.name!r}")
    if row.state != "pending":
        raise errors.PublishNotFound(f"publish {publish_id!r} is {row.state}, not pending")
    if row.expires_at is not None and row.expires_at <= now:
        raise errors.PublishNotFound(f"publish {publish_id!r} expired at {row.expires_at.isoformat()}")
    return row


def _pending_fields(s: Session, m: ModelKey, publish_id: str, now: datetime) -> VersionFields:
    """:func:`pending_row` (locked) as a Core read, for the row's fields only; PublishNotFound."""
    found = s.connection().execute(_PUBLISH, {"publish_id": publish_id}).first()
    return _still_pending(cast(VersionFields | None, found), m, publish_id, now)


def pending(s: Session, model: str, publish_id: str, now: datetime) -> Version:
    """The pending publish as a record (no lock)."""
    m = model_row(s, model)
    return version_record(pending_row(s, m, publish_id, now, lock=False), m.name)


def reference(s: Session, model: str, publish_id: str, refs: dict[str, int], now: datetime) -> Pinned:
    """Reference ``refs`` from the pending publish so GC keeps them; ``deleting`` ones are refused (objects.attach)."""
    m = model_key(s, model, lock=True)
    return objects.attach(s, _pending_fields(s, m, publish_id, now).id, refs, now)


# The commit's statements, built once (Core, on the tables: the commit is on every publish's path and
# the ORM's per-statement work cost several times the SQL's). Row locks as in pending_row.
_PUBLISH_OR_KEY = (
    select(*VERSION_COLUMNS)
    .where(
        or_(
            VERSIONS.c.publish_id == bindparam("publish_id"),
            and_(
                VERSIONS.c.model_id == bindparam("model_id"),
                VERSIONS.c.idempotency_key == bindparam("key"),
                VERSIONS.c.committed_at.is_not(None),
            ),
        )
    )
    .with_for_update()
)
# The newest number ever given (deleted versions keep theirs), with its chain base.
_NEWEST = (
    select(VERSIONS.c.number, VERSIONS.c.chain_base)
    .where(VERSIONS.c.model_id == bindparam("model_id"), VERSIONS.c.number.is_not(None))
    .order_by(VERSIONS.c.number.desc())
    .limit(1)
)
# A committed version of the model under an idempotency key (the one transaction's replay check).
_KEYED = select(*VERSION_COLUMNS).where(
    VERSIONS.c.model_id == bindparam("model_id"),
    VERSIONS.c.idempotency_key == bindparam("key"),
    VERSIONS.c.committed_at.is_not(None),
)
_REFERENCES = select(VERSION_OBJECTS.c.digest, VERSION_OBJECTS.c.size).where(
    VERSION_OBJECTS.c.version_id == bindparam("version_id")
)
_UNREFERENCE = delete(VERSION_OBJECTS).where(
    VERSION_OBJECTS.c.version_id == bindparam("version_id"),
    VERSION_OBJECTS.c.digest.in_(bindparam("digests", expanding=True)),
)
_COMMIT_ROW = (
    update(VERSIONS)
    .where(VERSIONS.c.id == bindparam("version_id"))
    .values(
        number=bindparam("v_number"),
        parent=bindparam("v_parent"),
        kind=bindparam("v_kind"),
        chain_base=bindparam("v_chain_base"),
        state="committed",
        manifest_digest=bindparam("v_manifest_digest"),
        raw_bytes=bindparam("v_raw_bytes"),
        stored_bytes=bindparam("v_stored_bytes"),
        idempotency_key=bindparam("v_idempotency_key"),
        committed_at=bindparam("v_committed_at"),
        expires_at=None,
    )
)
_MOVE_HEAD = update(MODELS).where(MODELS.c.id == bindparam("model_id")).values(head=bindparam("v_head"))


def commit(
    s: Session,
    model: str,
    publish_id: str,
    *,
    parent: int | None,
    manifest_digest: str,
    refs: dict[str, int],
    raw_bytes: int,
    stored_bytes: int,
    kind: str,
    chain_base: int | None,
    idempotency_key: str | None,
    now: datetime,
    as_begun: bool = False,
    held_only: bool = False,
    opened: Opened | None = None,
) -> Version | None:
    """The compare-and-swap commit (docs/CATALOG.md "Commit"); see Catalog.commit_version.

    The usual commit (checkObjects referenced every object and the manifest already) runs
    seven statements: the model's lock, the publish's row, the newest number, the publish's
    references, the manifest's reference dropped, the row and the head updated. ``held_only``
    (Catalog.commit_held): None, with nothing changed, when the publish lacks one of those references.
    ``opened``: what :func:`open_` made in this transaction (``Opened.fresh``, the publish
    ``publish_id``): the model, the row and its references are not read again (publishVersion's one
    transaction: four or five statements, the idempotency key's read only with a key).
    """

    got = _pending_to_commit(
        s, model, publish_id, manifest_digest=manifest_digest, idempotency_key=idempotency_key, now=now, opened=opened
    )
    if isinstance(got, Version):
        return got
    conn = s.connection()
    m, record, row_id = got.model, got.record, got.row_id
    if as_begun and parent != record.parent:
        raise errors.Conflict(f"manifest parent {parent} differs from the publish's parent {record.parent}")
    if as_begun and record.kind == "keyframe" and kind == "delta":
        raise errors.Conflict("the chain policy requires a keyframe for this publish")
    if parent != m.head:
        raise errors.StaleParent(
            f"model {m.name!r}: stated parent {parent} is not the head (head is {m.head})", current_head=m.head
        )
    # A delta's parent is the head, which is the newest version unless a forced deletion moved the head back.
    newest = conn.execute(_NEWEST, {"model_id": m.id}).first()
    number = 1 if newest is None else newest.number + 1
    base: int | None
    if kind == "delta":
        assert parent is not None
        base = newest.chain_base if newest is not None and newest.number == parent else None
        if base is None:
            base = committed_fields(s, m, parent).chain_base
        if chain_base is not None and chain_base != base:
            raise errors.InvalidArgument(f"chain_base {chain_base} is not the parent's chain base {base}")
    else:
        if chain_base is not None and chain_base != number:
            raise errors.InvalidArgument(f"a keyframe starts its own chain: chain_base must be None, not {chain_base}")
        base = number

    had = got.held if got.held is not None else {d: n for d, n in conn.execute(_REFERENCES, {"version_id": row_id})}
    # checkObjects referenced every object and the manifest already (the usual commit): a referenced
    # row is never deleting (objects.attach) and its grace clock is stopped, so nothing to lock or change.
    held = manifest_digest in had and all(had.get(d) == n for d, n in refs.items())
    if not held and held_only:
        return None
    if not held:
        # The manifest's row is locked with the others, in the one lock order (objects module).
        locked = objects.lock_rows(s, sorted({*refs, manifest_digest}))
        pinned = objects.attach(s, row_id, refs, now)
        gone = [*pinned.deleting, *(r.digest for r in locked if r.digest == manifest_digest and r.state == "deleting")]
        if gone:
            # GC is deleting these bytes (DESIGN invariant 7): the version would lose them.
            raise errors.IncompletePublish(f"object {gone[0]} is being deleted by GC: upload it again")
    # Pending-time references the final list no longer names go back to GC; the manifest's too: the
    # committed version refers to its manifest by its manifest_digest. A multi-part version keeps its
    # part manifests referenced for as long as it lives: they record what each rank published, and a
    # part retried after the commit is answered from them (CATALOG.md "Multi-part publishes").
    parts: set[str] = set()
    if record.publish_id is not None and record.publish_id.startswith(PARTS_PREFIX):
        parts = set(s.scalars(select(PartRow.manifest_digest).where(PartRow.version_id == row_id)))
    stale = [d for d in had if d not in refs and d not in parts]
    for chunk in chunks(stale):
        conn.execute(_UNREFERENCE, {"version_id": row_id, "digests": list(chunk)})
    conn.execute(_MOVE_HEAD, {"model_id": m.id, "v_head": number})
    conn.execute(
        _COMMIT_ROW,
        {
            "version_id": row_id,
            "v_number": number,
            "v_parent": parent,
            "v_kind": kind,
            "v_chain_base": base,
            "v_manifest_digest": manifest_digest,
            "v_raw_bytes": raw_bytes,
            "v_stored_bytes": stored_bytes,
            "v_idempotency_key": idempotency_key,
            "v_committed_at": now,
        },
    )
    if not held:
        s.execute(update(ObjectRow).where(ObjectRow.digest == manifest_digest).values(unreferenced_since=None))
    objects.mark_unreferenced(s, [d for d in stale if d != manifest_digest], now)
    return replace(
        record,
        number=number,
        parent=parent,
        kind=kind,
        chain_base=base,
        state="committed",
        manifest_digest=manifest_digest,
        raw_bytes=raw_bytes,
        stored_bytes=stored_bytes,
        idempotency_key=idempotency_key,
        committed_at=now,
        expires_at=None,
    )


def _pending_to_commit(
    s: Session,
    model: str,
    publish_id: str,
    *,
    manifest_digest: str,
    idempotency_key: str | None,
    now: datetime,
    opened: Opened | None,
) -> Version | Pending:
    """The pending publish :func:`commit` works on, or the version a retry of it committed already (a replay:
    by its idempotency key, or its publish id; Conflict when that committed another manifest). ``opened``:
    what :func:`open_` inserted in this transaction, the model's row locked (only a version the key committed
    is read)."""
    conn = s.connection()
    current = None if opened is None else opened.fresh
    if opened is not None:
        if current is None or current.record.publish_id != publish_id:
            raise ValueError("commit: `opened` must be the publish open_ inserted in this transaction")
        m = current.model
        keyed = {"model_id": m.id, "key": idempotency_key}
        found = [] if idempotency_key is None else conn.execute(_KEYED, keyed).all()
    else:
        m = model_key(s, model, lock=True)
        # The publish's row and the version its idempotency key committed, if any, in one read (row locks:
        # see pending_row). Idempotency first: a retried commit finds the head already moved by itself.
        if idempotency_key is None:
            found = conn.execute(_PUBLISH, {"publish_id": publish_id}).all()
        else:
            keyed = {"publish_id": publish_id, "model_id": m.id, "key": idempotency_key}
            found = conn.execute(_PUBLISH_OR_KEY, keyed).all()

    def replay(row: VersionFields, how: str) -> Version:
        if row.manifest_digest != manifest_digest:
            raise errors.Conflict(f"{how} already committed version {row.number} of {m.name!r} with another manifest")
        return version_record(row, m.name)

    rows = [cast(VersionFields, r) for r in found]
    for prior in rows if idempotency_key is not None else ():
        if prior.model_id == m.id and prior.idempotency_key == idempotency_key and prior.committed_at is not None:
            return replay(prior, f"idempotency key {idempotency_key!r}")
    if current is not None:
        return current
    mine = next((r for r in rows if r.publish_id == publish_id), None)
    if mine is not None and mine.model_id == m.id and mine.committed_at is not None:
        return replay(mine, f"publish {publish_id!r}")
    row = _still_pending(mine, m, publish_id, now)
    return Pending(m, version_record(row, m.name), row.id, None)


def abort(s: Session, model: str, publish_id: str, now: datetime) -> Version:
    """Abandon the pending publish (state deleted); PublishNotFound."""
    m = model_row(s, model, lock=True)
    row = pending_row(s, m, publish_id, now)
    versions.drop(s, [row], now)
    return version_record(row, m.name)


def expire(s: Session, now: datetime) -> list[Version]:
    """Mark every pending publish expired at ``now`` deleted; return them."""
    rows = list(
        s.execute(
            select(VersionRow, ModelRow.name)
            .join(ModelRow, ModelRow.id == VersionRow.model_id)
            .where(VersionRow.state == "pending", VersionRow.expires_at <= now)
            .order_by(VersionRow.id)
            .with_for_update(of=VersionRow)
        )
    )
    versions.drop(s, [r for r, _ in rows], now)
    return [version_record(r, name) for r, name in rows]


def list_pending(s: Session, model: str | None) -> list[Version]:
    """Pending publishes (of ``model``, or all), oldest first, expired ones included."""
    stmt = (
        select(VersionRow, ModelRow.name)
        .join(ModelRow, ModelRow.id == VersionRow.model_id)
        .where(VersionRow.state == "pending")
        .order_by(VersionRow.id)
    )
    if model is not None:
        stmt = stmt.where(ModelRow.id == model_row(s, model).id)
    return [version_record(r, name) for r, name in s.execute(stmt)]


@dataclass(frozen=True)
class Parts:
    """The parts a multi-part publish holds (rank → part manifest digest) and its state."""

    version: Version
    world: int
    parts: dict[int, str]
    allow_removals: bool

    @property
    def complete(self) -> bool:
        return len(self.parts) == self.world


def record_part(
    s: Session,
    model: str,
    publish_id: str,
    *,
    rank: int,
    world: int,
    manifest_digest: str,
    allow_removals: bool,
    now: datetime,
) -> Parts:
    """Record part ``rank`` of ``world`` of the publish (docs/CATALOG.md "Parts"); idempotent.

    Once the publish is committed a retried part answers the committed version when it is the
    part that was merged. PartConflict: another world size or removal choice than the parts
    recorded, or a part of that rank with other content; PublishNotFound: expired or aborted.
    """
    m = model_row(s, model, lock=True)
    row = s.scalars(select(VersionRow).where(VersionRow.publish_id == publish_id).with_for_update()).one_or_none()
    if row is not None and row.model_id == m.id and row.state == "committed":
        have = {p.rank: p for p in s.scalars(select(PartRow).where(PartRow.version_id == row.id))}
        mine = have.get(rank)
        if mine is None or mine.manifest_digest != manifest_digest or mine.world != world:
            raise errors.PartConflict(
                f"publish {publish_id!r} committed version {row.number} of {m.name!r} without this part"
            )
        return Parts(
            version_record(row, m.name),
            world,
            {r: p.manifest_digest for r, p in sorted(have.items())},
            mine.allow_removals,
        )
    row = _still_pending(row, m, publish_id, now)
    have = {p.rank: p for p in s.scalars(select(PartRow).where(PartRow.version_id == row.id))}
    for other in have.values():
        if other.world != world:
            raise errors.PartConflict(f"part {rank} says {world} parts, part {other.rank} said {other.world}")
        if other.allow_removals != allow_removals:
            raise errors.PartConflict(f"part {rank} and part {other.rank} disagree on allowing removals")
    mine = have.get(rank)
    if mine is not None and mine.manifest_digest != manifest_digest:
        raise errors.PartConflict(f"part {rank} of {world} was recorded with other content ({mine.manifest_digest})")
    if mine is None:
        mine = PartRow(
            version_id=row.id,
            rank=rank,
            world=world,
            manifest_digest=manifest_digest,
            allow_removals=allow_removals,
            created_at=now,
        )
        s.add(mine)
        s.flush()
        have[rank] = mine
    return Parts(
        version_record(row, m.name), world, {r: p.manifest_digest for r, p in sorted(have.items())}, allow_removals
    )


def drop_part(s: Session, model: str, publish_id: str, rank: int, manifest_digest: str) -> None:
    """Forget a pending part whose merge with the others was refused (a corrected part may be sent again)."""
    m = model_row(s, model, lock=True)
    row = s.scalars(select(VersionRow).where(VersionRow.publish_id == publish_id)).one_or_none()
    if row is None or row.model_id != m.id or row.state != "pending":
        return
    s.execute(
        delete(PartRow).where(
            PartRow.version_id == row.id, PartRow.rank == rank, PartRow.manifest_digest == manifest_digest
        )
    )
