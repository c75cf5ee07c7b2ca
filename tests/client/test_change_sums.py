"""Results checked from their base: how a change moves the tensor checksum (FORMAT §10, client/inplace.py).

`change_lanes` (numpy, host) and `devsum.change_lanes` (torch, any device) must move a
checksum exactly as recomputing it from the definition would, for every width, any
positions (sparse or dense) and any values; the tracked apply paths must report that move.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weightsync import devsum
from weightsync.client.tensors import apply_change_host, apply_staged, stage_change
from weightsync.codec.checksum import change_lanes, reference_sum
from weightsync.codec.values import Change

_INT = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}


@st.composite
def _changes(draw):
    width = draw(st.sampled_from([1, 2, 4, 8]))
    n = draw(st.integers(1, 300))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, n * width, dtype=np.uint8).view(_INT[width])
    density = draw(st.sampled_from([0.0, 0.01, 0.3, 1.0]))
    positions = np.flatnonzero(rng.random(n) < density).astype(np.int64)
    operands = rng.integers(0, 256, len(positions) * width, dtype=np.uint8).view(_INT[width])
    return width, base, Change(draw(st.booleans()), positions, operands)


def _moved(before: np.ndarray, after: np.ndarray, width: int) -> tuple[int, ...]:
    """What the definition says: sum(after) − sum(before), lane by lane, mod 2^64."""
    a = reference_sum(after.view(np.uint8), width)
    b = reference_sum(before.view(np.uint8), width)
    return tuple((x - y) & ((1 << 64) - 1) for x, y in zip(a.lanes, b.lanes, strict=True))


@settings(max_examples=150, deadline=None)
@given(_changes())
def test_change_lanes_move_the_checksum_as_the_definition(case) -> None:
    width, base, change = case
    after = base.copy()
    change.apply(after)
    pos = change.positions
    assert change_lanes(base[pos], after[pos], pos, width) == _moved(base, after, width)
    moved_dev = devsum.change_lanes(torch.from_numpy(base[pos]), torch.from_numpy(after[pos]), torch.from_numpy(pos))
    assert devsum.lanes_to_ints(moved_dev) == _moved(base, after, width)


@settings(max_examples=60, deadline=None)
@given(_changes())
def test_tracked_applies_report_the_move_and_undo_exactly(case) -> None:
    width, base, change = case
    want = base.copy()
    change.apply(want)
    host = torch.from_numpy(base.copy())
    assert apply_change_host(host, change, track=True) == _moved(base, want, width)
    assert np.array_equal(host.numpy(), want)
    apply_change_host(host, change, inverse=True)
    assert np.array_equal(host.numpy(), base)
    # The index-op path that device tensors take, run here on the host.
    t = torch.from_numpy(base.copy())
    staged = stage_change(change, "cpu", elements=len(base))
    moved = apply_staged(t, staged, track=True)
    got = devsum.lanes_to_ints(moved) if moved is not None else (0,) * max(1, width // 2)
    assert got == _moved(base, want, width)
    assert np.array_equal(t.numpy(), want)
    apply_staged(t, staged, inverse=True)
    assert np.array_equal(t.numpy(), base)


def test_change_lanes_refuses_mismatched_lengths() -> None:
    from weightsync.errors import InvalidArgument

    with pytest.raises(InvalidArgument):
        change_lanes(np.zeros(3, np.int16), np.zeros(2, np.int16), np.arange(3), 2)
