"""The server's memory of small objects (ops/hot.py): what a plan bundle reads comes from it once the
object was written or read whole; an object the server deletes is gone from it too; larger objects
always come from the store. "Behind its back" below is the store deleting an object Ops did not
delete (another replica's GC): the bytes Ops still hands out are the object's own (named by them)."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from datetime import timedelta

import pytest

from weightsync import errors
from weightsync.catalog import Catalog
from weightsync.ops import Ops, OpsSettings, gc
from weightsync.ops.core import HOT_OBJECT_BYTES
from weightsync.ops.hot import HotObjects

pytestmark = pytest.mark.anyio


async def chunks(data: bytes, size: int = 1000) -> AsyncIterator[bytes]:
    for at in range(0, len(data), size):
        yield data[at : at + size]


@pytest.fixture
async def small_ops(backends, clock):
    """Ops keeping at most 3000 bytes of objects, 3000 at most each."""
    url, make = backends
    catalog = Catalog.open(url)
    store = make()
    o = Ops(catalog, store, OpsSettings(gc_grace=timedelta(minutes=5), hot_object_bytes=3000), clock=clock)
    try:
        yield o
    finally:
        await o.aclose()
        await store.close()
        catalog.close()


async def test_an_object_written_whole_or_streamed_is_read_from_memory(ops):
    whole, streamed = b"w" * 5000, bytes(range(256)) * 40
    d1 = (await ops.put_bytes(whole)).digest
    d2 = (await ops.put_object(chunks(streamed))).digest
    for d in (d1, d2):
        await ops.store.delete(d)  # behind its back
        with pytest.raises(errors.ObjectNotFound):
            await ops.store.get(d)
    assert await ops.read_whole(d1) == whole
    assert await ops.read_whole(d2) == streamed


async def test_an_object_read_whole_once_is_read_from_memory_after(ops):
    data = b"read once" * 100
    digest = (await ops.store.put(data)).digest  # written by another replica: not in this one's memory
    assert await ops.read_whole(digest) == data
    await ops.store.delete(digest)
    assert await ops.read_whole(digest) == data


async def test_an_object_the_server_deletes_is_not_read_from_memory(ops, clock):
    data = b"doomed" * 100
    digest = (await ops.put_bytes(data)).digest
    assert await ops.read_whole(digest) == data
    await ops.delete_object(digest)
    with pytest.raises(errors.ObjectNotFound):
        await ops.read_whole(digest)
    # And through GC: an upload no version references, once its grace is over.
    digest = (await ops.put_bytes(b"unreferenced" * 50)).digest
    clock.advance(minutes=6)
    report = await gc(ops)
    assert report.objects_deleted == 1
    with pytest.raises(errors.ObjectNotFound):
        await ops.read_whole(digest)


async def test_large_objects_and_those_past_the_budget_come_from_the_store(small_ops):
    big = b"b" * 3001  # over the 3000 bytes a single object may take
    d_big = (await small_ops.put_bytes(big)).digest
    d_streamed = (await small_ops.put_object(chunks(big))).digest
    assert d_streamed == d_big
    first, second = b"1" * 2000, b"2" * 2000  # together over the budget: the first is dropped
    d1 = (await small_ops.put_bytes(first)).digest
    d2 = (await small_ops.put_bytes(second)).digest
    for d in (d_big, d1, d2):
        await small_ops.store.delete(d)
    for d in (d_big, d1):
        with pytest.raises(errors.ObjectNotFound):
            await small_ops.read_whole(d)
    assert await small_ops.read_whole(d2) == second


async def test_an_upload_declared_larger_than_memory_keeps_is_not_held_while_it_streams(small_ops):
    """put_object's `size` (the sender's Content-Length): a body declared larger than one object may take is
    not kept as it arrives (the stored bytes are still the ones that came), a declared size that fits is."""
    data = bytes(range(256)) * 8  # 2048 bytes: fits the 3000-byte memory
    over = (await small_ops.put_object(chunks(data), size=3001)).digest
    assert small_ops.held(over) is None and await small_ops.store.get(over) == data
    await small_ops.store.delete(over)  # behind its back
    fits = (await small_ops.put_object(chunks(data[::-1]), size=len(data))).digest
    assert small_ops.held(fits) == data[::-1]
    await small_ops.store.delete(fits)
    assert await small_ops.read_whole(fits) == data[::-1]
    assert hashlib.sha256(data).hexdigest() == over


def test_the_least_recently_used_go_first_within_the_budget():
    hot = HotObjects(budget=10, largest=HOT_OBJECT_BYTES)
    assert hot.largest == 10
    for name in "abc":
        hot.put(name, name.encode() * 3)
    assert hot.held_bytes == 9 and len(hot) == 3
    assert hot.get("a") == b"aaa"  # now the most recently used
    hot.put("d", b"dd")  # 11 bytes: "b" goes
    assert hot.get("b") is None and hot.get("a") == b"aaa" and hot.get("c") == b"ccc"
    assert hot.held_bytes == 8
    hot.put("e", b"e" * 11)  # larger than the budget: not kept, nothing dropped
    assert hot.get("e") is None and len(hot) == 3
    hot.drop("a")
    hot.drop("a")  # twice: nothing more
    assert hot.get("a") is None and hot.held_bytes == 5


def test_each_kept_object_has_its_transfer_digest_while_it_is_kept():
    """The xxh3-128 a plan bundle names (Weightsync-Xxh3) is taken of an entry's bytes as it is kept, and goes with
    it: evicted, dropped or never kept, there is none."""
    from weightsync import bundle

    hot = HotObjects(budget=10, largest=HOT_OBJECT_BYTES)
    for name in "abc":
        hot.put(name, name.encode() * 3)
    assert {n: hot.transfer_digest(n) for n in "abc"} == {n: bundle.transfer_digest(n.encode() * 3) for n in "abc"}
    hot.put("d", b"dd")  # "a" goes
    hot.drop("b")
    hot.put("e", b"e" * 11)  # not kept
    assert [hot.transfer_digest(n) for n in "abcde"] == [
        None,
        None,
        bundle.transfer_digest(b"ccc"),
        bundle.transfer_digest(b"dd"),
        None,
    ]


def test_a_zero_budget_keeps_nothing():
    hot = HotObjects(budget=0, largest=HOT_OBJECT_BYTES)
    hot.put(hashlib.sha256(b"x").hexdigest(), b"x")
    assert len(hot) == 0 and hot.held_bytes == 0


class _GatedReads:
    """The real store's `get`, counted, each call waiting for a gate of its own once it has the bytes (so that
    readers can pile up, leave, or see the object deleted while a read is under way); `damage` flips a bit of
    what the store gave (bit rot)."""

    def __init__(self, ops: Ops) -> None:
        self.real = ops.store.get
        self.calls = 0
        self.gates: list[asyncio.Event] = []
        self.damage = False
        self.opened = False
        self.got = 0  # calls that have the store's bytes (and wait at their gate)
        ops.store.get = self  # type: ignore[method-assign]  # on this instance only

    async def arrived(self, n: int) -> None:
        """Until `n` calls have the store's bytes (a real store's read takes its time: S3 is a round trip)."""
        for _ in range(2000):
            if self.got >= n:
                return
            await asyncio.sleep(0.005)
        raise AssertionError(f"{self.got} of {n} reads came back from the store")

    def release(self) -> None:
        """Open every gate, of the calls made and of those to come."""
        self.opened = True
        for g in self.gates:
            g.set()

    async def __call__(self, digest: str) -> bytes:
        self.calls += 1
        data = await self.real(digest)
        self.got += 1
        if self.damage:
            data = bytes([data[0] ^ 1]) + data[1:]
        while len(self.gates) < self.calls:
            self.gates.append(asyncio.Event())
        if not self.opened:
            await self.gates[self.calls - 1].wait()
        return data


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def test_concurrent_whole_reads_of_an_object_share_one_store_read(ops):
    """The followers' plans that arrive together at a server that did not take the upload: one store read."""
    data = b"shared" * 500
    digest = (await ops.store.put(data)).digest  # written by another replica: not in this one's memory
    reads = _GatedReads(ops)
    readers = [asyncio.ensure_future(ops.read_whole(digest)) for _ in range(5)]
    await _settle()
    reads.release()
    assert await asyncio.gather(*readers) == [data] * 5
    assert reads.calls == 1 and ops.held(digest) == data


