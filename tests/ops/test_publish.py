"""Publish, commit, plan and materialize over every catalog x store combination (DESIGN invariants 2-4)."""

from __future__ import annotations

import asyncio
import hashlib

import pytest
from _publish import Stopped, publish
from _versions import checkpoint, model_files, next_step

from weightsync import errors
from weightsync.codec import Checkpoint, Encoder
from weightsync.codec.pack import pack
from weightsync.ops import fsck

pytestmark = pytest.mark.anyio


def files_of(ck: Checkpoint) -> dict[str, bytes]:
    return {f.layout.path: f.data.tobytes() for f in ck.files}


async def publish_all(ops, versions, model="m"):
    out = []
    base, parent = None, None
    for ck in versions:
        v, _, _ = await publish(ops, model, ck, base, parent)
        out.append(v)
        base, parent = ck, v.number
    return out


async def test_publish_chain_materializes_byte_for_byte(ops, versions):
    committed = await publish_all(ops, versions)
    assert [v.number for v in committed] == [1, 2, 3, 4, 5]
    assert [v.kind for v in committed] == ["keyframe"] + ["delta"] * 4
    for v, ck in zip(committed, versions, strict=True):
        got = await ops.materialize("m", v.number)
        assert {p: a.tobytes() for p, a in got.files.items()} == files_of(ck)
    raw = versions[1].raw_bytes
    assert all(v.stored_bytes < raw / 4 for v in committed[1:])  # deltas are small


async def test_nothing_is_visible_before_commit_and_fsck_repair_cleans_up(ops, clock, versions):
    await publish_all(ops, versions[:1])
    for stop in ("begin", "some-objects", "objects", "manifest"):
        with pytest.raises(Stopped):
            await publish(ops, "m", versions[1], versions[0], 1, stop_after=stop)
        assert (await ops.get_version("m")).number == 1
        assert [v.number for v in await ops.list_versions("m")] == [1]
    clock.advance(hours=2)  # pending publishes expire, orphans leave their grace period
    report = await fsck(ops, repair=True)
    codes = {p.code for p in report.problems}
    assert "expired-pending" in codes and "orphan" in codes
    # Objects the expired publishes held became unreferenced just now: their grace starts now.
    assert any(p.code == "orphan" and not p.repaired for p in report.problems)
    clock.advance(minutes=10)
    report = await fsck(ops, repair=True)
    assert report.ok, report.problems
    again = await fsck(ops)
    assert again.problems == [], again.problems
    got = await ops.materialize("m", 1)
    assert {p: a.tobytes() for p, a in got.files.items()} == files_of(versions[0])
    stored = {i.digest async for i in ops.store.list()}
    referenced = await ops.referenced_digests()
    assert referenced <= stored


async def test_stale_parent_gets_conflict(ops, versions):
    await publish_all(ops, versions[:1])
    first = await ops.begin_publish("m", parent=1)
    second = await ops.begin_publish("m", parent=1)
    encoded = Encoder().encode(versions[1], versions[0])
    manifest, objects = pack(encoded)
    manifest.model, manifest.parent = "m", 1
    for o in objects:
        await ops.put_bytes(o.data)
    digest = (await ops.put_bytes(manifest.encode())).digest
    v = await ops.commit_publish("m", first.publish_id, manifest_digest=digest)
    assert v.number == 2
    with pytest.raises(errors.StaleParent) as exc:
        await ops.commit_publish("m", second.publish_id, manifest_digest=digest)
    assert exc.value.current_head == 2
    with pytest.raises(errors.StaleParent):
        await ops.begin_publish("m", parent=1)
    assert (await ops.get_version("m")).number == 2


async def test_commit_is_idempotent(ops, versions):
    await publish_all(ops, versions[:1])
    v, begin, digest = await publish(ops, "m", versions[1], versions[0], 1, idempotency_key="step-2")
    again = await ops.commit_publish("m", begin.publish_id, manifest_digest=digest, idempotency_key="step-2")
    assert (again.number, again.manifest_digest) == (v.number, v.manifest_digest)
    assert [x.number for x in await ops.list_versions("m")] == [1, 2]


async def test_racing_publishers_exactly_one_wins(ops, versions):
    await publish_all(ops, versions[:1])

    async def one(i):
        ck = checkpoint(next_step(model_files(), 100 + i), 1)
        try:
            v, _, _ = await publish(ops, "m", ck, versions[0], 1)
            return v.number
        except errors.StaleParent:
            return "conflict"

    results = await asyncio.gather(*(one(i) for i in range(6)))
    assert sorted(r for r in results if r != "conflict") == [2]
    assert results.count("conflict") == 5
    assert (await ops.get_version("m")).number == 2


