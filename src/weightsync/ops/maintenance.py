"""fsck, gc and catalog rebuild: keeping catalog and store in agreement (docs/DESIGN.md invariants 2, 5, 7).

fsck reads; with ``repair`` it fixes only what is safe: expire stale pending
publishes, rewrite missing commit records, record objects the catalog does not
know, and delete orphans older than the grace period (GC's own sweep). gc applies
retention, purges expired leases and deletes unreferenced objects after the grace
period. Both reach the catalog only through public :class:`Ops` methods. rebuild restores a
lost catalog from the commit records and manifests in the store.
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from weightsync import errors
from weightsync.catalog import Catalog, ImportedVersion
from weightsync.codec.manifest import MAGIC as MANIFEST_MAGIC
from weightsync.ops.core import Ops, committed
from weightsync.ops.records import MAGIC as RECORD_MAGIC
from weightsync.ops.records import CommitRecord, record_of
from weightsync.store import ObjectInfo as StoredObject
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
    """What fsck checked and found."""

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
    """What gc deleted (in a dry run: would delete) and kept."""

    versions_deleted: dict[str, list[int]] = field(default_factory=dict)
    pending_expired: int = 0
    objects_deleted: int = 0
    bytes_deleted: int = 0
    objects_kept_in_grace: int = 0
    leases_purged: int = 0


@dataclass
class Sweep:
    """What one pass over the store found among unreferenced objects (commit records of live versions excluded)."""

    #: Deleted (in a dry run: would be deleted).
    deleted: list[StoredObject] = field(default_factory=list)
    #: Unreferenced, but written or unreferenced within the grace period.
    in_grace: list[StoredObject] = field(default_factory=list)


#: Objects per GC batch: tombstoned in one transaction, deleted, then forgotten.
SWEEP_BATCH = 256


async def _live(ops: Ops) -> tuple[set[str], set[str]]:
    """(digests referenced by non-deleted versions incl. manifests, commit-record digests of committed ones)."""
    referenced = await ops.referenced_digests()
    records = set()
    for m in await ops.list_models():
        for v in await ops.list_versions(m.name, limit=None):
            records.add(record_of(v).digest)
    return referenced, records


async def _delete_tombstoned(ops: Ops, digests: list[str], stamp: datetime) -> None:
    """GC phases 2 and 3: delete the bytes of objects tombstoned with `stamp`, then forget them."""
    for digest in digests:
        await ops.delete_object(digest)
    await ops.finish_object_deletion(digests, stamp=stamp)


async def _forget_record_rows(ops: Ops, digests: list[str]) -> None:
    """Forget the objects rows of commit records whose bytes were just deleted. Records written before they went to
    the store only (07fb924) have one each, which nothing else removes: GC's sweep starts from the store's listing,
    where those bytes no longer are. GC's phases 1 and 3 (phase 2, the bytes, is done); a row left by a crash in
    between is left as before."""
    if not digests:  # retention kept every candidate (leases, chains): no catalog read for nothing
        return
    rows = await ops.object_records(digests)
    if not rows:
        return
    now = ops.clock()
    turned = await ops.begin_object_deletion(
        [(d, row.size, row.first_seen) for d, row in rows.items()], unreferenced_before=now, now=now
    )
    await ops.finish_object_deletion(turned, stamp=now)


async def sweep(ops: Ops, *, grace: timedelta, dry_run: bool) -> Sweep:
    """Delete objects no non-deleted version references, unreferenced for longer than `grace` (invariants 5, 7).

    Three phases per batch: tombstone the candidates in one catalog transaction that re-checks
    they are unreferenced and past their grace (an object the catalog never recorded gets a
    tombstone too), delete their bytes, forget the rows. While an object is tombstoned no
    publish can reference it, so no commit can name bytes being deleted. Tombstones a dead GC
    left behind longer than `grace` ago are finished first. `dry_run` changes nothing.
    """
    now = ops.clock()
    cutoff = now - grace
    found = Sweep()
    if not dry_run:
        stale = await ops.resume_object_deletions(before=cutoff, now=now)
        await _delete_tombstoned(ops, [d for d, _ in stale], now)
    referenced, records = await _live(ops)
    old: list[StoredObject] = []
    async for info in ops.store.list():
        if info.digest in referenced or info.digest in records:
            continue
        if info.mtime > cutoff:
            found.in_grace.append(info)
        else:
            old.append(info)
    for i in range(0, len(old), SWEEP_BATCH):
        batch = old[i : i + SWEEP_BATCH]
        rows = await ops.object_records([info.digest for info in batch])
        eligible = []
        for info in batch:
            row = rows.get(info.digest)
            if (
                row is None
                or row.state == "deleting"
                or (row.unreferenced_since is not None and row.unreferenced_since <= cutoff)
            ):
                eligible.append(info)
            elif row.unreferenced_since is not None:
                found.in_grace.append(info)
            # else: referenced again since the listing; not garbage.
        if dry_run:
            found.deleted.extend(eligible)
            continue
        turned = set(
            await ops.begin_object_deletion(
                [(o.digest, o.size, o.mtime) for o in eligible], unreferenced_before=cutoff, now=now
            )
        )
        await _delete_tombstoned(ops, sorted(turned), now)
        found.deleted.extend(o for o in eligible if o.digest in turned)
    return found


async def fsck(
    ops: Ops, *, read_data: bool = False, repair: bool = False, grace: timedelta | None = None
) -> FsckReport:
    """Check that every committed version can be served and report what does not belong.

    Checks, per committed version: its manifest is in the store and parses; every
    object its frames name exists and is long enough (with ``read_data``: hashes to
    its name, and the model's head materializes with every checksum matching); its
    commit record exists. Across the store: expired pending publishes, objects the
    catalog has no row for, and orphans (objects no version references), found by
    GC's own :func:`sweep` (which deletes them past the grace period only with ``repair``).
    Commit records still being written after their commits' answers are waited for first.
    """
    await ops.drain()
    report = FsckReport()
    now = ops.clock()
    grace = ops.settings.gc_grace if grace is None else grace
    expired = [v for v in await ops.list_pending() if v.expires_at is not None and v.expires_at <= now]
    if expired:
        done = []
        if repair:
            done = await ops.expire_pending()
        for v in expired:
            report.problems.append(
                Problem(
                    "expired-pending",
                    f"publish {v.publish_id} expired at {v.expires_at}",
                    v.model,
                    None,
                    None,
                    repaired=bool(done),
                )
            )
    stored = {info.digest: info async for info in ops.store.list()}
    verified: set[str] = set()
    records: set[str] = set()  # the commit records of the versions checked: known by their versions' rows
    for m in await ops.list_models():
        versions = await ops.list_versions(m.name, limit=None)
        for v in versions:
            report.versions_checked += 1
            records.add(record_of(v).digest)
            try:
                manifest = await ops.load_manifest(committed(v)[1])
            except errors.WeightsyncError as exc:
                report.problems.append(Problem("bad-manifest", str(exc), m.name, v.number, v.manifest_digest))
                continue
            for digest, extent in manifest.objects().items():
                info = stored.get(digest)
                if info is None:
                    report.problems.append(
                        Problem(
                            "missing-object",
                            "object referenced by a committed version is not in the store",
                            m.name,
                            v.number,
                            digest,
                        )
                    )
                    continue
                if info.size < extent:
                    report.problems.append(
                        Problem("short-object", f"{info.size} bytes, frames need {extent}", m.name, v.number, digest)
                    )
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
                report.problems.append(
                    Problem(
                        "missing-commit-record",
                        "commit record not in the store",
                        m.name,
                        v.number,
                        record.digest,
                        repaired=fixed,
                    )
                )
        if read_data and m.head is not None:
            try:
                await ops.materialize(m.name, m.head)
            except errors.WeightsyncError as exc:
                report.problems.append(Problem("unmaterializable", str(exc), m.name, m.head))
    known = await ops.object_records([d for d in stored if d not in records])
    unrecorded = [d for d in stored if d not in known and d not in records]
    # Orphans first: recording an unrecorded object would restart its grace period.
    orphans = await sweep(ops, grace=grace, dry_run=not repair)
    deleted = {o.digest for o in orphans.deleted}
    for digest in unrecorded:
        if repair and digest not in deleted:
            await ops.record_object(digest, stored[digest].size)
        report.problems.append(
            Problem("unrecorded-object", "in the store but unknown to the catalog", digest=digest, repaired=repair)
        )
    for o in orphans.deleted:
        report.problems.append(
            Problem(
                "orphan",
                "unreferenced object deleted" if repair else "unreferenced object",
                digest=o.digest,
                repaired=repair,
            )
        )
    for o in orphans.in_grace:
        report.problems.append(Problem("orphan", "unreferenced object (in grace period)", digest=o.digest))
    return report


async def gc(ops: Ops, *, grace: timedelta | None = None, dry_run: bool = False) -> GcReport:
    """Apply retention, purge expired leases, then delete objects unreferenced for longer than `grace`.

    Retention keeps each model's newest `keep_last` versions, every version their
    chains need (keyframes included), the head and any chain a reader holds a lease
    on. Objects referenced by pending publishes are never deleted. Objects go through
    :func:`sweep`: tombstoned (re-checking references in that transaction), deleted,
    forgotten (invariants 5 and 7).
    """
    report = GcReport()
    grace = ops.settings.gc_grace if grace is None else grace
    if not dry_run:
        report.pending_expired = len(await ops.expire_pending())
        report.leases_purged = await ops.purge_expired_leases()
    for m in await ops.list_models():
        candidates = await ops.retention_candidates(m.name)
        if not candidates:
            continue
        if dry_run:
            report.versions_deleted[m.name] = candidates
            continue
        before = {v.number: v for v in await ops.list_versions(m.name, limit=None)}
        deleted = await ops.delete_versions(m.name, candidates)
        if deleted:
            report.versions_deleted[m.name] = deleted
        records = [record_of(before[n]).digest for n in deleted]
        for digest in records:  # a rebuilt catalog must not resurrect them
            await ops.delete_object(digest)
        await _forget_record_rows(ops, records)
    found = await sweep(ops, grace=grace, dry_run=dry_run)
    report.objects_deleted = len(found.deleted)
    report.bytes_deleted = sum(o.size for o in found.deleted)
    report.objects_kept_in_grace = len(found.in_grace)
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
        await asyncio.to_thread(
            catalog.import_version,
            rec.model,
            ImportedVersion(
                number=rec.number,
                parent=rec.parent,
                kind=rec.kind,
                chain_base=rec.chain_base,
                manifest_digest=rec.manifest,
                raw_bytes=manifest.raw_bytes,
                stored_bytes=manifest.stored_bytes,
                objects=sorted(sizes.items()),
                step=rec.step,
                metadata=rec.metadata,
                committed_at=rec.committed_at,
            ),
        )
        imported.setdefault(rec.model, []).append(rec.number)
    return imported