async def test_a_reader_that_goes_away_does_not_end_the_read_for_the_others(ops):
    data = b"stay" * 700
    digest = (await ops.store.put(data)).digest
    reads = _GatedReads(ops)
    leaving, staying = asyncio.ensure_future(ops.read_whole(digest)), asyncio.ensure_future(ops.read_whole(digest))
    await _settle()
    leaving.cancel()  # its request went away
    await _settle()
    reads.release()
    assert await staying == data and reads.calls == 1 and ops.held(digest) == data
    with pytest.raises(asyncio.CancelledError):
        await leaving


async def test_a_missing_object_fails_every_concurrent_reader_and_is_read_again_after(ops):
    data = b"later" * 300
    digest = hashlib.sha256(data).hexdigest()
    reads = _GatedReads(ops)
    reads.release()
    got = await asyncio.gather(*(ops.read_whole(digest) for _ in range(3)), return_exceptions=True)
    assert all(isinstance(e, errors.ObjectNotFound) for e in got) and reads.calls == 1
    await ops.store.put(data)
    assert await ops.read_whole(digest) == data and reads.calls == 2


async def test_an_object_deleted_while_read_whole_is_not_kept_in_memory(ops):
    """delete_object during a whole read: the reader gets the bytes it read, the memory does not keep them
    (no later plan serves an object the server deleted)."""
    data = b"gone soon" * 200
    digest = (await ops.store.put(data)).digest
    reads = _GatedReads(ops)
    reader = asyncio.ensure_future(ops.read_whole(digest))
    await reads.arrived(1)
    assert reads.calls == 1
    await ops.delete_object(digest)
    reads.release()
    assert await reader == data
    assert ops.held(digest) is None
    with pytest.raises(errors.ObjectNotFound):
        await ops.read_whole(digest)


