"""The frames apply's result check over every tensor at once (frames_apply._Layout) against the per-tensor
reference (frames_apply._check): same first bad base, same first bad result, for any pieces and digests."""

from __future__ import annotations

import struct
from types import SimpleNamespace

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from weightsync.client.frames_apply import Frame, _check, _Layout
from weightsync.codec.checksum import MASK, lanes_of

DTYPE_OF_WIDTH = {1: "U8", 2: "BF16", 4: "F32", 8: "F64"}
U64 = st.integers(0, MASK)


@st.composite
def updates(draw):
    """(jobs, sums, views, digests): tensors of mixed widths in pieces across frames, some not held, some not
    in the digests; each piece's lanes arbitrary; each digest right, wrong in one field, or not a wire form."""
    n = draw(st.integers(1, 8))
    tensors = [(f"t{i}", draw(st.sampled_from([1, 2, 4, 8]))) for i in range(n)]
    pieces = []  # (tensor, width, elements)
    for name, width in tensors:
        for _ in range(draw(st.integers(1, 3))):
            pieces.append((name, width, draw(st.integers(0, 5))))
    pieces = draw(st.permutations(pieces))
    jobs, sums = [], []
    for width in sorted({w for _, w in tensors}):
        mine = [p for p in pieces if p[1] == width]
        while mine:
            k = draw(st.integers(1, len(mine)))
            frame, mine = mine[:k], mine[k:]
            fr = Frame(SimpleNamespace(dtype=DTYPE_OF_WIDTH[width]), None, tuple(p[0] for p in frame), 0)
            targets = [np.zeros(p[2] * width, dtype=np.uint8) for p in frame]
            jobs.append((fr, targets, [0] * len(frame)))
            lanes = lanes_of(width)
            sums.append(
                [(tuple(draw(U64) for _ in range(lanes)), tuple(draw(U64) for _ in range(lanes))) for _ in frame]
            )
    held = {name for name, _ in tensors if draw(st.booleans()) or name == "t0"}
    views = {name: np.zeros(1, dtype=np.uint8) for name in held}
    digests = {}
    for name, width in draw(st.permutations(tensors)):
        if not draw(st.booleans()) and name != "t0":
            continue
        count, before, after = 0, [0] * lanes_of(width), [0] * lanes_of(width)
        for (fr, targets, _), found in zip(jobs, sums, strict=True):
            for piece, t, (b, a) in zip(fr.names, targets, found, strict=True):
                if piece == name:
                    count += len(t) // width
                    before = [(x + y) & MASK for x, y in zip(before, b, strict=True)]
                    after = [(x + y) & MASK for x, y in zip(after, a, strict=True)]
        digests[name] = (_digest(draw, count, before), _digest(draw, count, after))
    if draw(st.integers(0, 9)) == 0:  # now and then a digest that is no wire form at all
        name = draw(st.sampled_from(sorted(digests)))
        digests[name] = (draw(st.sampled_from([None, "", "00"])), digests[name][1])
    return jobs, sums, views, digests


def _lanes(draw, n: int) -> tuple[int, ...]:
    return tuple(draw(U64) for _ in range(n))


def _digest(draw, count: int, lanes: list[int]) -> str:
    fields = [count, *lanes]
    how = draw(st.sampled_from(["right", "right", "right", "wrong"]))
    if how == "wrong":
        i = draw(st.integers(0, len(fields) - 1))
        fields[i] = (fields[i] + draw(st.integers(1, MASK))) & MASK
    return struct.pack(f"<{len(fields)}Q", *fields).hex()


@settings(max_examples=300, deadline=None)
@given(updates())
def test_the_layout_finds_what_the_reference_finds(case) -> None:
    jobs, sums, views, digests = case
    want = _check(jobs, sums, views, digests)
    layout = _Layout.of(jobs, views, digests)
    malformed = any(b in (None, "", "00") for n, (b, _) in digests.items() if n in views)
    assert (layout is None) == malformed
    if layout is None:
        return
    assert layout.check(sums) == want


def test_every_tensor_right_and_one_wrong_result_is_named() -> None:
    """A plain case spelled out: two tensors of one piece each and one in two frames; only t2's result differs."""
    fr1 = Frame(SimpleNamespace(dtype="BF16"), None, ("t0", "t2"), 0)
    fr2 = Frame(SimpleNamespace(dtype="BF16"), None, ("t2", "t1"), 0)
    jobs = [
        (fr1, [np.zeros(4, np.uint8), np.zeros(2, np.uint8)], [0, 0]),
        (fr2, [np.zeros(6, np.uint8), np.zeros(8, np.uint8)], [1, 0]),
    ]
    sums = [[((1,), (2,)), ((3,), (4,))], [((5,), (6,)), ((7,), (MASK,))]]
    wire = struct.Struct("<QQ")
    digests = {
        "t0": (wire.pack(2, 1).hex(), wire.pack(2, 2).hex()),
        "t1": (wire.pack(4, 7).hex(), wire.pack(4, MASK).hex()),
        "t2": (wire.pack(4, 8).hex(), wire.pack(4, 11).hex()),  # 4 + 6 = 10, not 11
    }
    views = {n: np.zeros(1, np.uint8) for n in digests}
    layout = _Layout.of(jobs, views, digests)
    assert layout is not None
    assert layout.check(sums) == (None, "t2") == _check(jobs, sums, views, digests)
    assert _Layout.of(jobs, views, {**digests, "t1": (None, digests["t1"][1])}) is None
