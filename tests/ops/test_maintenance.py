"""GC grace and retention (invariant 5), catalog rebuild from the store, crash in the commit transaction."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path

import pytest
from _publish import Stopped, publish
from test_publish import files_of, publish_all

from weightsync import errors
from weightsync.catalog import Catalog
from weightsync.ops import fsck, gc, rebuild_catalog
from weightsync.ops.records import record_of

pytestmark = pytest.mark.anyio


async def stored(ops) -> set[str]:
    return {i.digest async for i in ops.store.list()}


async def test_gc_waits_for_the_grace_period(ops, clock, versions):
    await publish_all(ops, versions[:2])
    with pytest.raises(Stopped) as stop:
        await publish(ops, "m", versions[2], versions[1], 2, stop_after="manifest")
    before = await stored(ops)
    # Pending publishes hold their objects: GC deletes none of them, whatever the clock says.
    report = await gc(ops, grace=__import__("datetime").timedelta(0))
    assert report.objects_deleted <= 1  # at most the manifest object, which nothing references yet
    await ops.abort_publish("m", stop.value.args[0])
    report = await gc(ops)
    assert report.objects_deleted == 0 and report.objects_kept_in_grace > 0
    clock.advance(minutes=6)
    report = await gc(ops)
    assert report.objects_deleted > 0
    after = await stored(ops)
    assert after < before
    for n in (1, 2):  # committed versions are untouched
        got = await ops.materialize("m", n)
        assert {p: a.tobytes() for p, a in got.files.items()} == files_of(versions[n - 1])


async def test_retention_keeps_chains_and_leases(ops, clock, versions):
    await ops.create_model("m", keep_last=1, keyframe_interval=3)
    await publish_all(ops, versions)  # kinds: K D D K D
    lease = (await ops.plan("m", have=None, want=2, holder="reader-a")).lease
    assert lease is not None
    report = await gc(ops)
    # v5 needs v4 (its keyframe); the lease on v2 keeps its whole chain: v1..v2 being read, v3 read next.
    assert report.versions_deleted == {}
    assert [v.number for v in await ops.list_versions("m")] == [1, 2, 3, 4, 5]
    await ops.release_lease("m", 2, "reader-a")
    report = await gc(ops)
    assert report.versions_deleted == {"m": [1, 2, 3]}
    clock.advance(minutes=10)
    report = await gc(ops)
    assert report.objects_deleted > 0
    for n in (4, 5):
        got = await ops.materialize("m", n)
        assert {p: a.tobytes() for p, a in got.files.items()} == files_of(versions[n - 1])
    assert (await fsck(ops, read_data=True)).problems == []


async def test_a_follower_leases_each_chain_once(ops, clock, versions):
    """A follower's plans along a chain reuse its lease (no catalog write) until half its TTL is gone;
    its report keeps the lease on the head's chain and drops the rest; retention keeps leased chains."""
    await ops.create_model("m", keep_last=1)
    await publish_all(ops, versions[:1])
    first = (await ops.plan("m", have=None, holder="r")).lease
    assert first is not None and (first.number, first.expires_at) == (1, clock.now + timedelta(minutes=10))
    await ops.record_replica("m", "r", 1)  # applied v1: the lease on the head's chain stays
    assert await ops.active_leases("m") == [first]

    await publish(ops, "m", versions[1], versions[0], 1)
    clock.advance(minutes=4)
    plan = await ops.plan("m", have=1, holder="r")
    assert [s.number for s in plan.steps] == [2] and plan.lease == first  # held: nothing written
    assert await ops.active_leases("m") == [first]
    await ops.record_replica("m", "r", 2)
    clock.advance(minutes=2)  # 4 minutes left of 10: renewed on the plan's target
    renewed = (await ops.plan("m", have=2, holder="r")).lease
    assert renewed is not None and (renewed.number, renewed.expires_at) == (2, clock.now + timedelta(minutes=10))
    assert (await ops.plan("m", have=2, holder="r")).lease == renewed

    # A new keyframe: another chain, another lease; v1..v2 stay while a lease holds their chain.
    await publish(ops, "m", versions[2], None, 2, keyframe=True)
    assert (await gc(ops)).versions_deleted == {}
    third = (await ops.plan("m", have=2, holder="r")).lease
    assert third is not None and third.number == 3
    assert {x.number for x in await ops.active_leases("m")} == {1, 2, 3}
    await ops.record_replica("m", "r", 3)  # applied v3: it needs nothing of chain 1 any more
    assert await ops.active_leases("m") == [third]
    assert (await gc(ops)).versions_deleted == {"m": [1, 2]}
    # Another holder has nothing to reuse; a report of a version off the head's chain drops them all.
    await ops.plan("m", have=None, holder="r2")
    assert {(x.holder, x.number) for x in await ops.active_leases("m")} == {("r", 3), ("r2", 3)}
    await publish(ops, "m", versions[3], None, 3, keyframe=True)
    await ops.record_replica("m", "r", 3)
    assert [x.holder for x in await ops.active_leases("m")] == ["r2"]
    with pytest.raises(errors.VersionNotFound):
        await ops.record_replica("m", "r", 1)  # deleted: no report


