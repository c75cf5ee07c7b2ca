"""The :class:`Catalog`: models, versions, object references, leases and the replica ledger.

docs/CATALOG.md is the reference for the states, the compare-and-swap rule and idempotency;
comments here cite its sections.
"""

from __future__ import annotations

import json
import math
import re
import secrets
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from typing import Any, TypeVar

from sqlalchemy import Engine, and_, delete, exists, func, or_, select, update
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import URL
from sqlalchemy.orm import Session, sessionmaker

from .. import errors
from . import migrate as _migrations
from .engine import make_engine, writer
from .records import ChainInfo, ImportedVersion, Lease, Model, ObjectInfo, Replica, Version
from .schema import KINDS, STATES, LeaseRow, ModelRow, ObjectRow, ReplicaRow, VersionObjectRow, VersionRow

__all__ = ["Catalog", "DEFAULT_PENDING_TTL", "DEFAULT_SETTINGS", "validate_model_name"]

_NAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,127}")
_DIGEST_RE = re.compile(r"[0-9a-f]{64}")
_TOKEN_MAX = 128  # publish ids and idempotency keys
_LABEL_MAX = 255  # subscriber, site, host, lease holder
_CHUNK = 500  # rows or IN-list values per statement, well under every driver's parameter limit

#: How long a pending publish lives when the caller does not say.
DEFAULT_PENDING_TTL = timedelta(hours=1)

#: Settings of a new model when the caller does not give them.
DEFAULT_SETTINGS: dict[str, Any] = {"keyframe_interval": 20, "max_chain_ratio": 0.5, "keep_last": None}


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


_UNSET: Any = _Unset()

T = TypeVar("T")


def validate_model_name(name: str) -> str:
    """Return ``name`` if it is a valid model name (``[a-z0-9][a-z0-9._-]{0,127}``), else raise InvalidName."""
    if not isinstance(name, str) or _NAME_RE.fullmatch(name) is None:
        raise errors.InvalidName(f"invalid model name {name!r}: use [a-z0-9][a-z0-9._-]{{0,127}}")
    return name


def _digest(d: str) -> str:
    if not isinstance(d, str) or _DIGEST_RE.fullmatch(d) is None:
        raise errors.InvalidDigest(f"not a lowercase hex SHA-256 digest: {d!r}")
    return d


