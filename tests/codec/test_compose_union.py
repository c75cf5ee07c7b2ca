"""codec.values.compose on the pieces of one delta: the disjoint fast path equals the general merge."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from weightsync.codec.values import Change, compose


def _general(changes: list[Change]) -> tuple[np.ndarray, np.ndarray]:
    """Apply `changes` one by one to a zero base of XOR or ADD operands: the reference the merge must equal."""
    n = 1 + max((int(c.positions.max()) for c in changes if len(c)), default=0)
    out = np.zeros(n, changes[0].operands.dtype)
    for c in changes:
        if c.add:
            np.add.at(out, c.positions, c.operands)
        else:
            np.bitwise_xor.at(out, c.positions, c.operands)
    keep = np.flatnonzero(out)
    return keep, out[keep]


@settings(max_examples=150, deadline=None)
@given(
    cuts=st.lists(st.integers(0, 400), min_size=1, max_size=8),
    add=st.booleans(),
    overlap=st.booleans(),
    zeros=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_pieces_in_any_order_merge_like_the_reference(cuts, add, overlap, zeros, seed) -> None:
    rng = np.random.default_rng(seed)
    bounds = sorted(set([0, *cuts, 401]))
    pieces = []
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        pos = np.sort(rng.choice(np.arange(lo, hi), size=rng.integers(0, hi - lo + 1), replace=False)).astype(np.int64)
        ops = rng.integers(0 if zeros else 1, 2**16, len(pos)).astype(np.uint16)
        pieces.append(Change(add, pos, ops))
    if overlap and pieces:  # an element changed twice: the general merge must run
        pieces.append(Change(add, np.array([200], np.int64), np.array([7], np.uint16)))
    order = rng.permutation(len(pieces))  # frames finish in any order
    composed = compose([pieces[i] for i in order])
    want_pos, want_ops = _general(pieces)
    got_pos = np.concatenate([c.positions for c in composed]) if composed else np.zeros(0, np.int64)
    got_ops = np.concatenate([c.operands for c in composed]) if composed else np.zeros(0, np.uint16)
    assert np.array_equal(got_pos, want_pos) and np.array_equal(got_ops, want_ops)
    assert all(c.positions.dtype == np.int64 and np.all(np.diff(c.positions) > 0) for c in composed)
