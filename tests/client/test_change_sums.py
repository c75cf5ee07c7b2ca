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


@st.composite
def _read_backs(draw):
    """A list of tensors as `apply` reads back: int64 lanes (some negative), (lanes, 2) moments, None, other dtypes."""
    items = []
    for _ in range(draw(st.integers(0, 12))):
        kind = draw(st.sampled_from(["lanes", "moments", "none", "float"]))
        seed = draw(st.integers(0, 2**32 - 1))
        g = torch.Generator().manual_seed(seed)
        lanes = draw(st.integers(1, 4))
        if kind == "none":
            items.append(None)
        elif kind == "float":
            items.append(torch.rand(lanes, generator=g))
        else:
            shape = (lanes,) if kind == "lanes" else (lanes, 2)
            items.append(torch.randint(-(2**63), 2**63 - 1, shape, dtype=torch.int64, generator=g))
    return items


@settings(max_examples=100, deadline=None)
@given(_read_backs())
def test_read_back_in_one_copy_equals_each_read_alone(items) -> None:
    """`devsum.read_back` (one copy per device and dtype) gives each tensor's own `.tolist()`, in order, None
    kept; `lanes_to_ints_many` each tensor's `lanes_to_ints` (unsigned, mod 2^64)."""
    assert devsum.read_back(items) == [None if t is None else t.tolist() for t in items]
    # int64 lanes, (lanes,) or (rows, lanes) whose rows add up: each read as Python ints mod 2^64.
    lanes = [t if t.dim() == 1 else t.T for t in items if t is not None and t.dtype == torch.int64]
    mask = (1 << 64) - 1
    want = [
        tuple(sum(row[j] for row in t.reshape(-1, t.shape[-1]).tolist()) & mask for j in range(t.shape[-1]))
        for t in lanes
    ]
    assert devsum.lanes_to_ints_many(lanes) == want
    assert [devsum.lanes_to_ints(t) for t in lanes] == want


def test_results_read_back_keep_each_tensors_moves_in_order() -> None:
    """`apply`'s result check reads every device tensor's checksum moves in one go (inplace._read_back): each
    tensor gets its own moves back, in its changes' order, host tuples untouched, negative lanes unsigned."""
    from weightsync.client import inplace

    a1 = torch.tensor([-1, 2], dtype=torch.int64)
    a2 = torch.tensor([3, -(2**63)], dtype=torch.int64)
    b = torch.tensor([7], dtype=torch.int64)
    got = inplace._read_back({"a": [a1, (5, 6), a2], "b": [b], "c": [(1,)], "d": []})
    assert got == {
        "a": [((1 << 64) - 1, 2), (5, 6), (3, 1 << 63)],
        "b": [(7,)],
        "c": [(1,)],
        "d": [],
    }


def test_ready_to_apply_leaves_host_staging_alone_and_counts_what_it_adds() -> None:
    """`tensors.ready_to_apply` makes the blocks' first changes for CUDA staging only (the Triton kernel's input,
    off the pause); a change staged on the host keeps none, and `nbytes` counts them where they are made."""
    from weightsync.client.tensors import ready_to_apply, stage_change

    positions = np.arange(0, 3 * 65536, 7, dtype=np.int64)
    change = Change(True, positions, np.ones(len(positions), dtype=np.int16))
    staged = stage_change(change, "cpu", elements=3 * 65536)
    assert staged.counts is not None and staged.starts is None
    before = staged.nbytes
    ready_to_apply([staged])
    assert staged.starts is None and staged.nbytes == before
    from weightsync.client.staged_triton import block_starts

    staged.starts = block_starts(staged.counts)  # what it makes on a CUDA device
    assert staged.nbytes == before + 8 * staged.counts.numel()
    counts = staged.counts.tolist()
    assert staged.starts.tolist() == [sum(counts[:b]) for b in range(len(counts))]  # each block's first change