def _nonneg(name: str, v: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{name} must be a non-negative integer, not {v!r}")
    return v


def _label(name: str, v: str, limit: int = _LABEL_MAX) -> str:
    if not isinstance(v, str) or not 0 < len(v) <= limit:
        raise ValueError(f"{name} must be a non-empty string of at most {limit} characters")
    return v


def _json_dict(name: str, v: dict[str, Any] | None) -> dict[str, Any]:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ValueError(f"{name} must be a JSON object")
    try:
        # Round-trip so the stored value is exactly what reading it back gives.
        return json.loads(json.dumps(v, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} is not JSON-serializable: {exc}") from None


def _utc(now: datetime | None) -> datetime:
    if now is None:
        return datetime.now(timezone.utc)
    if now.tzinfo is None:
        raise ValueError("timestamps must be timezone-aware")
    return now.astimezone(timezone.utc)


def _chunks(items: Sequence[T]) -> Iterator[Sequence[T]]:
    for i in range(0, len(items), _CHUNK):
        yield items[i : i + _CHUNK]


def _settings(keyframe_interval: Any, max_chain_ratio: Any, keep_last: Any) -> dict[str, Any]:
    """Validate the given (not _UNSET) settings and return them as a dict."""
    out: dict[str, Any] = {}
    if keyframe_interval is not _UNSET:
        if isinstance(keyframe_interval, bool) or not isinstance(keyframe_interval, int) or keyframe_interval < 1:
            raise ValueError(f"keyframe_interval must be an integer >= 1, not {keyframe_interval!r}")
        out["keyframe_interval"] = keyframe_interval
    if max_chain_ratio is not _UNSET:
        if (
            isinstance(max_chain_ratio, bool)
            or not isinstance(max_chain_ratio, (int, float))
            or not math.isfinite(max_chain_ratio)
            or max_chain_ratio <= 0
        ):
            raise ValueError(f"max_chain_ratio must be a finite number > 0, not {max_chain_ratio!r}")
        out["max_chain_ratio"] = float(max_chain_ratio)
    if keep_last is not _UNSET:
        if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"keep_last must be None (keep all) or an integer >= 1, not {keep_last!r}")
        out["keep_last"] = keep_last
    return out


def _refs(objects: Iterable[tuple[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for d, size in objects:
        _digest(d)
        _nonneg("object size", size)
        if out.setdefault(d, size) != size:
            raise errors.IncompletePublish(f"object {d} is listed with sizes {out[d]} and {size}")
    return out


@contextmanager
def _db_errors() -> Iterator[None]:
    """Translate driver failures into the catalog's named errors."""
    try:
        yield
    except errors.WeightsyncError:
        raise
    except (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.TimeoutError) as exc:
        # Connection refused or lost, pool exhausted, SQLite still locked after busy_timeout.
        detail = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0:1]
        raise errors.CatalogUnavailable(f"catalog database unavailable: {' '.join(detail)}") from exc
    except sa_exc.SQLAlchemyError as exc:
        detail = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0:1]
        raise errors.CatalogError(f"catalog database error: {' '.join(detail)}") from exc


def _model(row: ModelRow) -> Model:
    return Model(
        name=row.name,
        created_at=row.created_at,
        head=row.head,
        keyframe_interval=row.keyframe_interval,
        max_chain_ratio=row.max_chain_ratio,
        keep_last=row.keep_last,
    )


def _version(row: VersionRow, model: str) -> Version:
    return Version(
        model=model,
        number=row.number,
        parent=row.parent,
        kind=row.kind,
        chain_base=row.chain_base,
        state=row.state,
        step=row.step,
        metadata=dict(row.metadata_ or {}),
        raw_bytes=row.raw_bytes,
        stored_bytes=row.stored_bytes,
        manifest_digest=row.manifest_digest,
        publish_id=row.publish_id,
        idempotency_key=row.idempotency_key,
        created_at=row.created_at,
        committed_at=row.committed_at,
        expires_at=row.expires_at,
        deleted_at=row.deleted_at,
    )


def _object(row: ObjectRow) -> ObjectInfo:
    return ObjectInfo(
        digest=row.digest, size=row.size, first_seen=row.first_seen, unreferenced_since=row.unreferenced_since
    )


def _referenced(digest_col: Any) -> Any:
    """SQL condition: some non-deleted version refers to ``digest_col`` (as a frame pack or its manifest)."""
    live = VersionRow.state != "deleted"
    by_ref = exists().where(
        VersionObjectRow.digest == digest_col, VersionObjectRow.version_id == VersionRow.id, live
    )
    by_manifest = exists().where(VersionRow.manifest_digest == digest_col, live)
    return or_(by_ref, by_manifest)


class Catalog:
    """The SQL catalog (docs/CATALOG.md). Thread-safe: each call runs in its own session and transaction.

    Build one with :meth:`open` and share it between threads (the async service calls it from
    a thread pool). Every method is one transaction; writers serialize per model (the model row
    is locked on PostgreSQL, the database on SQLite with ``BEGIN IMMEDIATE``), so a
    compare-and-swap on the head can never interleave with another writer's.

    Timestamps are timezone-aware UTC. Methods that depend on the time take ``now`` (default:
    the current time) so callers and tests control the clock.
    """

    def __init__(self, engine: Engine) -> None:
        """Wrap ``engine`` (see :func:`weightsync.catalog.engine.make_engine`); does not migrate."""
        self.engine = engine
        self._read = sessionmaker(engine, expire_on_commit=False)
        self._write = sessionmaker(writer(engine), expire_on_commit=False)
        self._dialect = engine.dialect.name

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
            with _db_errors():
                if migrate:
                    _migrations.upgrade(engine)
                else:
                    _migrations.check(engine)
        except BaseException:
            engine.dispose()
            raise
        return cls(engine)

    def close(self) -> None:
        """Close every pooled connection; the catalog must not be used afterwards."""
        self.engine.dispose()

    def __enter__(self) -> Catalog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- plumbing --------------------------------------------------------------------

    def _tx(self, fn: Callable[[Session], T], *, write: bool = False) -> T:
        """Run ``fn(session)`` in one transaction (committed if it returns, rolled back if it raises)."""
        maker = self._write if write else self._read
        with _db_errors(), maker.begin() as s:
            return fn(s)

    def _model_row(self, s: Session, name: str, *, lock: bool = False) -> ModelRow:
        validate_model_name(name)
        stmt = select(ModelRow).where(ModelRow.name == name)
        if lock:
            # Serializes writers of one model on PostgreSQL; SQLite ignores it (BEGIN IMMEDIATE).
            stmt = stmt.with_for_update()
        row = s.scalars(stmt).one_or_none()
        if row is None:
            raise errors.ModelNotFound(f"no model named {name!r}")
        return row

    def _committed(self, s: Session, m: ModelRow, number: int, *, include_deleted: bool = False) -> VersionRow:
        states = ("committed", "deleted") if include_deleted else ("committed",)
        row = s.scalars(
            select(VersionRow).where(
                VersionRow.model_id == m.id, VersionRow.number == number, VersionRow.state.in_(states)
            )
        ).one_or_none()
        if row is None:
            raise errors.VersionNotFound(f"model {m.name!r} has no committed version {number}")
        return row

    def _insert_ignore_objects(self, s: Session, rows: list[dict[str, Any]]) -> None:
        insert = pg_insert if self._dialect == "postgresql" else sqlite_insert
        for chunk in _chunks(rows):
            s.execute(insert(ObjectRow).values(list(chunk)).on_conflict_do_nothing(index_elements=["digest"]))

    def _attach_refs(self, s: Session, v: VersionRow, refs: dict[str, int], now: datetime) -> None:
        """Make ``refs`` (digest -> size) referenced by ``v``, recording unknown objects."""
        if not refs:
            return
        # Sorted, so concurrent writers touch shared object rows in one order (no deadlocks).
        digests = sorted(refs)
        self._insert_ignore_objects(
            s, [{"digest": d, "size": refs[d], "first_seen": now, "unreferenced_since": None} for d in digests]
        )
        for chunk in _chunks(digests):
            for d, size in s.execute(select(ObjectRow.digest, ObjectRow.size).where(ObjectRow.digest.in_(chunk))):
                if size != refs[d]:
                    raise errors.IncompletePublish(f"object {d} has {size} bytes, the commit says {refs[d]}")
            s.execute(update(ObjectRow).where(ObjectRow.digest.in_(chunk)).values(unreferenced_since=None))
        have = set(s.scalars(select(VersionObjectRow.digest).where(VersionObjectRow.version_id == v.id)))
        new = [{"version_id": v.id, "digest": d, "size": refs[d]} for d in digests if d not in have]
        for chunk in _chunks(new):
            s.execute(VersionObjectRow.__table__.insert(), list(chunk))

    def _mark_unreferenced(self, s: Session, digests: Iterable[str], now: datetime) -> None:
        """Start the GC grace clock of those ``digests`` no non-deleted version refers to any more."""
        for chunk in _chunks(sorted(set(digests))):
            s.execute(
                update(ObjectRow)
                .where(
                    ObjectRow.digest.in_(chunk),
                    ObjectRow.unreferenced_since.is_(None),
                    ~_referenced(ObjectRow.digest),
                )
                .values(unreferenced_since=now)
                .execution_options(synchronize_session=False)
            )

    def _drop_versions(self, s: Session, rows: list[VersionRow], now: datetime) -> None:
        """Mark ``rows`` deleted and release their object references (docs/CATALOG.md "States")."""
        if not rows:
            return
        ids = [r.id for r in rows]
        digests = {r.manifest_digest for r in rows if r.manifest_digest}
        for chunk in _chunks(ids):
            digests.update(s.scalars(select(VersionObjectRow.digest).where(VersionObjectRow.version_id.in_(chunk))))
            s.execute(delete(VersionObjectRow).where(VersionObjectRow.version_id.in_(chunk)))
        for r in rows:
            r.state = "deleted"
            r.deleted_at = now
        s.flush()
        self._mark_unreferenced(s, digests, now)

    def _parents(self, s: Session, m: ModelRow) -> dict[int, tuple[int | None, str]]:
        """number -> (parent, kind) of every committed version of ``m``."""
        rows = s.execute(
            select(VersionRow.number, VersionRow.parent, VersionRow.kind).where(
                VersionRow.model_id == m.id, VersionRow.state == "committed"
            )
        )
        return {n: (p, k) for n, p, k in rows}

    @staticmethod
    def _chain(parents: dict[int, tuple[int | None, str]], number: int) -> list[int]:
        """Numbers from ``number`` back to its keyframe (newest first); stops early at a missing link."""
        out = [number]
        while True:
            parent, kind = parents[out[-1]]
            if kind == "keyframe" or parent is None or parent not in parents:
                return out
            out.append(parent)

    # --- models ----------------------------------------------------------------------

    def create_model(
        self,
        name: str,
        *,
        keyframe_interval: int = _UNSET,
        max_chain_ratio: float = _UNSET,
        keep_last: int | None = _UNSET,
        now: datetime | None = None,
    ) -> Model:
        """Create model ``name``; idempotent: an existing model is returned unchanged.

        Settings not given take :data:`DEFAULT_SETTINGS`. If the model exists and a setting
        given here differs from its value, raises :class:`~weightsync.errors.Conflict` (use
        :meth:`update_model_settings`). Raises InvalidName, ValueError for bad settings.
        """
        validate_model_name(name)
        given = _settings(keyframe_interval, max_chain_ratio, keep_last)
        now = _utc(now)

        def existing(s: Session) -> Model | None:
            row = s.scalars(select(ModelRow).where(ModelRow.name == name)).one_or_none()
            if row is None:
                return None
            differ = {k: v for k, v in given.items() if getattr(row, k) != v}
            if differ:
                raise errors.Conflict(f"model {name!r} exists with other settings ({', '.join(sorted(differ))})")
            return _model(row)

        def create(s: Session) -> Model:
            found = existing(s)
            if found is not None:
                return found
            row = ModelRow(name=name, created_at=now, head=None, **{**DEFAULT_SETTINGS, **given})
            s.add(row)
            s.flush()
            return _model(row)

        try:
            return self._tx(create, write=True)
        except errors.CatalogError as exc:
            # Lost a creation race on PostgreSQL (unique name): the winner's row is there now.
            if not isinstance(exc.__cause__, sa_exc.IntegrityError):
                raise
            found = self._tx(existing)
            if found is None:
                raise
            return found

    def get_model(self, name: str) -> Model:
        """Return model ``name``; raises ModelNotFound (InvalidName for a malformed name)."""
        return self._tx(lambda s: _model(self._model_row(s, name)))

    def list_models(self) -> list[Model]:
        """Return every model, ordered by name."""
        return self._tx(lambda s: [_model(r) for r in s.scalars(select(ModelRow).order_by(ModelRow.name))])

    def update_model_settings(
        self,
        name: str,
        *,
        keyframe_interval: int = _UNSET,
        max_chain_ratio: float = _UNSET,
        keep_last: int | None = _UNSET,
    ) -> Model:
        """Change the given settings of model ``name`` (others unchanged) and return the model."""
        given = _settings(keyframe_interval, max_chain_ratio, keep_last)

        def run(s: Session) -> Model:
            row = self._model_row(s, name, lock=True)
            for k, v in given.items():
                setattr(row, k, v)
            s.flush()
            return _model(row)

        return self._tx(run, write=True)

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
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
        if kind == "delta" and parent is None:
            raise ValueError("a delta needs a parent")
        if publish_id is None:
            publish_id = secrets.token_urlsafe(24)
        _label("publish_id", publish_id, _TOKEN_MAX)
        if step is not None:
            _nonneg("step", step)
        meta = _json_dict("metadata", metadata)
        now = _utc(now)
        expires = _utc(expires_at) if expires_at is not None else now + DEFAULT_PENDING_TTL

        def run(s: Session) -> Version:
            m = self._model_row(s, model, lock=True)
            prior = s.scalars(select(VersionRow).where(VersionRow.publish_id == publish_id)).one_or_none()
            if prior is not None:
                if prior.model_id == m.id and prior.state == "pending":
                    return _version(prior, m.name)
                raise errors.Conflict(f"publish id {publish_id!r} is already used")
            if parent is not None:
                self._committed(s, m, parent)
            row = VersionRow(
                model_id=m.id,
                number=None,
                parent=parent,
                kind=kind,
                chain_base=None,
                state="pending",
                step=step,
                metadata_=meta,
                publish_id=publish_id,
                created_at=now,
                expires_at=expires,
            )
            s.add(row)
            s.flush()
            return _version(row, m.name)

        return self._tx(run, write=True)

    def _pending(self, s: Session, m: ModelRow, publish_id: str, now: datetime, *, lock: bool = True) -> VersionRow:
        stmt = select(VersionRow).where(VersionRow.publish_id == publish_id)
        if lock:
            # expire_pending does not lock the model: on PostgreSQL the row lock (and its
            # re-read of the row once a concurrent sweep commits) keeps a commit from
            # resurrecting a publish being expired, or the sweep from deleting a commit.
            stmt = stmt.with_for_update()
        row = s.scalars(stmt).one_or_none()
        if row is None or row.model_id != m.id:
            raise errors.PublishNotFound(f"no publish {publish_id!r} for model {m.name!r}")
        if row.state != "pending":
            raise errors.PublishNotFound(f"publish {publish_id!r} is {row.state}, not pending")
        if row.expires_at is not None and row.expires_at <= now:
            raise errors.PublishNotFound(f"publish {publish_id!r} expired at {row.expires_at.isoformat()}")
        return row

    def get_pending(self, model: str, publish_id: str, *, now: datetime | None = None) -> Version:
        """Return the pending, unexpired publish ``publish_id`` of ``model``; raises PublishNotFound."""
        now = _utc(now)

        def run(s: Session) -> Version:
            m = self._model_row(s, model)
            return _version(self._pending(s, m, publish_id, now, lock=False), m.name)

        return self._tx(run)

    def reference_objects(
        self, model: str, publish_id: str, objects: Iterable[tuple[str, int]], *, now: datetime | None = None
    ) -> None:
        """Record that pending publish ``publish_id`` uses ``objects`` [(digest, size)], so GC keeps them.

        Optional: for long uploads whose objects could outlive GC's grace period before the
        commit. Raises PublishNotFound if the publish is not pending (or expired).
        """
        refs = _refs(objects)
        now = _utc(now)

        def run(s: Session) -> None:
            m = self._model_row(s, model, lock=True)
            self._attach_refs(s, self._pending(s, m, publish_id, now), refs, now)

        self._tx(run, write=True)

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
    ) -> Version:
        """Commit a pending publish as the model's new head, in one compare-and-swap transaction.

        docs/CATALOG.md "Commit": ``parent`` must equal the current head (None: the model has
        no committed version), else :class:`~weightsync.errors.StaleParent` (a Conflict)
        carrying ``current_head``, and nothing changes. On success the version gets the next
        number, its ``objects`` [(digest, size)] are referenced and the head moves to it.
        Idempotent: a retry with the same ``publish_id`` (or ``idempotency_key``) and manifest
        returns the original result, even after the head moved on; a different manifest raises
        Conflict. An unknown, aborted or expired publish raises PublishNotFound.

        ``chain_base``: for a keyframe None (it starts its own chain); for a delta None or the
        parent's chain base (derived from the parent either way).
        """
        _label("publish_id", publish_id, _TOKEN_MAX)
        _digest(manifest_digest)
        refs = _refs(objects)
        _nonneg("raw_bytes", raw_bytes)
        _nonneg("stored_bytes", stored_bytes)
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
        if kind == "delta" and parent is None:
            raise ValueError("a delta needs a parent")
        if idempotency_key is not None:
            _label("idempotency_key", idempotency_key, _TOKEN_MAX)
        now = _utc(now)

        def replay(m: ModelRow, row: VersionRow, how: str) -> Version:
            if row.manifest_digest != manifest_digest:
                raise errors.Conflict(
                    f"{how} already committed version {row.number} of {m.name!r} with another manifest"
                )
            return _version(row, m.name)

        def run(s: Session) -> Version:
            m = self._model_row(s, model, lock=True)
            # Idempotency first: a retried commit finds the head already moved by itself.
            if idempotency_key is not None:
                prior = s.scalars(
                    select(VersionRow).where(
                        VersionRow.model_id == m.id,
                        VersionRow.idempotency_key == idempotency_key,
                        VersionRow.committed_at.is_not(None),
                    )
                ).one_or_none()
                if prior is not None:
                    return replay(m, prior, f"idempotency key {idempotency_key!r}")
            row = s.scalars(select(VersionRow).where(VersionRow.publish_id == publish_id)).one_or_none()
            if row is not None and row.model_id == m.id and row.committed_at is not None:
                return replay(m, row, f"publish {publish_id!r}")
            row = self._pending(s, m, publish_id, now)

            if parent != m.head:
                raise errors.StaleParent(
                    f"model {m.name!r}: stated parent {parent} is not the head (head is {m.head})",
                    current_head=m.head,
                )
            base: int | None = None
            if kind == "delta":
                assert parent is not None
                base = self._committed(s, m, parent).chain_base
                if chain_base is not None and chain_base != base:
                    raise ValueError(f"chain_base {chain_base} is not the parent's chain base {base}")
            top = s.scalar(select(func.max(VersionRow.number)).where(VersionRow.model_id == m.id))
            number = (top or 0) + 1
            if kind == "keyframe":
                if chain_base is not None and chain_base != number:
                    raise ValueError(f"a keyframe starts its own chain: chain_base must be None, not {chain_base}")
                base = number

            self._attach_refs(s, row, refs, now)
            # Pending-time references the final list no longer names go back to GC.
            had = s.scalars(select(VersionObjectRow.digest).where(VersionObjectRow.version_id == row.id))
            stale = [d for d in had if d not in refs]
            if stale:
                s.execute(
                    delete(VersionObjectRow).where(
                        VersionObjectRow.version_id == row.id, VersionObjectRow.digest.in_(stale)
                    )
                )
            row.number = number
            row.parent = parent
            row.kind = kind
            row.chain_base = base
            row.state = "committed"
            row.manifest_digest = manifest_digest
            row.raw_bytes = raw_bytes
            row.stored_bytes = stored_bytes
            row.idempotency_key = idempotency_key
            row.committed_at = now
            row.expires_at = None
            m.head = number
            s.flush()
            s.execute(update(ObjectRow).where(ObjectRow.digest == manifest_digest).values(unreferenced_since=None))
            self._mark_unreferenced(s, stale, now)
            return _version(row, m.name)

        return self._tx(run, write=True)

    def abort_pending(self, model: str, publish_id: str, *, now: datetime | None = None) -> Version:
        """Abandon pending publish ``publish_id`` (state deleted) and return it; raises PublishNotFound."""
        now = _utc(now)

        def run(s: Session) -> Version:
            m = self._model_row(s, model, lock=True)
            row = self._pending(s, m, publish_id, now)
            self._drop_versions(s, [row], now)
            return _version(row, m.name)

        return self._tx(run, write=True)

    def expire_pending(self, now: datetime | None = None) -> list[Version]:
        """Mark every pending publish whose ``expires_at`` is at or before ``now`` deleted; return them.

        The rows stay (state ``deleted``, ``deleted_at`` set) as a record; their object
        references are released, which starts those objects' GC grace period.
        """
        now = _utc(now)

        def run(s: Session) -> list[Version]:
            rows = list(
                s.execute(
                    select(VersionRow, ModelRow.name)
                    .join(ModelRow, ModelRow.id == VersionRow.model_id)
                    .where(VersionRow.state == "pending", VersionRow.expires_at <= now)
                    .order_by(VersionRow.id)
                    .with_for_update(of=VersionRow)
                )
            )
            self._drop_versions(s, [r for r, _ in rows], now)
            return [_version(r, name) for r, name in rows]

        return self._tx(run, write=True)

    def list_pending(self, model: str | None = None) -> list[Version]:
        """Return pending publishes (of ``model``, or all), oldest first, expired ones included."""

        def run(s: Session) -> list[Version]:
            stmt = (
                select(VersionRow, ModelRow.name)
                .join(ModelRow, ModelRow.id == VersionRow.model_id)
                .where(VersionRow.state == "pending")
                .order_by(VersionRow.id)
            )
            if model is not None:
                stmt = stmt.where(ModelRow.id == self._model_row(s, model).id)
            return [_version(r, name) for r, name in s.execute(stmt)]

        return self._tx(run)

    # --- reading versions ----------------------------------------------------------------

    def get_version(self, model: str, number: int, *, include_deleted: bool = False) -> Version:
        """Return committed version ``number`` of ``model`` (deleted too if asked); raises VersionNotFound."""

        def run(s: Session) -> Version:
            m = self._model_row(s, model)
            return _version(self._committed(s, m, number, include_deleted=include_deleted), m.name)

        return self._tx(run)

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
        states = tuple(states)
        for st in states:
            if st not in STATES:
                raise ValueError(f"unknown state {st!r}")

        def run(s: Session) -> list[Version]:
            m = self._model_row(s, model)
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
            return [_version(r, m.name) for r in s.scalars(stmt)]

        return self._tx(run)

    def head(self, model: str) -> Version | None:
        """Return the model's head version, or None if nothing is committed yet."""

        def run(s: Session) -> Version | None:
            m = self._model_row(s, model)
            return None if m.head is None else _version(self._committed(s, m, m.head), m.name)

        return self._tx(run)

    def lineage(self, model: str, number: int) -> list[Version]:
        """Return the chain from version ``number``'s keyframe to it, keyframe first.

        Raises VersionNotFound if ``number`` is not committed or a link of its chain is missing.
        """

        def run(s: Session) -> list[Version]:
            m = self._model_row(s, model)
            top = self._committed(s, m, number)
            rows = {
                r.number: r
                for r in s.scalars(
                    select(VersionRow).where(
                        VersionRow.model_id == m.id,
                        VersionRow.state == "committed",
                        VersionRow.number.between(top.chain_base, number),
                    )
                )
            }
            chain = [top]
            while chain[-1].kind == "delta":
                p = chain[-1].parent
                if p not in rows:
                    raise errors.VersionNotFound(
                        f"model {m.name!r}: version {chain[-1].number} needs version {p}, which is not committed"
                    )
                chain.append(rows[p])
            return [_version(r, m.name) for r in reversed(chain)]

        return self._tx(run)

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

    # --- deletion and objects ------------------------------------------------------------

    def retention_candidates(self, model: str) -> list[int]:
        """Return committed numbers beyond the model's ``keep_last`` newest, oldest first.

        Pass them to :meth:`mark_deleted`, which keeps those a remaining version or a lease
        still needs.
        """

        def run(s: Session) -> list[int]:
            m = self._model_row(s, model)
            if m.keep_last is None:
                return []
            nums = s.scalars(
                select(VersionRow.number)
                .where(VersionRow.model_id == m.id, VersionRow.state == "committed")
                .order_by(VersionRow.number.desc())
                .offset(m.keep_last)
            )
            return sorted(n for n in nums if n is not None)

        return self._tx(run)

    def mark_deleted(
        self, model: str, numbers: Iterable[int], *, force: bool = False, now: datetime | None = None
    ) -> list[int]:
        """Mark committed versions ``numbers`` deleted; return the numbers actually deleted.

        Without ``force``, a version is kept (silently left out of the result) if it is the
        head, or in the chain of a version that stays committed, or in the chain of a version
        an active lease holds: deleting it would break a materialization. Already deleted
        numbers are ignored; numbers that never existed raise VersionNotFound. ``force``
        (fsck repair) deletes exactly what is asked; if the head goes, the head moves to
        the newest remaining committed version (or None).
        """
        asked = set(numbers)
        now = _utc(now)

        def run(s: Session) -> list[int]:
            m = self._model_row(s, model, lock=True)
            rows = {
                r.number: r
                for r in s.scalars(
                    select(VersionRow).where(VersionRow.model_id == m.id, VersionRow.number.in_(sorted(asked)))
                )
            }
            missing = asked - set(rows)
            if missing:
                raise errors.VersionNotFound(f"model {m.name!r} has no versions {sorted(missing)}")
            targets = {n for n, r in rows.items() if r.state == "committed"}
            if not force:
                parents = self._parents(s, m)
                roots = (set(parents) - targets) | self._leased(s, m, now)
                if m.head is not None:
                    roots.add(m.head)
                keep: set[int] = set()
                for root in roots & set(parents):
                    keep.update(self._chain(parents, root))
                targets -= keep
            self._drop_versions(s, [rows[n] for n in sorted(targets)], now)
            if m.head in targets:
                m.head = s.scalar(
                    select(func.max(VersionRow.number)).where(
                        VersionRow.model_id == m.id, VersionRow.state == "committed"
                    )
                )
            return sorted(targets)

        return self._tx(run, write=True)

    def referenced_digests(self) -> set[str]:
        """Return every digest a non-deleted version (pending included) refers to, manifests included."""

        def run(s: Session) -> set[str]:
            live = VersionRow.state != "deleted"
            out = set(
                s.scalars(
                    select(VersionObjectRow.digest)
                    .join(VersionRow, VersionRow.id == VersionObjectRow.version_id)
                    .where(live)
                    .distinct()
                )
            )
            manifests = select(VersionRow.manifest_digest).where(live, VersionRow.manifest_digest.is_not(None))
            out.update(s.scalars(manifests))
            return out

        return self._tx(run)

    def record_object(self, digest: str, size: int, *, now: datetime | None = None) -> ObjectInfo:
        """Record that the store holds object ``digest`` of ``size`` bytes; idempotent.

        Recording an object again while it is unreferenced restarts its GC grace period, so
        a publisher that reuses an existing object is not racing GC to its commit. Raises
        DigestMismatch if the object is known with another size.
        """
        _digest(digest)
        _nonneg("size", size)
        now = _utc(now)

        def run(s: Session) -> ObjectInfo:
            self._insert_ignore_objects(
                s, [{"digest": digest, "size": size, "first_seen": now, "unreferenced_since": now}]
            )
            row = s.get(ObjectRow, digest)
            assert row is not None
            if row.size != size:
                raise errors.DigestMismatch(f"object {digest} is recorded with {row.size} bytes, not {size}")
            if row.unreferenced_since is not None and row.unreferenced_since < now:
                row.unreferenced_since = now
            s.flush()
            return _object(row)

        return self._tx(run, write=True)

    def get_object(self, digest: str) -> ObjectInfo | None:
        """Return what the catalog knows of object ``digest``, or None."""
        _digest(digest)
        return self._tx(lambda s: None if (r := s.get(ObjectRow, digest)) is None else _object(r))

    def unreferenced_objects(self, *, before: datetime) -> list[ObjectInfo]:
        """Return recorded objects no non-deleted version refers to, unreferenced since at or before ``before``.

        GC passes ``now - grace``; the result is ordered by digest.
        """
        before = _utc(before)

        def run(s: Session) -> list[ObjectInfo]:
            stmt = (
                select(ObjectRow)
                .where(ObjectRow.unreferenced_since <= before, ~_referenced(ObjectRow.digest))
                .order_by(ObjectRow.digest)
            )
            return [_object(r) for r in s.scalars(stmt)]

        return self._tx(run)

    def forget_object(self, digest: str, *, unreferenced_before: datetime | None = None) -> bool:
        """Remove object ``digest`` from the catalog if nothing refers to it; return whether it was removed.

        With ``unreferenced_before``, only if it has been unreferenced since at or before then
        (GC re-checks its candidate in the same transaction that forgets it). Call before
        deleting the bytes from the store.
        """
        _digest(digest)
        cutoff = _utc(unreferenced_before) if unreferenced_before is not None else None

        def run(s: Session) -> bool:
            conds = [ObjectRow.digest == digest, ~_referenced(ObjectRow.digest)]
            if cutoff is not None:
                conds.append(ObjectRow.unreferenced_since <= cutoff)
            res = s.execute(delete(ObjectRow).where(*conds).execution_options(synchronize_session=False))
            return bool(res.rowcount)

        return self._tx(run, write=True)

    # --- leases ----------------------------------------------------------------------------

    def _leased(self, s: Session, m: ModelRow, now: datetime) -> set[int]:
        return set(
            s.scalars(select(LeaseRow.number).where(LeaseRow.model_id == m.id, LeaseRow.expires_at > now))
        )

    def acquire_lease(
        self, model: str, number: int, holder: str, ttl: timedelta | float, *, now: datetime | None = None
    ) -> Lease:
        """Hold the chain of committed version ``number`` for ``holder`` until ``now + ttl``; return the lease.

        Acquiring again (same model, number, holder) extends the lease. While it is active,
        :meth:`mark_deleted` keeps every version of that chain. Raises VersionNotFound.
        """
        _label("holder", holder)
        ttl = ttl if isinstance(ttl, timedelta) else timedelta(seconds=ttl)
        if ttl <= timedelta(0):
            raise ValueError("ttl must be positive")
        now = _utc(now)

        def run(s: Session) -> Lease:
            m = self._model_row(s, model, lock=True)
            self._committed(s, m, number)
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
            return Lease(m.name, row.number, row.holder, row.acquired_at, row.expires_at)

        return self._tx(run, write=True)

    def release_lease(self, model: str, number: int, holder: str) -> bool:
        """Drop ``holder``'s lease on version ``number``; return whether there was one."""

        def run(s: Session) -> bool:
            m = self._model_row(s, model, lock=True)
            res = s.execute(
                delete(LeaseRow).where(LeaseRow.model_id == m.id, LeaseRow.number == number, LeaseRow.holder == holder)
            )
            return bool(res.rowcount)

        return self._tx(run, write=True)

    def active_leases(self, model: str | None = None, *, now: datetime | None = None) -> list[Lease]:
        """Return leases not expired at ``now`` (of ``model``, or all), by model, number and holder."""
        now = _utc(now)

        def run(s: Session) -> list[Lease]:
            stmt = (
                select(LeaseRow, ModelRow.name)
                .join(ModelRow, ModelRow.id == LeaseRow.model_id)
                .where(LeaseRow.expires_at > now)
                .order_by(ModelRow.name, LeaseRow.number, LeaseRow.holder)
            )
            if model is not None:
                stmt = stmt.where(ModelRow.id == self._model_row(s, model).id)
            return [Lease(name, r.number, r.holder, r.acquired_at, r.expires_at) for r, name in s.execute(stmt)]

        return self._tx(run)

    def purge_expired_leases(self, now: datetime | None = None) -> int:
        """Delete leases expired at ``now``; return how many. (Expired leases already protect nothing.)"""
        now = _utc(now)
        return self._tx(
            lambda s: s.execute(delete(LeaseRow).where(LeaseRow.expires_at <= now)).rowcount or 0, write=True
        )

    # --- replica ledger --------------------------------------------------------------------

    def record_replica(
        self,
        model: str,
        subscriber: str,
        number: int,
        *,
        applied_at: datetime | None = None,
        pause_ms: float | None = None,
        bytes_received: int | None = None,
        site: str | None = None,
        host: str | None = None,
        extra: dict[str, Any] | None = None,
    ) -> Replica:
        """Append a ledger entry: ``subscriber`` applied version ``number`` of ``model``; return it.

        The version must have been committed (it may be deleted since); else VersionNotFound.
        """
        _label("subscriber", subscriber)
        for name, v in (("site", site), ("host", host)):
            if v is not None:
                _label(name, v)
        if pause_ms is not None and (isinstance(pause_ms, bool) or not math.isfinite(pause_ms) or pause_ms < 0):
            raise ValueError(f"pause_ms must be a finite number >= 0, not {pause_ms!r}")
        if bytes_received is not None:
            _nonneg("bytes_received", bytes_received)
        ext = _json_dict("extra", extra)
        applied = _utc(applied_at)

        def run(s: Session) -> Replica:
            m = self._model_row(s, model)
            self._committed(s, m, number, include_deleted=True)
            row = ReplicaRow(
                model_id=m.id,
                subscriber=subscriber,
                number=number,
                applied_at=applied,
                pause_ms=None if pause_ms is None else float(pause_ms),
                bytes_received=bytes_received,
                site=site,
                host=host,
                extra=ext,
            )
            s.add(row)
            s.flush()
            return self._replica(row, m.name)

        return self._tx(run, write=True)

    @staticmethod
    def _replica(r: ReplicaRow, model: str) -> Replica:
        return Replica(
            model=model,
            subscriber=r.subscriber,
            number=r.number,
            applied_at=r.applied_at,
            pause_ms=r.pause_ms,
            bytes_received=r.bytes_received,
            site=r.site,
            host=r.host,
            extra=dict(r.extra or {}),
        )

    def list_replicas(self, model: str, subscriber: str | None = None, *, latest_only: bool = True) -> list[Replica]:
        """Return ledger entries of ``model`` (of one ``subscriber`` if given), by subscriber then time.

        ``latest_only`` keeps each subscriber's most recent entry: where the fleet is now.
        """

        def run(s: Session) -> list[Replica]:
            m = self._model_row(s, model)
            conds = [ReplicaRow.model_id == m.id]
            if subscriber is not None:
                conds.append(ReplicaRow.subscriber == subscriber)
            if latest_only:
                ranked = (
                    select(
                        ReplicaRow.id,
                        func.row_number()
                        .over(
                            partition_by=ReplicaRow.subscriber,
                            order_by=(ReplicaRow.applied_at.desc(), ReplicaRow.id.desc()),
                        )
                        .label("rn"),
                    )
                    .where(*conds)
                    .subquery()
                )
                conds.append(ReplicaRow.id.in_(select(ranked.c.id).where(ranked.c.rn == 1)))
            stmt = (
                select(ReplicaRow)
                .where(*conds)
                .order_by(ReplicaRow.subscriber, ReplicaRow.applied_at, ReplicaRow.id)
            )
            return [self._replica(r, m.name) for r in s.scalars(stmt)]

        return self._tx(run)

    # --- disaster recovery ---------------------------------------------------------------

    def import_version(self, model: str, record: ImportedVersion, *, now: datetime | None = None) -> Version:
        """Insert a committed version with its given number (rebuilding a catalog from manifests).

        Any order works: parents need not be imported first. The head becomes the highest
        committed number. Idempotent: importing the same number with the same manifest again
        returns the existing version; another manifest under that number raises Conflict.
        """
        r = record
        if isinstance(r.number, bool) or not isinstance(r.number, int) or r.number < 1:
            raise ValueError(f"version number must be an integer >= 1, not {r.number!r}")
        if r.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, not {r.kind!r}")
        if r.kind == "keyframe" and r.chain_base != r.number:
            raise ValueError("a keyframe's chain_base is its own number")
        if r.kind == "delta" and (r.parent is None or not 1 <= r.chain_base <= r.parent < r.number):
            raise ValueError("a delta needs a parent below it and a chain_base at or below that")
        _digest(r.manifest_digest)
        refs = _refs(r.objects)
        _nonneg("raw_bytes", r.raw_bytes)
        _nonneg("stored_bytes", r.stored_bytes)
        if r.step is not None:
            _nonneg("step", r.step)
        meta = _json_dict("metadata", r.metadata)
        now = _utc(now)
        committed_at = _utc(r.committed_at) if r.committed_at is not None else now

        def run(s: Session) -> Version:
            m = self._model_row(s, model, lock=True)
            prior = s.scalars(
                select(VersionRow).where(VersionRow.model_id == m.id, VersionRow.number == r.number)
            ).one_or_none()
            if prior is not None:
                if prior.state == "committed" and prior.manifest_digest == r.manifest_digest:
                    return _version(prior, m.name)
                raise errors.Conflict(f"model {m.name!r} already has a version {r.number} ({prior.state})")
            row = VersionRow(
                model_id=m.id,
                number=r.number,
                parent=r.parent,
                kind=r.kind,
                chain_base=r.chain_base,
                state="committed",
                step=r.step,
                metadata_=meta,
                raw_bytes=r.raw_bytes,
                stored_bytes=r.stored_bytes,
                manifest_digest=r.manifest_digest,
                publish_id="import-" + secrets.token_urlsafe(24),
                created_at=committed_at,
                committed_at=committed_at,
            )
            s.add(row)
            s.flush()
            self._attach_refs(s, row, refs, now)
            s.execute(update(ObjectRow).where(ObjectRow.digest == r.manifest_digest).values(unreferenced_since=None))
            if m.head is None or r.number > m.head:
                m.head = r.number
            s.flush()
            return _version(row, m.name)

        return self._tx(run, write=True)

    def dump_committed(self, model: str | None = None) -> dict[str, Any]:
        """Return committed versions and heads as plain JSON data; equal dumps mean equal catalogs.

        Holds exactly what manifests can restore (docs/CATALOG.md "Rebuilding"): per model
        the head, per version number, parent, kind, chain base, step, metadata, sizes, manifest
        digest and sorted object references. Not timestamps, publish ids, idempotency keys,
        settings, pending or deleted versions, leases or the ledger.
        """

        def run(s: Session) -> dict[str, Any]:
            mstmt = select(ModelRow).order_by(ModelRow.name)
            if model is not None:
                mstmt = mstmt.where(ModelRow.id == self._model_row(s, model).id)
            out: dict[str, Any] = {"models": {}, "versions": []}
            for m in s.scalars(mstmt):
                out["models"][m.name] = {"head": m.head}
                vrows = list(
                    s.scalars(
                        select(VersionRow)
                        .where(VersionRow.model_id == m.id, VersionRow.state == "committed")
                        .order_by(VersionRow.number)
                    )
                )
                refs: dict[int, list[list[Any]]] = {v.id: [] for v in vrows}
                for vid, d, size in s.execute(
                    select(VersionObjectRow.version_id, VersionObjectRow.digest, VersionObjectRow.size)
                    .join(VersionRow, VersionRow.id == VersionObjectRow.version_id)
                    .where(and_(VersionRow.model_id == m.id, VersionRow.state == "committed"))
                    .order_by(VersionObjectRow.version_id, VersionObjectRow.digest)
                ):
                    refs[vid].append([d, size])
                for v in vrows:
                    out["versions"].append(
                        {
                            "model": m.name,
                            "number": v.number,
                            "parent": v.parent,
                            "kind": v.kind,
                            "chain_base": v.chain_base,
                            "step": v.step,
                            "metadata": v.metadata_,
                            "raw_bytes": v.raw_bytes,
                            "stored_bytes": v.stored_bytes,
                            "manifest_digest": v.manifest_digest,
                            "objects": refs[v.id],
                        }
                    )
            return out

        return self._tx(run)