async def test_catalog_rebuilt_from_the_store_equals_the_original(ops, backends, tmp_path, versions):
    await ops.create_model("m", keyframe_interval=3)
    await publish_all(ops, versions, model="m")
    await publish_all(ops, versions[:2], model="other")
    fresh = Catalog.open(f"sqlite:///{tmp_path / 'rebuilt.db'}")
    try:
        imported = await rebuild_catalog(ops.store, fresh)
        assert imported == {"m": [1, 2, 3, 4, 5], "other": [1, 2]}
        assert fresh.dump_committed() == ops.catalog.dump_committed()
    finally:
        fresh.close()


async def test_rebuild_skips_versions_gc_deleted(ops, clock, tmp_path, versions):
    await ops.create_model("m", keep_last=2, keyframe_interval=2)
    await publish_all(ops, versions)  # K D K D K
    await gc(ops)
    fresh = Catalog.open(f"sqlite:///{tmp_path / 'rebuilt.db'}")
    try:
        await rebuild_catalog(ops.store, fresh)
        assert fresh.dump_committed() == ops.catalog.dump_committed()
    finally:
        fresh.close()


CRASHER = textwrap.dedent("""
    import asyncio, os, sys
    sys.path[:0] = [{tests!r}, {ops_tests!r}]
    from sqlalchemy import event
    from weightsync.catalog import Catalog
    from weightsync.store.fs import FsStore
    from weightsync.ops import Ops
    from _versions import model_files, next_step, checkpoint
    from _publish import publish

    catalog = Catalog.open({url!r})
    # Die inside the commit transaction: after the version row changed, before COMMIT.
    armed = {{"on": False}}
    @event.listens_for(catalog.engine, "commit")
    def die(conn):
        if armed["on"]:
            os._exit(17)
    ops = Ops(catalog, FsStore({store!r}))
    orig = catalog.commit_version
    def commit(*a, **k):
        armed["on"] = True
        return orig(*a, **k)
    catalog.commit_version = commit
    t0 = model_files()
    asyncio.run(publish(ops, "m", checkpoint(next_step(t0, 1), 1), checkpoint(t0, 0), 1))
""")


@pytest.mark.parametrize("db", ["sqlite", pytest.param("pg", marks=pytest.mark.postgres)])
async def test_crash_inside_the_commit_transaction_leaves_nothing_visible(db, tmp_path, clock):
    from _pg import fresh_database
    from _versions import checkpoint, model_files

    from weightsync.ops import Ops, OpsSettings
    from weightsync.store.fs import FsStore

    ctx = fresh_database() if db == "pg" else None
    url = ctx.__enter__() if ctx else f"sqlite:///{tmp_path / 'c.db'}"
    try:
        catalog = Catalog.open(url)
        ops = Ops(catalog, FsStore(tmp_path / "store"), OpsSettings(), clock=clock)
        await publish(ops, "m", checkpoint(model_files(), 0), None, None)
        tests = str(Path(__file__).resolve().parents[1])
        script = CRASHER.format(
            tests=tests, ops_tests=str(Path(__file__).parent), url=url, store=str(tmp_path / "store")
        )
        proc = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env={**os.environ}
        )
        assert proc.returncode == 17, proc.stderr
        assert [v.number for v in await ops.list_versions("m")] == [1]
        assert (await ops.get_version("m")).number == 1
        clock.advance(hours=3)
        await fsck(ops, repair=True)
        clock.advance(hours=3)
        report = await fsck(ops, repair=True)
        assert report.ok
        assert (await fsck(ops)).problems == []
        await ops.aclose()
        await ops.store.close()
        catalog.close()
    finally:
        if ctx:
            ctx.__exit__(None, None, None)


async def test_gc_never_deletes_what_a_version_references(ops, clock, versions):
    await publish_all(ops, versions[:3])
    clock.advance(days=30)
    await gc(ops)
    referenced = await ops.referenced_digests()
    assert referenced <= await stored(ops)
    with pytest.raises(errors.VersionNotFound):
        await ops.get_version("m", 9)


async def test_gc_purges_expired_leases(ops, clock, versions):
    await publish_all(ops, versions[:2])
    await ops.plan("m", have=None, want=1, holder="reader-a")
    await ops.plan("m", have=None, want=2, holder="reader-b")
    assert [(x.number, x.holder) for x in await ops.active_leases("m")] == [(1, "reader-a"), (2, "reader-b")]
    report = await gc(ops)
    assert report.leases_purged == 0  # both still protect their chains
    clock.advance(minutes=11)  # past OpsSettings.lease_ttl (10 min)
    assert await ops.active_leases() == []
    assert (await gc(ops, dry_run=True)).leases_purged == 0  # a dry run changes nothing
    assert (await gc(ops)).leases_purged == 2
    assert (await gc(ops)).leases_purged == 0  # the rows are gone, not piling up


