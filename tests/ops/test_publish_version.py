"""Ops.publish_version (publishVersion) over every catalog x store combination: a whole publish in one call;
a refusal or a body that stops half-way aborts the publish, so nothing is visible and nothing stays pending,
and what was stored is left to GC (DESIGN invariants 2 and 5)."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from datetime import timedelta

import pytest
from _publish import publish
from _versions import checkpoint, model_files, next_step
from sqlalchemy import event, text

from weightsync import errors
from weightsync.codec import Checkpoint, Encoder
from weightsync.codec.pack import pack
from weightsync.ops import core, fsck, gc

pytestmark = pytest.mark.anyio


def encoded(ck: Checkpoint, base: Checkpoint | None, parent: int | None) -> tuple[str, dict[str, bytes]]:
    manifest, objects = pack(Encoder(chunk_bytes=1 << 16, threads=2).encode(ck, base), target_bytes=1 << 16)
    manifest.model, manifest.parent = "m", parent
    mbytes = manifest.encode()
    digest = hashlib.sha256(mbytes).hexdigest()
    return digest, {**{o.digest: o.data for o in objects}, digest: mbytes}


async def parts_of(objects: dict[str, bytes], *, stop_after: int | None = None, cut: int | None = None):
    """The (digest, size, bytes) parts of a body; `stop_after` parts then the body ends; `cut` bytes of the
    last one sent, then the body ends (a client that went away)."""

    async def body(data: bytes) -> AsyncIterator[bytes]:
        for at in range(0, len(data), 4096):
            yield data[at : at + 4096]

    async def cut_body(data: bytes, n: int) -> AsyncIterator[bytes]:
        yield data[:n]
        raise errors.InvalidArgument("publish bundle: part is truncated")

    for i, (digest, data) in enumerate(objects.items()):
        if stop_after is not None and i == stop_after:
            if cut is not None:
                yield digest, len(data), cut_body(data, cut)
            return
        yield digest, len(data), body(data)


def delta_in_one_call(ops, digest: str, objects: dict[str, bytes], *, parent: int = 1, **kwargs):
    """Ops.publish_version of the delta `objects` (the manifest `digest` among them) on `parent`, its parts in
    order; `kwargs` (metadata, idempotency_key) as publish_version takes them."""
    return ops.publish_version(
        "m",
        parent=parent,
        step=None,
        metadata=kwargs.pop("metadata", None),
        keyframe=False,
        objects=[(d, len(b)) for d, b in objects.items()],
        manifest_digest=digest,
        parts=parts_of(objects),
        **kwargs,
    )


async def pending(ops) -> list:
    return await ops.list_versions("m", states=("pending",))


@pytest.fixture
def chain():
    t = model_files()
    return [checkpoint(t), checkpoint(next_step(t, 1), 1)]


@pytest.mark.parametrize("order", ["manifest-last", "manifest-first"])
async def test_one_call_commits_and_reads_back(ops, chain, order):
    v1, _, _ = await publish(ops, "m", chain[0], None, None)
    digest, objects = encoded(chain[1], chain[0], v1.number)
    if order == "manifest-first":  # as Publisher sends them: the manifest parses while the rest is written
        objects = {digest: objects[digest], **{d: b for d, b in objects.items() if d != digest}}
    v = await ops.publish_version(
        "m",
        parent=1,
        step=None,
        metadata={"k": 1},
        keyframe=False,
        objects=[(d, len(b)) for d, b in objects.items()],
        manifest_digest=digest,
        parts=parts_of(objects),
        idempotency_key="key",
    )
    assert (v.number, v.kind, v.manifest_digest, v.metadata) == (2, "delta", digest, {"k": 1})
    got = await ops.materialize("m", 2)
    assert {p: a.tobytes() for p, a in got.files.items()} == {f.layout.path: f.data.tobytes() for f in chain[1].files}
    assert await pending(ops) == []
    report = await fsck(ops, read_data=True)
    assert report.ok, report.problems


@pytest.mark.parametrize(
    "how",
    [
        "body-ends-early",
        "client-went-away",
        "wrong-part",
        "other-bytes",
        "other-big-bytes",
        "removes-content",
        "a-slow-write-fails",
        "a-bad-part-after-a-slow-write",
    ],
)
async def test_a_failed_call_aborts_the_publish(ops, clock, chain, how, monkeypatch):
    """…and is answered only once every write it began has ended (the slow-write cases), so nothing is
    still being stored after the answer."""
    await publish(ops, "m", chain[0], None, None)
    digest, objects = encoded(chain[1], chain[0], 1)
    listed = [(d, len(b)) for d, b in objects.items()]
    kwargs = {}
    put, begun, ended = ops.store.put, [], []

    async def slow_put(data, **kw):
        begun.append(len(data))
        await asyncio.sleep(0.05)  # a slow write: the answer must wait for it
        try:
            return await put(data, **kw)
        finally:
            ended.append(len(data))

    if how.startswith("a-"):
        monkeypatch.setattr(ops.store, "put", slow_put)
    first = next(iter(objects))
    if how == "body-ends-early":
        parts, expected = parts_of(objects, stop_after=len(objects) - 1), errors.IncompletePublish
    elif how == "client-went-away":
        parts, expected = parts_of(objects, stop_after=0, cut=10), errors.InvalidArgument
    elif how == "wrong-part":
        parts, expected = parts_of({"ab" * 32: b"abc"}), errors.InvalidArgument
    elif how in ("other-bytes", "other-big-bytes", "a-slow-write-fails"):  # a listed size, not its bytes
        if how == "other-big-bytes":  # streamed, not stored whole
            monkeypatch.setattr(core, "WHOLE_PART_BYTES", 0)
        damaged = {**objects, first: bytes([objects[first][0] ^ 1]) + objects[first][1:]}
        parts, expected = parts_of(damaged), errors.DigestMismatch
    elif how == "a-bad-part-after-a-slow-write":
        parts, expected = parts_of({first: objects[first], "ab" * 32: b"abc"}), errors.InvalidArgument
    else:  # a version that drops the config file its parent had
        smaller = Checkpoint([f for f in chain[1].files if f.layout.path != "config.json"])
        digest, objects = encoded(smaller, chain[0], 1)
        listed = [(d, len(b)) for d, b in objects.items()]
        parts, expected = parts_of(objects), errors.RemovesContent
    with pytest.raises(expected):
        await ops.publish_version(
            "m",
            parent=1,
            step=None,
            metadata=None,
            keyframe=False,
            objects=listed,
            manifest_digest=digest,
            parts=parts,
            **kwargs,
        )
    if how.startswith("a-"):
        assert begun and sorted(ended) == sorted(begun)
    assert (await ops.get_version("m")).number == 1
    assert await pending(ops) == []
    # What was stored is unreferenced: GC takes it after the grace period, and fsck is clean after.
    clock.advance(hours=2)
    await fsck(ops, repair=True)
    report = await fsck(ops)
    assert report.ok, report.problems


async def test_a_kind_the_policy_refuses_is_answered_as_a_begin_referencing_nothing(ops, clock, chain):
    await publish(ops, "m", chain[0], None, None)
    await ops.update_model_settings("m", keyframe_interval=1)
    digest, objects = encoded(chain[1], chain[0], 1)
    begun = await delta_in_one_call(ops, digest, objects)
    assert begun.kind == "keyframe" and begun.missing is None
    assert [v.publish_id for v in await pending(ops)] == [begun.publish_id]
    # The delta's objects were stored before the policy answered; nothing references them, so GC takes them.
    await ops.abort_publish("m", begun.publish_id)
    clock.advance(hours=2)
    report = await gc(ops)
    assert report.objects_deleted == len(objects)
    for d in objects:
        with pytest.raises(errors.ObjectNotFound):
            await ops.stat_object(d)
    assert (await fsck(ops)).ok


@pytest.mark.parametrize("key", [None, "key"])
async def test_the_one_transaction_reads_back_nothing_it_wrote(ops, chain, key):
    """The commit half of publishVersion's one transaction takes the model, the pending row and its references
    from the begin half: it reads no reference back and locks the model's row once; the version it answers is
    the one read back afterwards, and an idempotency key still finds its replay."""
    v1, _, _ = await publish(ops, "m", chain[0], None, None)
    digest, objects = encoded(chain[1], chain[0], v1.number)
    statements: list[str] = []

    def seen(conn, cursor, statement, *args):
        statements.append(" ".join(statement.split()).lower())

    event.listen(ops.catalog.engine, "before_cursor_execute", seen)
    try:
        v = await delta_in_one_call(ops, digest, objects, metadata={"k": 1}, idempotency_key=key)
    finally:
        event.remove(ops.catalog.engine, "before_cursor_execute", seen)
    assert not any(st.startswith("select") and "from version_objects" in st for st in statements), statements
    assert sum(st.startswith("select") and "from models" in st for st in statements) == 1, statements
    keyed = [st for st in statements if "idempotency_key =" in st and st.startswith("select")]
    assert len(keyed) == (0 if key is None else 1), statements
    assert v == await ops.get_version("m", 2)
    assert (v.number, v.parent, v.kind, v.manifest_digest, v.metadata, v.idempotency_key) == (
        2,
        1,
        "delta",
        digest,
        {"k": 1},
        key,
    )
    report = await fsck(ops, read_data=True)
    assert report.ok, report.problems
    if key is not None:  # the same key on a later head: the replay of what it committed, not a new version
        again = await delta_in_one_call(ops, digest, objects, metadata={"k": 1}, idempotency_key=key)
        assert again == v
        # The key again on the new head with another version: the key committed v2 with another manifest.
        digest3, objects3 = encoded(checkpoint(next_step(model_files(), 2), 2), chain[1], 2)
        with pytest.raises(errors.Conflict, match="idempotency key"):
            await delta_in_one_call(ops, digest3, objects3, parent=2, idempotency_key=key)
        assert (await ops.get_model("m")).head == 2
        assert await pending(ops) == []


@pytest.mark.parametrize(
    "gc_run",
    ["none", "long-ago", "just-before", "no-fence-row", "deleting-its-objects", "deleting-its-new-objects", "resumed"],
)
async def test_one_transaction_unless_a_gc_may_have_deleted_what_was_written(ops, clock, chain, gc_run, monkeypatch):
    """DESIGN invariant 7 for publishVersion: objects it created itself are referenced and committed in one
    catalog transaction only when GC's fence (the last time it forgot tombstones after deleting their bytes)
    is older than its first write; otherwise they are referenced first and the store asked about every one,
    so a GC that deleted them in between is caught (IncompletePublish) and nothing is committed."""
    await publish(ops, "m", chain[0], None, None)
    digest, objects = encoded(chain[1], chain[0], 1)
    data = [d for d in objects if d != digest]

    async def garbage_deleted(grace: timedelta) -> None:
        await ops.store.put(b"garbage nothing references %d" % len(clock.__dict__))
        clock.advance(hours=1)
        assert (await gc(ops, grace=grace)).objects_deleted >= 1

    def after_the_writes(step) -> None:  # runs `step` between the writes and the catalog transaction
        store_parts = ops._store_parts

        async def then(*args, **kwargs):
            written = await store_parts(*args, **kwargs)
            await step()
            return written

        monkeypatch.setattr(ops, "_store_parts", then)

    if gc_run == "long-ago":  # an ordinary GC deleted garbage 10 minutes before: the fence is older than the writes
        await garbage_deleted(timedelta(minutes=5))
        clock.advance(minutes=10)
    elif gc_run == "just-before":  # moments ago: its deletes came before these writes, but clocks may disagree
        await garbage_deleted(timedelta(0))
    elif gc_run == "no-fence-row":  # removed by hand: nothing is known of GC, so the two-transaction way
        with ops.catalog.engine.begin() as conn:
            conn.execute(text("DELETE FROM gc_fence"))
    elif gc_run in ("deleting-its-objects", "deleting-its-new-objects"):
        if gc_run == "deleting-its-new-objects":  # one object is the store's already and kept: the two-transaction way
            await ops.store.put(objects[data[0]])
            keeper = await ops.begin_publish(
                "other", parent=None, keyframe=True, objects=[(data[0], len(objects[data[0]]))]
            )
            assert keeper.missing == []

        async def gc_with_no_grace() -> None:
            clock.advance(minutes=1)  # the store dates the bytes by the real clock: past the cutoff now
            assert (await gc(ops, grace=timedelta(0))).objects_deleted >= 1

        after_the_writes(gc_with_no_grace)
    elif gc_run == "resumed":  # a GC died after deleting one object's bytes; the next one finishes that delete
        # after this request wrote the object again
        size = len(objects[data[0]])
        assert await ops.begin_object_deletion([(data[0], size, clock())], unreferenced_before=clock(), now=clock())
        clock.advance(hours=1)
        after_the_writes(lambda: gc(ops))
    transactions: list[str] = []
    for name in ("publish_whole", "open_publish", "commit_held", "commit_version"):
        real = getattr(ops.catalog, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            transactions.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(ops.catalog, name, spy)
    call = delta_in_one_call(ops, digest, objects)
    if gc_run.startswith("deleting") or gc_run == "resumed":
        with pytest.raises(errors.IncompletePublish):
            await call
        assert (await ops.get_model("m")).head == 1 and await pending(ops) == []
        # The begin alone (one transaction, or its own when the store had an object); the store, asked after it,
        # lacks the objects GC deleted.
        assert transactions == (["open_publish"] if gc_run == "deleting-its-new-objects" else ["publish_whole"])
        assert [p.code for p in (await fsck(ops)).problems if p.code != "orphan"] == []
        return
    v = await call
    assert v.number == 2
    one = gc_run in ("none", "long-ago")
    assert transactions == (["publish_whole"] if one else ["publish_whole", "commit_held"])
    got = await ops.materialize("m", 2)
    assert {p: a.tobytes() for p, a in got.files.items()} == {f.layout.path: f.data.tobytes() for f in chain[1].files}
