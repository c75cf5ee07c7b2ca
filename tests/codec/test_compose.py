"""codec.values.compose: k consecutive deltas composed, then applied, equal the k deltas applied one by one."""

from __future__ import annotations

import numpy as np
import pytest
from _ckpt import mutate
from hypothesis import given, settings
from hypothesis import strategies as st

from weightsync.codec import apply_frame, by_name, encode_delta
from weightsync.codec.values import Change, compose, decode_values

DTYPES = ["BF16", "F32", "F8_E4M3", "U8", "BOOL", "F64", "I16"]


def _chain(rng: np.random.Generator, dtype: str, n: int, k: int, density: float) -> list[np.ndarray]:
    """k+1 versions of an n-element array, each a mutation of the previous one."""
    w = by_name(dtype).width
    out = [rng.integers(0, 256, n * w, dtype=np.uint8)]
    for _ in range(k):
        out.append(mutate(rng, out[-1], w, int(n * density)))
    return out


@settings(max_examples=80, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    n=st.integers(1, 2000),
    k=st.integers(1, 6),
    density=st.floats(0, 1),
    kinds=st.lists(st.booleans(), min_size=6, max_size=6),
    seed=st.integers(0, 2**32 - 1),
)
def test_composed_deltas_equal_deltas_applied_one_by_one(
    dtype: str, n: int, k: int, density: float, kinds: list[bool], seed: int
) -> None:
    rng = np.random.default_rng(seed)
    dt = by_name(dtype)
    versions = _chain(rng, dtype, n, k, density)
    frames = [encode_delta(versions[i], versions[i + 1], dt, add=kinds[i]) for i in range(k)]
    # One by one, through the codec's own apply (checks every base and result hash).
    one_by_one = versions[0].copy()
    for f in frames:
        apply_frame(f, one_by_one)
    assert np.array_equal(one_by_one, versions[-1])
    # Composed: each element changed at most once per run of one kind.
    composed = compose(decode_values(f).change() for f in frames)
    assert len(composed) <= sum(1 for i in range(k) if i == 0 or kinds[i] != kinds[i - 1])
    out = versions[0].copy()
    for c in composed:
        assert np.all(np.diff(c.positions) > 0) and np.all(c.operands != 0)
        c.apply(out)
    assert np.array_equal(out, versions[-1])
    if len(set(kinds[:k])) == 1:
        assert len(composed) <= 1
        changed = np.flatnonzero(np.any((versions[0] != versions[-1]).reshape(n, dt.width), axis=1))
        # Same kind all along: exactly the elements that differ end to end, whatever happened in between.
        assert np.array_equal(composed[0].positions if composed else np.zeros(0, np.int64), changed)


@settings(max_examples=40, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    n=st.integers(2, 1500),
    k=st.integers(1, 4),
    split=st.floats(0, 1),
    seed=st.integers(0, 2**32 - 1),
)
def test_pieces_of_frames_compose_into_one_target(dtype: str, n: int, k: int, split: float, seed: int) -> None:
    """A tensor covered by two frames per step (pieces placed at offsets) composes as the whole would."""
    rng = np.random.default_rng(seed)
    dt = by_name(dtype)
    w = dt.width
    versions = _chain(rng, dtype, n, k, 0.1)
    cut = int(n * split)
    pieces = []
    for i in range(k):
        lo = encode_delta(versions[i][: cut * w], versions[i + 1][: cut * w], dt)
        hi = encode_delta(versions[i][cut * w :], versions[i + 1][cut * w :], dt)
        pieces += [decode_values(lo).change(), decode_values(hi).change(offset=cut)]
    out = versions[0].copy()
    for c in compose(pieces):
        c.apply(out)
    assert np.array_equal(out, versions[-1])
    # A window of one frame: elements [start, start+count) placed at `offset`.
    whole = decode_values(encode_delta(versions[0], versions[1], dt))
    start, count = cut // 2, n - cut
    part = whole.change(start=start, count=count, offset=7)
    want = versions[0].copy().view(dt.numpy_uint)
    got = np.zeros(count + 7, dtype=dt.numpy_uint)
    got[7:] = want[start : start + count]
    part.apply(got)
    assert np.array_equal(got[7:], versions[1].view(dt.numpy_uint)[start : start + count])


def test_changes_that_cancel_out_vanish() -> None:
    dt = by_name("BF16")
    a = np.arange(64, dtype=np.uint8)
    b = a.copy()
    b[10] ^= 0x40
    there = decode_values(encode_delta(a, b, dt)).change()
    back = decode_values(encode_delta(b, a, dt)).change()
    assert len(there) == 1
    assert compose([there, back]) == []
    assert compose([]) == []


@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_addends_wrap_modulo_the_element_width(width: int) -> None:
    signed = np.dtype(f"<i{width}")
    top = np.iinfo(signed).max
    c = Change(True, np.array([0, 0], dtype=np.int64), np.array([top, 1], dtype=signed))
    (merged,) = compose([Change(True, c.positions[:1], c.operands[:1]), Change(True, c.positions[1:], c.operands[1:])])
    assert merged.operands.dtype == signed and merged.operands[0] == np.iinfo(signed).min
    target = np.zeros(1, dtype=signed)
    merged.apply(target)
    assert target[0] == np.iinfo(signed).min
