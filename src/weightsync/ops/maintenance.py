"""fsck, gc and catalog rebuild: keeping catalog and store in agreement (docs/DESIGN.md invariants 2, 5).

fsck reads; with ``repair`` it fixes only what is safe: expire stale pending
publishes, rewrite missing commit records, record objects the catalog does not
know, and delete orphans older than the grace period. gc applies retention and
deletes unreferenced objects after the grace period. rebuild restores a lost
catalog from the commit records and manifests in the store.
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass, field
from datetime import timedelta

from weightsync import errors
from weightsync.catalog import Catalog, ImportedVersion
from weightsync.codec.manifest import MAGIC as MANIFEST_MAGIC
from weightsync.ops.core import Ops
from weightsync.ops.records import MAGIC as RECORD_MAGIC
from weightsync.ops.records import CommitRecord, record_of
from weightsync.store import ObjectStore


@dataclass(frozen=True)
class Problem:
    """One finding: what (a stable code), where, and whether repair fixed it."""

    code: str
    detail: str
    model: str | None = None
    number: int | None = None
    digest: str | None = None
    repaired: bool = False


@dataclass
class FsckReport:
    versions_checked: int = 0
    objects_checked: int = 0
    bytes_verified: int = 0
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when nothing is wrong that repair did not fix."""
        return all(p.repaired for p in self.problems)


@dataclass
class GcReport:
    versions_deleted: dict[str, list[int]] = field(default_factory=dict)
    pending_expired: int = 0
    objects_deleted: int = 0
    bytes_deleted: int = 0
    objects_kept_in_grace: int = 0


async def _all_objects(store: ObjectStore) -> dict[str, object]:
    return {info.digest: info async for info in store.list()}


async def _live(ops: Ops) -> tuple[set[str], set[str]]:
    """(digests referenced by non-deleted versions incl. manifests, commit-record digests of committed ones)."""
    referenced = await ops._db(ops.catalog.referenced_digests)
    records = set()
    for m in await ops.list_models():
        for v in await ops.list_versions(m.name, limit=None):
            records.add(record_of(v).digest)
    return referenced, records


async def fsck(ops: Ops, *, read_data: bool = False, repair: bool = False,
               grace: timedelta | None = None) -> FsckReport:
    """Check that every committed version can be served and report what does not belong.

    Checks, per committed version: its manifest is in the store and parses; every
    object its frames name exists and is long enough (with ``read_data``: hashes to
    its name, and the model's head materializes with every checksum matching); its
    commit record exists. Across the store: expired pending publishes, objects the
    catalog has no row for, rows whose object is gone, and orphans (objects no
    version references).
    """
    report = FsckReport()
    now = ops.clock()
    grace = ops.settings.gc_grace if grace is None else grace
    expired = await ops._db(ops.catalog.list_pending)
    expired = [v for v in expired if v.expires_at is not None and v.expires_at <= now]
    if expired:
        done = []
        if repair:
            done = await ops._db(ops.catalog.expire_pending, now)
        for v in expired:
            report.problems.append(Problem("expired-pending", f"publish {v.publish_id} expired at {v.expires_at}",
                                           v.model, None, None, repaired=bool(done)))
    stored = await _all_objects(ops.store)
    verified: set[str] = set()
    for m in await ops.list_models():
        versions = await ops.list_versions(m.name, limit=None)
        for v in versions:
            report.versions_checked += 1
            try:
                manifest = await ops.load_manifest(v.manifest_digest)
            except errors.WeightsyncError as exc:
                report.problems.append(Problem("bad-manifest", str(exc), m.name, v.number, v.manifest_digest))
                continue
            for digest, extent in manifest.objects().items():
                info = stored.get(digest)
                if info is None:
                    report.problems.append(Problem("missing-object", "object referenced by a committed version is "
                                                   "not in the store", m.name, v.number, digest))
                    continue
                if info.size < extent:
                    report.problems.append(Problem("short-object", f"{info.size} bytes, frames need {extent}",
                                                   m.name, v.number, digest))
                    continue
                if read_data and digest not in verified:
                    verified.add(digest)
                    try:
                        data = await ops.fetch_verified(digest)
                        report.bytes_verified += len(data)
                    except errors.WeightsyncError as exc:
                        report.problems.append(Problem("corrupt-object", str(exc), m.name, v.number, digest))
                report.objects_checked += 1
            record = record_of(v)
            if record.digest not in stored:
                fixed = False
                if repair:
                    await ops.write_commit_record(v)
                    fixed = True
                report.problems.append(Problem("missing-commit-record", "commit record not in the store",
                                               m.name, v.number, record.digest, repaired=fixed))
        if read_data and m.head is not None:
            try:
                await ops.materialize(m.name, m.head)
            except errors.WeightsyncError as exc:
                report.problems.append(Problem("unmaterializable", str(exc), m.name, m.head))
    referenced, records = await _live(ops)
    for digest, info in stored.items():
        row = await ops._db(ops.catalog.get_object, digest)
        if row is None:
            if repair:
                await ops._db(ops.catalog.record_object, digest, info.size, now=now)
            report.problems.append(Problem("unrecorded-object", "in the store but unknown to the catalog",
                                           digest=digest, repaired=repair))
        if digest in referenced or digest in records:
            continue
        old = info.mtime <= now - grace
        if repair and old and await ops._db(ops.catalog.forget_object, digest,
                                            unreferenced_before=now - grace if row is not None else None):
            await ops.store.delete(digest)
            report.problems.append(Problem("orphan", "unreferenced object deleted", digest=digest, repaired=True))
        else:
            report.problems.append(Problem("orphan", "unreferenced object" + ("" if old else " (in grace period)"),
                                           digest=digest, repaired=False))
    return report