async def test_gc_finishes_what_a_dead_gc_tombstoned(ops, clock, versions):
    await publish_all(ops, versions[:1])
    before = await stored(ops)
    with pytest.raises(Stopped) as stop:
        await publish(ops, "m", versions[1], versions[0], 1, stop_after="manifest")
    await ops.abort_publish("m", stop.value.args[0])
    clock.advance(minutes=6)
    garbage = [i async for i in ops.store.list() if i.digest not in before]
    assert garbage
    # A GC tombstones the objects and dies before deleting anything.
    died_at = clock()
    marked = await ops.begin_object_deletion(
        [(i.digest, i.size, i.mtime) for i in garbage], unreferenced_before=died_at, now=died_at
    )
    assert set(marked) == {i.digest for i in garbage}
    # Within the grace period a later GC leaves the tombstones alone (their GC may still be deleting)...
    clock.advance(minutes=1)
    await gc(ops)
    assert {i.digest for i in garbage} <= await stored(ops)
    assert all(r.state == "deleting" for r in (await ops.object_records(marked)).values())
    # ...after it, it finishes them: bytes deleted, rows gone, nothing committed harmed.
    clock.advance(minutes=10)
    await gc(ops)
    assert not {i.digest for i in garbage} & await stored(ops)
    assert await ops.object_records(marked) == {}
    assert (await fsck(ops, read_data=True)).problems == []


async def test_commit_records_are_known_by_their_versions_not_by_catalog_rows(ops, clock, versions):
    """A commit record goes to the store only: the catalog gets no objects row for it (its digest follows from
    its version's row). fsck counts it as known, GC keeps it while its version lives and deletes it with its
    version; a row an older server wrote for one changes none of that."""
    await ops.create_model("m", keep_last=1, keyframe_interval=1)  # every version a keyframe: v1 can go
    await publish_all(ops, versions[:2])
    await ops.drain()
    v1, v2 = await ops.list_versions("m", limit=None)
    r1, r2 = record_of(v1).digest, record_of(v2).digest
    assert {r1, r2} <= await stored(ops)
    assert await ops.object_records([r1, r2]) == {}
    assert (await fsck(ops)).problems == []
    await ops.record_object(r2, len(record_of(v2).encode()))  # as servers before session 38 recorded them
    assert (await fsck(ops)).problems == []
    clock.advance(hours=2)
    report = await gc(ops, grace=timedelta(0))
    assert report.versions_deleted == {"m": [1]}
    left = await stored(ops)
    assert r1 not in left and r2 in left
    assert (await fsck(ops)).problems == []
    got = await ops.materialize("m", 2)
    assert {p: a.tobytes() for p, a in got.files.items()} == files_of(versions[1])


async def test_gc_forgets_the_row_an_older_server_wrote_for_a_deleted_version_s_commit_record(ops, clock, versions):
    """Servers before session 38 gave each commit record an objects row. GC's retention deletes a version's record
    with the version; the row goes with it (the sweep, which starts from the store's listing, would never see it
    again), and what the live version's record and row are is left alone."""
    await ops.create_model("m", keep_last=1, keyframe_interval=1)  # every version a keyframe: v1 can go
    await publish_all(ops, versions[:2])
    await ops.drain()
    v1, v2 = await ops.list_versions("m", limit=None)
    r1, r2 = record_of(v1).digest, record_of(v2).digest
    for v, digest in ((v1, r1), (v2, r2)):  # as servers before session 38 recorded them
        await ops.record_object(digest, len(record_of(v).encode()))
    clock.advance(hours=2)
    report = await gc(ops, grace=timedelta(0))
    assert report.versions_deleted == {"m": [1]}
    assert r1 not in await stored(ops) and r2 in await stored(ops)
    assert set(await ops.object_records([r1, r2])) == {r2}
    assert (await fsck(ops)).problems == []


async def test_fsck_repairs_a_missing_commit_record_without_a_catalog_row(ops, versions):
    """A commit record lost (a crash between the commit and the record's write) is rewritten by fsck --repair,
    into the store only; the next fsck finds nothing."""
    (v1,) = await publish_all(ops, versions[:1])
    await ops.drain()
    digest = record_of(v1).digest
    await ops.store.delete(digest)
    report = await fsck(ops)
    assert [(p.code, p.digest, p.repaired) for p in report.problems] == [("missing-commit-record", digest, False)]
    report = await fsck(ops, repair=True)
    assert [(p.code, p.repaired) for p in report.problems] == [("missing-commit-record", True)]
    assert digest in await stored(ops)
    assert await ops.object_records([digest]) == {}
    assert (await fsck(ops)).problems == []


async def test_model_settings_through_ops(ops, versions):
    await ops.create_model("m")
    m = await ops.update_model_settings("m", keep_last=2, keyframe_interval=4)
    assert (m.keep_last, m.keyframe_interval) == (2, 4)
    assert (await ops.get_model("m")).keep_last == 2
    with pytest.raises(errors.InvalidArgument):
        await ops.update_model_settings("m", keep_last=0)
    with pytest.raises(errors.ModelNotFound):
        await ops.update_model_settings("nope", keep_last=1)
