"""The :class:`Catalog` facade: one transaction helper over the aggregate modules.

docs/CATALOG.md is the reference for the states, the compare-and-swap rule and idempotency.
Each public method checks its arguments (:mod:`.checks`), then runs one function of an
aggregate module in one transaction: :mod:`.models`, :mod:`.publishes`, :mod:`.versions`,
:mod:`.objects`, :mod:`.leases`, :mod:`.ledger`, :mod:`.recovery`, :mod:`.identity`.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any, TypeVar

from sqlalchemy import Engine
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL
from sqlalchemy.orm import Session, sessionmaker

from .. import errors
from . import checks, identity, leases, ledger, models, notices, objects, publishes, recovery, relays, versions
from . import migrate as migrations
from .checks import DEFAULT_PENDING_TTL, DEFAULT_SETTINGS, UNSET, validate_model_name
from .engine import make_engine, writer
from .objects import written_after_fence  # publish_whole's `objects` argument hides the module
from .records import (
    ChainInfo,
    DeletedModel,
    ImportedVersion,
    Lease,
    Model,
    ObjectInfo,
    Pinned,
    RelayInfo,
    Replica,
    Target,
    Version,
    VersionTotals,
)
from .rows import db_errors
from .schema import STATES

__all__ = ["Catalog", "DEFAULT_PENDING_TTL", "DEFAULT_SETTINGS", "validate_model_name"]

T = TypeVar("T")


class Catalog:
    """The SQL catalog (docs/CATALOG.md). Thread-safe: each call runs in its own session and transaction.

    Build one with :meth:`open` and share it between threads (the async service calls it from
    a thread pool). Every method is one transaction; writers serialize per model (the model row
    is locked on PostgreSQL, the database on SQLite with ``BEGIN IMMEDIATE``), so a
    compare-and-swap on the head can never interleave with another writer's.

    Timestamps are timezone-aware UTC. Methods that depend on the time take ``now`` (default:
    the current time) so callers and tests control the clock. Arguments outside their rules
    raise :class:`~weightsync.errors.InvalidArgument` (names InvalidName, digests InvalidDigest).
    """

    def __init__(self, engine: Engine) -> None:
        """Wrap ``engine`` (see :func:`weightsync.catalog.engine.make_engine`); does not migrate."""
        self.engine = engine
        self._read = sessionmaker(engine, expire_on_commit=False)
        self._write = sessionmaker(writer(engine), expire_on_commit=False)

    @classmethod
    def open(cls, url: str | URL, *, migrate: bool = True, **engine_kwargs: Any) -> Catalog:
        """Open the catalog at ``url``; with ``migrate`` run ``alembic upgrade head`` first.

        ``sqlite:///path`` (directory created if missing), ``postgresql://…`` (psycopg 3).
        Raises :class:`~weightsync.errors.SchemaVersionError` if the database is at a revision
        newer than this code knows, or (``migrate=False``) is not at the newest revision, and
        :class:`~weightsync.errors.CatalogUnavailable` if the database cannot be reached.
        """
        engine = make_engine(url, **engine_kwargs)
        try:
            with db_errors():
                if migrate:
                    migrations.upgrade(engine)
                else:
                    migrations.check(engine)
        except BaseException:
            engine.dispose()
            raise
        return cls(engine)

    def close(self) -> None:
        """Close every pooled connection; the catalog must not be used afterwards."""
        self.engine.dispose()

    def __enter__(self) -> Catalog:
        """Use as ``with Catalog.open(url) as cat:``; closed on exit."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Close the catalog."""
        self.close()

    def _tx(self, fn: Callable[[Session], T], *, write: bool = False) -> T:
        """Run ``fn(session)`` in one transaction (committed if it returns, rolled back if it raises)."""
        maker = self._write if write else self._read
        with db_errors(), maker.begin() as s:
            return fn(s)

    def server_id(self) -> str:
        """Return this catalog's server id: made once (migration 0003), the same for every service on it."""
        return self._tx(identity.server_id)

    # --- models ----------------------------------------------------------------------

    def create_model(
        self,
        name: str,
        *,
        keyframe_interval: int = UNSET,
        max_chain_ratio: float = UNSET,
        keep_last: int | None = UNSET,
        now: datetime | None = None,
    ) -> Model:
        """Create model ``name``; idempotent: an existing model is returned unchanged.

        The name of a deleted model is free: creating it again starts with no head and no pin, and
        its first commit continues the old numbering (docs/CATALOG.md "Deleting a model").

        Settings not given take :data:`DEFAULT_SETTINGS`. If the model exists and a setting
        given here differs from its value, raises :class:`~weightsync.errors.Conflict` (use
        :meth:`update_model_settings`). Raises InvalidName, InvalidArgument for bad settings.
        """
        validate_model_name(name)
        given = checks.settings(keyframe_interval, max_chain_ratio, keep_last)
        at = checks.utc(now)
        try:
            return self._tx(lambda s: models.create(s, name, given, at), write=True)
        except errors.CatalogError as exc:
            # Lost a creation race on PostgreSQL (unique name): the winner's row is there now.
            if not isinstance(exc.__cause__, sa_exc.IntegrityError):
                raise
            found = self._tx(lambda s: models.find(s, name, given))
            if found is None:
                raise
            return found

    def get_model(self, name: str) -> Model:
        """Return model ``name``; raises ModelNotFound (InvalidName for a malformed name)."""
        validate_model_name(name)
        found = self._tx(lambda s: models.find(s, name, {}))
        if found is None:
            raise errors.ModelNotFound(f"no model named {name!r}")
        return found

    def list_models(self) -> list[Model]:
        """Return every model, ordered by name."""
        return self._tx(models.list_all)

    def update_model_settings(
        self,
        name: str,
        *,
        keyframe_interval: int = UNSET,
        max_chain_ratio: float = UNSET,
        keep_last: int | None = UNSET,
    ) -> Model:
        """Change the given settings of model ``name`` (others unchanged) and return the model.

        Raises ModelNotFound, InvalidArgument for a bad setting.
        """
        given = checks.settings(keyframe_interval, max_chain_ratio, keep_last)
        return self._tx(lambda s: models.update_settings(s, name, given), write=True)

    def pin_model(self, name: str, number: int | None) -> Model:
        """Make followers of model ``name`` hold committed version ``number`` (None: unpin) and return the model.

        While pinned, :meth:`follow_target` is that version whatever the head, and :meth:`mark_deleted`
        keeps its chain. Raises ModelNotFound, VersionNotFound (never committed, or deleted).
        """
        if number is not None:
            checks.nonneg("version", number)
        return self._tx(lambda s: models.pin(s, name, number), write=True)

    def delete_model(self, name: str, *, now: datetime | None = None) -> DeletedModel:
        """Delete model ``name`` in one transaction and say what went; raises ModelNotFound.

        Every committed version is marked deleted and every pending publish aborted (their objects
        enter GC's grace period, unless other versions refer to them), its leases and ledger entries
        are removed, and the model disappears: every lookup raises ModelNotFound until it is created again.
        """
        at = checks.utc(now)
        return self._tx(lambda s: models.delete(s, name, at), write=True)

    # --- publishing --------------------------------------------------------------------

    def begin_version(
        self,
        model: str,
        *,
        parent: int | None,
        kind: str,
        publish_id: str | None = None,
        step: int | None = None,
        metadata: dict[str, Any] | None = None,
        expires_at: datetime | None = None,
        now: datetime | None = None,
    ) -> Version:
        """Open a pending publish and return it (``number`` None: numbers are given at commit).

        ``parent`` is the version the publisher diffs against (must be committed: else
        VersionNotFound); the compare-and-swap happens at commit. ``publish_id`` defaults to
        a random token; beginning again with the id of a pending publish of the same model
        returns it unchanged (idempotent), any other reuse raises Conflict. The publish expires
        at ``expires_at`` (default ``now`` + :data:`DEFAULT_PENDING_TTL`).
        """
        checks.kind(kind, parent)
        pid = checks.label(
            "publish_id", secrets.token_urlsafe(24) if publish_id is None else publish_id, checks.TOKEN_MAX
        )
        if step is not None:
            checks.nonneg("step", step)
        meta = checks.json_object("metadata", metadata)
        at = checks.utc(now)
        expires = checks.utc(expires_at) if expires_at is not None else at + DEFAULT_PENDING_TTL
        return self._tx(
            lambda s: publishes.begin(
                s, model, parent=parent, kind=kind, publish_id=pid, step=step, metadata=meta, expires=expires, now=at
            ),
            write=True,
        )

    def open_publish(
        self,
        model: str,
        *,
        parent: int | None,
        keyframe: bool = False,
        publish_id: str | None = None,
        step: int | None = None,
        metadata: dict[str, Any] | None = None,
        objects: Iterable[tuple[str, int]] | None = None,
        expires_at: datetime | None = None,
        now: datetime | None = None,
    ) -> publishes.Opened:
        """Begin a publish as the service's beginPublish does, in one transaction (publishes.open_).

        :meth:`begin_version` with the head check (StaleParent) and the model's keyframe policy
        (a keyframe when ``keyframe`` is forced), and, with ``objects`` [(digest, size)] encoded as
        that kind, :meth:`reference_objects` for them. ModelNotFound when the model does not exist.
        """
        opener = _opener(
            model,
            parent=parent,
            keyframe=keyframe,
            publish_id=publish_id,
            step=step,
            metadata=metadata,
            objects=objects,
            expires_at=expires_at,
            now=now,
        )
        return self._tx(opener, write=True)

    def publish_whole(
        self,
        model: str,
        *,
        parent: int | None,
        keyframe: bool,
        step: int | None,
        metadata: dict[str, Any] | None,
        objects: Iterable[tuple[str, int]],
        manifest_parent: int | None,
        manifest_digest: str,
        data_objects: Iterable[tuple[str, int]],
        raw_bytes: int,
        stored_bytes: int,
        kind: str,
        written_since: datetime,
        idempotency_key: str | None = None,
        expires_at: datetime | None = None,
        now: datetime | None = None,
    ) -> Version | publishes.Opened:
        """Begin and commit a publish whose objects the caller wrote to the store itself, each newly, from
        ``written_since`` on, in one transaction (publishVersion; DESIGN invariant 7).

        :meth:`open_publish` on ``parent`` with ``objects`` (every object of the version, the manifest
        among them), then, when GC's fence says no GC can have deleted bytes written since
        ``written_since`` (objects.written_after_fence, read after the references), :meth:`commit_held`
        with the commit's fields (the manifest's parent, digest and sizes; ``data_objects``: the data
        objects with their sizes). Returns the committed Version; or, committing only the begin, what
        the begin made (publishes.Opened) when the commit cannot follow: the chain policy answered
        another kind than ``keyframe`` says the objects were encoded as (nothing referenced), GC is
        deleting one of the objects (``pinned.deleting``), or a GC may have deleted some since
        ``written_since`` (everything referenced: the caller asks the store, then commits). Raises what
        either raises (StaleParent, a refusal of the commit), with nothing changed.
        """
        opener = _opener(
            model,
            parent=parent,
            keyframe=keyframe,
            publish_id=None,
            step=step,
            metadata=metadata,
            objects=objects,
            expires_at=expires_at,
            now=now,
        )
        checks.digest(manifest_digest)
        data_refs = checks.object_refs(data_objects)
        checks.nonneg("raw_bytes", raw_bytes)
        checks.nonneg("stored_bytes", stored_bytes)
        checks.kind(kind, manifest_parent)
        if idempotency_key is not None:
            checks.label("idempotency_key", idempotency_key, checks.TOKEN_MAX)
        at = checks.utc(now)
        since = checks.utc(written_since)

        def both(s: Session) -> Version | publishes.Opened:
            opened = opener(s)
            if opened.pinned is None or opened.pinned.deleting or not written_after_fence(s, since):
                return opened
            version = publishes.commit(
                s,
                model,
                opened.version.publish_id,
                parent=manifest_parent,
                manifest_digest=manifest_digest,
                refs=data_refs,
                raw_bytes=raw_bytes,
                stored_bytes=stored_bytes,
                kind=kind,
                chain_base=None,
                idempotency_key=idempotency_key,
                now=at,
                as_begun=True,
                held_only=True,
                opened=opened,
            )
            return opened if version is None else version

        return self._tx(both, write=True)

    def get_pending(self, model: str, publish_id: str, *, now: datetime | None = None) -> Version:
        """Return the pending, unexpired publish ``publish_id`` of ``model``; raises PublishNotFound."""
        at = checks.utc(now)
        return self._tx(lambda s: publishes.pending(s, model, publish_id, at))

    def record_part(
        self,
        model: str,
        publish_id: str,
        *,
        rank: int,
        world: int,
        manifest_digest: str,
        allow_removals: bool = False,
        now: datetime | None = None,
    ) -> publishes.Parts:
        """Record part ``rank`` of ``world`` of pending publish ``publish_id`` (publishes.record_part)."""
        checks.nonneg("rank", rank)
        if world < 1 or rank >= world:
            raise errors.InvalidArgument(f"part {rank} of {world}: rank must lie in [0, world)")
        at = checks.utc(now)
        return self._tx(
            lambda s: publishes.record_part(
                s,
                model,
                publish_id,
                rank=rank,
                world=world,
                manifest_digest=manifest_digest,
                allow_removals=allow_removals,
                now=at,
            ),
            write=True,
        )

    def drop_part(self, model: str, publish_id: str, rank: int, manifest_digest: str) -> None:
        """Forget a pending part whose merge was refused (publishes.drop_part)."""
        self._tx(lambda s: publishes.drop_part(s, model, publish_id, rank, manifest_digest), write=True)

    def reference_objects(
        self, model: str, publish_id: str, objects: Iterable[tuple[str, int]], *, now: datetime | None = None
    ) -> Pinned:
        """Reference ``objects`` [(digest, size)] from pending publish ``publish_id`` so GC keeps them.

        Returns the references this call added, and the objects it refused because GC is
        deleting them (``deleting``): the publisher must upload those again. An object
        referenced here stays in the store until the publish ends (GC marks only unreferenced
        objects), so a store check made after this call holds until the commit. Raises
        PublishNotFound if the publish is not pending (or expired), IncompletePublish if an
        object is known with another size.
        """
        refs = checks.object_refs(objects)
        at = checks.utc(now)
        return self._tx(lambda s: publishes.reference(s, model, publish_id, refs, at), write=True)

    def commit_version(
        self,
        model: str,
        publish_id: str,
        *,
        parent: int | None,
        manifest_digest: str,
        objects: Iterable[tuple[str, int]],
        raw_bytes: int,
        stored_bytes: int,
        kind: str,
        chain_base: int | None = None,
        idempotency_key: str | None = None,
        now: datetime | None = None,
        as_begun: bool = False,
    ) -> Version:
        """Commit a pending publish as the model's new head, in one compare-and-swap transaction.

        docs/CATALOG.md "Commit": ``parent`` must equal the current head (None: the model has
        no committed version), else :class:`~weightsync.errors.StaleParent` (a Conflict)
        carrying ``current_head``, and nothing changes (the publish stays pending: its publisher
        may rebase). With ``as_begun`` the version must be what the publish was begun as: on the
        parent it was begun on, and not a delta where a keyframe was begun (Conflict). On success
        the version gets the next number, its ``objects`` [(digest, size)] are referenced and the
        head moves to it.
        Idempotent: a retry with the same ``publish_id`` (or ``idempotency_key``) and manifest
        returns the original result, even after the head moved on; a different manifest raises
        Conflict. An unknown, aborted or expired publish raises PublishNotFound. An object (or
        the manifest) GC is deleting raises IncompletePublish: nothing is committed.

        ``chain_base``: for a keyframe None (it starts its own chain); for a delta None or the
        parent's chain base (derived from the parent either way).
        """
        version = self._commit(
            model,
            publish_id,
            parent=parent,
            manifest_digest=manifest_digest,
            objects=objects,
            raw_bytes=raw_bytes,
            stored_bytes=stored_bytes,
            kind=kind,
            chain_base=chain_base,
            idempotency_key=idempotency_key,
            now=now,
            as_begun=as_begun,
            held_only=False,
        )
        assert version is not None  # only held_only answers None
        return version

    def commit_held(
        self,
        model: str,
        publish_id: str,
        *,
        parent: int | None,
        manifest_digest: str,
        objects: Iterable[tuple[str, int]],
        raw_bytes: int,
        stored_bytes: int,
        kind: str,
        idempotency_key: str | None = None,
        now: datetime | None = None,
        as_begun: bool = False,
    ) -> Version | None:
        """:meth:`commit_version` for a publish that references its ``objects`` and manifest already.

        The usual commit: the publisher's objects check (:meth:`reference_objects`) referenced
        all of them before the store was asked for them, so the store's answer still holds
        (DESIGN invariant 7) and nothing needs locking. If the pending publish lacks one of those
        references, nothing changes and None is returned: reference them, ask the store again,
        then :meth:`commit_version`. Replays and refusals are :meth:`commit_version`'s.
        """
        return self._commit(
            model,
            publish_id,
            parent=parent,
            manifest_digest=manifest_digest,
            objects=objects,
            raw_bytes=raw_bytes,
            stored_bytes=stored_bytes,
            kind=kind,
            chain_base=None,
            idempotency_key=idempotency_key,
            now=now,
            as_begun=as_begun,
            held_only=True,
        )

    def _commit(
        self,
        model: str,
        publish_id: str,
        *,
        parent: int | None,
        manifest_digest: str,
        objects: Iterable[tuple[str, int]],
        raw_bytes: int,
        stored_bytes: int,
        kind: str,
        chain_base: int | None,
        idempotency_key: str | None,
        now: datetime | None,
        as_begun: bool,
        held_only: bool,
    ) -> Version | None:
        checks.label("publish_id", publish_id, checks.TOKEN_MAX)
        checks.digest(manifest_digest)
        refs = checks.object_refs(objects)
        checks.nonneg("raw_bytes", raw_bytes)
        checks.nonneg("stored_bytes", stored_bytes)
        checks.kind(kind, parent)
        if idempotency_key is not None:
            checks.label("idempotency_key", idempotency_key, checks.TOKEN_MAX)
        at = checks.utc(now)
        return self._tx(
            lambda s: publishes.commit(
                s,
                model,
                publish_id,
                parent=parent,
                manifest_digest=manifest_digest,
                refs=refs,
                raw_bytes=raw_bytes,
                stored_bytes=stored_bytes,
                kind=kind,
                chain_base=chain_base,
                idempotency_key=idempotency_key,
                now=at,
                as_begun=as_begun,
                held_only=held_only,
            ),
            write=True,
        )

    def abort_pending(self, model: str, publish_id: str, *, now: datetime | None = None) -> Version:
        """Abandon pending publish ``publish_id`` (state deleted) and return it; raises PublishNotFound."""
        at = checks.utc(now)
        return self._tx(lambda s: publishes.abort(s, model, publish_id, at), write=True)

    def expire_pending(self, now: datetime | None = None) -> list[Version]:
        """Mark every pending publish whose ``expires_at`` is at or before ``now`` deleted; return them.

        The rows stay (state ``deleted``, ``deleted_at`` set) as a record; their object
        references are released, which starts those objects' GC grace period.
        """
        at = checks.utc(now)
        return self._tx(lambda s: publishes.expire(s, at), write=True)

    def list_pending(self, model: str | None = None) -> list[Version]:
        """Return pending publishes (of ``model``, or all), oldest first, expired ones included."""
        return self._tx(lambda s: publishes.list_pending(s, model))

    # --- reading versions ----------------------------------------------------------------

    def get_version(self, model: str, number: int, *, include_deleted: bool = False) -> Version:
        """Return committed version ``number`` of ``model`` (deleted too if asked); raises VersionNotFound."""
        return self._tx(lambda s: versions.get(s, model, number, include_deleted))

    def list_versions(
        self,
        model: str,
        *,
        states: Iterable[str] = ("committed",),
        limit: int | None = None,
        before: int | None = None,
        after: int | None = None,
        descending: bool = False,
    ) -> list[Version]:
        """Return versions of ``model`` in ``states`` ordered by number (pending, unnumbered, last).

        ``before``/``after`` keep numbers strictly below/above (pending excluded when given);
        ``descending`` reverses the order, so ``limit=10, descending=True`` is "the newest 10".
        """
        wanted = tuple(states)
        for st in wanted:
            if st not in STATES:
                raise errors.InvalidArgument(f"unknown state {st!r}")
        return self._tx(lambda s: versions.listing(s, model, wanted, limit, before, after, descending))

    def version_totals(self, model: str) -> VersionTotals:
        """Return how many committed versions ``model`` has and their raw and stored bytes (ModelNotFound)."""
        return self._tx(lambda s: versions.totals(s, model))

    def head(self, model: str) -> Version | None:
        """Return the model's head version, or None if nothing is committed yet."""
        return self._tx(lambda s: versions.head(s, model))

    def reading(
        self, model: str, number: int | None = None, *, holder: str | None = None, now: datetime | None = None
    ) -> tuple[list[Version], Lease | None]:
        """Return what a reader of version ``number`` fetches from, and ``holder``'s lease on it, in one read.

        ``number`` None is what followers hold (:meth:`follow_target`). The first item is
        :meth:`lineage` of the version, the second ``holder``'s unexpired lease on that chain, the
        one expiring last (None without a ``holder`` or a lease). Raises VersionNotFound.
        """
        if holder is not None:
            checks.label("holder", holder)
        at = checks.utc(now)
        return self._tx(lambda s: versions.reading(s, model, number, holder, at))

    def follow_target(self, model: str) -> Target:
        """Return what followers of ``model`` hold: the pinned version if it is pinned, else the head."""
        return self._tx(lambda s: versions.target(s, model))

    @property
    def announces(self) -> bool:
        """Whether :meth:`announce` reaches other processes (PostgreSQL) or does nothing (SQLite)."""
        return notices.announces(self.engine)

    def announce(self, payload: str) -> None:
        """Tell the other processes on this catalog that what followers hold changed (catalog/notices.py).

        PostgreSQL: a NOTIFY on ``notices.CHANNEL``, in a transaction of its own; SQLite: nothing (its
        processes find changes by polling). CatalogUnavailable when the database is unreachable.
        """
        notices.announce(self.engine, payload)

    def listener(
        self, on_notice: Callable[[str], None], on_listening: Callable[[bool], None]
    ) -> notices.Listener | None:
        """A listener for what :meth:`announce` sends, through a connection of its own (PostgreSQL), or None."""
        connect = notices.listen_args(self.engine)
        return None if connect is None else notices.Listener(connect, on_notice, on_listening)

    def lineage(self, model: str, number: int) -> list[Version]:
        """Return the chain from version ``number``'s keyframe to it, keyframe first.

        Raises VersionNotFound if ``number`` is not committed or a link of its chain is missing.
        """
        return self._tx(lambda s: versions.lineage(s, model, number))

    def chain_info(self, model: str, number: int | None = None) -> ChainInfo | None:
        """Return the chain of version ``number`` (default: the head) for the keyframe policy; None if no head."""
        if number is None:
            m = self.get_model(model)
            if m.head is None:
                return None
            number = m.head
        chain = self.lineage(model, number)
        return ChainInfo(
            base=chain[0].number or 0,
            length=len(chain),
            keyframe_bytes=chain[0].stored_bytes or 0,
            delta_bytes=sum(v.stored_bytes or 0 for v in chain[1:]),
        )

    # --- deleting versions ---------------------------------------------------------------

    def retention_candidates(self, model: str) -> list[int]:
        """Return committed numbers beyond the model's ``keep_last`` newest, oldest first.

        Pass them to :meth:`mark_deleted`, which keeps those a remaining version or a lease
        still needs.
        """
        return self._tx(lambda s: versions.retention_candidates(s, model))

    def mark_deleted(
        self, model: str, numbers: Iterable[int], *, force: bool = False, now: datetime | None = None
    ) -> list[int]:
        """Mark committed versions ``numbers`` deleted; return the numbers actually deleted.

        Without ``force``, a version is kept (silently left out of the result) if it is the
        head or the pinned version, or in the chain of a version that stays committed, or in the
        chain of a version an active lease holds: deleting it would break a materialization.
        Already deleted numbers are ignored; numbers that never existed raise VersionNotFound.
        ``force`` (fsck repair) deletes exactly what is asked; if the head goes, the head moves to
        the newest remaining committed version (or None); if the pinned version goes, the pin goes.
        """
        asked = set(numbers)
        at = checks.utc(now)
        return self._tx(lambda s: versions.mark_deleted(s, model, asked, force, at), write=True)

    # --- objects and GC --------------------------------------------------------------------

    def referenced_digests(self) -> set[str]:
        """Return every digest a non-deleted version (pending included) refers to, manifests included."""
        return self._tx(objects.referenced_digests)

    def record_object(self, digest: str, size: int, *, now: datetime | None = None, new: bool = False) -> ObjectInfo:
        """Record that the store holds object ``digest`` of ``size`` bytes; idempotent; return its record.

        ``new``: the store has just created the object (it held no such bytes), so the catalog
        most likely has no row for it: the read that spares known objects the write lock is skipped
        (the outcome is the same either way).

        Recording an object again while it is unreferenced restarts its GC grace period, so
        a publisher that reuses an existing object is not racing GC to its commit. An object
        GC is deleting is returned unchanged with ``state == "deleting"``: its bytes may vanish,
        so the caller must write them again once GC is done. Raises DigestMismatch if the
        object is known with another size.
        """
        checks.digest(digest)
        checks.nonneg("size", size)
        at = checks.utc(now)
        # An object a version or a pending publish references is recorded already and out of GC's
        # reach (its grace starts when the last reference goes): a read answers, no write lock taken.
        # One the store has just created (`new`) is rarely recorded yet: straight to the write.
        if not new:
            known = self._tx(lambda s: objects.get_many(s, [digest])).get(digest)
            if known is not None and known.state == "live" and known.unreferenced_since is None and known.size == size:
                return known
        return self._tx(lambda s: objects.record(s, digest, size, at), write=True)

    def get_object(self, digest: str) -> ObjectInfo | None:
        """Return what the catalog knows of object ``digest``, or None."""
        checks.digest(digest)
        return self._tx(lambda s: objects.get_many(s, [digest])).get(digest)

    def get_objects(self, digests: Sequence[str]) -> dict[str, ObjectInfo]:
        """Return what the catalog knows of each of ``digests`` (unknown ones are left out), by digest."""
        wanted = [checks.digest(d) for d in digests]
        return self._tx(lambda s: objects.get_many(s, wanted))

    def begin_object_deletion(
        self,
        candidates: Sequence[tuple[str, int, datetime]],
        *,
        unreferenced_before: datetime,
        now: datetime | None = None,
    ) -> list[str]:
        """GC phase 1: tombstone the eligible ``candidates`` [(digest, size, stored_at)]; return their digests.

        Eligible: no non-deleted version refers to it, and it has been unreferenced since at or
        before ``unreferenced_before`` (an object without a row counts from ``stored_at``, and
        gets a row). Each returned object is ``deleting``, stamped ``now``: delete its bytes,
        then call :meth:`finish_object_deletion` with the same ``now``. Until then no publish
        can reference it (DESIGN invariant 7). One transaction.
        """
        for d, size, _ in candidates:
            checks.digest(d)
            checks.nonneg("size", size)
        cutoff = checks.utc(unreferenced_before)
        at = checks.utc(now)
        found = [(d, size, checks.utc(stored)) for d, size, stored in candidates]
        return self._tx(lambda s: objects.begin_deletion(s, found, cutoff, at), write=True)

    def finish_object_deletion(self, digests: Sequence[str], *, stamp: datetime, now: datetime | None = None) -> int:
        """GC phase 3: forget objects whose bytes phase 2 deleted; return how many rows went.

        Only tombstones still carrying ``stamp`` (the ``now`` of :meth:`begin_object_deletion`
        or :meth:`resume_object_deletions`) are removed: one another GC took over is its own. GC's
        fence rises to ``now`` (the time of this call, after the deletes) in the same transaction.
        """
        wanted = [checks.digest(d) for d in digests]
        at = checks.utc(stamp)
        when = checks.utc(now)
        return self._tx(lambda s: objects.finish_deletion(s, wanted, at, when), write=True)

    def resume_object_deletions(self, *, before: datetime, now: datetime | None = None) -> list[tuple[str, int]]:
        """Take over tombstones ``deleting`` since at or before ``before`` (their GC died); return [(digest, size)].

        They are re-stamped ``now``: delete their bytes, then :meth:`finish_object_deletion`.
        Pass a ``before`` far enough back that no GC is still deleting them (GC uses its grace).
        """
        cutoff = checks.utc(before)
        at = checks.utc(now)
        return self._tx(lambda s: objects.take_over_stale(s, cutoff, at), write=True)

    # --- leases ----------------------------------------------------------------------------

    def acquire_lease(
        self, model: str, number: int, holder: str, ttl: timedelta | float, *, now: datetime | None = None
    ) -> Lease:
        """Hold the chain of committed version ``number`` for ``holder`` until ``now + ttl``; return the lease.

        Acquiring again (same model, number, holder) extends the lease. While it is active,
        :meth:`mark_deleted` keeps every version of that chain: the keyframe, the deltas up to
        ``number`` and the later ones (what the reader fetches next). Raises VersionNotFound,
        InvalidArgument for a ttl that is not positive.
        """
        checks.label("holder", holder)
        span = checks.positive_ttl(ttl)
        at = checks.utc(now)
        return self._tx(lambda s: leases.acquire(s, model, number, holder, span, at), write=True)

    def release_lease(self, model: str, number: int, holder: str) -> bool:
        """Drop ``holder``'s lease on version ``number``; return whether there was one."""
        return self._tx(lambda s: leases.release(s, model, number, holder), write=True)

    def active_leases(self, model: str | None = None, *, now: datetime | None = None) -> list[Lease]:
        """Return leases not expired at ``now`` (of ``model``, or all), by model, number and holder."""
        at = checks.utc(now)
        return self._tx(lambda s: leases.active(s, model, at))

    def purge_expired_leases(self, now: datetime | None = None) -> int:
        """Delete leases expired at ``now``; return how many. (Expired leases already protect nothing.)"""
        at = checks.utc(now)
        return self._tx(lambda s: leases.purge_expired(s, at), write=True)

    # --- replica ledger --------------------------------------------------------------------

    def record_replica(
        self,
        model: str,
        subscriber: str,
        number: int | None,
        *,
        applied_at: datetime | None = None,
        pause_ms: float | None = None,
        bytes_received: int | None = None,
        site: str | None = None,
        host: str | None = None,
        extra: dict[str, Any] | None = None,
        status: str = "applied",
        mode: str | None = None,
        engine: str | None = None,
        release_leases: bool = False,
    ) -> Replica:
        """Append a ledger entry: ``subscriber`` holds version ``number`` of ``model`` (None: it is unhealthy
        and holds none); return it.

        ``status``, ``mode``, ``engine``: docs/CATALOG.md "Replica ledger" (InvalidArgument for an unknown
        value, a version on an unhealthy entry or none on another). The version must have been committed
        (it may be deleted since); else VersionNotFound. ``release_leases`` (the subscriber's own report):
        the version must still be committed, and ``subscriber``'s leases go in the same transaction, but
        for one on the head's chain when that is the version's (docs/CATALOG.md "Leases").
        """
        checks.label("subscriber", subscriber)
        ledger.check_report(number, status, mode, engine)
        for name, v in (("site", site), ("host", host)):
            if v is not None:
                checks.label(name, v)
        if pause_ms is not None:
            checks.finite_nonneg("pause_ms", pause_ms)
        if bytes_received is not None:
            checks.nonneg("bytes_received", bytes_received)
        fields = {
            "pause_ms": None if pause_ms is None else float(pause_ms),
            "bytes_received": bytes_received,
            "site": site,
            "host": host,
            "extra": checks.json_object("extra", extra),
            "status": status,
            "mode": mode,
            "engine": engine,
        }
        applied = checks.utc(applied_at)
        return self._tx(
            lambda s: ledger.append(s, model, subscriber, number, applied, fields, release_leases=release_leases),
            write=True,
        )

    def list_replicas(self, model: str, subscriber: str | None = None, *, latest_only: bool = True) -> list[Replica]:
        """Return ledger entries of ``model`` (of one ``subscriber`` if given), by subscriber then time.

        ``latest_only`` keeps each subscriber's most recent entry: where the fleet is now. Each entry's
        ``lag`` is the head now minus its version (None for an unhealthy entry).
        """
        return self._tx(lambda s: ledger.entries(s, model, subscriber, latest_only))

    # --- relays ----------------------------------------------------------------------------

    def record_relay(
        self,
        name: str,
        *,
        site: str | None = None,
        upstream: str | None = None,
        degraded: bool = False,
        state: dict[str, Any] | None = None,
        now: datetime | None = None,
    ) -> RelayInfo:
        """Record relay ``name``'s heartbeat (its previous one replaced; ``first_seen`` kept); return it.

        InvalidArgument for a name or site that is not a label, or a state that is not a JSON object.
        """
        checks.label("relay name", name)
        if site is not None:
            checks.label("site", site)
        if upstream is not None:
            checks.label("upstream", upstream, 1024)
        body = checks.json_object("state", state)
        at = checks.utc(now)
        return self._tx(lambda s: relays.heartbeat(s, name, site, upstream, bool(degraded), body, at), write=True)

    def list_relays(self) -> list[RelayInfo]:
        """Every relay's latest heartbeat, by name."""
        return self._tx(relays.listing)

    def claim_fetch(self, digest: str, holder: str, *, ttl: timedelta, now: datetime | None = None) -> bool:
        """Claim the upstream fetch of object ``digest`` for ``holder`` (a relay replica) until ``now + ttl``.

        True when the claim is ``holder``'s (new, renewed, or taken over from an expired one); False while
        another replica holds it (then that one fetches: wait for the object). InvalidDigest, InvalidArgument.
        """
        checks.digest(digest)
        checks.label("holder", holder)
        checks.positive_ttl(ttl)
        at = checks.utc(now)
        return self._tx(lambda s: relays.claim(s, digest, holder, ttl, at), write=True)

    def release_fetch(self, digest: str, holder: str) -> bool:
        """End ``holder``'s claim on ``digest`` (its fetch ended); whether it held one."""
        return self._tx(lambda s: relays.release(s, digest, holder), write=True)

    # --- disaster recovery ---------------------------------------------------------------

    def import_version(self, model: str, record: ImportedVersion, *, now: datetime | None = None) -> Version:
        """Insert a committed version with its given number (rebuilding a catalog from manifests).

        Any order works: parents need not be imported first. The head becomes the highest
        committed number. Idempotent: importing the same number with the same manifest again
        returns the existing version; another manifest under that number raises Conflict.
        Raises InvalidArgument for an inconsistent record.
        """
        r = record
        if isinstance(r.number, bool) or not isinstance(r.number, int) or r.number < 1:
            raise errors.InvalidArgument(f"version number must be an integer >= 1, not {r.number!r}")
        checks.kind(r.kind, r.parent)
        if r.kind == "keyframe" and r.chain_base != r.number:
            raise errors.InvalidArgument("a keyframe's chain_base is its own number")
        if r.kind == "delta" and (r.parent is None or not 1 <= r.chain_base <= r.parent < r.number):
            raise errors.InvalidArgument("a delta needs a parent below it and a chain_base at or below that")
        checks.digest(r.manifest_digest)
        refs = checks.object_refs(r.objects)
        checks.nonneg("raw_bytes", r.raw_bytes)
        checks.nonneg("stored_bytes", r.stored_bytes)
        if r.step is not None:
            checks.nonneg("step", r.step)
        meta = checks.json_object("metadata", r.metadata)
        at = checks.utc(now)
        committed_at = checks.utc(r.committed_at) if r.committed_at is not None else at
        return self._tx(lambda s: recovery.import_version(s, model, r, refs, meta, committed_at, at), write=True)

    def dump_committed(self, model: str | None = None) -> dict[str, Any]:
        """Return committed versions and heads as plain JSON data; equal dumps mean equal catalogs.

        Holds exactly what manifests can restore (docs/CATALOG.md "Rebuilding"): per model
        the head, per version number, parent, kind, chain base, step, metadata, sizes, manifest
        digest and sorted object references. Not timestamps, publish ids, idempotency keys,
        settings, pending or deleted versions, leases or the ledger. An operator compares the
        dumps of the live and a rebuilt catalog (``Ops.dump_committed``) to check a rebuild.
        """
        return self._tx(lambda s: recovery.dump(s, model))


def _opener(
    model: str,
    *,
    parent: int | None,
    keyframe: bool,
    publish_id: str | None,
    step: int | None,
    metadata: dict[str, Any] | None,
    objects: Iterable[tuple[str, int]] | None,
    expires_at: datetime | None,
    now: datetime | None,
) -> Callable[[Session], publishes.Opened]:
    """The begin of :meth:`Catalog.open_publish` with its arguments checked, to run in a transaction (a new
    publish id when ``publish_id`` is None; ``objects`` None: nothing referenced)."""
    pid = checks.label("publish_id", secrets.token_urlsafe(24) if publish_id is None else publish_id, checks.TOKEN_MAX)
    if step is not None:
        checks.nonneg("step", step)
    meta = checks.json_object("metadata", metadata)
    refs = None if objects is None else checks.object_refs(objects)
    at = checks.utc(now)
    expires = checks.utc(expires_at) if expires_at is not None else at + DEFAULT_PENDING_TTL
    return lambda s: publishes.open_(
        s,
        model,
        parent=parent,
        keyframe=keyframe,
        publish_id=pid,
        step=step,
        metadata=meta,
        expires=expires,
        now=at,
        refs=refs,
    )
