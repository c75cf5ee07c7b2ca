"""A device's staging kernels (codec/_kernels_loops.h: piece_blocks, stage_pieces) against numpy: the layout
table a test hands stage_pieces and what each piece's staged arrays must then hold (client/stage_frames.py
builds the same table from real frames)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from weightsync.codec import kernels

# stage_pieces' modes (STAGE_*): skipped, block-coded with int32 / int64 block ids, int32 / int64 positions.
SKIP, BLOCKS32, BLOCKS64, POS32, POS64 = range(5)


def tensor_positions(positions: np.ndarray, bounds: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each change's piece and its position in that piece's tensor."""
    piece = np.searchsorted(bounds, positions, side="right") - 1
    return piece, positions - bounds[piece] + offsets[piece]


def check_piece_blocks(
    stats: Sequence[np.ndarray], positions: np.ndarray, bounds: np.ndarray, offsets: np.ndarray
) -> None:
    """piece_blocks' outputs: per piece its changes, its 2^16-element blocks, the first and the last (-1: none)."""
    piece, tensor_pos = tensor_positions(positions, bounds, offsets)
    blocks = [np.unique(tensor_pos[piece == i] >> 16) for i in range(len(bounds))]
    assert stats[0].tolist() == [int((piece == i).sum()) for i in range(len(bounds))]
    assert stats[1].tolist() == [len(b) for b in blocks]
    assert stats[2].tolist() == [int(b[0]) if len(b) else -1 for b in blocks]
    assert stats[3].tolist() == [int(b[-1]) if len(b) else -1 for b in blocks]


def lay_out(
    stats: Sequence[np.ndarray], bounds: np.ndarray, offsets: np.ndarray, modes: Sequence[int], merges: Sequence[bool]
) -> tuple[np.ndarray, np.ndarray, list[bool]]:
    """stage_pieces' table for 2-byte elements (every region end to end in one zeroed buffer) and which pieces
    merge: a block-coded piece with changes whose `merges` is set continues the block before its first
    (its first block's count goes to carry, not to a slot)."""
    table = np.zeros((len(bounds), 10), dtype=np.int64)
    table[:, 0], table[:, 1], table[:, 8] = bounds, offsets, stats[0]
    size, merged = 0, []
    for i, mode in enumerate(modes):
        k, blocked, wide = int(stats[0][i]), mode in (BLOCKS32, BLOCKS64), mode in (BLOCKS64, POS64)
        merge = blocked and merges[i] and k > 0
        merged.append(merge)
        row = table[i]
        row[2], row[3] = mode, int(merge)
        if mode == SKIP:
            continue
        slots = int(stats[1][i]) - merge if blocked else 0
        row[9] = slots
        row[4] = size
        size += 2 * k
        row[5] = size
        size += k * (2 if blocked else 8 if wide else 4)
        row[6] = size
        size += slots * (8 if wide else 4)
        row[7] = size
        size += slots * 8
    return table, np.zeros(size, dtype=np.uint8), merged


def check_staged(
    buf: np.ndarray,
    table: np.ndarray,
    carry: np.ndarray,
    positions: np.ndarray,
    planes: Sequence[np.ndarray],
    add: bool,
    merged: Sequence[bool],
) -> None:
    """Every staged piece's operands, positions (low bits, block ids and counts when block-coded) and carry."""
    bounds, offsets = table[:, 0], table[:, 1]
    piece, tensor_pos = tensor_positions(positions, bounds, offsets)
    joined = kernels.REFERENCE.join_planes(planes, 2).view("<u2")
    operands = kernels.REFERENCE.unzigzag(joined) if add else joined
    for i, row in enumerate(table):
        mode, mine, k = int(row[2]), piece == i, int(row[8])
        if mode == SKIP:
            continue
        assert np.array_equal(buf[row[4] : row[4] + 2 * k].view("<u2"), operands[mine]), i
        t = tensor_pos[mine]
        if mode in (POS32, POS64):
            index = np.int64 if mode == POS64 else np.int32
            assert np.array_equal(buf[row[5] : row[5] + k * index().itemsize].view(index), t), i
            continue
        assert np.array_equal(buf[row[5] : row[5] + 2 * k].view(np.uint16), (t & 0xFFFF).astype(np.uint16)), i
        ids, counts = np.unique(t >> 16, return_counts=True)
        assert carry[i] == (counts[0] if merged[i] else -1), i
        if merged[i]:
            ids, counts = ids[1:], counts[1:]
        index = np.int64 if mode == BLOCKS64 else np.int32
        assert np.array_equal(buf[row[6] : row[6] + len(ids) * index().itemsize].view(index), ids), i
        assert np.array_equal(buf[row[7] : row[7] + len(ids) * 8].view(np.int64), counts), i
