"""Use cases over codec, store and catalog: publish, commit, plan, materialize (docs/DESIGN.md).

Publish order (invariant 2): the publisher uploads objects, then the manifest
object; :meth:`Ops.commit_publish` checks that everything the manifest names is
in the store and commits in one catalog transaction (compare-and-swap on the
head, invariant 3), then writes the commit record. A crash anywhere before the
commit leaves only unreferenced objects; fsck and GC reclaim them.

The catalog is synchronous (SQLAlchemy); its calls run in worker threads so the
event loop keeps serving transfers.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections import OrderedDict
from collections.abc import AsyncIterable, AsyncIterator, Callable, Collection, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple, ParamSpec, TypeVar

import numpy as np

from weightsync import errors
from weightsync.catalog import (
    PARTS_PREFIX,
    Catalog,
    ImportedVersion,
    Lease,
    Model,
    ObjectInfo,
    RelayInfo,
    Replica,
    Target,
    Version,
    VersionTotals,
)
from weightsync.codec import Checkpoint, CheckpointFile, Decoder, FrameRef, Manifest
from weightsync.codec.checkpoint import tensor_names
from weightsync.codec.manifest import DIGEST_KINDS
from weightsync.codec.manifest import MAGIC as MANIFEST_MAGIC
from weightsync.codec.parts import merge_parts
from weightsync.codec.validate import check_publishable
from weightsync.common import gc_paused, removal_message, removed_content
from weightsync.ops.follow import FollowTargets
from weightsync.ops.hot import HotObjects
from weightsync.ops.phases import timed
from weightsync.ops.records import record_of
from weightsync.store import ObjectInfo as StoredObject
from weightsync.store import ObjectStore, PresignedRequest, PutResult
from weightsync.store.base import sha256_hex_async

log = logging.getLogger("weightsync.ops")

P = ParamSpec("P")
T = TypeVar("T")

MAX_OBJECT_BYTES = 4 << 30
MAX_MANIFEST_BYTES = 256 << 20
# A digest no object has: readiness probes look it up in the catalog and the store.
_PROBE_DIGEST = "0" * 64
# Uploads up to this size that start like a manifest are parsed as they arrive (Ops._warm_manifest).
MAX_WARM_MANIFEST_BYTES = 32 << 20
WHOLE_PART_BYTES = 4 << 20
"""publishVersion parts up to this size are gathered from the request and stored whole (``ObjectStore.put``);
larger ones are streamed to the store as they arrive."""
_HASH_INLINE_BYTES = 1 << 20
"""A manifest up to this size is hashed on the event loop (~0.5 ms) so that it parses while it is written."""
HOT_OBJECT_BYTES = 16 << 20
"""The largest object the server keeps in memory once written or read whole: a plan bundle carries what it
holds without reading the store (a mid-size update's packed object of frames, ~12 MB for the 436 MB step,
comes to every follower from memory)."""
_REPLAY_WINDOW = 1000
"""Versions after its parent that a retried publishVersion looks through for its own commit."""


@dataclass(frozen=True)
class OpsSettings:
    """Tunables of the use cases (the service fills them from its settings)."""

    pending_ttl: timedelta = timedelta(hours=1)
    gc_grace: timedelta = timedelta(hours=1)
    lease_ttl: timedelta = timedelta(minutes=10)
    max_object_bytes: int = MAX_OBJECT_BYTES
    store_concurrency: int = 16
    manifest_cache: int = 256
    hot_object_bytes: int = 64 << 20
    """Bytes of small objects (up to HOT_OBJECT_BYTES each) kept in memory for the plans that name them (ops/hot.py)."""
    announce: bool = True
    """Announce changes of what followers hold to the other processes on the catalog, and listen for theirs, where
    the catalog can (PostgreSQL: ops/follow.py, catalog/notices.py)."""


@dataclass(frozen=True)
class BeginResult:
    """A pending publish: what to encode (keyframe or delta against `parent`) and its id."""

    model: str
    publish_id: str
    kind: str
    parent: int | None
    parent_manifest: str | None
    expires_at: datetime | None
    missing: list[str] | None = None
    """With the objects of an encoding of the answered kind: those to upload (the others are held)."""
    deleting: tuple[str, ...] = ()
    """Of those objects, the ones GC is deleting (missing too: upload them once GC is done)."""


@dataclass(frozen=True)
class PartsResult:
    """A multi-part publish after a part arrived: the pending publish (or the committed version) and its parts."""

    version: Version
    world: int
    ranks: list[int]

    @property
    def committed(self) -> bool:
        return self.version.state == "committed"


def parts_id(model: str, parent: int | None, step: int) -> str:
    """The publish id every rank of a multi-part publish derives from what it knows (model, parent, step)."""
    key = hashlib.sha256(f"{model}\0{parent}\0{step}".encode()).hexdigest()[:40]
    return f"{PARTS_PREFIX}{key}"


def _check_digests(objects: list[tuple[str, int]]) -> None:
    for digest, _ in objects:
        if not isinstance(digest, str) or len(digest) != 64:
            raise errors.InvalidDigest(f"not a sha-256 digest: {digest!r}")


@dataclass(frozen=True)
class PlanStep:
    """One version to apply: its manifest and the objects its frames live in."""

    number: int
    kind: str
    manifest: str
    manifest_bytes: int
    objects: dict[str, int]
    stored_bytes: int


@dataclass(frozen=True)
class Plan:
    """The versions to apply, in order, to go from `have` to `target`; `bytes` is the download total."""

    model: str
    have: int | None
    target: int
    steps: list[PlanStep]
    bytes: int
    full_bytes: int
    lease: Lease | None = None


@dataclass
class Materialized:
    """A version's files rebuilt in memory, byte for byte."""

    manifest: Manifest
    files: dict[str, np.ndarray] = field(default_factory=dict)


def utcnow() -> datetime:
    """The current time, timezone-aware UTC (the default clock of :class:`Ops`)."""
    return datetime.now(UTC)


def _result(answer: Any) -> Any:
    """One answer of ``gather(..., return_exceptions=True)``: its value, or its exception raised."""
    if isinstance(answer, BaseException):
        raise answer
    return answer


def committed(v: Version) -> tuple[int, str]:
    """A committed version's number and manifest digest (the catalog sets both at commit)."""
    if v.number is None or v.manifest_digest is None:
        raise errors.VersionNotFound(f"a version of {v.model!r} is not committed (publish {v.publish_id})")
    return v.number, v.manifest_digest


def removed(manifest: Manifest, parent: Manifest) -> list[str]:
    """What `parent` holds that `manifest` drops (common.removed_content over their files' tensor names)."""
    return removed_content(
        tensor_names(f.layout for f in parent.files),
        tensor_names(f.layout for f in manifest.files),
        single_file=manifest.single_file and parent.single_file,
    )


FORMATS: tuple[int, ...] = tuple(sorted(DIGEST_KINDS))
"""The manifest formats this server reads (and accepts at commit), answered with every begin."""