async def test_a_read_begun_before_a_delete_does_not_keep_the_bytes_while_a_later_one_runs(ops):
    """Read A under way, the object deleted and stored again (the same bytes, published anew), read B under
    way: A ends first and keeps nothing (its bytes are of before the delete); B keeps them."""
    data = b"twice" * 400
    digest = (await ops.store.put(data)).digest
    reads = _GatedReads(ops)
    a = asyncio.ensure_future(ops.read_whole(digest))
    await reads.arrived(1)
    await ops.delete_object(digest)
    await ops.store.put(data)
    b = asyncio.ensure_future(ops.read_whole(digest))
    await reads.arrived(2)
    assert reads.calls == 2
    reads.gates[0].set()
    assert await a == data
    assert ops.held(digest) is None
    reads.gates[1].set()
    assert await b == data and ops.held(digest) == data


async def test_bytes_read_whole_that_do_not_hash_to_their_name_are_not_kept(ops):
    """The store gave damaged bytes: the reader gets them (its own check refuses them), no plan after it does."""
    data = b"rotten" * 300
    digest = (await ops.store.put(data)).digest
    reads = _GatedReads(ops)
    reads.damage = True
    reads.release()
    damaged = await ops.read_whole(digest)
    assert damaged != data and ops.held(digest) is None
    reads.damage = False
    assert await ops.read_whole(digest) == data and ops.held(digest) == data