async def gc(ops: Ops, *, grace: timedelta | None = None, dry_run: bool = False) -> GcReport:
    """Apply retention, then delete objects unreferenced for longer than `grace` (invariant 5).

    Retention keeps each model's newest `keep_last` versions, every version their
    chains need (keyframes included), the head and any chain a reader holds a lease
    on. Objects referenced by pending publishes are never deleted. The catalog row
    is forgotten (re-checking references in that transaction) before the bytes go.
    """
    report = GcReport()
    now = ops.clock()
    grace = ops.settings.gc_grace if grace is None else grace
    if not dry_run:
        report.pending_expired = len(await ops._db(ops.catalog.expire_pending, now))
    for m in await ops.list_models():
        candidates = await ops._db(ops.catalog.retention_candidates, m.name)
        if not candidates:
            continue
        if dry_run:
            report.versions_deleted[m.name] = candidates
            continue
        before = {v.number: v for v in await ops.list_versions(m.name, limit=None)}
        deleted = await ops._db(ops.catalog.mark_deleted, m.name, candidates, now=now)
        if deleted:
            report.versions_deleted[m.name] = deleted
        for n in deleted:  # a rebuilt catalog must not resurrect them
            await ops.store.delete(record_of(before[n]).digest)
    referenced, records = await _live(ops)
    cutoff = now - grace
    async for info in ops.store.list():
        if info.digest in referenced or info.digest in records:
            continue
        if info.mtime > cutoff:
            report.objects_kept_in_grace += 1
            continue
        row = await ops._db(ops.catalog.get_object, info.digest)
        if row is not None and row.unreferenced_since is not None and row.unreferenced_since > cutoff:
            report.objects_kept_in_grace += 1
            continue
        if dry_run:
            report.objects_deleted += 1
            report.bytes_deleted += info.size
            continue
        if row is not None and not await ops._db(ops.catalog.forget_object, info.digest,
                                                  unreferenced_before=cutoff):
            continue  # referenced again (or grace restarted) since we looked
        await ops.store.delete(info.digest)
        report.objects_deleted += 1
        report.bytes_deleted += info.size
    return report


async def rebuild_catalog(store: ObjectStore, catalog: Catalog) -> dict[str, list[int]]:
    """Restore committed versions into an empty (migrated) catalog from the store alone.

    Reads every commit record and the manifest it names; returns the version
    numbers imported per model.
    """
    records: list[CommitRecord] = []
    async for info in store.list():
        head = await store.get(info.digest, offset=0, length=min(info.size, 5))
        if head[:4] != RECORD_MAGIC:
            continue
        data = await store.get(info.digest)
        if hashlib.sha256(data).hexdigest() != info.digest:
            raise errors.DigestMismatch(f"object {info.digest} does not hash to its name")
        records.append(CommitRecord.decode(data))
    imported: dict[str, list[int]] = {}
    from weightsync.codec import Manifest

    for rec in sorted(records, key=lambda r: (r.model, r.number)):
        data = await store.get(rec.manifest)
        if hashlib.sha256(data).hexdigest() != rec.manifest or data[:4] != MANIFEST_MAGIC:
            raise errors.CorruptData(f"manifest {rec.manifest} of {rec.model} v{rec.number} is damaged")
        manifest = Manifest.decode(data)
        sizes = {}
        for digest in manifest.objects():
            sizes[digest] = (await store.stat(digest)).size
        try:
            await asyncio.to_thread(catalog.get_model, rec.model)
        except errors.ModelNotFound:
            await asyncio.to_thread(catalog.create_model, rec.model)
        await asyncio.to_thread(catalog.record_object, rec.manifest, len(data))
        for digest, size in sizes.items():
            await asyncio.to_thread(catalog.record_object, digest, size)
        await asyncio.to_thread(catalog.import_version, rec.model, ImportedVersion(
            number=rec.number, parent=rec.parent, kind=rec.kind, chain_base=rec.chain_base,
            manifest_digest=rec.manifest, raw_bytes=manifest.raw_bytes, stored_bytes=manifest.stored_bytes,
            objects=sorted(sizes.items()), step=rec.step, metadata=rec.metadata, committed_at=rec.committed_at))
        imported.setdefault(rec.model, []).append(rec.number)
    return imported