class Ops:
    """The use cases. One instance per process (or per event loop); safe for concurrent tasks."""

    def __init__(
        self,
        catalog: Catalog,
        store: ObjectStore,
        settings: OpsSettings | None = None,
        *,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self.catalog = catalog
        self.store = store
        self.settings = settings or OpsSettings()
        self.clock = clock
        self._sem = asyncio.Semaphore(self.settings.store_concurrency)
        # Parsed manifests with what a plan step needs of them: immutable, so cached by digest.
        self._manifests: OrderedDict[str, _Parsed] = OrderedDict()
        # Small objects' bytes as written or read whole, for the plans that follow (ops/hot.py).
        self._hot = HotObjects(self.settings.hot_object_bytes, HOT_OBJECT_BYTES)
        # Whole reads under way (read_whole), by digest: concurrent readers of one object share one store read.
        self._whole_reads: dict[str, asyncio.Task[tuple[bytes, bool]]] = {}
        # Manifests being parsed as they are uploaded (_warm_manifest), by digest.
        self._manifest_loads: dict[str, asyncio.Future[_Parsed]] = {}
        # Committed versions' manifest digests by (model, number): a number is never given twice in a
        # model (deleted versions and deleted models keep theirs), so an entry never changes.
        self._version_manifests: OrderedDict[tuple[str, int], str] = OrderedDict()
        # Commit records written after the commit's answer (commit_publish(record_later=True)).
        self._record_tasks: set[asyncio.Task[None]] = set()
        # The followers waiting in this process (watch, events), one catalog read per model per poll for all of
        # them; a local commit makes it read at once, and so does one through another process where the catalog
        # announces it (PostgreSQL), elsewhere it is found by the poll.
        announces = self.settings.announce and catalog.announces
        self._followers = FollowTargets(
            lambda model: self._db(self.catalog.follow_target, model),
            announce=(lambda payload: self._db(self.catalog.announce, payload)) if announces else None,
            listener=self.catalog.listener if announces else None,
        )

    async def _db(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run a (blocking) catalog call in a worker thread, so the event loop keeps serving."""
        return await asyncio.to_thread(fn, *args, **kwargs)

    async def _creating(
        self, fn: Callable[..., T], model: str, *args: Any, settings: dict[str, Any] | None = None, **kwargs: Any
    ) -> T:
        """``fn(model, *args, now=…, **kwargs)`` in a catalog thread; when the model does not exist, it is created
        (with ``settings``) and `fn` called again."""
        try:
            return await self._db(fn, model, *args, now=self.clock(), **kwargs)
        except errors.ModelNotFound:
            await self._db(self.catalog.create_model, model, now=self.clock(), **(settings or {}))
            return await self._db(fn, model, *args, now=self.clock(), **kwargs)

    # --- models ------------------------------------------------------------------------

    async def create_model(self, name: str, **settings: Any) -> Model:
        """Create model `name` (idempotent when the settings agree); InvalidName, Conflict."""
        return await self._db(self.catalog.create_model, name, now=self.clock(), **settings)

    async def get_model(self, name: str) -> Model:
        return await self._db(self.catalog.get_model, name)

    async def list_models(self) -> list[Model]:
        """Every model, by name."""
        return await self._db(self.catalog.list_models)

    async def update_model_settings(self, name: str, **settings: Any) -> Model:
        """Change the given settings (keyframe_interval, max_chain_ratio, keep_last) of model `name`.

        Others stay; ModelNotFound, InvalidArgument for a bad value.
        """
        return await self._db(self.catalog.update_model_settings, name, **settings)

    # --- publishing --------------------------------------------------------------------

    @timed("begin")
    async def begin_publish(
        self,
        model: str,
        *,
        parent: int | None,
        step: int | None = None,
        metadata: dict[str, Any] | None = None,
        keyframe: bool = False,
        create: bool = True,
        publish_id: str | None = None,
        objects: list[tuple[str, int]] | None = None,
        ask_store: bool = True,
    ) -> BeginResult:
        """Open a publish on top of `parent` (the head the publisher holds; None for the first version).

        Decides keyframe or delta by the model's chain policy: a keyframe when forced,
        when there is no parent, when the chain holds `keyframe_interval` versions, or
        when its deltas add up to more than `max_chain_ratio` of its keyframe. A stale
        parent fails here already (StaleParent) so no encoding work is wasted; the
        binding check is the compare-and-swap at commit. `objects` [(digest, size)]: an
        encoding made before asking (a keyframe when `keyframe`, else a delta on
        `parent`); when the answered kind is that one they are held for the publish as
        :meth:`missing_objects` holds them and the result's `missing` says which to
        upload. One catalog transaction (Catalog.open_publish), plus one the first time
        a model is created. Without `ask_store` the store is not asked: every object is
        missing (a caller that holds all their bytes anyway, publishVersion).
        """
        if objects is not None:
            _check_digests(objects)
        args: dict[str, Any] = dict(
            parent=parent, keyframe=keyframe, publish_id=publish_id, step=step, metadata=metadata, objects=objects
        )
        expires = self.clock() + self.settings.pending_ttl
        if create:
            opened = await self._creating(self.catalog.open_publish, model, expires_at=expires, **args)
        else:
            opened = await self._db(self.catalog.open_publish, model, expires_at=expires, now=self.clock(), **args)
        v = opened.version
        if v.parent != parent:
            raise errors.Conflict(f"publish {v.publish_id!r} was begun on parent {v.parent}, not {parent}")
        missing: list[str] | None = None
        deleting: tuple[str, ...] = ()
        if opened.pinned is not None and objects is not None:
            deleting = opened.pinned.deleting
            if ask_store:
                missing = await self._missing_in_store(objects, set(deleting))
            else:
                missing = [d for d, _ in objects]
        # Beginning again with a pending publish's id returns that publish: its kind, not today's policy's.
        return BeginResult(
            model, v.publish_id, v.kind, parent, opened.parent_manifest, v.expires_at, missing, tuple(deleting)
        )

    async def missing_objects(self, model: str, publish_id: str, objects: list[tuple[str, int]]) -> list[str]:
        """Return which of `objects` [(digest, size)] the publisher must upload; the others are held for it.

        Holding them (a reference from the pending version, taken *before* the store is
        asked) keeps GC away from objects the publish reuses while it uploads the rest, so
        "present" stays true until the commit. An object GC is deleting is missing even if
        the store still has its bytes (DESIGN invariant 7): it must be written again.
        """
        _check_digests(objects)
        pinned = await self._db(self.catalog.reference_objects, model, publish_id, objects, now=self.clock())
        return await self._missing_in_store(objects, set(pinned.deleting))

    async def _missing_in_store(self, objects: list[tuple[str, int]], deleting: set[str]) -> list[str]:
        """Which of `objects` (already referenced by a pending publish) the store lacks, or GC is deleting."""

        async def check(digest: str, size: int) -> str | None:
            if digest in deleting:
                return digest
            async with self._sem:
                try:
                    info = await self.store.stat(digest)
                except errors.ObjectNotFound:
                    return digest
            if info.size != size:
                raise errors.DigestMismatch(f"object {digest} has {info.size} bytes, not {size}")
            # Recorded already: referencing it above made its row (with this size) and stopped its grace clock.
            return None

        found = await asyncio.gather(*(check(d, s) for d, s in objects))
        return [d for d in found if d is not None]

    async def put_object(
        self,
        chunks: AsyncIterable[bytes],
        *,
        expected_digest: str | None = None,
        max_size: int | None = None,
        size: int | None = None,
    ) -> PutResult:
        """Store streamed bytes under their SHA-256 (computed here, never trusted) and record them.

        `size`: the length the sender declared, when known: a body larger than the memory of objects
        keeps is then not held while it streams (the store still checks what arrives)."""
        result = await self._store_stream(chunks, expected_digest=expected_digest, max_size=max_size, size=size)
        await self._record_written(result)
        return result

    async def _store_stream(
        self,
        chunks: AsyncIterable[bytes],
        *,
        expected_digest: str | None,
        max_size: int | None,
        size: int | None = None,
    ) -> PutResult:
        """:meth:`put_object` without the catalog's record (a manifest among the bytes is parsed as it arrives)."""
        limit = min(max_size or self.settings.max_object_bytes, self.settings.max_object_bytes)
        # The bytes of a small object (for the memory of objects), or of what may be a manifest (for
        # _warm_manifest, up to its own cap); None once the object is larger than either keeps.
        kept: list[bytes] | None = []
        manifest = False  # decided by the first bytes

        def keeps(n: int) -> bool:
            return n <= max(self._hot.largest, MAX_WARM_MANIFEST_BYTES if manifest else 0)

        async def teed() -> AsyncIterator[bytes]:
            nonlocal kept, manifest
            got = 0
            async for chunk in chunks:
                if got == 0 and chunk:
                    manifest = chunk[: len(MANIFEST_MAGIC)] == MANIFEST_MAGIC
                    if size is not None and not keeps(size):  # declared too large to keep: not held meanwhile
                        kept = None
                got += len(chunk)
                if kept is not None:
                    if not keeps(got):
                        kept = None
                    elif chunk:
                        kept.append(chunk)
                yield chunk

        result = await self.store.put_stream(teed(), expected_digest=expected_digest, max_size=limit)
        data = None if kept is None else b"".join(kept)
        if data is not None and len(data) == result.size:  # every byte the store named is in hand
            self._hot.put(result.digest, data)
            if manifest:
                self._warm_manifest(result.digest, data)
        return result

    async def put_bytes(self, data: bytes, *, expected_digest: str | None = None) -> PutResult:
        """`put_object` for bytes already in memory."""
        result = await self._store_bytes(data, expected_digest=expected_digest)
        await self._record_written(result)
        return result

    async def _store_bytes(self, data: bytes, *, expected_digest: str | None) -> PutResult:
        """:meth:`put_bytes` without the catalog's record (a manifest among them is parsed into the cache)."""
        if len(data) > self.settings.max_object_bytes:
            raise errors.LimitExceeded(f"object of {len(data)} bytes exceeds {self.settings.max_object_bytes}")
        manifest = data[: len(MANIFEST_MAGIC)] == MANIFEST_MAGIC and len(data) <= MAX_WARM_MANIFEST_BYTES
        if manifest and len(data) <= _HASH_INLINE_BYTES:
            # Hashed here, so it parses while the store writes it: the cache holds only bytes that
            # hash to their digest, whether or not the write then succeeds.
            self._warm_manifest(hashlib.sha256(data).hexdigest(), data)
            manifest = False
        result = await self.store.put(data, expected_digest=expected_digest)
        self._hot.put(result.digest, data)
        if manifest:
            self._warm_manifest(result.digest, data)
        return result

    def _warm_manifest(self, digest: str, data: bytes) -> None:
        """Parse a manifest just uploaded into the cache, off the upload's answer: its commit follows.

        The publisher uploads the manifest with (and usually before the end of) its data objects,
        so the commit finds it parsed instead of reading and parsing it on its own path. `data` is
        what the store hashed to `digest`; bytes that do not parse are left for the commit to refuse.
        """
        if digest in self._manifests or digest in self._manifest_loads:
            return

        async def parse() -> _Parsed:
            entry = await asyncio.to_thread(_parse_manifest, data)
            self._cache_manifest(digest, entry)
            return entry

        def done(task: asyncio.Future[_Parsed]) -> None:
            self._manifest_loads.pop(digest, None)
            if not task.cancelled():
                task.exception()  # retrieved: a manifest that does not parse is the commit's to report

        task = asyncio.ensure_future(parse())
        self._manifest_loads[digest] = task
        task.add_done_callback(done)

    async def _record_written(self, result: PutResult) -> None:
        """Record a written object; StoreUnavailable (retry) if GC is deleting it.

        The store may have kept the old bytes (nothing written) that GC is about to delete:
        the write counts only once GC is done and the object is written again.
        """
        info = await self._db(
            self.catalog.record_object, result.digest, result.size, now=self.clock(), new=result.created
        )
        if info.state == "deleting":
            raise errors.StoreUnavailable(f"object {result.digest} is being garbage-collected: upload it again shortly")

    @timed("commit")
    async def commit_publish(
        self,
        model: str,
        publish_id: str,
        *,
        manifest_digest: str,
        idempotency_key: str | None = None,
        allow_removals: bool = False,
        record_later: bool = False,
        stored: dict[str, int] | None = None,
    ) -> Version:
        """Make the publish visible: validate its manifest and objects, then compare-and-swap the head.

        Raises IncompletePublish if the manifest or an object it names is not in
        the store, a FormatError if the manifest is malformed, Conflict if it does
        not fit the pending publish (other parent, a delta where a keyframe was
        required, deltas against other bytes than the parent's), InvalidCheckpoint
        if its files are not publishable (codec/validate.py: broken safetensors
        layouts, no safetensors weights, pickles), StaleParent if
        another commit moved the head first, PublishNotFound if the publish expired.
        A retry of a commit that succeeded returns the same version. A version that drops
        files or tensors its parent had raises RemovesContent unless ``allow_removals``.

        The commit record (DESIGN invariant 2: after the catalog commit) is written before this
        returns, or with ``record_later`` by a task of its own, off the commit's answer
        (:meth:`drain` waits for those; a record lost to a crash is what fsck --repair rewrites).
        ``stored`` (digest -> size): objects this caller wrote to the store after the publish held
        them, so the store is not asked about them again (GC cannot take a held object).
        """
        same, refs, shown = await self._commit_fields(model, manifest_digest, idempotency_key, allow_removals, stored)
        version = await self._db(self.catalog.commit_held, model, publish_id, **same, now=self.clock())
        if version is None:  # something is not referenced yet: reference it, ask the store again, commit
            await self._hold_for_commit(model, publish_id, [*refs, shown])
            version = await self._db(self.catalog.commit_version, model, publish_id, **same, now=self.clock())
        await self._committed_now(version, record_later)
        return version

    async def _commit_fields(
        self,
        model: str,
        manifest_digest: str,
        idempotency_key: str | None,
        allow_removals: bool,
        stored: dict[str, int] | None,
    ) -> tuple[dict[str, Any], list[tuple[str, int]], tuple[str, int]]:
        """A commit's checks before its catalog transaction (see :meth:`commit_publish`): the commit's fields,
        the data objects' (digest, size) and the manifest's."""
        manifest = await self.load_manifest(manifest_digest, missing=errors.IncompletePublish)  # parsed at upload
        if manifest.model not in (None, model):
            raise errors.Conflict(f"manifest is for model {manifest.model!r}, not {model!r}")
        objects = manifest.objects()

        async def parent_manifest() -> Manifest | None:
            if manifest.parent is None:
                return None
            return await self.load_manifest(await self._manifest_of(model, manifest.parent))

        async def check(digest: str, extent: int) -> tuple[str, int]:
            known = None if stored is None else stored.get(digest)
            if known is not None and known >= extent:
                return digest, known
            async with self._sem:
                try:
                    info = await self.store.stat(digest)
                except errors.ObjectNotFound:
                    raise errors.IncompletePublish(f"object {digest} is not in the store") from None
            if info.size < extent:
                raise errors.IncompletePublish(f"object {digest} has {info.size} bytes, frames need {extent}")
            return digest, info.size

        # The parent's manifest and the store's answers are independent: asked at once (one wait on
        # the commit's path, not one per call), then judged in the order a reader expects.
        answers = await asyncio.gather(
            parent_manifest(),
            check(manifest_digest, 0),
            *(check(d, e) for d, e in objects.items()),
            return_exceptions=True,
        )
        parent = _result(answers[0])
        # The version's files must be publishable, whoever encoded them (codec/validate.py). A retried
        # commit passes again what it passed the first time; the catalog then answers the replay.
        check_publishable([f.layout for f in manifest.files], single_file=manifest.single_file, source="the version")
        if manifest.kind == "delta":
            self._check_bases(manifest, parent)
        dropped = [] if allow_removals or parent is None else removed(manifest, parent)
        if dropped:
            raise errors.RemovesContent(removal_message(manifest.parent, dropped))
        refs: list[tuple[str, int]] = [_result(a) for a in answers[2:]]
        if isinstance(answers[1], errors.IncompletePublish):
            raise errors.IncompletePublish(f"manifest {manifest_digest} is not in the store")
        shown = _result(answers[1])
        # The usual commit: checkObjects referenced every object and the manifest before the store was
        # asked, so its answer holds (DESIGN invariant 7) and the catalog commits in one transaction.
        # The same version whichever way it commits (only the clock is read again).
        same: dict[str, Any] = {
            "parent": manifest.parent,
            "manifest_digest": manifest_digest,
            "objects": refs,
            "raw_bytes": manifest.raw_bytes,
            "stored_bytes": manifest.stored_bytes,
            "kind": manifest.kind,
            "idempotency_key": idempotency_key,
            "as_begun": True,
        }
        return same, refs, shown

    async def _committed_now(self, version: Version, record_later: bool) -> None:
        """After a catalog commit: remember the version, wake the watchers, write the commit record (or start it)."""
        self._remember(version)
        self.wake_followers(version.model)
        if record_later:
            task = asyncio.create_task(self._record_committed(version))
            self._record_tasks.add(task)
            task.add_done_callback(self._record_tasks.discard)
        else:
            await self._record_committed(version)

    async def publish_version(
        self,
        model: str,
        *,
        parent: int | None,
        step: int | None,
        metadata: dict[str, Any] | None,
        keyframe: bool,
        objects: list[tuple[str, int]],
        manifest_digest: str,
        parts: AsyncIterator[tuple[str, int, AsyncIterator[bytes]]],
        idempotency_key: str | None = None,
        allow_removals: bool = False,
        record_later: bool = True,
    ) -> Version | BeginResult:
        """A whole publish in one call (publishVersion): store each of `parts` ((digest, size, bytes) as
        they arrive: every listed object, once), then begin and commit.

        `objects` [(digest, size)] are every object of the version, the manifest among them, encoded
        as a keyframe when `keyframe` is set, else as a delta on `parent`. When the publish's kind is
        not that encoding's (the chain policy asks for a keyframe), nothing is referenced and the
        begun publish is returned, pending, for the usual uploads and commit (what was stored stays
        unreferenced, for GC). Otherwise the version is returned, committed as commit_publish commits
        it (DESIGN invariant 2: every object stored before the catalog commit). A retry whose first
        attempt committed finds the head moved by itself: with the same `idempotency_key` and
        manifest it returns that version (a replay), where beginning alone would raise StaleParent.
        Any failure after the begin aborts the publish (what was stored stays unreferenced, for GC)
        and raises. ``record_later``: as for commit_publish (the commit record written off the
        answer's path).

        Every object is written first. When this call created each of them (the store had none of
        those bytes), one catalog transaction begins and commits the publish (Catalog.publish_whole):
        GC deletes bytes only under a tombstone, which a reference cannot pass, and forgets the
        tombstone in a transaction that raises its fence to that time, so once the publish's
        references are in, a fence older than the first write (less objects.FENCE_MARGIN) says no GC
        deleted these bytes, and a later GC finds them referenced (DESIGN invariant 7). Otherwise (an
        object the store had already, or a GC that deleted something since the first write) the
        objects are referenced first and the store asked about every one before the commit.
        """
        listed = dict(objects)
        if len(listed) != len(objects):
            raise errors.InvalidArgument("publishVersion: an object is listed twice")
        if manifest_digest not in listed:
            raise errors.InvalidArgument(f"publishVersion: the manifest {manifest_digest} is not among the objects")
        _check_digests(objects)
        since = self.clock()  # before the first byte is written (objects.written_after_fence)
        created_all = await self._store_parts(parts, listed)
        same: dict[str, Any] = dict(
            parent=parent,
            step=step,
            metadata=metadata,
            keyframe=keyframe,
            objects=objects,
            manifest_digest=manifest_digest,
            idempotency_key=idempotency_key,
            allow_removals=allow_removals,
            record_later=record_later,
        )
        if not created_all:
            return await self._publish_held(model, **same)
        return await self._publish_whole(model, **same, written_since=since)

    @timed("commit")
    async def _publish_whole(
        self,
        model: str,
        *,
        parent: int | None,
        step: int | None,
        metadata: dict[str, Any] | None,
        keyframe: bool,
        objects: list[tuple[str, int]],
        manifest_digest: str,
        written_since: datetime,
        idempotency_key: str | None,
        allow_removals: bool,
        record_later: bool,
    ) -> Version | BeginResult:
        """publish_version's begin and commit in one catalog transaction, its objects written already, each
        created by this request from `written_since` on: the commit's checks (as commitPublish's, the store
        not asked about them), then Catalog.publish_whole; when it answers with the begin alone, the
        commit as commitPublish's (the store asked about every object, all now referenced)."""
        written = dict(objects)
        try:
            same, refs, _ = await self._commit_fields(model, manifest_digest, idempotency_key, allow_removals, written)
        except errors.WeightsyncError:
            # A refusal of the encoding itself, or one of a delta on another head (its parent's manifest is not
            # what this model holds): a stale publisher learns that it is stale first, as a begin would say.
            await self._head_is(model, parent)
            raise
        whole: dict[str, Any] = dict(
            parent=parent,
            manifest_parent=same["parent"],
            keyframe=keyframe,
            step=step,
            metadata=metadata,
            objects=objects,
            manifest_digest=manifest_digest,
            data_objects=refs,
            raw_bytes=same["raw_bytes"],
            stored_bytes=same["stored_bytes"],
            kind=same["kind"],
            written_since=written_since,
            idempotency_key=idempotency_key,
        )
        expires = self.clock() + self.settings.pending_ttl
        try:
            got = await self._creating(self.catalog.publish_whole, model, **whole, expires_at=expires)
        except errors.StaleParent:
            replay = await self._replay(model, parent, idempotency_key, manifest_digest)
            if replay is None:
                raise
            return replay
        if isinstance(got, Version):
            await self._committed_now(got, record_later)
            return got
        v = got.version
        if got.pinned is None:  # another kind than the one encoded: the publisher encodes again (what was
            # written stays unreferenced, for GC)
            return BeginResult(model, v.publish_id, v.kind, parent, got.parent_manifest, v.expires_at, None, ())
        # Referenced, not committed (a GC since the first write, or a reference the commit lacked): the usual
        # commit takes it from here, asking the store about every object.
        return await self._commit_begun(
            model,
            v.publish_id,
            got.pinned.deleting,
            manifest_digest=manifest_digest,
            idempotency_key=idempotency_key,
            allow_removals=allow_removals,
            record_later=record_later,
        )

    async def _head_is(self, model: str, parent: int | None) -> None:
        """StaleParent unless `parent` is `model`'s head (a missing model has none)."""
        try:
            head = (await self.get_model(model)).head
        except errors.ModelNotFound:
            head = None
        if head != parent:
            raise errors.StaleParent(f"model {model!r}: parent {parent} is not the head ({head})", current_head=head)

    async def _publish_held(
        self,
        model: str,
        *,
        parent: int | None,
        step: int | None,
        metadata: dict[str, Any] | None,
        keyframe: bool,
        objects: list[tuple[str, int]],
        manifest_digest: str,
        idempotency_key: str | None,
        allow_removals: bool,
        record_later: bool,
    ) -> Version | BeginResult:
        """publish_version when the store had some of its objects already: the begin references them all, then
        the commit asks the store about every one (DESIGN invariant 7: each was written before it was held,
        so a GC may have taken it meanwhile)."""
        try:
            begun = await self.begin_publish(
                model, parent=parent, step=step, metadata=metadata, keyframe=keyframe, objects=objects, ask_store=False
            )
        except errors.StaleParent:
            replay = await self._replay(model, parent, idempotency_key, manifest_digest)
            if replay is None:
                raise
            return replay
        if begun.missing is None:  # another kind than the one encoded: the publisher encodes again
            return begun
        return await self._commit_begun(
            model,
            begun.publish_id,
            begun.deleting,
            manifest_digest=manifest_digest,
            idempotency_key=idempotency_key,
            allow_removals=allow_removals,
            record_later=record_later,
        )

    async def _commit_begun(
        self,
        model: str,
        publish_id: str,
        deleting: Sequence[str],
        *,
        manifest_digest: str,
        idempotency_key: str | None,
        allow_removals: bool,
        record_later: bool,
    ) -> Version:
        """publish_version's commit of a publish begun with its objects referenced (`deleting`: those GC holds),
        as commit_publish commits, the store asked about every object; any failure aborts the publish (what was
        stored stays unreferenced, for GC)."""
        try:
            if deleting:  # as an upload of it would be answered (Ops._record_written): retry shortly
                raise errors.StoreUnavailable(f"object {deleting[0]} is being garbage-collected: publish again shortly")
            return await self.commit_publish(
                model,
                publish_id,
                manifest_digest=manifest_digest,
                idempotency_key=idempotency_key,
                allow_removals=allow_removals,
                record_later=record_later,
            )
        except BaseException:
            with contextlib.suppress(errors.WeightsyncError):
                await self.abort_publish(model, publish_id)
            raise

    @timed("store")
    async def _store_parts(
        self, parts: AsyncIterator[tuple[str, int, AsyncIterator[bytes]]], listed: dict[str, int]
    ) -> bool:
        """Store every part of a publishVersion body, each a listed object sent once; whether this call created
        every one (False: the store had some of those bytes already).

        One at a time, in the body's order: a part of up to WHOLE_PART_BYTES is gathered and written
        in one go, a larger one streamed to the store. (Writing a part while the next arrives gained
        nothing measurable on a 2-core box, where the server's Python is the bottleneck, and made the
        order of the store's actions vary from run to run, which the crash-point enumeration of
        tests/reliability needs fixed.) A manifest among them parses meanwhile (`_store_bytes`).
        """
        stored: dict[str, bool] = {}
        async for digest, size, body in parts:
            if listed.get(digest) != size or digest in stored:
                raise errors.InvalidArgument(
                    f"publishVersion: part {digest} ({size} bytes) is not a listed object of that size"
                )
            if size <= WHOLE_PART_BYTES:  # gathered and written in one go: fewer hops to the store's threads
                put = await self._store_bytes(b"".join([chunk async for chunk in body]), expected_digest=digest)
            else:
                put = await self._store_stream(body, expected_digest=digest, max_size=size, size=size)
            stored[digest] = put.created
        if len(stored) != len(listed):
            raise errors.IncompletePublish(
                f"publishVersion: {len(listed) - len(stored)} listed object(s) were not sent"
            )
        return all(stored.values())

    async def _replay(
        self, model: str, parent: int | None, idempotency_key: str | None, manifest_digest: str
    ) -> Version | None:
        """The version committed on `parent` under `idempotency_key` (a retried publishVersion), if any.

        Conflict when that key committed another manifest (as a retried commit would be told)."""
        if idempotency_key is None:
            return None
        after = -1 if parent is None else parent
        for v in await self.list_versions(model, after=after, limit=_REPLAY_WINDOW):
            if v.idempotency_key == idempotency_key and v.parent == parent:
                if v.manifest_digest != manifest_digest:
                    raise errors.Conflict(
                        f"idempotency key {idempotency_key!r} already committed version {v.number} "
                        f"of {model!r} with another manifest"
                    )
                return v
        return None

    def wake_followers(self, model: str) -> None:
        """What followers of `model` hold changed through this process (a commit, a pin, a deletion): its waiters
        hear at once, and those of other processes on the catalog as soon as it announces it (ops/follow.py)."""
        self._followers.changed(model)

    async def aclose(self) -> None:
        """At shutdown (after :meth:`drain`, where commit records must be finished): the followers' listening
        connection closed and announcements under way sent. The catalog may be closed after."""
        await self._followers.aclose()

    async def import_version(self, model: str, record: ImportedVersion, **settings: Any) -> Version:
        """Record a version committed elsewhere under its own number, then wake watchers (a relay's mirror).

        The caller has stored the manifest first; the objects it names are referenced with
        ``record.objects``' sizes whether or not their bytes are here yet (a relay fetches those
        on demand). The model is created with ``settings`` if missing. Idempotent for the same
        manifest (Catalog.import_version); the commit record follows, as for a local commit.
        """
        version = await self._creating(self.catalog.import_version, model, record, settings=settings)
        self._remember(version)
        self.wake_followers(model)
        await self._record_committed(version)
        return version

    async def _record_committed(self, version: Version) -> None:
        """Write a committed version's record; a failure is logged (the version stands; fsck --repair rewrites it)."""
        try:
            await self.write_commit_record(version)
        except errors.WeightsyncError as exc:
            log.warning("commit record for %s v%s not written: %s", version.model, version.number, exc)

    async def drain(self) -> None:
        """Wait until every commit record written off a commit's answer is stored (or failed, logged)."""
        while self._record_tasks:
            await asyncio.gather(*list(self._record_tasks))

    async def _hold_for_commit(self, model: str, publish_id: str, refs: list[tuple[str, int]]) -> None:
        """Reference what the commit needs (`refs`, the manifest included) before trusting the store's answer
        (DESIGN invariant 7).

        The store was asked first (for sizes), so GC may have deleted an object since. Once
        referenced, GC cannot start deleting it, so objects this call newly holds are asked
        again; an object GC is already deleting fails the commit (IncompletePublish). Objects
        the publish held already were referenced before the store was asked: that answer stands.
        """
        try:
            pinned = await self._db(self.catalog.reference_objects, model, publish_id, refs, now=self.clock())
        except errors.PublishNotFound:
            return  # committed meanwhile (a retry) or expired: the commit replays or refuses
        if pinned.deleting:
            raise errors.IncompletePublish(f"object {pinned.deleting[0]} is being deleted by GC: upload it again")

        async def still_there(digest: str) -> None:
            async with self._sem:
                if not await self.store.exists(digest):
                    raise errors.IncompletePublish(f"object {digest} is not in the store")

        await asyncio.gather(*(still_there(d) for d in pinned.added))

    async def write_commit_record(self, version: Version) -> str:
        """Store the commit record of a committed version (idempotent); returns its digest.

        The catalog's objects table gets no row for it: a record's digest follows from its version's row
        (``record_of``), which is how GC keeps the records of live versions and fsck tells them from objects
        the catalog does not know. So a commit costs one write transaction, not two: the record's was
        written right when the subscribers' plan requests arrive (docs/SCALE-RUNS.md, run AO)."""
        data = record_of(version).encode()
        result = await self.store.put(data)
        return result.digest

    async def commit_part(
        self,
        model: str,
        publish_id: str,
        *,
        rank: int,
        world: int,
        manifest_digest: str,
        allow_removals: bool = False,
    ) -> PartsResult:
        """Record part `rank` of `world` of multi-part publish `publish_id`; the last part commits the version.

        The part's manifest (uploaded, its objects held by checkObjects) must be for the publish's
        model, parent and step. It is merged with the parts recorded so far (codec/parts.py):
        PartConflict refuses it (and forgets it) when the merge does. When all `world` parts are
        there, their merge is stored as the version's one manifest and committed by
        :meth:`commit_publish` (the compare-and-swap on the parent; a retry replays it). A retried
        part is idempotent: it answers the group's state, or the committed version.
        """
        part = await self.load_manifest(manifest_digest, missing=errors.IncompletePublish)
        pending = None
        with contextlib.suppress(errors.PublishNotFound):
            pending = await self._db(self.catalog.get_pending, model, publish_id, now=self.clock())
        if pending is not None and (
            part.model not in (None, model) or part.parent != pending.parent or part.step != pending.step
        ):
            raise errors.PartConflict(
                f"part {rank} is for model {part.model!r}, parent {part.parent}, step {part.step}; "
                f"the publish is for parent {pending.parent}, step {pending.step}"
            )
        parts = await self._db(
            self.catalog.record_part,
            model,
            publish_id,
            rank=rank,
            world=world,
            manifest_digest=manifest_digest,
            allow_removals=allow_removals,
            now=self.clock(),
        )
        if parts.version.state == "committed":
            return PartsResult(parts.version, world, sorted(parts.parts))
        manifests = [await self.load_manifest(d, missing=errors.IncompletePublish) for d in parts.parts.values()]
        try:
            merged = merge_parts(manifests)
        except errors.PartConflict:
            await self._db(self.catalog.drop_part, model, publish_id, rank, manifest_digest)
            raise
        if not parts.complete:
            return PartsResult(parts.version, world, sorted(parts.parts))
        merged.number = None
        data = merged.encode()
        stored = await self.put_bytes(data)
        version = await self.commit_publish(
            model, publish_id, manifest_digest=stored.digest, allow_removals=parts.allow_removals, record_later=True
        )
        return PartsResult(version, world, sorted(parts.parts))

    async def abort_publish(self, model: str, publish_id: str) -> Version:
        """Abandon a pending publish; its objects become unreferenced (GC reclaims them)."""
        return await self._db(self.catalog.abort_pending, model, publish_id, now=self.clock())

    @staticmethod
    def _check_bases(manifest: Manifest, parent: Manifest) -> None:
        """Every delta segment's base digest must be the parent version's at that place (invariant 4).

        The digests must be of one kind: a chain never mixes manifest formats (FORMAT §5.4).
        """
        if manifest.digest_kind != parent.digest_kind and any(
            e.base_offset is not None for f in manifest.files for e in f.segments
        ):
            raise errors.BaseMismatch(
                f"a format-{manifest.version} delta on version {manifest.parent}, stored in format "
                f"{parent.version}: a chain never mixes formats (publish a keyframe)"
            )
        if manifest.single_file and len(parent.files) == 1:
            by_path = {manifest.files[0].path: parent.files[0]}
        else:
            by_path = {f.path: f for f in parent.files}
        for f in manifest.files:
            base = by_path.get(f.path)
            spans = {} if base is None else base.spans()
            for e in f.segments:
                if e.base_offset is None:
                    continue
                held = spans.get((e.base_offset, e.segment.length))
                if held is None or held != e.base_digest:
                    raise errors.BaseMismatch(
                        f"{f.path}: {e.segment.kind} {e.segment.name!r} was diffed against bytes that are "
                        f"not version {manifest.parent}'s"
                    )

    # --- reading -----------------------------------------------------------------------

    def _remember(self, version: Version) -> None:
        """Cache a committed version's manifest digest (see ``_version_manifests``)."""
        if version.number is None or version.manifest_digest is None:
            return
        key = (version.model, version.number)
        self._version_manifests[key] = version.manifest_digest
        self._version_manifests.move_to_end(key)
        while len(self._version_manifests) > self.settings.manifest_cache:
            self._version_manifests.popitem(last=False)

    async def _manifest_of(self, model: str, number: int) -> str:
        """The manifest digest of committed version `number` (cached; VersionNotFound if not committed)."""
        digest = self._version_manifests.get((model, number))
        if digest is not None:
            return digest
        v = await self._db(self.catalog.get_version, model, number)
        self._remember(v)
        return committed(v)[1]

    async def load_manifest(
        self, digest: str, *, missing: type[errors.WeightsyncError] = errors.ObjectNotFound
    ) -> Manifest:
        """Fetch, hash-check and parse a manifest object (cached: manifests are immutable)."""
        return (await self._parsed_manifest(digest, missing=missing)).manifest

    async def _parsed_manifest(
        self, digest: str, *, missing: type[errors.WeightsyncError] = errors.ObjectNotFound
    ) -> _Parsed:
        """A manifest with its stored size and what a plan step lists of it (cached together: every plan of
        every follower needs them, without a store round trip or a walk over the manifest's frames)."""
        cached = self._manifests.get(digest)
        if cached is not None:
            self._manifests.move_to_end(digest)
            return cached
        warming = self._manifest_loads.get(digest)
        if warming is not None:
            with contextlib.suppress(Exception):  # did not parse: read it from the store, to refuse it as readers do
                return await asyncio.shield(warming)
        data = await self.read_manifest_bytes(digest, missing=missing)
        entry = await asyncio.to_thread(_parse_manifest, data)
        self._cache_manifest(digest, entry)
        return entry

    def _cache_manifest(self, digest: str, entry: _Parsed) -> None:
        self._manifests[digest] = entry
        self._manifests.move_to_end(digest)
        while len(self._manifests) > self.settings.manifest_cache:
            self._manifests.popitem(last=False)

    async def read_manifest_bytes(
        self, digest: str, *, missing: type[errors.WeightsyncError] = errors.ObjectNotFound
    ) -> bytes:
        try:
            info = await self.store.stat(digest)
            if info.size > MAX_MANIFEST_BYTES:
                raise errors.LimitExceeded(f"manifest object of {info.size} bytes")
            data = await self.store.get(digest)
        except errors.ObjectNotFound:
            raise missing(f"manifest {digest} is not in the store") from None
        if hashlib.sha256(data).hexdigest() != digest:
            raise errors.DigestMismatch(f"stored manifest {digest} does not hash to its name")
        return data

    async def list_versions(self, model: str, **kwargs: Any) -> list[Version]:
        return await self._db(self.catalog.list_versions, model, **kwargs)

    async def version_totals(self, model: str) -> VersionTotals:
        """How many committed versions `model` has and their raw and stored bytes (ModelNotFound)."""
        return await self._db(self.catalog.version_totals, model)

    async def get_version(self, model: str, number: int | None = None) -> Version:
        """Version `number`, or the head; VersionNotFound if the model has none."""
        if number is None:
            head = await self._db(self.catalog.head, model)
            if head is None:
                raise errors.VersionNotFound(f"model {model!r} has no committed version")
            return head
        return await self._db(self.catalog.get_version, model, number)

    async def lineage(self, model: str, number: int) -> list[Version]:
        return await self._db(self.catalog.lineage, model, number)

    @timed("plan")
    async def plan(
        self,
        model: str,
        *,
        have: int | None,
        want: int | None = None,
        holder: str | None = None,
        formats: Collection[int] | None = None,
    ) -> Plan:
        """The cheapest versions to fetch to go from `have` (None: nothing) to `want`.

        `want` None is what followers hold: the pinned version while the model is pinned, else the head.

        Either the deltas after `have` (when `have` is in the target's chain and
        not after it) or the target's keyframe and every delta up to the target,
        whichever moves fewer bytes. With `holder`, a lease on the target's chain
        keeps GC from deleting it while the reader fetches: the holder's lease on that
        chain when it has one with at least half the lease TTL left (a follower's steady
        state: the plan writes nothing), else a lease taken now. `formats`: the manifest
        formats the reader can read (None: any); FormatNotReadable when the chosen
        steps use another (a chain is one format, FORMAT §5.4).
        """
        now = self.clock()
        # One catalog read: the target (or what followers hold), its chain, the holder's lease on it.
        chain, lease = await self._db(self.catalog.reading, model, want, holder=holder or None, now=now)
        number, _ = committed(chain[-1])
        steps = list(await asyncio.gather(*(self._step(v) for v in chain)))  # stats at once, in chain order
        full = sum(s.manifest_bytes + s.stored_bytes for s in steps)
        chosen = steps
        numbers = [v.number for v in chain]
        if have == number:
            chosen = []
        elif have is not None and have in numbers:
            tail = steps[numbers.index(have) + 1 :]
            if sum(s.manifest_bytes + s.stored_bytes for s in tail) <= full:
                chosen = tail
        if formats is not None:
            for s in chosen:
                version = (await self.load_manifest(s.manifest)).version
                if version not in formats:
                    raise errors.FormatNotReadable(
                        f"version {s.number} of {model!r} is stored in manifest format {version}; this client reads "
                        f"{', '.join(map(str, sorted(formats)))}: upgrade weightsync"
                    )
        if holder and (lease is None or lease.expires_at - now < self.settings.lease_ttl / 2):
            lease = await self._db(
                self.catalog.acquire_lease, model, number, holder, self.settings.lease_ttl, now=self.clock()
            )
        return Plan(model, have, number, chosen, sum(s.manifest_bytes + s.stored_bytes for s in chosen), full, lease)

    async def _step(self, v: Version) -> PlanStep:
        number, digest = committed(v)
        parsed = await self._parsed_manifest(digest)
        return PlanStep(number, v.kind, digest, parsed.size, parsed.objects, parsed.stored_bytes)

    async def stat_object(self, digest: str) -> StoredObject:
        """The stored object's size and mtime; ObjectNotFound."""
        return await self.store.stat(digest)

    @property
    def can_presign(self) -> bool:
        """Whether the store hands out presigned URLs (then :meth:`presign_get` and :meth:`presign_uploads` work)."""
        return self.store.capabilities.presigned_urls

    async def presign_get(self, digest: str, expires_s: int) -> str:
        """A URL that GETs an existing object straight from the store for `expires_s` seconds.

        ObjectNotFound if absent; Unsupported if the store cannot presign.
        """
        if not self.can_presign:
            raise errors.Unsupported("this server's store does not hand out presigned URLs")
        await self.store.stat(digest)
        return await self.store.presign_get(digest, expires_s)

    async def presign_uploads(self, objects: dict[str, int], expires_s: int) -> dict[str, PresignedRequest]:
        """Presigned requests that each upload one of `objects` (digest -> size) once; Unsupported if unable."""
        if not self.can_presign:
            raise errors.Unsupported("this server's store does not hand out presigned URLs")
        digests = list(objects)
        signed = await asyncio.gather(*(self.store.presign_put(d, objects[d], expires_s) for d in digests))
        return dict(zip(digests, signed, strict=True))

    def held(self, digest: str) -> bytes | None:
        """An object's bytes if this process holds them in memory (ops/hot.py), else None; no store read."""
        return self._hot.get(digest)

    def transfer_digest(self, digest: str) -> str | None:
        """The xxh3-128 of an object this process holds in memory, taken when it was kept (ops/hot.py), else None."""
        return self._hot.transfer_digest(digest)

    @property
    def memory(self) -> tuple[int, int]:
        """What this process keeps of objects in memory (ops/hot.py): (bytes in all, bytes of the largest)."""
        return self._hot.budget, self._hot.largest

    async def read_whole(self, digest: str) -> bytes:
        """An object's bytes in one read (for small objects; ObjectNotFound when the store lacks it).

        A small object written or read whole lately comes from memory (ops/hot.py), not the store.
        Concurrent calls for one object share one store read (the followers' plans that arrive together
        after a commit, at a server that did not take the upload), and a caller that goes away (its
        request cancelled) does not end it for the others.
        """
        return (await self.read_whole_checked(digest))[0]

    async def read_whole_checked(self, digest: str) -> tuple[bytes, bool]:
        """:meth:`read_whole`, and whether this process checked that the bytes hash to `digest` (those it
        keeps in memory, and those it hashed on this read to keep them; not an object larger than the
        memory keeps, whose bytes go unhashed to a reader that checks them)."""
        data = self._hot.get(digest)
        if data is not None:
            return data, True
        task = self._whole_reads.get(digest)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._read_into_memory(digest))
            self._whole_reads[digest] = task
            task.add_done_callback(lambda t: self._read_done(digest, t))
        return await asyncio.shield(task)

    async def _read_into_memory(self, digest: str) -> tuple[bytes, bool]:
        async with self._sem:
            data = await self.store.get(digest)
        if len(data) > self._hot.largest:
            return data, False
        # Kept only when they are the object's bytes (damaged ones still go to the caller, whose reader checks
        # them, but not to every plan after it), and when no delete_object ran since this read began.
        intact = await sha256_hex_async(data) == digest
        if intact and self._whole_reads.get(digest) is asyncio.current_task():
            self._hot.put(digest, data)
        return data, intact

    def _read_done(self, digest: str, task: asyncio.Task[tuple[bytes, bool]]) -> None:
        if self._whole_reads.get(digest) is task:
            del self._whole_reads[digest]
        if not task.cancelled():
            task.exception()  # retrieved: every caller may have gone (each got it, or was cancelled)

    async def delete_object(self, digest: str) -> None:
        """Delete an object's bytes from the store (idempotent), and from the memory of small objects first."""
        self._hot.drop(digest)
        self._whole_reads.pop(digest, None)  # a read under way does not put the bytes back in memory,
        await self.store.delete(digest)
        self._whole_reads.pop(digest, None)  # nor one that began while the store deleted them

    def read_object(self, digest: str, *, offset: int = 0, length: int | None = None) -> AsyncIterator[bytes]:
        """Stream an object's bytes (or a range) without buffering it whole."""
        return self.store.iter_range(digest, offset=offset, length=length)

    async def fetch_verified(self, digest: str) -> bytes:
        """A whole object, checked against its SHA-256 name (DigestMismatch if the store returns other bytes)."""
        async with self._sem:
            data = await self.store.get(digest)
        if hashlib.sha256(data).hexdigest() != digest:
            raise errors.DigestMismatch(f"object {digest} read back with other bytes")
        return data

    async def materialize(self, model: str, number: int | None = None) -> Materialized:
        """Rebuild a committed version's files byte for byte from the store (keyframe, then each delta)."""
        target = await self.get_version(model, number)
        chain = await self.lineage(model, committed(target)[0])
        decoder = Decoder()
        current: Materialized | None = None
        for v in chain:
            manifest = await self.load_manifest(committed(v)[1])
            digests = list(manifest.objects())
            blobs = dict(zip(digests, await asyncio.gather(*(self.fetch_verified(d) for d in digests)), strict=True))
            base = None
            if current is not None:
                base = Checkpoint(
                    [CheckpointFile(f.layout, current.files[f.path]) for f in current.manifest.files],
                    single_file=current.manifest.single_file,
                )
            outputs = [np.empty(f.size, dtype=np.uint8) for f in manifest.files]

            def read(ref: FrameRef, blobs: dict[str, bytes] = blobs) -> memoryview:
                assert ref.object is not None  # packed frames name their object (FORMAT §5)
                return memoryview(blobs[ref.object])[ref.offset : ref.offset + ref.length]

            await asyncio.to_thread(decoder.decode, manifest, read, outputs, base, verify_segments=True)
            current = Materialized(manifest, {f.path: out for f, out in zip(manifest.files, outputs, strict=True)})
        assert current is not None
        return current

    # --- leases and the replica ledger ---------------------------------------------------

    async def release_lease(self, model: str, number: int, holder: str) -> bool:
        """Drop `holder`'s lease on version `number`; whether there was one."""
        return await self._db(self.catalog.release_lease, model, number, holder)

    async def active_leases(self, model: str | None = None) -> list[Lease]:
        """Leases unexpired now (of `model`, or all): which readers hold which chains."""
        return await self._db(self.catalog.active_leases, model, now=self.clock())

    async def purge_expired_leases(self) -> int:
        """Delete leases expired now (they protect nothing); how many went."""
        return await self._db(self.catalog.purge_expired_leases, self.clock())

    async def record_replica(self, model: str, subscriber: str, number: int | None, **kwargs: Any) -> Replica:
        """Record that `subscriber` holds committed version `number` and drop the leases it needs no more.

        One transaction (Catalog.record_replica with ``release_leases``): its lease on the head's
        chain stays while that is the version's chain (its next plan then writes nothing). `number`
        None with ``status="unhealthy"``: the subscriber's engine holds no verified version; its
        leases stay (it is still trying to reach a version on them).
        """
        return await self._db(self.catalog.record_replica, model, subscriber, number, release_leases=True, **kwargs)

    async def list_replicas(
        self, model: str, subscriber: str | None = None, *, latest_only: bool = True
    ) -> list[Replica]:
        """The ledger of `model` (each subscriber's latest entry, unless not `latest_only`); lag from the head now."""
        return await self._db(self.catalog.list_replicas, model, subscriber, latest_only=latest_only)

    async def record_relay(self, name: str, **report: Any) -> RelayInfo:
        """Record a relay's heartbeat (site, upstream, degraded, state: Catalog.record_relay)."""
        return await self._db(self.catalog.record_relay, name, now=self.clock(), **report)

    async def list_relays(self) -> list[RelayInfo]:
        """Every relay's latest heartbeat, by name."""
        return await self._db(self.catalog.list_relays)

    async def claim_fetch(self, digest: str, holder: str, ttl: timedelta) -> bool:
        """Claim the upstream fetch of ``digest`` among relay replicas sharing the catalog (Catalog.claim_fetch)."""
        return await self._db(self.catalog.claim_fetch, digest, holder, ttl=ttl, now=self.clock())

    async def release_fetch(self, digest: str, holder: str) -> bool:
        """End ``holder``'s fetch claim on ``digest``."""
        return await self._db(self.catalog.release_fetch, digest, holder)

    # --- maintenance (fsck, gc, readiness) ------------------------------------------------

    async def check_catalog(self) -> None:
        """Raise unless a catalog query answers (readiness): a lookup in the objects table."""
        await self._db(self.catalog.get_object, _PROBE_DIGEST)

    async def check_store(self) -> None:
        """Raise unless the store answers (readiness)."""
        await self.store.exists(_PROBE_DIGEST)

    async def list_pending(self, model: str | None = None) -> list[Version]:
        """Pending publishes (of `model`, or all), expired ones included."""
        return await self._db(self.catalog.list_pending, model)

    async def expire_pending(self) -> list[Version]:
        """Mark pending publishes expired now deleted (their objects enter GC's grace); return them."""
        return await self._db(self.catalog.expire_pending, self.clock())

    async def retention_candidates(self, model: str) -> list[int]:
        """Committed numbers beyond the model's `keep_last` newest, oldest first."""
        return await self._db(self.catalog.retention_candidates, model)

    async def delete_versions(self, model: str, numbers: Sequence[int], *, force: bool = False) -> list[int]:
        """Mark versions deleted, keeping what a remaining version or a lease needs unless `force`; the deleted."""
        return await self._db(self.catalog.mark_deleted, model, numbers, force=force, now=self.clock())

    async def referenced_digests(self) -> set[str]:
        """Every digest a non-deleted version (pending included) refers to, manifests included."""
        return await self._db(self.catalog.referenced_digests)

    async def object_records(self, digests: Sequence[str]) -> dict[str, ObjectInfo]:
        """What the catalog knows of each of `digests` (unknown ones left out)."""
        return await self._db(self.catalog.get_objects, digests)

    async def record_object(self, digest: str, size: int) -> ObjectInfo:
        """Record an object the store holds (fsck repair); its record."""
        return await self._db(self.catalog.record_object, digest, size, now=self.clock())

    async def begin_object_deletion(
        self, candidates: Sequence[tuple[str, int, datetime]], *, unreferenced_before: datetime, now: datetime
    ) -> list[str]:
        """GC phase 1: tombstone the eligible candidates [(digest, size, stored_at)], stamped `now`; their digests."""
        return await self._db(
            self.catalog.begin_object_deletion, candidates, unreferenced_before=unreferenced_before, now=now
        )

    async def finish_object_deletion(self, digests: Sequence[str], *, stamp: datetime) -> int:
        """GC phase 3: forget tombstoned objects whose bytes are gone (only those stamped `stamp`)."""
        return await self._db(self.catalog.finish_object_deletion, digests, stamp=stamp, now=self.clock())

    async def resume_object_deletions(self, *, before: datetime, now: datetime) -> list[tuple[str, int]]:
        """Take over tombstones a dead GC left since `before`, re-stamped `now`; [(digest, size)]."""
        return await self._db(self.catalog.resume_object_deletions, before=before, now=now)

    async def dump_committed(self, model: str | None = None) -> dict[str, Any]:
        """What a rebuild from the store restores, as JSON data: compare a rebuilt catalog's with the live one's."""
        return await self._db(self.catalog.dump_committed, model)

    async def wait_for_version(
        self, model: str, *, after: int | None, timeout: float, poll: float = 0.25, absent_ok: bool = True
    ) -> Target | None:
        """Wait until a follower holding `after` must move (`Target.news_for`); return the target, or None on timeout.

        The target is the pinned version while the model is pinned (answered as soon as `after`
        is another), else the head once it is newer than `after`. A model that does not exist
        (yet: a replica may start before the trainer's first push) is waited for like one without
        versions; with ``absent_ok`` False it raises ModelNotFound instead. Reads the catalog as it
        begins, then takes what one task per model reads for every waiter of this process every
        `poll` seconds (ops/follow.py), so it sees commits and pins made through any service process
        sharing the catalog; a commit made through this process makes that task read at once.
        """
        return await self._followers.wait(model, after=after, timeout=timeout, poll=poll, absent_ok=absent_ok)


class _Parsed(NamedTuple):
    """A manifest as the service keeps it: parsed, with its stored size and its plan step's figures."""

    manifest: Manifest
    size: int
    """Bytes of the manifest object."""
    objects: dict[str, int]
    """``manifest.objects()``, shared by every plan that lists the version: never mutated."""
    stored_bytes: int


def _parse_manifest(data: bytes) -> _Parsed:
    """Parse a manifest with the cyclic collector held off: one of tens of thousands of tensors is as many
    small objects, and the collections their allocation sets off walk the whole heap (common.gc_paused)."""
    with gc_paused():
        manifest = Manifest.decode(data)
        return _Parsed(manifest, len(data), manifest.objects(), manifest.stored_bytes)
