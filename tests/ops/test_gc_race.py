"""DESIGN invariant 7: a publish racing GC never commits a version whose objects GC then deletes.

GC used to forget an object's catalog row, then delete its bytes. A publisher that asked in
between found the object in the store (nothing to upload), committed, and lost the object when
GC's delete landed. These tests run the publisher *inside* GC's first delete of an object,
through a store wrapper, so the interleaving happens every time (no sleeps, no luck).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from _publish import Stopped, publish
from test_publish import files_of

from weightsync import errors
from weightsync.codec.manifest import MAGIC as MANIFEST_MAGIC
from weightsync.ops import fsck, gc
from weightsync.store import ForwardingStore, ObjectInfo, ObjectStore

pytestmark = pytest.mark.anyio


class StepBefore(ForwardingStore):
    """Runs `step` once, just before GC deletes the first of `targets` (or when a listing ends)."""

    def __init__(
        self, inner: ObjectStore, targets: set[str], step: Callable[[], Awaitable[None]], *, at: str = "delete"
    ) -> None:
        super().__init__(inner)
        self.targets, self.step, self.at = targets, step, at
        self.fired = False

    async def _fire(self) -> None:
        if not self.fired:
            self.fired = True
            await self.step()

    async def delete(self, digest: str) -> None:
        if self.at == "delete" and digest in self.targets:
            await self._fire()
        await self.inner.delete(digest)

    def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        async def listing() -> AsyncIterator[ObjectInfo]:
            async for info in self.inner.list(prefix):
                yield info
            if self.at == "list":
                await self._fire()

        return listing()


async def garbage_of_an_aborted_publish(ops, clock, ck) -> set[str]:
    """Upload a whole version (objects and manifest), abort it, and let the grace period pass; its digests."""
    before = {i.digest async for i in ops.store.list()}
    with pytest.raises(Stopped) as stop:
        await publish(ops, "m", ck, None, None, stop_after="manifest")
    await ops.abort_publish("m", stop.value.args[0])
    clock.advance(minutes=10)
    return {i.digest async for i in ops.store.list()} - before


async def assert_every_version_is_whole(ops, versions) -> None:
    report = await fsck(ops)
    assert [p for p in report.problems if p.code != "orphan"] == []
    for v in await ops.list_versions("m"):
        got = await ops.materialize("m", v.number)
        assert {p: a.tobytes() for p, a in got.files.items()} == files_of(versions[0])


async def test_publisher_reusing_objects_while_gc_deletes_them(ops, clock, versions):
    """GC has decided to delete the objects; the publisher finds them "present" in the store and commits."""
    await ops.create_model("m")
    garbage = await garbage_of_an_aborted_publish(ops, clock, versions[0])
    # Data objects only: the new publish needs them (its manifest may differ from the aborted one's).
    data = {d for d in garbage if await ops.store.get(d, length=4) != MANIFEST_MAGIC}
    outcome: list[object] = []

    async def publisher() -> None:
        try:
            outcome.append(await publish(ops, "m", versions[0], None, None))
        except (errors.IncompletePublish, errors.StoreUnavailable) as exc:  # "retry later"
            outcome.append(exc)

    ops.store = StepBefore(ops.store, data, publisher)
    await gc(ops)
    assert ops.store.fired and len(outcome) == 1
    # The publish inside GC's window must not have been committed on bytes being deleted.
    await assert_every_version_is_whole(ops, versions)
    # Told the objects were missing, the publisher's upload met the tombstone: "retry shortly".
    assert isinstance(outcome[0], errors.StoreUnavailable), outcome
    # Once GC is done, the retry uploads them again and commits a whole version.
    version, _, _ = await publish(ops, "m", versions[0], None, None)
    assert version.number == 1
    await assert_every_version_is_whole(ops, versions)


async def test_commit_without_checking_objects_while_gc_deletes_them(ops, clock, versions):
    """A client that skips checkObjects and commits a manifest whose objects GC is deleting."""
    await ops.create_model("m")
    garbage = await garbage_of_an_aborted_publish(ops, clock, versions[0])
    manifest = next(iter([d for d in garbage if await ops.store.get(d, length=4) == MANIFEST_MAGIC]))
    begun = await ops.begin_publish("m", parent=None)
    outcome: list[object] = []

    async def commit() -> None:
        try:
            outcome.append(await ops.commit_publish("m", begun.publish_id, manifest_digest=manifest))
        except errors.IncompletePublish as exc:
            outcome.append(exc)

    ops.store = StepBefore(ops.store, garbage, commit)
    await gc(ops)
    assert ops.store.fired and len(outcome) == 1
    assert isinstance(outcome[0], errors.IncompletePublish)
    assert await ops.list_versions("m") == []
    await assert_every_version_is_whole(ops, versions)


async def test_publisher_holding_objects_before_gc_looks(ops, clock, versions):
    """The other order: the publisher holds the objects first; GC, re-checking in its transaction, keeps them."""
    await ops.create_model("m")
    garbage = await garbage_of_an_aborted_publish(ops, clock, versions[0])
    outcome: list[object] = []

    async def publisher() -> None:
        outcome.append(await publish(ops, "m", versions[0], None, None))

    ops.store = StepBefore(ops.store, garbage, publisher, at="list")
    report = await gc(ops)
    assert ops.store.fired and outcome
    version, _, _ = outcome[0]
    assert version.number == 1
    assert report.objects_deleted <= 1  # at most the aborted publish's manifest, which v1 does not name
    await assert_every_version_is_whole(ops, versions)
