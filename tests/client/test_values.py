"""codec.values: a delta frame's (positions, values) applied by hand equal apply_frame's result."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from _ckpt import mutate
from hypothesis import given, settings
from hypothesis import strategies as st

from weightsync.codec import apply_frame, by_name, encode_delta, encode_key
from weightsync.codec.frame import METHOD_PLANES, METHOD_SPARSE, METHOD_STORED, parse_header
from weightsync.codec.values import decode_pieces, decode_values, keyframe_bytes
from weightsync.errors import FormatError

DTYPES = ["BF16", "F32", "F8_E4M3", "U8", "BOOL", "F64", "I16"]


def _pair(rng: np.random.Generator, dtype: str, n: int, changed: int) -> tuple[np.ndarray, np.ndarray]:
    dt = by_name(dtype)
    base = rng.integers(0, 256, n * dt.width, dtype=np.uint8)
    return base, mutate(rng, base, dt.width, changed)


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    n=st.integers(1, 3000),
    density=st.floats(0, 1),
    add=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_decode_values_matches_apply_frame(dtype: str, n: int, density: float, add: bool, seed: int) -> None:
    rng = np.random.default_rng(seed)
    base, new = _pair(rng, dtype, n, int(n * density))
    frame = encode_delta(base, new, by_name(dtype), add=add)
    change = decode_values(frame)
    assert change.header.add == add
    # Whole frame, as one Change.
    out = base.copy()
    change.change().apply(out)
    assert np.array_equal(out, new)
    # Sparse form, applied as the tensor path does: signed operands added (or xored) at positions.
    pos, vals = change.sparse()
    target = base.copy().view(by_name(dtype).numpy_uint)
    signed = change.operands() if change.positions is not None else None
    if add:
        from weightsync.codec.frame import unzigzag

        target[pos] += unzigzag(vals)
    else:
        target[pos] ^= vals
    assert np.array_equal(target.view(np.uint8), new)
    if signed is not None:
        assert len(signed) == len(change.positions)
    # A split into two pieces covers the same change.
    split = n // 2
    out2 = base.copy()
    w = by_name(dtype).width
    change.change(start=0, count=split).apply(out2[: split * w])
    change.change(start=split, count=n - split).apply(out2[split * w :])
    assert np.array_equal(out2, new)


@pytest.mark.parametrize("changed,method", [(3, METHOD_SPARSE), (900, METHOD_PLANES)])
def test_methods_covered(changed: int, method: int) -> None:
    rng = np.random.default_rng(1)
    base, new = _pair(rng, "BF16", 1000, changed)
    frame = encode_delta(base, new, by_name("BF16"))
    assert parse_header(frame).method == method
    ref = base.copy()
    apply_frame(frame, ref)
    out = base.copy()
    decode_values(frame).change().apply(out)
    assert np.array_equal(out, ref)


def test_stored_delta_frame() -> None:
    rng = np.random.default_rng(2)
    base, new = _pair(rng, "U8", 64, 64)  # random values: dense planes do not shrink → STORED
    frame = encode_delta(base, new, by_name("U8"), add=False)
    assert parse_header(frame).method == METHOD_STORED
    out = base.copy()
    decode_values(frame).change().apply(out)
    assert np.array_equal(out, new)


def test_keyframe_and_delta_are_told_apart() -> None:
    data = np.arange(64, dtype=np.uint8)
    key = encode_key(data, by_name("U8"))
    assert np.array_equal(keyframe_bytes(key), data)
    with pytest.raises(FormatError):
        decode_values(key)
    delta = encode_delta(data, data[::-1].copy(), by_name("U8"))
    with pytest.raises(FormatError):
        keyframe_bytes(delta)


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    n=st.integers(1, 3000),
    density=st.sampled_from([0.0, 0.002, 0.03, 0.3, 0.95]),
    add=st.booleans(),
    cuts=st.lists(st.integers(0, 3000), max_size=5),
    seed=st.integers(0, 2**32 - 1),
)
def test_decode_pieces_equals_each_pieces_change(
    dtype: str, n: int, density: float, add: bool, cuts: list[int], seed: int
) -> None:
    """decode_pieces gives, piece by piece, what decode_values(...).change(...) gives, for sparse and dense
    frames, and the pieces applied into their own tensors make the new bytes."""
    rng = np.random.default_rng(seed)
    base, new = _pair(rng, dtype, n, int(n * density))
    w = by_name(dtype).width
    frame = encode_delta(base, new, by_name(dtype), add=add)
    bounds = sorted({0, *(c % n for c in cuts)}) + [n]  # distinct cuts: no empty piece here
    pieces = [(b - a, 7 * i) for i, (a, b) in enumerate(itertools.pairwise(bounds))]
    got = decode_pieces(frame, pieces)
    values = decode_values(frame)
    out = base.copy()
    for (a, b), (count, offset), piece in zip(itertools.pairwise(bounds), pieces, got, strict=True):
        want = values.change(start=a, count=count, offset=offset)
        assert piece.add == want.add == add
        assert piece.positions.dtype == np.int64 and piece.operands.dtype == want.operands.dtype
        assert np.array_equal(piece.positions, want.positions)
        assert np.array_equal(piece.operands, want.operands)
        tensor = np.zeros((offset + count) * w, dtype=np.uint8)  # the piece's own tensor, base bytes at offset
        tensor[offset * w :] = base[a * w : b * w]
        piece.apply(tensor)
        out[a * w : b * w] = tensor[offset * w :]
    assert np.array_equal(out, new)


def test_decode_pieces_refuses_pieces_that_do_not_cover_the_frame_and_keyframes() -> None:
    rng = np.random.default_rng(3)
    base, new = _pair(rng, "BF16", 100, 5)
    frame = encode_delta(base, new, by_name("BF16"))
    for pieces in ([(99, 0)], [(60, 0), (41, 0)], []):
        with pytest.raises(ValueError):
            decode_pieces(frame, pieces)
    with pytest.raises(FormatError):
        decode_pieces(encode_key(base, by_name("BF16")), [(100, 0)])
