"""RetryingStore over FaultyStore: transient faults are recovered, the rest surface, nothing partial is left."""

from __future__ import annotations

import hashlib
import random
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from weightsync import errors
from weightsync.store.base import ObjectStore
from weightsync.store.faulty import FaultyStore
from weightsync.store.fs import FsStore
from weightsync.store.retry import RetryingStore

pytestmark = pytest.mark.anyio


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def blob(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


async def no_sleep(_: float) -> None:
    """Backoff without waiting: the tests check retry decisions, not wall time."""


def retrying(inner: ObjectStore, attempts: int = 5) -> RetryingStore:
    return RetryingStore(inner, attempts=attempts, base_delay=0.01, max_delay=0.05, seed=1, sleep=no_sleep)


@pytest.fixture
def fs(tmp_path: Path) -> FsStore:
    return FsStore(tmp_path / "store", fsync=False)


async def pieces(data: bytes, n: int) -> AsyncIterator[bytes]:
    for i in range(0, len(data), n):
        yield data[i : i + n]


# --- RetryingStore --------------------------------------------------------------------


async def test_transient_failures_are_retried(fs: FsStore) -> None:
    faulty = FaultyStore(fs, seed=1, fail_first=2)
    store = retrying(faulty)
    data = b"retried into place"
    result = await store.put(data)
    assert result.created is True
    assert await store.get(result.digest) == data
    assert (await store.stat(result.digest)).size == len(data)
    assert await store.exists(result.digest)
    await store.delete(result.digest)
    assert faulty.faults["fail_first"] == 2 * 5  # put, get, stat, exists, delete
    assert store.retries == 10


async def test_random_transient_faults_are_recovered(fs: FsStore) -> None:
    faulty = FaultyStore(fs, seed=7, error_rate=0.3, lost_reply_rate=0.2)
    store = retrying(faulty, attempts=12)
    payloads = [blob(1000 + i, seed=i) for i in range(30)]
    digests = [(await store.put(p)).digest for p in payloads]
    for p, d in zip(payloads, digests, strict=True):
        assert await store.get(d) == p
    assert sorted([i.digest async for i in store.list()]) == sorted(digests)
    assert faulty.faults["error"] > 0 and faulty.faults["lost_reply"] > 0


async def test_lost_reply_on_put_is_idempotent(fs: FsStore) -> None:
    # The first put lands but its reply is lost; the retry finds the object.
    faulty = FaultyStore(fs, seed=3, lost_reply_rate=1.0, ops={"put"})
    data = b"written once"
    with pytest.raises(errors.StoreUnavailable):
        await faulty.put(data)
    assert await fs.get(sha(data)) == data
    assert (await retrying(FaultyStore(fs, seed=3)).put(data)).created is False


async def test_persistent_unavailability_surfaces_after_the_budget(fs: FsStore) -> None:
    faulty = FaultyStore(fs, seed=1, error_rate=1.0)
    store = retrying(faulty, attempts=4)
    with pytest.raises(errors.StoreUnavailable):
        await store.put(b"never")
    assert faulty.calls["put"] == 4
    assert not await fs.exists(sha(b"never"))


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda s: s.get(sha(b"absent")), errors.ObjectNotFound),
        (lambda s: s.put(b"x", expected_digest=sha(b"y")), errors.DigestMismatch),
        (lambda s: s.get("not-a-digest"), errors.InvalidDigest),
    ],
)
async def test_permanent_errors_are_not_retried(fs: FsStore, call, error) -> None:
    faulty = FaultyStore(fs, seed=1)
    store = retrying(faulty)
    with pytest.raises(error):
        await call(store)
    assert sum(faulty.calls.values()) == 1
    assert store.retries == 0


async def test_backoff_is_jittered_exponential_and_capped(fs: FsStore) -> None:
    delays: list[float] = []

    async def record(d: float) -> None:
        delays.append(d)

    store = RetryingStore(
        FaultyStore(fs, seed=1, error_rate=1.0), attempts=8, base_delay=0.1, max_delay=1.0, seed=5, sleep=record
    )
    with pytest.raises(errors.StoreUnavailable):
        await store.stat(sha(b"x"))
    assert len(delays) == 7
    for i, d in enumerate(delays):
        assert 0.0 <= d <= min(1.0, 0.1 * 2**i)
    assert len(set(delays)) == len(delays)  # jittered, not a fixed schedule


async def test_broken_stream_resumes_where_it_stopped(fs: FsStore) -> None:
    data = blob(300_000, seed=2)
    digest = (await fs.put(data)).digest
    faulty = FaultyStore(fs, seed=11, stream_error_rate=0.3, ops={"iter_range"})
    store = retrying(faulty, attempts=5)
    got = b"".join([c async for c in store.iter_range(digest, offset=10, length=250_000, chunk_size=8192)])
    assert got == data[10:250_010]
    assert faulty.faults["stream_error"] > 3
    assert faulty.calls["iter_range"] == faulty.faults["stream_error"] + 1


