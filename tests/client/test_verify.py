"""client/verify.py: batched, chunked xxh3-128 of tensors equals xxh3-128 of their bytes, on every path."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import numpy as np  # noqa: E402
import xxhash  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as stn  # noqa: E402

from weightsync.client.tensors import tensor_xxh3, torch_dtype  # noqa: E402
from weightsync.client.verify import IN_PLACE, STAGED_HOST, HostHasher, _batches, _pieces  # noqa: E402

DTYPES = ["BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "F16", "BF16", "I32", "F32", "F64", "I64"]


def _tensor(name: str, n: int, seed: int) -> torch.Tensor:
    """A tensor of `n` elements of dtype `name` with random bytes (bool: 0/1 bytes, as torch stores them)."""
    dtype = torch_dtype(name)
    width = torch.empty(0, dtype=dtype).element_size()
    if n == 0:
        return torch.empty(0, dtype=dtype)
    raw = np.random.default_rng(seed).integers(0, 256, size=n * width, dtype=np.uint8)
    if dtype == torch.bool:
        raw &= 1
    return torch.from_numpy(raw).view(dtype)


def _want(t: torch.Tensor) -> str:
    return xxhash.xxh3_128_hexdigest(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


# Small staging geometry so that sizes around piece and buffer boundaries are cheap to reach.
PIECE, BUFFER = 96, 256


@settings(max_examples=60, deadline=None)
@given(
    specs=stn.lists(
        stn.tuples(
            stn.sampled_from(DTYPES),
            stn.one_of(
                stn.integers(0, 3),
                stn.sampled_from([PIECE - 1, PIECE, PIECE + 1, BUFFER - 1, BUFFER, BUFFER + 1, 3 * BUFFER + 5]),
                stn.integers(0, 1200),
            ),
        ),
        min_size=1,
        max_size=8,
    ),
    buffers=stn.integers(1, 3),
    threads=stn.integers(1, 4),
    seed=stn.integers(0, 2**16),
)
def test_chunked_hash_equals_xxh3_of_the_bytes(
    specs: list[tuple[str, int]], buffers: int, threads: int, seed: int
) -> None:
    tensors = [_tensor(name, n, seed + i) for i, (name, n) in enumerate(specs)]
    want = [_want(t) for t in tensors]
    staged = HostHasher(threads=threads, buffers=buffers, buffer_bytes=BUFFER, piece_bytes=PIECE, stage_cpu=True)
    got = staged.hash(tensors)
    assert got.digests == want
    assert got.staged_bytes == sum(t.numel() * t.element_size() for t in tensors)
    assert got.paths == (STAGED_HOST,)
    in_place = HostHasher(threads=threads).hash(tensors)
    assert in_place.digests == want and in_place.paths == (IN_PLACE,) and in_place.staged_bytes == 0


def test_large_tensors_span_several_staging_buffers() -> None:
    tensors = [_tensor("BF16", 300_001, 1), _tensor("F32", 77_777, 2), _tensor("U8", 1, 3), _tensor("I64", 50_000, 4)]
    total = sum(t.numel() * t.element_size() for t in tensors)
    hasher = HostHasher(threads=3, buffers=2, buffer_bytes=64 << 10, piece_bytes=10_000, stage_cpu=True)
    assert total > 10 * hasher.buffer_bytes  # each staging buffer is reused many times
    got = hasher.hash(tensors)
    assert got.digests == [_want(t) for t in tensors]
    assert got.staged_bytes == total


def test_a_tensor_given_twice_is_hashed_once_and_views_are_their_own_bytes() -> None:
    t = _tensor("BF16", 5000, 9)
    head = t[:100]  # same storage, fewer bytes: a different tensor to hash
    got = HostHasher(buffer_bytes=4096, piece_bytes=1000, stage_cpu=True).hash([t, head, t])
    assert got.digests == [_want(t), _want(head), _want(t)]
    assert got.staged_bytes == (5000 + 100) * 2  # `t` went through staging once


def test_zero_dim_and_non_contiguous_tensors() -> None:
    scalar = torch.tensor(3.5, dtype=torch.float64)
    strided = _tensor("F32", 64, 5).reshape(8, 8).t()
    for hasher in (HostHasher(), HostHasher(buffer_bytes=64, piece_bytes=16, stage_cpu=True)):
        assert hasher.hash([scalar, strided]).digests == [_want(scalar), _want(strided)]
    assert tensor_xxh3(strided) == _want(strided)


def test_invalid_geometry_is_refused() -> None:
    with pytest.raises(ValueError):
        HostHasher(buffers=0)
    with pytest.raises(ValueError):
        HostHasher(threads=0)


@settings(max_examples=200, deadline=None)
@given(
    sizes=stn.lists(stn.integers(0, 500), max_size=10),
    piece=stn.integers(1, 64),
    window=stn.integers(1, 5),
    capacity=stn.integers(1, 200),
)
def test_pieces_cover_each_item_in_order_and_batches_fill_buffers(
    sizes: list[int], piece: int, window: int, capacity: int
) -> None:
    batches = list(_batches(_pieces(sizes, piece, window), capacity))
    seen = {k: 0 for k in range(len(sizes))}
    for b in batches:
        at = 0
        for k, src, buf_at, n in b:
            assert n > 0 and buf_at == at and src == seen[k]  # contiguous in the buffer, in order per item
            seen[k] += n
            at += n
        assert at <= capacity
    assert all(sum(n for _, _, _, n in b) == capacity for b in batches[:-1])  # only the last is partial
    assert seen == dict(enumerate(sizes))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_stream_through_pinned_buffers() -> None:
    from weightsync.client.verify import STAGED_CUDA

    host = [_tensor("BF16", 3_000_001, 1), _tensor("F32", 5, 2), _tensor("U8", 0, 3), _tensor("I64", 70_001, 4)]
    tensors = [t.cuda() for t in host]
    got = HostHasher(threads=4, buffers=2, buffer_bytes=1 << 20, piece_bytes=100_000).hash(tensors)
    assert got.digests == [_want(t) for t in host]
    assert got.paths == (STAGED_CUDA,)
    assert tensor_xxh3(tensors[0]) == _want(host[0])


# --- FORMAT v2: the tensor checksum, where the tensor lives ---------------------------------------


def _want_sum(t: torch.Tensor) -> str:
    from weightsync.codec.checksum import reference_sum

    return reference_sum(t.contiguous().reshape(-1).view(torch.uint8).numpy(), t.element_size()).hex()


@settings(max_examples=40, deadline=None)
@given(
    specs=stn.lists(
        stn.tuples(stn.sampled_from(DTYPES), stn.one_of(stn.integers(0, 3), stn.integers(0, 40_000))),
        min_size=1,
        max_size=6,
    ),
    threads=stn.integers(1, 3),
    seed=stn.integers(0, 2**16),
)
def test_checksums_of_cpu_tensors_equal_the_reference(specs: list[tuple[str, int]], threads: int, seed: int) -> None:
    from weightsync import devsum
    from weightsync.client.verify import SUM_CPU, checksums

    tensors = [_tensor(name, n, seed + i) for i, (name, n) in enumerate(specs)]
    got = checksums(tensors, threads=threads)
    want = [_want_sum(t) for t in tensors]
    assert got.digests == want and got.paths == (SUM_CPU,) and got.staged_bytes == 0
    assert [s.hex() for s in devsum.tensor_sums(tensors, chunk=5000)] == want  # torch, as on a GPU


def test_checksums_of_large_tensors_are_summed_in_parts_and_views_are_their_own() -> None:
    from weightsync.client.verify import checksums

    big = _tensor("BF16", 9_000_001, 3)  # 18 MB: several parts of 8 MiB
    strided = _tensor("F32", 64, 5).reshape(8, 8).t()
    scalar = torch.tensor(3.5, dtype=torch.float64)
    assert checksums([big, big[:100], strided, scalar], threads=3).digests == [
        _want_sum(big),
        _want_sum(big[:100]),
        _want_sum(strided),
        _want_sum(scalar),
    ]


def test_digests_follow_the_manifest_kind() -> None:
    from weightsync.client.verify import SUM_CPU, digests

    tensors = [_tensor("BF16", 1000, 1), _tensor("I64", 7, 2)]
    hasher = HostHasher(threads=2)
    assert digests(tensors, "xxh3-128", hasher).digests == [_want(t) for t in tensors]
    summed = digests(tensors, "sum64x16", hasher)
    assert summed.digests == [_want_sum(t) for t in tensors] and summed.paths == (SUM_CPU,)
    with pytest.raises(ValueError):
        digests(tensors, "md5", hasher)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_are_checksummed_on_the_device() -> None:
    from weightsync.client.verify import SUM_DEVICE, checksums

    host = [_tensor("BF16", 3_000_001, 1), _tensor("F32", 5, 2), _tensor("U8", 0, 3), _tensor("I64", 70_001, 4)]
    got = checksums([t.cuda() for t in host])
    assert got.digests == [_want_sum(t) for t in host] and got.paths == (SUM_DEVICE,) and got.staged_bytes == 0
