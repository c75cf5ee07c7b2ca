"""The ObjectStore contract, run against every backend (fs, and S3 on a real SeaweedFS).

Each test states one promise of weightsync.store.base.ObjectStore. A backend
is correct when this whole module passes for it.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest

from weightsync import errors
from weightsync.store.base import ObjectStore

pytestmark = pytest.mark.anyio


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def blob(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


async def chunked(data: bytes, sizes: list[int]) -> AsyncIterator[bytes]:
    """Yield ``data`` in pieces of the given sizes, cycling (uneven on purpose)."""
    i = k = 0
    while i < len(data):
        n = sizes[k % len(sizes)]
        yield data[i : i + n]
        i += n
        k += 1


async def all_digests(st: ObjectStore, prefix: str = "") -> list[str]:
    return sorted([info.digest async for info in st.list(prefix)])


def big_size(st: ObjectStore) -> int:
    """A size that spans two full multipart parts plus a ragged tail (or 3 MB without parts)."""
    part = st.capabilities.multipart_part_size
    return 2 * part + 12345 if part else 3 * 1024 * 1024 + 12345


# --- put / get ------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 1000, 300_001])
async def test_put_get_round_trip_byte_for_byte(store: ObjectStore, size: int) -> None:
    data = blob(size, seed=size)
    result = await store.put(data)
    assert result.digest == sha(data)
    assert result.size == size
    assert result.created is True
    assert await store.get(result.digest) == data


async def test_put_is_idempotent(store: ObjectStore) -> None:
    data = b"the same bytes twice"
    first = await store.put(data)
    second = await store.put(data)
    assert first.created is True
    assert second.created is False
    assert second.digest == first.digest and second.size == first.size
    assert await all_digests(store) == [first.digest]
    assert await store.get(first.digest) == data


async def test_digest_is_computed_by_the_store(store: ObjectStore) -> None:
    data = b"content decides the name"
    result = await store.put(data, expected_digest=sha(data))
    assert result.digest == sha(data)
    assert await store.exists(sha(data))


async def test_wrong_expected_digest_is_refused_and_leaves_nothing(store: ObjectStore, leftovers) -> None:
    data = b"these are not the bytes you claimed"
    with pytest.raises(errors.DigestMismatch):
        await store.put(data, expected_digest=sha(b"other bytes"))
    assert not await store.exists(sha(data))
    assert not await store.exists(sha(b"other bytes"))
    assert await all_digests(store) == []
    assert await leftovers(store) == []


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "abc",
        "A" * 64,  # uppercase aliases would name the same object twice
        "g" * 64,
        "a" * 63,
        "a" * 65,
        "a" * 64 + "\n",
        "../" + "a" * 61,
        "..%2F" + "a" * 59,
        "/etc/passwd",
        "ab/../../../../etc/passwd" + "a" * 39,
        "a" * 62 + "/.",
        "\x00" * 64,
        b"a" * 64,
        12345,
    ],
)
async def test_malformed_digests_are_refused_everywhere(store: ObjectStore, bad: object, leftovers) -> None:
    with pytest.raises(errors.InvalidDigest):
        await store.put(b"x", expected_digest=bad)  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidDigest):
        await store.put_stream(chunked(b"x", [1]), expected_digest=bad)  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidDigest):
        await store.get(bad)  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidDigest):
        [c async for c in store.iter_range(bad)]  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidDigest):
        await store.stat(bad)  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidDigest):
        await store.exists(bad)  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidDigest):
        await store.delete(bad)  # type: ignore[arg-type]
    assert await all_digests(store) == []
    assert await leftovers(store) == []


@pytest.mark.parametrize("bad_prefix", ["../", "A", "abcx", "a" * 65, "/"])
async def test_malformed_list_prefixes_are_refused(store: ObjectStore, bad_prefix: str) -> None:
    with pytest.raises(errors.InvalidDigest):
        [i async for i in store.list(bad_prefix)]


# --- ranges ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("offset", "length"),
    [(0, None), (0, 1000), (1, 10), (999, 1), (999, None), (500, 0), (1000, None), (1000, 0), (0, 0)],
)
async def test_ranges_return_exactly_the_requested_bytes(store: ObjectStore, offset: int, length: int | None) -> None:
    data = blob(1000, seed=7)
    digest = (await store.put(data)).digest
    end = None if length is None else offset + length
    expected = data[offset:end]
    assert await store.get(digest, offset=offset, length=length) == expected
    got = b"".join([c async for c in store.iter_range(digest, offset=offset, length=length, chunk_size=64)])
    assert got == expected


@pytest.mark.parametrize(("offset", "length"), [(1001, None), (1001, 0), (0, 1001), (999, 2), (-1, None), (0, -1)])
async def test_ranges_outside_the_object_are_refused(store: ObjectStore, offset: int, length: int | None) -> None:
    digest = (await store.put(blob(1000, seed=7))).digest
    with pytest.raises(errors.InvalidRange):
        await store.get(digest, offset=offset, length=length)
    with pytest.raises(errors.InvalidRange):
        [c async for c in store.iter_range(digest, offset=offset, length=length)]


async def test_empty_object_reads_as_empty(store: ObjectStore) -> None:
    digest = (await store.put(b"")).digest
    assert digest == sha(b"")
    assert await store.get(digest) == b""
    assert await store.get(digest, offset=0, length=0) == b""
    assert [c async for c in store.iter_range(digest)] == []
    with pytest.raises(errors.InvalidRange):
        await store.get(digest, offset=0, length=1)


async def test_iter_range_streams_in_bounded_chunks(store: ObjectStore) -> None:
    data = blob(1_000_003, seed=3)
    digest = (await store.put(data)).digest
    chunks = [c async for c in store.iter_range(digest, offset=5, length=900_000, chunk_size=65536)]
    assert all(0 < len(c) <= 65536 for c in chunks)
    assert len(chunks) >= 900_000 // 65536
    assert b"".join(chunks) == data[5:900_005]


async def test_iter_range_can_be_abandoned(store: ObjectStore) -> None:
    data = blob(500_000, seed=4)
    digest = (await store.put(data)).digest
    it = store.iter_range(digest, chunk_size=4096).__aiter__()
    assert await it.__anext__() == data[:4096]
    await it.aclose()  # type: ignore[attr-defined]
    # The store is still usable afterwards (no stuck connection or descriptor).
    assert await store.get(digest, offset=10, length=10) == data[10:20]


# --- stat, exists, not found ----------------------------------------------------------


async def test_stat_reports_size_and_aware_mtime(store: ObjectStore) -> None:
    data = blob(4321, seed=1)
    digest = (await store.put(data)).digest
    info = await store.stat(digest)
    assert info.digest == digest
    assert info.size == 4321
    assert info.mtime.tzinfo is not None
    # A sanity bound on the clock, not a timing assertion.
    assert abs(datetime.now(UTC) - info.mtime) < timedelta(hours=1)


async def test_absent_objects_raise_object_not_found(store: ObjectStore) -> None:
    absent = sha(b"never stored")
    assert await store.exists(absent) is False
    with pytest.raises(errors.ObjectNotFound):
        await store.get(absent)
    with pytest.raises(errors.ObjectNotFound):
        await store.get(absent, offset=3, length=4)
    with pytest.raises(errors.ObjectNotFound):
        await store.get(absent, offset=0, length=0)
    with pytest.raises(errors.ObjectNotFound):
        [c async for c in store.iter_range(absent)]
    with pytest.raises(errors.ObjectNotFound):
        await store.stat(absent)


# --- list -----------------------------------------------------------------------------


async def test_list_by_prefix(store: ObjectStore) -> None:
    digests = sorted([(await store.put(f"object {i}".encode())).digest for i in range(40)])
    assert await all_digests(store) == digests
    target = digests[17]
    for n in (0, 1, 2, 3, 4, 5, 64):
        prefix = target[:n]
        assert await all_digests(store, prefix) == [d for d in digests if d.startswith(prefix)]
    assert await all_digests(store, "0" * 64) == []
    sizes = {info.digest: info.size async for info in store.list()}
    assert sizes[target] == len(
        next(f"object {i}".encode() for i in range(40) if sha(f"object {i}".encode()) == target)
    )


async def test_list_of_empty_store_is_empty(store: ObjectStore) -> None:
    assert await all_digests(store) == []
    assert await all_digests(store, "ab") == []


# --- delete ---------------------------------------------------------------------------


async def test_delete_is_idempotent(store: ObjectStore) -> None:
    keep = (await store.put(b"keep")).digest
    gone = (await store.put(b"gone")).digest
    await store.delete(gone)
    assert not await store.exists(gone)
    with pytest.raises(errors.ObjectNotFound):
        await store.get(gone)
    await store.delete(gone)  # again: not an error
    await store.delete(sha(b"never existed"))
    assert await all_digests(store) == [keep]
    # A deleted object can be written again.
    assert (await store.put(b"gone")).created is True


# --- streamed writes ------------------------------------------------------------------


@pytest.mark.parametrize("with_digest", [True, False])
async def test_put_stream_small(store: ObjectStore, with_digest: bool) -> None:
    data = blob(70_000, seed=11)
    result = await store.put_stream(
        chunked(data, [1, 4096, 10_000]), expected_digest=sha(data) if with_digest else None
    )
    assert (result.digest, result.size, result.created) == (sha(data), len(data), True)
    assert await store.get(result.digest) == data


@pytest.mark.parametrize("with_digest", [True, False])
async def test_put_stream_large_spans_multipart(store: ObjectStore, with_digest: bool, leftovers) -> None:
    data = blob(big_size(store), seed=12)
    expected = sha(data) if with_digest else None
    result = await store.put_stream(chunked(data, [1 << 20, 333_333, 77]), expected_digest=expected)
    assert (result.digest, result.size, result.created) == (sha(data), len(data), True)
    assert await store.get(result.digest) == data
    assert await store.get(result.digest, offset=len(data) - 20_000, length=20_000) == data[-20_000:]
    again = await store.put_stream(chunked(data, [1 << 20]), expected_digest=expected)
    assert again.created is False and again.digest == result.digest
    assert await leftovers(store) == []


async def test_put_large_bytes_spans_multipart(store: ObjectStore) -> None:
    data = blob(big_size(store), seed=13)
    result = await store.put(data)
    assert result.created is True
    assert await store.get(result.digest) == data
    assert (await store.put(data)).created is False


async def test_put_stream_wrong_digest_leaves_nothing(store: ObjectStore, leftovers) -> None:
    data = blob(big_size(store), seed=14)
    with pytest.raises(errors.DigestMismatch):
        await store.put_stream(chunked(data, [1 << 20]), expected_digest=sha(b"something else"))
    assert await all_digests(store) == []
    assert await leftovers(store) == []


async def test_put_stream_into_existing_object_still_verifies(store: ObjectStore) -> None:
    data = b"already here"
    digest = (await store.put(data)).digest
    with pytest.raises(errors.DigestMismatch):
        await store.put_stream(chunked(b"impostor bytes", [5]), expected_digest=digest)
    assert await store.get(digest) == data
    ok = await store.put_stream(chunked(data, [5]), expected_digest=digest)
    assert ok.created is False


@pytest.mark.parametrize("with_digest", [True, False])
async def test_put_stream_over_max_size_leaves_nothing(store: ObjectStore, with_digest: bool, leftovers) -> None:
    data = blob(big_size(store), seed=15)
    limit = len(data) - 1
    with pytest.raises(errors.LimitExceeded):
        await store.put_stream(
            chunked(data, [1 << 20]), expected_digest=sha(data) if with_digest else None, max_size=limit
        )
    assert await all_digests(store) == []
    assert await leftovers(store) == []
    exact = await store.put_stream(chunked(data, [1 << 20]), max_size=len(data))
    assert exact.size == len(data)


async def test_put_stream_failing_producer_leaves_nothing(store: ObjectStore, leftovers) -> None:
    data = blob(big_size(store), seed=16)

    async def breaks() -> AsyncIterator[bytes]:
        async for c in chunked(data, [1 << 20]):
            yield c
        raise ConnectionResetError("client went away")

    for expected in (sha(data), None):
        with pytest.raises(ConnectionResetError):
            await store.put_stream(breaks(), expected_digest=expected)
    assert await all_digests(store) == []
    assert await leftovers(store) == []


async def test_cancelled_put_stream_leaves_nothing(store: ObjectStore, leftovers) -> None:
    data = blob(big_size(store), seed=17)
    started = asyncio.Event()

    async def stalls() -> AsyncIterator[bytes]:
        async for c in chunked(data, [1 << 20]):
            yield c
        started.set()
        await asyncio.Event().wait()  # a client that stops sending

    task = asyncio.ensure_future(store.put_stream(stalls(), expected_digest=sha(data)))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await all_digests(store) == []
    assert await leftovers(store) == []


# --- concurrency ----------------------------------------------------------------------


async def test_concurrent_puts_of_one_object(backend, store: ObjectStore) -> None:
    _, make = backend
    data = blob(200_000, seed=21)
    # Several instances as well as several tasks: like several processes.
    async with make() as other:
        results = await asyncio.gather(*(s.put(data) for s in [store, other] * 4))
    assert {r.digest for r in results} == {sha(data)}
    assert sum(r.created for r in results) == 1
    assert await store.get(sha(data)) == data
    assert await all_digests(store) == [sha(data)]


async def test_concurrent_streamed_puts_of_one_large_object(store: ObjectStore, leftovers) -> None:
    data = blob(big_size(store), seed=22)
    results = await asyncio.gather(
        *(store.put_stream(chunked(data, [1 << 20]), expected_digest=sha(data)) for _ in range(3))
    )
    assert {r.digest for r in results} == {sha(data)}
    # At least one writer created it. Exactly one is not promised here:
    # SeaweedFS 4.x does not serialise racing CompleteMultipartUpload calls
    # with If-None-Match (docs/STORE.md); the bytes are identical either way.
    assert sum(r.created for r in results) >= 1
    assert await store.get(sha(data)) == data
    assert await all_digests(store) == [sha(data)]
    assert await leftovers(store) == []


async def test_many_distinct_concurrent_puts(store: ObjectStore) -> None:
    payloads = [os.urandom(1000 + i) for i in range(32)]
    results = await asyncio.gather(*(store.put(p) for p in payloads))
    assert all(r.created for r in results)
    assert await all_digests(store) == sorted(sha(p) for p in payloads)


# --- capabilities ---------------------------------------------------------------------


async def test_presign_is_capability_gated(store: ObjectStore) -> None:
    digest = (await store.put(b"presign me")).digest
    if store.capabilities.presigned_urls:
        assert (await store.presign_get(digest, 60)).startswith("http")
    else:
        with pytest.raises(errors.Unsupported):
            await store.presign_get(digest, 60)
        with pytest.raises(errors.Unsupported):
            await store.presign_put(digest, 10, 60)


async def test_object_size_limit_is_enforced(store: ObjectStore) -> None:
    limit = store.capabilities.max_object_size
    if limit is None:
        pytest.skip("backend has no size limit of its own")
    assert limit >= 5 * 1024**3  # parts × 10,000 must leave room for real checkpoints