async def test_broken_listing_restarts_without_duplicates(fs: FsStore) -> None:
    digests = sorted([(await fs.put(f"o{i}".encode())).digest for i in range(300)])
    faulty = FaultyStore(fs, seed=4, stream_error_rate=0.05, ops={"list"})
    store = retrying(faulty, attempts=8)
    listed = [i.digest async for i in store.list()]
    assert sorted(listed) == digests  # every object exactly once
    assert faulty.faults["stream_error"] > 5
    # Broken listings were split into sub-prefixes rather than redone whole.
    assert faulty.calls["list"] > 16


async def test_put_stream_is_not_retried(fs: FsStore) -> None:
    faulty = FaultyStore(fs, seed=1, fail_first=1)
    store = retrying(faulty)
    with pytest.raises(errors.StoreUnavailable):
        await store.put_stream(pieces(b"abc", 1))
    assert faulty.calls["put_stream"] == 1


# --- FaultyStore itself ---------------------------------------------------------------


async def test_same_seed_same_faults(fs: FsStore) -> None:
    data = blob(50_000, seed=9)
    digest = (await fs.put(data)).digest

    async def run(seed: int) -> list[tuple[str, str]]:
        faulty = FaultyStore(fs, seed=seed, error_rate=0.3, bitflip_rate=0.3, short_read_rate=0.2)
        for _ in range(40):
            try:
                await faulty.get(digest)
            except errors.StoreUnavailable:
                pass
        return faulty.events

    assert await run(42) == await run(42)
    assert await run(42) != await run(43)


async def test_bit_flips_and_short_reads_really_damage_bytes(fs: FsStore) -> None:
    data = blob(10_000, seed=5)
    digest = (await fs.put(data)).digest
    flipped = await FaultyStore(fs, seed=1, bitflip_rate=1.0).get(digest)
    assert len(flipped) == len(data) and sha(flipped) != digest
    assert sum(bin(a ^ b).count("1") for a, b in zip(flipped, data, strict=True)) == 1
    short = await FaultyStore(fs, seed=1, short_read_rate=1.0).get(digest)
    assert len(short) < len(data) and data.startswith(short)
    streamed = b"".join(
        [c async for c in FaultyStore(fs, seed=1, short_read_rate=1.0).iter_range(digest, chunk_size=1000)]
    )
    assert len(streamed) < len(data) and data.startswith(streamed)


async def test_latency_is_injected_without_changing_results(fs: FsStore) -> None:
    faulty = FaultyStore(fs, seed=1, latency_s=0.001)
    r = await faulty.put(b"slow")
    assert await faulty.get(r.digest) == b"slow"


# --- short writes, on every backend ---------------------------------------------------


@pytest.mark.parametrize("with_digest", [True, False])
async def test_short_put_leaves_no_object(store: ObjectStore, with_digest: bool, leftovers) -> None:
    part = store.capabilities.multipart_part_size or 1024 * 1024
    data = blob(3 * part + 999, seed=31)
    faulty = FaultyStore(store, seed=5, short_write_rate=1.0)
    for seed in range(3):
        faulty._rng.seed(seed)  # different cut points
        with pytest.raises(errors.StoreUnavailable):
            await faulty.put(data, expected_digest=sha(data) if with_digest else None)
    assert faulty.faults["short_write"] == 3
    assert [i async for i in store.list()] == []
    assert await leftovers(store) == []
    # The store is healthy afterwards: the same object goes in whole.
    assert (await store.put(data)).created is True


@pytest.mark.parametrize("with_digest", [True, False])
async def test_short_put_stream_leaves_no_object(store: ObjectStore, with_digest: bool, leftovers) -> None:
    part = store.capabilities.multipart_part_size or 1024 * 1024
    data = blob(2 * part + 1, seed=32)
    faulty = FaultyStore(store, seed=8, short_write_rate=1.0)
    for _ in range(3):
        with pytest.raises(errors.StoreUnavailable):
            await faulty.put_stream(pieces(data, part // 2), expected_digest=sha(data) if with_digest else None)
    assert [i async for i in store.list()] == []
    assert await leftovers(store) == []


async def test_retry_over_faults_on_every_backend(store: ObjectStore) -> None:
    faulty = FaultyStore(store, seed=13, error_rate=0.25, lost_reply_rate=0.1, stream_error_rate=0.1)
    rs = retrying(faulty, attempts=15)
    data = blob(400_000, seed=33)
    digest = (await rs.put(data)).digest
    assert await rs.get(digest) == data
    assert b"".join([c async for c in rs.iter_range(digest, chunk_size=50_000)]) == data
    assert [i.digest async for i in rs.list()] == [digest]
    await rs.delete(digest)
    assert not await rs.exists(digest)
    assert sum(faulty.faults.values()) > 0
