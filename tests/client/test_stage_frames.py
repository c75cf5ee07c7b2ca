"""A device's update staged straight from its frames (client/stage_frames.py) equals the reference path's.

The reference decodes every frame into per-tensor changes, composes them and codes them for the device
(client/tensors.py ``stage_changes``); the native path writes the staged form from the frames. Both must
stage the same arrays, byte for byte (block-coded or int32 positions, the block counts of a block two
frames share, the apply steps), and the decoded change a tensor's ``ops`` makes on demand must equal the
reference's. Hypothesis drives models of several dtypes, densities and frame sizes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _staging import SKIP, check_piece_blocks, check_staged, lay_out
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightsync.client import inplace, stage_frames
from weightsync.client.tensors import HostOps, apply_staged, serialize_state_dict
from weightsync.codec import kernels
from weightsync.codec.checkpoint import Checkpoint
from weightsync.codec.encoder import Encoder
from weightsync.codec.frame import METHOD_SPARSE, parse_header

FIELDS = ("operands", "positions", "low", "blocks", "counts")
DTYPES = [torch.bfloat16, torch.float32, torch.uint8, torch.float16, torch.int64, torch.bool]


def _encoded(base: dict, new: dict, chunk_bytes: int, steps: list[dict] | None = None):
    """(manifests, read_frame) of base → new (and on through `steps`), encoded in process."""

    def ck(sd: dict) -> Checkpoint:
        return Checkpoint.from_bytes({"model.safetensors": serialize_state_dict(sd).tobytes()})

    versions = [base, new, *(steps or [])]
    manifests, areas = [], []
    for i, (a, b) in enumerate(zip(versions, versions[1:], strict=False)):
        encoded = Encoder(chunk_bytes=chunk_bytes, threads=2).encode(ck(b), ck(a))
        area = b"".join(fr.data for fr in encoded.frames)
        starts = np.cumsum([0] + [len(fr.data) for fr in encoded.frames])
        manifests.append(encoded.with_locations(lambda k, fr, i=i, s=starts: (f"o{i}", int(s[k]))))
        areas.append(area)
    by_object = {f"o{i}": a for i, a in enumerate(areas)}

    def read(ref):
        return memoryview(by_object[ref.object])[ref.offset : ref.offset + ref.length]

    return manifests, read


def _prepare(manifests, read, *, native: bool, monkeypatch: pytest.MonkeyPatch, select=None):
    """inplace.prepare "on" the CPU, staged from the frames (WEIGHTSYNC_STAGE_FRAMES=1: the host is no staging
    device otherwise) or the reference way."""
    with monkeypatch.context() as m:
        m.setenv("WEIGHTSYNC_STAGE_FRAMES", "1" if native else "0")
        return inplace.prepare(
            manifests, read, model="m", base=1, target=1 + len(manifests), threads=2, device="cpu", select=select
        )


def _dense_tensors(manifest, read) -> set[str]:
    """Tensors with a piece in a delta frame that is not sparse (those take the reference path)."""
    names = {(fi, si): e.segment.name for fi, f in enumerate(manifest.files) for si, e in enumerate(f.segments)}
    out = set()
    for ref in manifest.frames:
        if ref.delta and parse_header(read(ref)).method != METHOD_SPARSE:
            out.update(names[(p.file, p.seg)] for p in ref.pieces)
    return out


@st.composite
def step(draw):
    """(base, new, chunk_bytes): a few tensors of drawn dtypes and sizes, a drawn share of elements changed
    (some by one ulp: ADD frames' small differences), frames small enough to cut tensors into pieces."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    base, new = {}, {}
    for i in range(draw(st.integers(1, 4))):
        dtype = draw(st.sampled_from(DTYPES))
        n = draw(st.sampled_from([1, 7, 300, 70_000, 200_000]))
        width = torch.empty(0, dtype=dtype).element_size()
        raw = rng.integers(0, 2 if dtype == torch.bool else 256, n * width, dtype=np.uint8)  # a bool byte is 0 or 1
        changed = raw.copy()
        density = draw(st.sampled_from([0.0, 0.00002, 0.001, 0.02, 0.2]))
        at = np.flatnonzero(rng.random(n) < density)
        if draw(st.booleans()):  # blocks of 2^16 elements with many changes: block-coded positions
            at = np.union1d(at, rng.choice(n, min(n, 3000), replace=False))
        view = changed.view(f"<u{width}")
        if dtype == torch.bool:
            view[at] ^= 1
        else:
            view[at] = view[at] + rng.integers(1, 3, len(at)).astype(view.dtype)
        base[f"t{i}"] = torch.from_numpy(raw).view(dtype)
        new[f"t{i}"] = torch.from_numpy(changed).view(dtype)
    return base, new, draw(st.sampled_from([4 << 10, 64 << 10, 1 << 20]))


def _same_staged(a, b) -> None:
    assert a.add == b.add
    assert a.spans == b.spans
    for f in FIELDS:
        x, y = getattr(a, f), getattr(b, f)
        assert (x is None) == (y is None), f
        if x is not None:
            assert x.dtype == y.dtype, f
            assert torch.equal(x, y), f


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(step())
def test_staged_from_frames_equals_the_reference_staging(monkeypatch, s) -> None:
    base, new, chunk = s
    manifests, read = _encoded(base, new, chunk)
    native = _prepare(manifests, read, native=True, monkeypatch=monkeypatch)
    reference = _prepare(manifests, read, native=False, monkeypatch=monkeypatch)
    assert native.updates.keys() == reference.updates.keys()
    assert native.changed_elements == reference.changed_elements
    # Staged from its frames unless a piece of the tensor lies in a dense frame: that tensor the reference way.
    dense = _dense_tensors(manifests[0], read)
    for name, want in reference.updates.items():
        got = native.updates[name]
        assert isinstance(got.ops, HostOps) == (name not in dense), name
        assert (got.base_digest, got.result_digest) == (want.base_digest, want.result_digest)
        assert len(got.staged) == len(want.staged) == 1
        _same_staged(got.staged[0], want.staged[0])
        change, ref = got.ops[0], want.ops[0]  # the decoded change, made from the staged host copy
        assert change.add == ref.add
        assert np.array_equal(change.positions, ref.positions) and change.positions.dtype == np.int64
        assert np.array_equal(change.operands, ref.operands) and change.operands.dtype == ref.operands.dtype
        # The staged form itself, applied as a device applies it (torch index ops), gives the new bytes too.
        t = base[name].clone()
        apply_staged(t, got.staged[0])
        assert torch.equal(t.view(torch.uint8), new[name].view(torch.uint8)), name
    # Applied into live tensors holding the base, the staged update gives the new version bit for bit.
    live = {k: v.clone() for k, v in base.items()}
    inplace.apply(live, native, model="m", version=1, verify=True, strict=True)
    for k, v in new.items():
        assert torch.equal(live[k].view(torch.uint8), v.view(torch.uint8)), k


def test_a_tensor_across_many_frames_completes_the_blocks_they_share(monkeypatch) -> None:
    """A bf16 tensor cut into 4 KiB frames (2048 elements: 32 frames per block of 2^16) with changes in every
    frame: each block's count is completed from the frames after its first."""
    rng = np.random.default_rng(4)
    raw = rng.integers(0, 256, 2 * 200_000, dtype=np.uint8)
    changed = raw.copy()
    view = changed.view("<u2")
    at = np.arange(0, 200_000, 37)
    view[at] += 1
    base, new = {"w": torch.from_numpy(raw).view(torch.bfloat16)}, {"w": torch.from_numpy(changed).view(torch.bfloat16)}
    manifests, read = _encoded(base, new, 4 << 10)
    assert len(manifests[0].frames) > 60
    native = _prepare(manifests, read, native=True, monkeypatch=monkeypatch)
    reference = _prepare(manifests, read, native=False, monkeypatch=monkeypatch)
    got, want = native.updates["w"].staged[0], reference.updates["w"].staged[0]
    assert got.positions is None and got.counts is not None  # block-coded
    assert got.counts.tolist() == [len(at[(at >> 16) == b]) for b in range(4)]
    _same_staged(got, want)


def test_updates_of_several_steps_take_the_reference_path(monkeypatch) -> None:
    rng = np.random.default_rng(5)
    versions = []
    raw = rng.integers(0, 256, 2 * 5000, dtype=np.uint8)
    for _ in range(3):
        raw = raw.copy()
        raw.view("<u2")[rng.choice(5000, 50, replace=False)] += 1
        versions.append({"w": torch.from_numpy(raw).view(torch.bfloat16)})
    manifests, read = _encoded(versions[0], versions[1], 4 << 10, steps=[versions[2]])
    prepared = _prepare(manifests, read, native=True, monkeypatch=monkeypatch)
    assert not isinstance(prepared.updates["w"].ops, HostOps)  # composed by the reference path
    live = {"w": versions[0]["w"].clone()}
    inplace.apply(live, prepared, model="m", version=1, verify=True, strict=True)
    assert torch.equal(live["w"].view(torch.int16), versions[2]["w"].view(torch.int16))


def _bf16(raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(raw).view(torch.bfloat16)


def test_a_tensor_in_a_dense_frame_takes_the_reference_path_and_the_others_stay_staged(monkeypatch) -> None:
    """Every element of "norm" changed: its frame is dense (PLANES) and it is decoded and staged the reference
    way, in the same update whose sparse "w" is staged from its frames; both apply exactly."""
    rng = np.random.default_rng(6)
    base, new = {}, {}
    for name, n, every in (("norm", 40_000, 1), ("w", 100_000, 50)):
        raw = rng.integers(0, 256, 2 * n, dtype=np.uint8)
        changed = raw.copy()
        changed.view("<u2")[::every] += 1
        base[name], new[name] = _bf16(raw), _bf16(changed)
    manifests, read = _encoded(base, new, 64 << 10)
    assert _dense_tensors(manifests[0], read) == {"norm"}
    prepared = _prepare(manifests, read, native=True, monkeypatch=monkeypatch)
    reference = _prepare(manifests, read, native=False, monkeypatch=monkeypatch)
    assert not isinstance(prepared.updates["norm"].ops, HostOps)
    assert isinstance(prepared.updates["w"].ops, HostOps)
    for name in base:
        _same_staged(prepared.updates[name].staged[0], reference.updates[name].staged[0])
    live = {k: v.clone() for k, v in base.items()}
    inplace.apply(live, prepared, model="m", version=1, verify=True, strict=True)
    for k, v in new.items():
        assert torch.equal(live[k].view(torch.int16), v.view(torch.int16)), k


def test_a_tensor_named_with_the_empty_string_is_staged(monkeypatch) -> None:
    rng = np.random.default_rng(2)
    raw = rng.integers(0, 256, 10_000, dtype=np.uint8)
    changed = raw.copy()
    changed.view("<u2")[::50] += 1
    base, new = {"": _bf16(raw)}, {"": _bf16(changed)}
    manifests, read = _encoded(base, new, 4 << 10)
    prepared = _prepare(manifests, read, native=True, monkeypatch=monkeypatch)
    assert isinstance(prepared.updates[""].ops, HostOps)
    live = {"": base[""].clone()}
    inplace.apply(live, prepared, model="m", version=1, verify=True, strict=True)
    assert torch.equal(live[""].view(torch.int16), new[""].view(torch.int16))


def test_a_selection_stages_only_the_selected_tensors(monkeypatch) -> None:
    rng = np.random.default_rng(12)
    base, new = {}, {}
    for i in range(3):
        raw = rng.integers(0, 256, 2 * 30_000, dtype=np.uint8)
        changed = raw.copy()
        changed.view("<u2")[i::40] += 1
        base[f"t{i}"], new[f"t{i}"] = _bf16(raw), _bf16(changed)
    manifests, read = _encoded(base, new, 16 << 10)
    wanted = {"t0", "t2"}.__contains__
    prepared = _prepare(manifests, read, native=True, monkeypatch=monkeypatch, select=wanted)
    reference = _prepare(manifests, read, native=False, monkeypatch=monkeypatch, select=wanted)
    assert prepared.updates.keys() == reference.updates.keys() == {"t0", "t2"}
    for name in ("t0", "t2"):
        _same_staged(prepared.updates[name].staged[0], reference.updates[name].staged[0])


def test_a_zero_operand_sends_the_update_to_the_reference_path(monkeypatch) -> None:
    """The reference path drops a change whose operand is zero (the format allows one; this codec never writes
    it): told so by stage_pieces, the whole update is decoded the reference way, nothing staged from frames."""
    ext = kernels.EXTENSION
    assert ext is not None

    class Zero:
        def __getattr__(self, name):
            return getattr(ext, name)

        def stage_pieces(self, *args):
            assert ext.stage_pieces(*args) == 1
            return 2

    rng = np.random.default_rng(13)
    raw = rng.integers(0, 256, 2 * 20_000, dtype=np.uint8)
    changed = raw.copy()
    changed.view("<u2")[::30] += 1
    base, new = {"w": _bf16(raw)}, {"w": _bf16(changed)}
    manifests, read = _encoded(base, new, 16 << 10)
    monkeypatch.setattr(kernels, "EXTENSION", Zero())
    prepared = _prepare(manifests, read, native=True, monkeypatch=monkeypatch)
    assert not isinstance(prepared.updates["w"].ops, HostOps)
    live = {"w": base["w"].clone()}
    inplace.apply(live, prepared, model="m", version=1, verify=True, strict=True)
    assert torch.equal(live["w"].view(torch.int16), new["w"].view(torch.int16))


# ---- the kernels themselves -------------------------------------------------------------------------------


def _frame_changes(rng: np.random.Generator, n: int, count: int, width: int):
    """Gap planes and value planes of `count` changes among `n` elements, and their positions and values."""
    positions = np.sort(rng.choice(n, count, replace=False)).astype(np.int64)
    gaps = np.diff(positions, prepend=-1) - 1
    gap_planes = [((gaps >> (8 * j)) & 0xFF).astype(np.uint8) for j in range(4)]
    values = rng.integers(1, 256, (count, width), dtype=np.uint8)
    return gap_planes, [np.ascontiguousarray(values[:, j]) for j in range(width)], positions, values


@pytest.mark.parametrize("mode", [1, 2, 3, 4])
@pytest.mark.parametrize("add", [False, True])
def test_stage_pieces_writes_each_mode_where_the_table_says(mode: int, add: bool) -> None:
    """Every staging mode (block-coded with int32 or int64 block ids, int32 or int64 positions), a skipped
    piece between two written ones, and a merged first block: against numpy's own coding."""
    ext = kernels.EXTENSION
    assert ext is not None
    rng = np.random.default_rng(mode)
    width, n = 2, 300_000
    gaps, planes, positions, values = _frame_changes(rng, n, 5000, width)
    bounds = np.array([0, 100_000, 150_000], dtype=np.int64)
    offsets = np.array([(1 << 16) - 10, 0, 70_000], dtype=np.int64)  # piece 0 starts 10 elements into block 0
    stats = [np.empty(3, dtype=np.int64) for _ in range(4)]
    end = ext.piece_blocks(len(positions), gaps, bounds, offsets, *stats)
    assert end == positions[-1] + 1
    check_piece_blocks(stats, positions, bounds, offsets)
    # piece 1: a tensor this update does not stage; piece 2 continues a block of piece 0's tensor (when blocked)
    table, buf, merged = lay_out(stats, bounds, offsets, [mode, SKIP, mode], [False, False, True])
    carry = np.empty(3, dtype=np.int64)
    assert ext.stage_pieces(len(positions), gaps, planes, width, int(add), table, buf, carry) == 1
    check_staged(buf, table, carry, positions, planes, add, merged)


def test_stage_pieces_refuses_regions_outside_its_buffer_and_a_layout_that_does_not_match() -> None:
    ext = kernels.EXTENSION
    assert ext is not None
    rng = np.random.default_rng(9)
    gaps, planes, positions, _ = _frame_changes(rng, 1000, 40, 2)
    table = np.zeros((1, 10), dtype=np.int64)
    table[0, 2], table[0, 8] = 3, 40  # int32 positions, 40 changes
    table[0, 5] = 80
    carry = np.empty(1, dtype=np.int64)
    with pytest.raises(ValueError):
        ext.stage_pieces(40, gaps, planes, 2, 0, table, np.zeros(80 + 40 * 4 - 1, np.uint8), carry)
    table[0, 2] = 7
    with pytest.raises(ValueError):
        ext.stage_pieces(40, gaps, planes, 2, 0, table, np.zeros(1000, np.uint8), carry)
    table[0, 2], table[0, 8] = 3, 39  # one change fewer than the frame holds: refused, not overrun
    assert ext.stage_pieces(40, gaps, planes, 2, 0, table, np.zeros(1000, np.uint8), carry) == 0
    table[0, 8] = 40
    assert ext.stage_pieces(40, gaps, planes, 2, 0, table, np.zeros(1000, np.uint8), carry) == 1
    zero = [p.copy() for p in planes]
    zero[0][7] = zero[1][7] = 0  # one change that changes nothing
    assert ext.stage_pieces(40, gaps, zero, 2, 0, table, np.zeros(1000, np.uint8), carry) == 2
    assert ext.stage_pieces(40, gaps, zero, 2, 1, table, np.zeros(1000, np.uint8), carry) == 2  # zigzag 0 is 0
    blocked = table.copy()
    blocked[0, 2], blocked[0, 6], blocked[0, 7], blocked[0, 9] = 1, 400, 500, 1
    for column, at in ((4, 1000 - 79), (6, 1000 - 3), (7, 1000 - 7), (4, -1), (9, -1)):
        bad = blocked.copy()
        bad[0, column] = at
        with pytest.raises(ValueError):
            ext.stage_pieces(40, gaps, planes, 2, 0, bad, np.zeros(1000, np.uint8), carry)
    few = blocked.copy()
    few[0, 9] = 0  # the changes' blocks need a slot it does not have
    assert ext.stage_pieces(40, gaps, planes, 2, 0, few, np.zeros(1000, np.uint8), carry) == 0


def test_the_environment_can_select_the_reference_path(monkeypatch) -> None:
    rng = np.random.default_rng(8)
    raw = rng.integers(0, 256, 2 * 5000, dtype=np.uint8)
    changed = raw.copy()
    changed.view("<u2")[::50] += 1
    base, new = {"w": torch.from_numpy(raw).view(torch.bfloat16)}, {"w": torch.from_numpy(changed).view(torch.bfloat16)}
    manifests, read = _encoded(base, new, 4 << 10)
    monkeypatch.delenv("WEIGHTSYNC_STAGE_FRAMES", raising=False)
    assert stage_frames.available("cuda:0") and stage_frames.available("meta")
    assert not stage_frames.available("cpu")  # a host apply would decode each change inside its pause
    on_host = inplace.prepare(manifests, read, model="m", base=1, target=2, device="cpu")
    assert not isinstance(on_host.updates["w"].ops, HostOps)
    monkeypatch.setenv("WEIGHTSYNC_STAGE_FRAMES", "0")
    assert not stage_frames.available("cuda:0")
    monkeypatch.setenv("WEIGHTSYNC_STAGE_FRAMES", "1")
    assert stage_frames.available("cpu")
    assert isinstance(_prepare(manifests, read, native=True, monkeypatch=monkeypatch).updates["w"].ops, HostOps)


def test_a_frame_whose_pieces_do_not_cover_it_is_refused(monkeypatch) -> None:
    """A manifest built in process whose frame's pieces fall short of its bytes (a parsed one cannot be):
    CorruptData, nothing staged beyond a piece."""
    import dataclasses

    from weightsync.codec.manifest import Piece
    from weightsync.errors import CorruptData

    rng = np.random.default_rng(3)
    raw = rng.integers(0, 256, 2 * 5000, dtype=np.uint8)
    changed = raw.copy()
    changed.view("<u2")[::50] += 1
    manifests, read = _encoded({"w": _bf16(raw)}, {"w": _bf16(changed)}, 1 << 20)
    m = manifests[0]
    first = m.frames[0]
    p = first.pieces[-1]
    m.frames[0] = dataclasses.replace(
        first, pieces=(*first.pieces[:-1], Piece(p.file, p.seg, p.offset, p.length - 2000))
    )
    with pytest.raises(CorruptData):
        _prepare(manifests, read, native=True, monkeypatch=monkeypatch)