async def test_delta_against_other_bytes_than_the_parent_is_refused(ops, versions):
    await publish_all(ops, versions[:2])
    begin = await ops.begin_publish("m", parent=2)
    encoded = Encoder().encode(versions[2], versions[0])  # diffed against v1, not the parent v2
    manifest, objects = pack(encoded)
    manifest.model, manifest.parent = "m", 2
    for o in objects:
        await ops.put_bytes(o.data)
    digest = (await ops.put_bytes(manifest.encode())).digest
    with pytest.raises(errors.BaseMismatch):
        await ops.commit_publish("m", begin.publish_id, manifest_digest=digest)
    assert (await ops.get_version("m")).number == 2


async def test_commit_with_missing_objects_is_refused(ops, versions):
    begin = await ops.begin_publish("m", parent=None)
    manifest, objects = pack(Encoder().encode(versions[0]), target_bytes=1 << 15)
    manifest.model = "m"
    for o in objects[1:]:
        await ops.put_bytes(o.data)
    digest = (await ops.put_bytes(manifest.encode())).digest
    with pytest.raises(errors.IncompletePublish):
        await ops.commit_publish("m", begin.publish_id, manifest_digest=digest)
    with pytest.raises(errors.IncompletePublish):
        await ops.commit_publish("m", begin.publish_id, manifest_digest=hashlib.sha256(b"none").hexdigest())
    with pytest.raises(errors.VersionNotFound):
        await ops.get_version("m")
    await ops.put_bytes(objects[0].data)
    v = await ops.commit_publish("m", begin.publish_id, manifest_digest=digest)
    assert v.number == 1


async def test_an_uploaded_manifest_that_does_not_parse_is_refused_at_commit(ops, versions):
    """Manifests are parsed as they are uploaded (for the commit); one that does not parse is the commit's to refuse."""
    await publish_all(ops, versions[:1])
    begin = await ops.begin_publish("m", parent=1)
    for bad in (b"WSMF" + bytes(60), b"WSMF"):
        digest = (await ops.put_bytes(bad)).digest
        with pytest.raises(errors.FormatError):
            await ops.commit_publish("m", begin.publish_id, manifest_digest=digest)
    assert (await ops.get_version("m")).number == 1


async def test_uploads_are_named_by_their_bytes(ops):
    with pytest.raises(errors.DigestMismatch):
        await ops.put_bytes(b"hello", expected_digest=hashlib.sha256(b"other").hexdigest())
    assert [i async for i in ops.store.list()] == []
    r = await ops.put_bytes(b"hello")
    assert r.digest == hashlib.sha256(b"hello").hexdigest()


async def test_plan_prefers_deltas_from_what_the_reader_holds(ops, versions):
    await publish_all(ops, versions)
    full = await ops.plan("m", have=None)
    assert [s.number for s in full.steps] == [1, 2, 3, 4, 5] and full.target == 5
    inc = await ops.plan("m", have=3)
    assert [s.number for s in inc.steps] == [4, 5]
    assert inc.bytes < full.bytes / 2
    assert (await ops.plan("m", have=5)).steps == []
    older = await ops.plan("m", have=5, want=2)  # going back: from the keyframe
    assert [s.number for s in older.steps] == [1, 2]
    with pytest.raises(errors.VersionNotFound):
        await ops.plan("m", have=None, want=99)


async def test_chain_policy_starts_new_keyframes(ops, versions):
    await ops.create_model("m", keyframe_interval=2)
    committed = await publish_all(ops, versions)
    assert [v.kind for v in committed] == ["keyframe", "delta", "keyframe", "delta", "keyframe"]
    forced, _, _ = await publish(ops, "m", versions[0], versions[4], 5, keyframe=True)
    assert forced.kind == "keyframe"
    plan = await ops.plan("m", have=None)
    assert [s.number for s in plan.steps] == [6]


async def test_fsck_read_data_detects_corruption(ops, versions):
    await publish_all(ops, versions[:2])
    v2 = await ops.get_version("m", 2)
    manifest = await ops.load_manifest(v2.manifest_digest)
    victim = next(iter(manifest.objects()))
    data = bytearray(await ops.store.get(victim))
    data[len(data) // 2] ^= 0x40
    # Swap the stored bytes behind the store's back, as disk rot would.
    await ops.store.delete(victim)
    inner = getattr(ops.store, "inner", ops.store)
    if hasattr(inner, "path_of"):
        path = inner.path_of(victim)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bytes(data))
    else:
        client = await inner._s3()
        await client.put_object(Bucket=inner.bucket, Key=inner.key_of(victim), Body=bytes(data))
    report = await fsck(ops, read_data=True)
    assert any(p.code == "corrupt-object" and p.digest == victim for p in report.problems), report.problems
    assert not report.ok
