"""The C kernels against the numpy reference: same bytes for every width, method and operation.

The reference (kernels.REFERENCE) is the definition; the native kernels must agree bit for
bit on random inputs, frames encoded by either must be byte-identical, and the golden
frames must decode identically through both.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from _ckpt import ALL_DTYPES
from _staging import check_piece_blocks, check_staged, lay_out
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightsync.codec import decode_frame, kernels
from weightsync.codec import frame as fr
from weightsync.codec.dtypes import UINT, by_name
from weightsync.codec.values import decode_pieces
from weightsync.errors import ChecksumMismatch, CorruptData, LimitExceeded

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
NATIVE = kernels.NATIVE
IMPLS = [kernels.REFERENCE] + ([NATIVE] if NATIVE is not None else [])
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
OPS = [kernels.OP_SET, kernels.OP_XOR, kernels.OP_ADD, kernels.OP_SUB]


def test_the_extension_is_built_in_this_environment():
    # CI must notice a broken build: the fallback would otherwise hide it behind a warning.
    assert NATIVE is not None, f"weightsync.codec._kernels did not load: {kernels.LOAD_ERROR}"
    assert kernels.active() is NATIVE or os.environ.get("WEIGHTSYNC_NATIVE") == "0"


def need_native() -> kernels.Kernels:
    if NATIVE is None:
        pytest.fail(f"C kernels not built: {kernels.LOAD_ERROR}")
    return NATIVE


@st.composite
def pair(draw, widths=(1, 2, 4, 8)):
    """(width, base, new): random elements, a drawn fraction of them changed, some by tiny amounts."""
    width = draw(st.sampled_from(widths))
    n = draw(st.integers(0, 300))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    base = rng.integers(0, 256, n * width, dtype=np.uint8)
    new = base.copy()
    density = draw(st.sampled_from([0.0, 0.01, 0.1, 0.3, 1.0]))
    mask = rng.random(n) < density
    view = new.view(UINT[width])
    small = rng.integers(-2, 3, n).astype(np.int64).astype(UINT[width])
    view[mask] = view[mask] + np.where(
        rng.random(int(mask.sum())) < 0.5, small[mask], rng.integers(0, 255, int(mask.sum())).astype(UINT[width])
    )
    return width, base, new


@SETTINGS
@given(pair(), st.booleans(), st.integers(0, 400))
def test_encode_kernels_agree(p, add, cap):
    width, base, new = p
    ref, nat = kernels.REFERENCE, need_native()
    assert nat.count_changed(base, new, width) == ref.count_changed(base, new, width)
    a, b = ref.encode_sparse(base, new, width, add, cap), nat.encode_sparse(base, new, width, add, cap)
    assert (a is None) == (b is None)
    if a is not None and b is not None:
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    assert np.array_equal(ref.encode_dense(base, new, width, add), nat.encode_dense(base, new, width, add))
    planes = ref.split_planes(new, width)
    assert np.array_equal(planes, nat.split_planes(new, width))
    assert np.array_equal(nat.join_planes(list(planes), width), new)
    assert np.array_equal(ref.join_planes(list(planes), width), new)


@SETTINGS
@given(pair(), st.booleans(), st.sampled_from(OPS))
def test_apply_kernels_agree(p, add, op):
    width, base, new = p
    ref, nat = kernels.REFERENCE, need_native()
    n = len(base) // width
    dense = ref.encode_dense(base, new, width, add)
    outs = []
    for impl in (ref, nat):
        t = base.copy()
        impl.apply_dense(t, width, op, list(dense))
        outs.append(t)
    assert np.array_equal(outs[0], outs[1])
    sparse = ref.encode_sparse(base, new, width, add, n)
    assert sparse is not None
    gaps, values = list(sparse[0]), list(sparse[1])
    count = len(gaps[0])
    assert np.array_equal(ref.gap_positions(count, gaps), nat.gap_positions(count, gaps))
    bounds = np.array(sorted([0, n // 3, n // 2, n // 2, n]), dtype=np.int64)  # equal bounds: empty pieces
    for a, b in zip(ref.gap_cuts(count, gaps, bounds), nat.gap_cuts(count, gaps, bounds), strict=True):
        assert np.array_equal(a, b)
    outs = []
    for impl in (ref, nat):
        t = base.copy()
        assert impl.apply_sparse(t, width, op, count, gaps, values)
        outs.append(t)
    assert np.array_equal(outs[0], outs[1])
    if op == (kernels.OP_ADD if add else kernels.OP_XOR):
        assert np.array_equal(outs[1], new)  # the delta applied to base gives new


@settings(max_examples=60, deadline=None)
@given(width=st.sampled_from([1, 2, 4, 8]), raw=st.binary(max_size=4096), step=st.sampled_from([1, 2, 3]))
def test_unzigzag_kernels_agree_and_invert_zigzag(width, raw, step):
    """The subscriber's decode turns every added frame's values into addends with this (FORMAT §4.2)."""
    nat = need_native()
    z = np.frombuffer(raw[: len(raw) // width * width], dtype=UINT[width])[::step]  # strided: copied first
    got = nat.unzigzag(z)
    assert got.dtype == z.dtype and np.array_equal(got, kernels.REFERENCE.unzigzag(z))
    assert np.array_equal(kernels.zigzag(got), z)
    assert np.array_equal(kernels.unzigzag(z), got)  # the module function: the active kernels


@pytest.mark.parametrize("impl", IMPLS, ids=lambda k: k.name)
def test_sparse_position_past_the_end_writes_nothing(impl):
    target = np.arange(16, dtype=np.uint8)
    gaps = [np.array([3, 20], dtype=np.uint8)] + [np.zeros(2, dtype=np.uint8)] * 3  # positions 3 and 24
    values = [np.array([1, 1], dtype=np.uint8), np.array([0, 0], dtype=np.uint8)]
    before = target.copy()
    assert not impl.apply_sparse(target, 2, kernels.OP_XOR, 2, gaps, values)
    assert np.array_equal(target, before)


@SETTINGS
@given(pair(), st.booleans(), st.lists(st.integers(0, 300), max_size=6), st.integers(0, 2**40))
def test_piece_changes_agree_and_place_each_change_in_its_pieces_tensor(p, add, cuts, shift):
    """Both kernels split a frame's changes into its pieces alike, and each change lands where the frame's
    positions, moved by its piece's start and offset, put it (equal bounds make empty pieces)."""
    width, base, new = p
    ref, nat = kernels.REFERENCE, need_native()
    n = len(base) // width
    sparse = ref.encode_sparse(base, new, width, add, n)
    assert sparse is not None
    gaps, values = list(sparse[0]), list(sparse[1])
    count = len(gaps[0])
    bounds = np.array(sorted([0, *(c % (n + 1) for c in cuts)]), dtype=np.int64)
    offsets = np.array([shift + 3 * i for i in range(len(bounds))], dtype=np.int64)
    got = [impl.piece_changes(count, gaps, values, width, add, bounds, offsets) for impl in (ref, nat)]
    for a, b in zip(*got, strict=True):
        assert np.array_equal(a, b)
    positions, operands, piece_cuts, end = got[1]
    frame_positions = ref.gap_positions(count, gaps)
    assert end == (int(frame_positions[-1]) + 1 if count else 0)
    piece = np.searchsorted(bounds, frame_positions, side="right") - 1
    assert np.array_equal(positions, frame_positions - bounds[piece] + offsets[piece])
    assert np.array_equal(piece_cuts, np.searchsorted(frame_positions, bounds))
    view = base.copy().view(UINT[width])  # the operands applied at the frame's positions give `new`
    if add:
        view[frame_positions] += operands
    else:
        view[frame_positions] ^= operands
    assert np.array_equal(view.view(np.uint8), new)


@pytest.mark.parametrize("impl", IMPLS, ids=lambda k: k.name)
def test_piece_changes_refuse_bounds_not_ascending_from_zero(impl):
    gaps, values = [np.zeros(1, np.uint8)] * 4, [np.ones(1, np.uint8)] * 2
    for bounds in ([1, 4], [0, 5, 3], []):
        b = np.array(bounds, dtype=np.int64)
        with pytest.raises(ValueError):
            impl.piece_changes(1, gaps, values, 2, False, b, np.zeros(len(b), np.int64))


def test_native_rejects_bad_arguments_before_touching_memory():
    ext = kernels.EXTENSION
    assert ext is not None
    t = np.zeros(8, dtype=np.uint8)
    with pytest.raises(ValueError):
        ext.apply_dense(t, 3, kernels.OP_XOR, [t] * 3)  # width 3
    with pytest.raises(ValueError):
        ext.apply_dense(t, 2, kernels.OP_XOR, [np.zeros(3, np.uint8)] * 2)  # plane of the wrong length
    with pytest.raises(ValueError):
        ext.apply_sparse(t, 2, 9, 0, [np.zeros(0, np.uint8)] * 4, [np.zeros(0, np.uint8)] * 2)  # unknown op
    with pytest.raises(ValueError):
        ext.count_changed(np.zeros(4, np.uint8), np.zeros(6, np.uint8), 2)
    with pytest.raises((ValueError, BufferError, TypeError)):
        ext.apply_dense(bytes(8), 1, kernels.OP_XOR, [bytes(8)])  # read-only target


@st.composite
def frame_input(draw):
    dtype = by_name(draw(st.sampled_from(ALL_DTYPES)))
    w = dtype.width
    n = draw(st.integers(0, 2000))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    base = rng.integers(0, 256, n * w, dtype=np.uint8)
    if draw(st.booleans()):  # smooth data compresses: exercises zstd sections, not only STORED
        base = (np.arange(n * w) // 7 % 5).astype(np.uint8)
    new = base.copy()
    density = draw(st.sampled_from([0.0, 0.001, 0.02, 0.2, 0.3, 0.9]))
    idx = np.flatnonzero(rng.random(n * w) < density)
    new[idx] ^= rng.integers(1, 256, len(idx), dtype=np.uint8)
    return dtype, base, new


@SETTINGS
@given(frame_input(), st.sampled_from([None, True, False]))
def test_frames_are_byte_identical_through_both_paths(inp, add):
    dtype, base, new = inp
    need_native()
    blobs = {}
    for impl in IMPLS:
        with kernels.using(impl):
            blobs[impl.name] = (fr.encode_delta(base, new, dtype, add=add), fr.encode_key(new, dtype))
    assert blobs["reference"] == blobs["native"]
    delta, key = blobs["native"]
    for impl in IMPLS:
        with kernels.using(impl):
            assert decode_frame(delta, base).tobytes() == new.tobytes()
            assert decode_frame(key).tobytes() == new.tobytes()
            head = fr.parse_header(delta)
            pos, vals = fr.decode_payload(delta, head)
            with kernels.using(kernels.REFERENCE):
                rpos, rvals = fr.decode_payload(delta, head)
            assert (pos is None) == (rpos is None)
            assert pos is None or np.array_equal(pos, rpos)
            assert np.array_equal(vals, rvals)


@SETTINGS
@given(frame_input(), st.lists(st.integers(0, 2000), max_size=5))
def test_pieces_code_and_apply_as_their_concatenation(inp, cuts):
    dtype, base, new = inp
    n = len(new) // dtype.width
    bounds = sorted({0, n, *(min(c, n) for c in cuts)})
    spans = [(a * dtype.width, b * dtype.width) for a, b in zip(bounds, bounds[1:], strict=False)] or [(0, 0)]
    whole = fr.encode_delta(base, new, dtype)
    pieces = fr.encode_delta_pieces([base[a:b] for a, b in spans], [new[a:b] for a, b in spans], dtype)
    assert pieces == whole
    target = base.copy()
    fr.apply_frame_pieces(whole, [target[a:b] for a, b in spans])
    assert target.tobytes() == new.tobytes()


def test_a_result_mismatch_undoes_every_piece():
    dtype = by_name("BF16")
    base = np.arange(4000, dtype=np.uint8)
    new = base.copy()
    new[::37] ^= 0x5A
    blob = bytearray(fr.encode_delta(base, new, dtype))
    # Forge the result hash (and the header check) so the payload applies but fails its result check.
    blob[40:56] = bytes(16)
    import struct

    import xxhash

    blob[56:64] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(blob[:56])))
    for impl in IMPLS:
        with kernels.using(impl):
            target = base.copy()
            with pytest.raises(ChecksumMismatch):
                fr.apply_frame_pieces(bytes(blob), [target[:1000], target[1000:1002], target[1002:]])
            assert target.tobytes() == base.tobytes()


def test_a_sparse_position_past_the_end_is_corrupt_data_through_pieces():
    dtype = by_name("U8")
    base = np.zeros(100, dtype=np.uint8)
    new = base.copy()
    new[99] = 1
    blob = fr.encode_delta(base, new, dtype)
    head = fr.parse_header(blob)
    for impl in IMPLS:
        with kernels.using(impl):
            t = np.zeros(100, dtype=np.uint8)
            fr.apply_frame_pieces(blob, [t[:50], t[50:]])
            assert t[99] == 1
    assert head.method == fr.METHOD_SPARSE
    short = _with_raw_len(blob, 99)  # the change at element 99 now lies past the end
    for impl in IMPLS:
        with kernels.using(impl):
            t = np.zeros(99, dtype=np.uint8)
            with pytest.raises(CorruptData):
                fr.apply_frame(short, t, verify_base=False)
            with pytest.raises(CorruptData):
                fr.apply_frame_pieces(short, [t[:40], t[40:]], verify_base=False)
            with pytest.raises(CorruptData):
                fr.decode_payload(short, fr.parse_header(short))
            with pytest.raises(CorruptData):
                decode_pieces(short, [(40, 0), (59, 0)])
            assert not t.any()


def _with_raw_len(blob: bytes, raw_len: int) -> bytes:
    import struct

    import xxhash

    b = bytearray(blob)
    b[8:16] = struct.pack("<Q", raw_len)
    b[56:64] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(b[:56])))
    return bytes(b)


@pytest.mark.parametrize("impl", IMPLS, ids=lambda k: k.name)
def test_golden_frames_decode_identically_through_each_path(impl):
    index = json.loads((GOLDEN / "index.json").read_text())
    for entry in index["frames"]:
        blob = (GOLDEN / entry["frame"]).read_bytes()
        base = None if entry["base"] is None else np.frombuffer((GOLDEN / entry["base"]).read_bytes(), np.uint8)
        with kernels.using(impl):
            assert decode_frame(blob, base).tobytes() == (GOLDEN / entry["expect"]).read_bytes(), entry["frame"]


def test_without_the_extension_the_codec_falls_back_with_one_warning(tmp_path):
    script = """
import logging, sys
logging.basicConfig(level=logging.WARNING, format="%(name)s|%(message)s")
sys.modules["weightsync.codec._kernels"] = None  # what a checkout without a compiler looks like
import numpy as np
from weightsync.codec import kernels, frame, dtypes
assert kernels.NATIVE is None and kernels.active() is kernels.REFERENCE
import importlib
importlib.import_module("weightsync.codec.encoder")
base = np.zeros(4096, np.uint8); new = base.copy(); new[::100] = 7
blob = frame.encode_delta(base, new, dtypes.by_name("BF16"))
assert frame.decode_frame(blob, base).tobytes() == new.tobytes()
"""
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "WEIGHTSYNC_NATIVE": "1"},
    )
    assert out.returncode == 0, out.stderr
    warnings = [line for line in out.stderr.splitlines() if "C kernels not built" in line]
    assert len(warnings) == 1, out.stderr


def _digest(version: int, data: np.ndarray, width: int) -> str:
    """What a manifest of `version` records for a segment's bytes: xxh3-128 (1) or the §10 checksum (2)."""
    from weightsync.codec.checksum import reference_sum

    return fr.xxh3_128(data).hex() if version == 1 else reference_sum(data, width).hex()


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("keyframe", [False, True])
def test_hashing_in_the_coding_pass_gives_every_segments_own_hash(threads, keyframe, version):
    # The encoder digests each byte once, inside the frame tasks (v1: whole segments from the
    # coder, segments cut across frames chained chunk by chunk; v2: every piece's checksum at its
    # position, added): the manifest must hold exactly the digest of each segment's bytes, and
    # the known base digests passed in.
    from _ckpt import safetensors_file

    from weightsync.codec import Checkpoint, Decoder, Encoder

    rng = np.random.default_rng(threads)
    tensors = {f"t{i}": ("BF16", (int(rng.integers(1, 40)), 64), None) for i in range(30)}
    tensors["big"] = ("BF16", (300, 64), None)  # 38 KB: cut into chunks
    tensors["wide"] = ("F64", (100, 16), None)  # 12.8 KB of 8-byte elements: 4 lanes, cut into chunks
    tensors["empty"] = ("F32", (0, 4), None)
    tensors["same"] = ("F32", (7, 3), None)  # left unchanged below
    base_t = {k: (d, s, rng.integers(0, 256, by_name(d).nbytes(s), dtype=np.uint8)) for k, (d, s, _) in tensors.items()}
    new_t = {}
    for k, (d, s, data) in base_t.items():
        data = data.copy()
        if k != "same":
            data[rng.random(len(data)) < 0.02] ^= 1
        new_t[k] = (d, s, data)
    base = Checkpoint.from_bytes({"m.safetensors": safetensors_file(base_t, {})})
    new = Checkpoint.from_bytes({"m.safetensors": safetensors_file(new_t, {})})
    enc = Encoder(threads=threads, chunk_bytes=4096, format_version=version)
    encoded = enc.encode(new, base, keyframe=keyframe)
    assert encoded.manifest.version == version
    assert len(encoded.frames) > 5
    for f, fe in zip(new.files, encoded.manifest.files, strict=True):
        bf = base.files[0]
        for seg, entry in zip(f.layout.segments, fe.segments, strict=True):
            assert entry.digest == _digest(version, f.segment_bytes(seg), seg.dtype.width), seg.name
            if not keyframe:
                other = next(s for s in bf.layout.segments if s.key == seg.key)
                assert entry.base_digest == _digest(version, bf.segment_bytes(other), seg.dtype.width), seg.name
    known = {
        ("m.safetensors", e.segment.kind, e.segment.name): e.base_digest for e in encoded.manifest.files[0].segments
    }
    if not keyframe:
        again = enc.encode(new, base, base_digests=known)
        assert again.manifest.files == encoded.manifest.files
    frames = [x.data for x in encoded.frames]
    offsets = np.cumsum([0] + [len(x) for x in frames])
    manifest = encoded.with_locations(lambda i, _: (None, int(offsets[i])))
    area = b"".join(frames)
    out = [np.empty(f.layout.size, dtype=np.uint8) for f in new.files]
    Decoder(threads=threads).decode(
        manifest, lambda r: area[r.offset : r.offset + r.length], out, base, verify_segments=True
    )
    assert out[0].tobytes() == new.files[0].data.tobytes()


# --- fused kernels: coding or applying with the tensor checksum in the same pass ---------


@st.composite
def pieces(draw, big: bool = False):
    """(width, base pieces, new pieces, starts): a changed pair cut at drawn points.

    `big` makes pieces span several checksum blocks (4 KiB), so block edges, whole blocks
    and tails are all exercised.
    """
    width, base, new = draw(pair()) if not big else draw(big_pair())
    n = len(base) // width
    cuts = sorted({0, n, *draw(st.lists(st.integers(0, n), max_size=4))})
    spans = [(a * width, b * width) for a, b in zip(cuts, cuts[1:], strict=False)] or [(0, 0)]
    starts = [draw(st.integers(0, 1 << 40)) for _ in spans]
    return width, [base[a:b] for a, b in spans], [new[a:b] for a, b in spans], starts


@st.composite
def big_pair(draw):
    width = draw(st.sampled_from((1, 2, 4, 8)))
    n = draw(st.sampled_from([4096 // width - 1, 4096 // width, 4096 // width + 1, 3 * 4096 // width + 17]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    base = rng.integers(0, 256, n * width, dtype=np.uint8)
    new = base.copy()
    density = draw(st.sampled_from([0.0, 0.001, 0.02, 0.3]))
    idx = np.flatnonzero(rng.random(n) < density)
    new.view(UINT[width])[idx] += np.array(1, dtype=UINT[width])
    return width, base, new


def _reference_sums(pieces_: list[np.ndarray], width: int, starts: list[int]) -> list[tuple[int, ...]]:
    from weightsync.codec.checksum import reference_sum

    return [reference_sum(p, width, start=s).lanes for p, s in zip(pieces_, starts, strict=True)]


@SETTINGS
@given(st.one_of(pieces(), pieces(big=True)), st.booleans(), st.integers(0, 400), st.booleans(), st.booleans())
def test_fused_encode_codes_and_sums_like_the_reference(p, add, cap, before, after):
    width, bases, news, starts = p
    ref, nat = kernels.REFERENCE, need_native()
    a = ref.encode_sparse_sums(bases, news, starts, width, add, cap, before=before, after=after)
    b = nat.encode_sparse_sums(bases, news, starts, width, add, cap, before=before, after=after)
    assert (a is None) == (b is None)
    if a is None or b is None:
        return
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    assert a[2] == b[2]
    scratch = np.full((kernels.GAP_PLANES + width, cap + 3), 0xEE, dtype=np.uint8)  # reused: planes are views
    c = nat.encode_sparse_sums(bases, news, starts, width, add, cap, before=before, after=after, scratch=scratch)
    assert c is not None and np.array_equal(c[0], b[0]) and np.array_equal(c[1], b[1]) and c[2] == b[2]
    # the pieces code as their concatenation, and each sum is the piece's checksum at its start
    whole = ref.encode_sparse(np.concatenate(bases), np.concatenate(news), width, add, cap)
    assert whole is not None and np.array_equal(whole[0], b[0]) and np.array_equal(whole[1], b[1])
    assert [s.before for s in b[2]] == (_reference_sums(bases, width, starts) if before else [None] * len(bases))
    assert [s.after for s in b[2]] == (_reference_sums(news, width, starts) if after else [None] * len(news))


@SETTINGS
@given(st.one_of(pieces(), pieces(big=True)), st.booleans(), st.integers(0, 400), st.booleans(), st.booleans())
def test_a_keeping_encode_codes_alike_and_leaves_the_new_bytes_in_the_bases(p, add, cap, before, after):
    """keep: the same planes and sums as without, and the bases hold the new bytes after; above `cap`
    (None) the bases hold their bytes of before again (what the scan wrote was taken back), so the
    dense coding that follows reads the right base."""
    width, bases, news, starts = p
    plain = kernels.REFERENCE.encode_sparse_sums(bases, news, starts, width, add, cap, before=before, after=after)
    for impl in IMPLS:
        mine = [b.copy() for b in bases]
        got = impl.encode_sparse_sums(mine, news, starts, width, add, cap, before=before, after=after, keep=True)
        assert (got is None) == (plain is None), impl.name
        if got is None or plain is None:
            assert all(np.array_equal(m, b) for m, b in zip(mine, bases, strict=True)), impl.name
            continue
        assert np.array_equal(got[0], plain[0]) and np.array_equal(got[1], plain[1]) and got[2] == plain[2]
        assert all(np.array_equal(m, n) for m, n in zip(mine, news, strict=True)), impl.name
        mine = [b.copy() for b in bases]
        planes, sums = impl.encode_dense_sums(mine, news, starts, width, add, before=before, after=after, keep=True)
        assert np.array_equal(
            planes, kernels.REFERENCE.encode_dense(np.concatenate(bases), np.concatenate(news), width, add)
        )
        assert (
            sums == kernels.REFERENCE.encode_dense_sums(bases, news, starts, width, add, before=before, after=after)[1]
        )
        assert all(np.array_equal(m, n) for m, n in zip(mine, news, strict=True)), impl.name


def test_a_keeping_encode_needs_writable_bases():
    nat = need_native()
    base = np.arange(64, dtype=np.uint8)
    base.flags.writeable = False
    new = base.copy()
    new[3] ^= 1
    with pytest.raises((BufferError, ValueError, TypeError)):
        nat.encode_sparse_sums([base], [new], [0], 1, False, 64, before=False, after=True, keep=True)
    assert base[3] == 3


@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("fill", [0x00, 0xFF, 0x80, 0x7F, "alternating"])
def test_fused_encode_sums_extreme_words_like_the_reference(width, fill):
    """Words at the ends of their range, over several 4 KiB blocks, at odd starts: the one-loop 2-byte
    scan sums words as signed pairs and recovers the odd ones mod 2^32 (_kernels_loops.h), so its
    bounds are where it could go wrong; the base's sum comes from the changes, so some change."""
    nat = need_native()
    n = 3 * 4096 // width + 37
    if fill == "alternating":
        base = np.tile(np.array([0xFF, 0xFF, 0x00, 0x00], dtype=np.uint8), n * width // 4 + 1)[: n * width]
    else:
        base = np.full(n * width, fill, dtype=np.uint8)
    new = base.copy()
    new[:: 997 * width] ^= 0x81  # changes in every block, the first at element 0
    new[-width:] = 0xFF - new[-width:]
    cuts = [0, 5 * width, 2048 * width, n * width]
    bases = [base[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
    news = [new[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
    starts = [(1 << 40) + 3, 0, 12345]
    for add in (False, True):
        a = kernels.REFERENCE.encode_sparse_sums(bases, news, starts, width, add, n, before=True, after=True)
        b = nat.encode_sparse_sums(bases, news, starts, width, add, n, before=True, after=True)
        assert a is not None and b is not None
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]


@SETTINGS
@given(st.one_of(pieces(), pieces(big=True)), st.booleans(), st.booleans(), st.booleans())
def test_fused_dense_encode_codes_and_sums_like_the_reference(p, add, before, after):
    width, bases, news, starts = p
    ref, nat = kernels.REFERENCE, need_native()
    planes, sums = nat.encode_dense_sums(bases, news, starts, width, add, before=before, after=after)
    assert ref.encode_dense_sums(bases, news, starts, width, add, before=before, after=after)[1] == sums
    scratch = np.zeros((width + 1, sum(len(x) for x in news) // width + 5), dtype=np.uint8)
    again, _ = nat.encode_dense_sums(bases, news, starts, width, add, before=False, after=False, scratch=scratch)
    assert np.array_equal(again, planes)
    assert np.array_equal(planes, ref.encode_dense(np.concatenate(bases), np.concatenate(news), width, add))
    assert [s.before for s in sums] == (_reference_sums(bases, width, starts) if before else [None] * len(bases))
    assert [s.after for s in sums] == (_reference_sums(news, width, starts) if after else [None] * len(news))


@SETTINGS
@given(st.one_of(pieces(), pieces(big=True)), st.booleans(), st.sampled_from(OPS), st.booleans(), st.booleans())
def test_fused_apply_patches_and_sums_like_the_reference(p, add, op, before, after):
    width, bases, news, starts = p
    ref, nat = kernels.REFERENCE, need_native()
    base, new = np.concatenate(bases), np.concatenate(news)
    n = len(base) // width
    sparse = ref.encode_sparse(base, new, width, add, n)
    assert sparse is not None
    gaps, values = list(sparse[0]), list(sparse[1])
    dense = list(ref.encode_dense(base, new, width, add))
    for kind in ("sparse", "dense"):
        results = []
        for impl in (ref, nat):
            targets = [b.copy() for b in bases]
            if kind == "sparse":
                sums = impl.apply_sparse_sums(
                    targets, starts, width, op, len(gaps[0]), gaps, values, before=before, after=after
                )
            else:
                sums = impl.apply_dense_sums(targets, starts, width, op, dense, before=before, after=after)
            assert sums is not None
            results.append((targets, sums))
        (ref_t, ref_s), (nat_t, nat_s) = results
        assert all(np.array_equal(x, y) for x, y in zip(ref_t, nat_t, strict=True)), kind
        assert ref_s == nat_s, kind
        if op == (kernels.OP_ADD if add else kernels.OP_XOR):
            assert np.concatenate(nat_t).tobytes() == new.tobytes()
        expect_before = _reference_sums(bases, width, starts) if before else [None] * len(bases)
        expect_after = _reference_sums(nat_t, width, starts) if after else [None] * len(bases)
        assert [s.before for s in nat_s] == expect_before and [s.after for s in nat_s] == expect_after


WIDTH_DTYPE = {1: "U8", 2: "BF16", 4: "F32", 8: "F64"}


@SETTINGS
@given(st.one_of(pieces(), pieces(big=True)), st.booleans(), st.booleans())
def test_frames_apply_with_base_sums_and_undo_alike_through_both_paths(p, add, before):
    """apply_frame_sums(before=...) and undo_frame through the reference and the C kernels: the same bytes,
    the same checksums of every piece before and after, and the undo gives the base back with its checksums."""
    width, bases, news, starts = p
    dtype = by_name(WIDTH_DTYPE[width])
    blob = fr.encode_delta_pieces(bases, news, dtype, add=add, version=2)
    expect_before = _reference_sums(bases, width, starts)
    expect_after = _reference_sums(news, width, starts)
    found = []
    for impl in IMPLS:
        with kernels.using(impl):
            targets = [b.copy() for b in bases]
            _, sums = fr.apply_frame_sums(blob, targets, starts, before=before)
            assert [t.tobytes() for t in targets] == [n.tobytes() for n in news], impl.name
            assert [s.after.lanes for s in sums] == expect_after, impl.name
            assert [s.before.lanes if s.before else None for s in sums] == (
                expect_before if before else [None] * len(bases)
            ), impl.name
            undone = fr.undo_frame(blob, targets, starts)
            assert [t.tobytes() for t in targets] == [b.tobytes() for b in bases], impl.name
            assert undone is not None and [s.lanes for s in undone] == expect_before, impl.name
            assert fr.undo_frame(blob, [n.copy() for n in news]) is None
            targets = [b.copy() for b in bases]
            _, lanes = fr.apply_frame_lanes(blob, targets, starts, before=before)  # the same pass, bare lanes
            assert [t.tobytes() for t in targets] == [n.tobytes() for n in news], impl.name
            assert [tuple(a) for _, a in lanes] == expect_after, impl.name
            assert [tuple(b) if b is not None else None for b, _ in lanes] == [
                s.before.lanes if s.before else None for s in sums
            ], impl.name
            found.append(sums)
    assert found[0] == found[-1]


@pytest.mark.parametrize("impl", IMPLS, ids=lambda k: k.name)
def test_fused_apply_past_the_end_writes_nothing(impl):
    targets = [np.arange(10, dtype=np.uint8), np.arange(6, dtype=np.uint8)]  # 8 two-byte elements
    before = [t.copy() for t in targets]
    gaps = [np.array([3, 4], dtype=np.uint8)] + [np.zeros(2, dtype=np.uint8)] * 3  # positions 3 and 8
    values = [np.array([1, 1], dtype=np.uint8), np.array([0, 0], dtype=np.uint8)]
    assert impl.apply_sparse_sums(targets, [0, 5], 2, kernels.OP_XOR, 2, gaps, values, before=True, after=True) is None
    assert all(np.array_equal(t, b) for t, b in zip(targets, before, strict=True))


ALWAYS_DENSE = 1 << 40
"""A dense_apply_every that takes every frame with a change to the dense blocks (count * it >= its elements)."""


@contextlib.contextmanager
def _dense_every(n: int) -> Iterator[None]:
    need_native()
    ext = kernels.EXTENSION
    assert ext is not None
    before = ext.dense_apply_every(n)
    try:
        yield
    finally:
        ext.dense_apply_every(before)


@pytest.mark.parametrize("every", [0, ALWAYS_DENSE], ids=["sparse-loops", "dense-blocks"])
@pytest.mark.parametrize("op", OPS)
def test_sparse_apply_across_gaps_of_2_to_the_24_and_more_agrees(op, every):
    # The vector loop for 2-byte elements takes eight gaps of under 2^24 at a time; a larger
    # gap hands the run to the scalar loop mid-frame. Changes packed before, between and after
    # two such gaps, a piece edge inside the packed run: bytes and checksums as the reference's.
    ref, nat = kernels.REFERENCE, need_native()
    n = (1 << 25) + 300
    rng = np.random.default_rng(7)
    positions = np.unique(
        np.concatenate([np.arange(0, 40), [40 + (1 << 24)], np.arange(100 + (1 << 24), 160 + (1 << 24), 3), [n - 1]])
    )
    gaps_u32 = np.diff(np.concatenate([[-1], positions])) - 1
    assert gaps_u32.max() >= 1 << 24
    gaps = [((gaps_u32 >> (8 * j)) & 0xFF).astype(np.uint8) for j in range(4)]
    values = [rng.integers(0, 256, len(positions), dtype=np.uint8) for _ in range(2)]
    base = rng.integers(0, 256, 2 * n, dtype=np.uint8)
    cut = 2 * (120 + (1 << 24))  # a piece edge among the packed changes after the first large gap
    results = []
    for impl in (ref, nat):
        targets = [base[:cut].copy(), base[cut:].copy()]
        with _dense_every(every):
            sums = impl.apply_sparse_sums(targets, [5, 0], 2, op, len(positions), gaps, values, before=True, after=True)
        plain = base.copy()
        assert impl.apply_sparse(plain, 2, op, len(positions), gaps, values)
        assert np.array_equal(np.concatenate(targets), plain)
        results.append((plain, sums))
    assert np.array_equal(results[0][0], results[1][0])
    assert results[0][1] == results[1][1]


@st.composite
def dense_pieces(draw):
    """(bases, news, starts) of 2-byte elements changed at a high density, cut into pieces: whole checksum
    blocks, tails, piece edges inside a block, and changes of every size (the zigzag's both signs)."""
    n = draw(st.sampled_from([1, 2047, 2048, 2049, 3 * 2048 + 17, 4 * 2048]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    base = rng.integers(0, 256, 2 * n, dtype=np.uint8)
    new = base.copy()
    density = draw(st.sampled_from([0.07, 0.2, 0.5, 1.0]))
    idx = np.flatnonzero(rng.random(n) < density)
    new.view(np.uint16)[idx] = rng.integers(0, 1 << 16, len(idx), dtype=np.uint16)
    cuts = sorted({0, n, *draw(st.lists(st.integers(0, n), max_size=4))})
    spans = [(2 * a, 2 * b) for a, b in zip(cuts, cuts[1:], strict=False)]
    starts = [draw(st.integers(0, 1 << 40)) for _ in spans]
    return [base[a:b] for a, b in spans], [new[a:b] for a, b in spans], starts


@SETTINGS
@given(dense_pieces(), st.booleans(), st.sampled_from(OPS), st.booleans(), st.booleans())
def test_dense_blocks_patch_and_sum_like_the_sparse_loops_and_the_reference(p, add, op, before, after):
    """A frame of 2-byte elements changing one element in a few: the dense blocks (scattered into a scratch
    block, combined and summed in one pass) give the bytes and checksums of the sparse loops and of numpy."""
    bases, news, starts = p
    ref, nat = kernels.REFERENCE, need_native()
    base, new = np.concatenate(bases), np.concatenate(news)
    sparse = ref.encode_sparse(base, new, 2, add, len(base) // 2)
    assert sparse is not None
    gaps, values = list(sparse[0]), list(sparse[1])
    results = []
    for impl, every in ((ref, None), (nat, 0), (nat, ALWAYS_DENSE)):
        targets = [b.copy() for b in bases]
        with contextlib.nullcontext() if every is None else _dense_every(every):
            sums = impl.apply_sparse_sums(
                targets, starts, 2, op, len(gaps[0]), gaps, values, before=before, after=after
            )
        assert sums is not None
        results.append(([t.tobytes() for t in targets], sums))
    assert results[0] == results[1] == results[2]
    if op == (kernels.OP_ADD if add else kernels.OP_XOR):
        assert b"".join(results[2][0]) == new.tobytes()
        undone = [bytearray(t) for t in results[2][0]]
        targets = [np.frombuffer(u, dtype=np.uint8) for u in undone]
        with _dense_every(ALWAYS_DENSE):  # and back (what undo_frame does)
            nat.apply_sparse_sums(
                targets,
                starts,
                2,
                kernels.OP_SUB if add else kernels.OP_XOR,
                len(gaps[0]),
                gaps,
                values,
                before=False,
                after=True,
            )
        assert b"".join(bytes(u) for u in undone) == base.tobytes()


def test_dense_apply_every_is_read_and_set_and_refuses_a_negative():
    need_native()
    ext = kernels.EXTENSION
    assert ext is not None
    was = ext.dense_apply_every()
    with _dense_every(3):
        assert ext.dense_apply_every() == 3
    assert ext.dense_apply_every() == was
    with pytest.raises(ValueError):
        ext.dense_apply_every(-5)


def test_fused_kernels_reject_bad_arguments_before_touching_memory():
    ext = kernels.EXTENSION
    assert ext is not None
    c = 0x9E3779B97F4A7C15
    t = np.zeros(8, dtype=np.uint8)
    planes = [np.zeros(4, np.uint8)] * 2
    g = [np.zeros(2, np.uint8)] * 4
    with pytest.raises(ValueError):  # one start per piece
        ext.apply_dense_sums([t], [0, 1], 2, kernels.OP_XOR, planes, c, 3)
    with pytest.raises(ValueError):  # planes shorter than the targets
        ext.apply_dense_sums([t, t], [0, 0], 2, kernels.OP_XOR, planes, c, 3)
    with pytest.raises(ValueError):  # a piece that is not whole elements
        ext.apply_dense_sums([t[:3]], [0], 2, kernels.OP_XOR, [np.zeros(1, np.uint8)] * 2, c, 3)
    with pytest.raises(ValueError):  # unknown checksum selection
        ext.apply_sparse_sums([t], [0], 2, kernels.OP_XOR, 2, g, [np.zeros(2, np.uint8)] * 2, c, 4)
    with pytest.raises((ValueError, BufferError, TypeError)):  # read-only target
        ext.apply_dense_sums([bytes(8)], [0], 2, kernels.OP_XOR, planes, c, 3)
    with pytest.raises(ValueError):  # base and new pieces of different lengths
        ext.encode_sparse_sums([t], [t[:6]], [0], 2, True, 4, [t] * 4, [t] * 2, c, 3)
    with pytest.raises(ValueError):  # more base pieces than new ones
        ext.encode_sparse_sums([t, t], [t], [0], 2, True, 4, [t] * 4, [t] * 2, c, 3)
    with pytest.raises(OverflowError):  # a negative start
        ext.encode_sparse_sums([t], [t], [-1], 2, True, 4, [t] * 4, [t] * 2, c, 3)
    with pytest.raises(ValueError):  # dense planes shorter than the pieces
        ext.encode_dense_sums([t], [t], [0], 2, True, [np.zeros(3, np.uint8)] * 2, c, 3)
    nat = need_native()
    for scratch in (np.zeros((5, 9), np.uint8), np.zeros((6, 3), np.uint8), np.zeros((6, 9), np.uint16)):
        with pytest.raises(ValueError):  # too few planes, too short, not bytes
            nat.encode_sparse_sums([t], [t], [0], 2, True, 4, before=True, after=True, scratch=scratch)
    assert not t.any()


@pytest.mark.slow  # ~10 s: a second pytest run
@pytest.mark.skipif(os.environ.get("WEIGHTSYNC_KERNELS_PORTABLE") == "1", reason="already the portable run")
def test_the_portable_loops_pass_the_differential_tests():
    # The AVX2 loops have portable twins (any other CPU); run the differential tests on them.
    script = "from weightsync.codec import kernels; assert kernels.EXTENSION.AVX2 == 0"
    env = {**os.environ, "WEIGHTSYNC_KERNELS_PORTABLE": "1", "WEIGHTSYNC_NATIVE": "1"}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    selection = "(agree or like) and not portable"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            __file__,
            "-q",
            "-p",
            "no:randomly",
            "-p",
            "no:cacheprovider",
            "-k",
            selection,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


@pytest.mark.parametrize("impl", IMPLS, ids=lambda k: k.name)
def test_memory_views_are_the_spans_own_bytes_and_take_a_sums_apply(impl):
    """Views by address are the memory itself (writes land, reads see it), in any length including none, and
    serve as the targets of a checked apply exactly as numpy arrays of the same bytes do."""
    from weightsync.codec.frame import apply_frame_lanes, encode_delta_pieces

    rng = np.random.default_rng(7)
    mem = rng.integers(0, 256, 4096, dtype=np.uint8)
    base = mem.ctypes.data
    spans = [(0, 1000), (1000, 0), (1000, 3096)]
    views = impl.memory_views([base + a for a, _ in spans], [n for _, n in spans])
    assert [len(v) for v in views] == [1000, 0, 3096]
    assert bytes(views[0]) == mem[:1000].tobytes() and bytes(views[2]) == mem[1000:].tobytes()
    np.frombuffer(views[2], dtype=np.uint8)[:2] = (1, 2)
    assert mem[1000:1002].tolist() == [1, 2]
    new = mem.copy()
    new[::97] ^= 0x55
    old = mem.copy()
    frame = encode_delta_pieces([old[:1000], old[1000:]], [new[:1000], new[1000:]], by_name("BF16"), version=2)
    with kernels.using(impl):
        views = impl.memory_views([base, base + 1000], [1000, 3096])
        copies = [old[:1000].copy(), old[1000:].copy()]
        _, by_address = apply_frame_lanes(frame, views, [0, 500], before=True)
        _, by_array = apply_frame_lanes(frame, copies, [0, 500], before=True)
    assert mem.tobytes() == new.tobytes() == b"".join(c.tobytes() for c in copies)
    assert [tuple(map(tuple, s)) for s in by_address] == [tuple(map(tuple, s)) for s in by_array]
    with pytest.raises(LimitExceeded, match="targets"):  # a view of 2-byte items is not a byte buffer
        apply_frame_lanes(frame, [memoryview(np.zeros(500, np.uint16)), views[1]], [0, 500])


@pytest.mark.parametrize("impl", IMPLS, ids=lambda k: k.name)
def test_memory_views_refuse_spans_that_are_not_memory(impl):
    with pytest.raises(ValueError, match="length"):
        impl.memory_views([1, 2], [3])
    with pytest.raises(ValueError, match="span 0"):
        impl.memory_views([0], [16])
    with pytest.raises((ValueError, OverflowError)):
        impl.memory_views([4096], [-1])


@pytest.mark.parametrize("impl", IMPLS, ids=lambda k: k.name)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_same_spans_says_which_spans_hold_equal_bytes(impl, data):
    """Each span pair is equal exactly when its bytes are, whatever the lengths (none included) and
    wherever a difference lies, its first or last byte among them."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    a = rng.integers(0, 256, 3000, dtype=np.uint8)
    b = a.copy()
    spans = data.draw(
        st.lists(st.tuples(st.integers(0, 1500), st.integers(0, 1500), st.integers(0, 1500)), max_size=12)
    )
    for at in data.draw(st.lists(st.integers(0, 2999), max_size=4)):
        b[at] ^= 0x80
    want = [bytes(a[x : x + n]) == bytes(b[y : y + n]) for x, y, n in spans]
    table = np.array([(a.ctypes.data + x, b.ctypes.data + y, n) for x, y, n in spans], np.uint64).reshape(-1, 3)
    got = impl.same_spans(table[:, 0], table[:, 1], table[:, 2])
    assert got.dtype == np.bool_ and got.tolist() == want


@pytest.mark.parametrize("impl", IMPLS, ids=lambda k: k.name)
def test_same_spans_refuses_columns_of_different_lengths(impl):
    with pytest.raises(ValueError, match="one length"):
        impl.same_spans(np.zeros(2, np.uint64), np.zeros(2, np.uint64), np.zeros(1, np.uint64))


@st.composite
def mixed_blocks(draw):
    """(width, base, new): 1- or 2-byte words over several blocks of 2048 elements, each block changed at
    its own density. The 2-byte coder lists the changes of a sparse block and visits rows one by one
    after a dense block (4 KiB blocks), so runs of dense blocks, sparse ones after them, empty ones and
    rows of more than four changes all occur; the 1-byte coder sees the same mixes."""
    width = draw(st.sampled_from([1, 2]))
    per = 2048
    densities = draw(st.lists(st.sampled_from([0.0, 0.0005, 0.015, 0.1, 0.12, 0.3, 1.0]), min_size=2, max_size=7))
    tail = draw(st.integers(0, per - 1))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n = per * len(densities) + tail
    kind = UINT[width]
    base = rng.integers(0, 1 << (8 * width), n, dtype=kind)
    new = base.copy()
    for b, d in enumerate([*densities, draw(st.sampled_from([0.0, 0.3]))]):
        lo, hi = b * per, min(n, (b + 1) * per)
        idx = lo + np.flatnonzero(rng.random(hi - lo) < d)
        new[idx] += rng.integers(1, 1 << (8 * width), len(idx)).astype(kind)
    return width, base.view(np.uint8), new.view(np.uint8)


@SETTINGS
@given(mixed_blocks(), st.booleans(), st.integers(0, 6000), st.booleans(), st.booleans())
def test_the_sparse_coders_code_blocks_of_any_density_like_the_reference(p, add, cap, keep, before):
    """Whatever the mix of block densities (the 2-byte coder lists sparse blocks and codes rows one by one
    after a dense block): the same planes and checksums as the reference, a cap that falls inside either
    kind of block gives None, and a keeping coder leaves the new bytes in the base (past the cap, the old
    ones)."""
    width, base, new = p
    start = 12345
    want = kernels.REFERENCE.encode_sparse_sums([base], [new], [start], width, add, cap, before=before, after=True)
    mine = base.copy()
    got = need_native().encode_sparse_sums(
        [mine], [new], [start], width, add, cap, before=before, after=True, keep=keep
    )
    assert (got is None) == (want is None)
    if got is None or want is None:
        assert np.array_equal(mine, base)
        return
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]) and got[2] == want[2]
    assert np.array_equal(mine, new if keep else base)


def test_a_thread_coding_frame_after_frame_reuses_its_planes_without_mixing_them(monkeypatch):
    """The frame coder keeps its sparse planes in a per-thread buffer: a frame coded after smaller and
    larger ones on the same thread is byte-identical to the same frame coded on a fresh thread, and
    decodes to its new bytes (nothing of an earlier frame's planes leaks into a later one); the buffer a
    thread keeps is bounded, and a frame that needs more is coded alike on planes of its own."""
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(7)
    dtype = by_name("BF16")

    def case(n: int, density: float) -> tuple[np.ndarray, np.ndarray]:
        base = rng.integers(0, 1 << 16, n, dtype=np.uint16)
        new = base.copy()
        idx = np.flatnonzero(rng.random(n) < density)
        new[idx] ^= rng.integers(1, 1 << 16, len(idx)).astype(np.uint16)
        return base.view(np.uint8), new.view(np.uint8)

    cases = [case(5_000, 0.01), case(300_000, 0.2), case(80_000, 0.05), case(300_000, 0.002)]  # grows, then reuses

    def code(pair: tuple[np.ndarray, np.ndarray]) -> bytes:
        return fr.encode_delta_pieces([pair[0]], [pair[1]], dtype, add=True, version=2)

    with ThreadPoolExecutor(1) as one:
        in_turn = list(one.map(code, cases))
        kept = one.submit(lambda: fr._local.scratch.nbytes).result()
    assert 0 < kept <= fr._SCRATCH_MAX
    for pair, blob in zip(cases, in_turn, strict=True):
        with ThreadPoolExecutor(1) as fresh:
            assert fresh.submit(code, pair).result() == blob
        assert decode_frame(blob, pair[0]).tobytes() == pair[1].tobytes()
    # A frame whose planes would pass the bound gets planes of its own: the same bytes, the kept buffer bounded.
    monkeypatch.setattr(fr, "_SCRATCH_MAX", 512 << 10)
    with ThreadPoolExecutor(1) as bounded:
        assert list(bounded.map(code, cases)) == in_turn
        assert bounded.submit(lambda: fr._local.scratch.nbytes).result() <= 512 << 10


# ---- a device's staging kernels (client/stage_frames.py): piece_blocks, stage_pieces ----------------------


@st.composite
def staged_frame(draw):
    """Sorted change positions of a frame cut into pieces, as runs of the kinds the vector loops must hand on
    correctly: consecutive changes, short and long gaps, gaps of 2^24 and more, runs across block edges."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    runs, at = [], 0
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["dense", "sparse", "huge", "edge"]))
        n = draw(st.integers(1, 400))
        if kind == "dense":
            steps = np.ones(n, dtype=np.int64)
        elif kind == "sparse":
            steps = rng.integers(1, 300, n)
        elif kind == "huge":
            steps = rng.integers(1, 40, n)
            steps[rng.integers(0, n)] += (1 << 24) + int(rng.integers(0, 1 << 20))
        else:  # changes just before and after the next block edge of 2^16
            edge = ((at >> 16) + 1) << 16
            steps = np.ones(n, dtype=np.int64)
            steps[0] = max(1, edge - at - n // 2)
        pos = at + np.cumsum(steps)
        runs.append(pos)
        at = int(pos[-1])
    positions = np.concatenate(runs) - 1  # the first change may lie at 0
    span = int(positions[-1]) + 1 + draw(st.integers(0, 5))
    cuts = set(draw(st.lists(st.integers(1, span - 1), max_size=5))) if span > 1 else set()
    on_changes = draw(st.lists(st.integers(0, len(positions) - 1), max_size=3))  # a piece starting at a change
    cuts = sorted((cuts | {int(positions[i]) for i in on_changes}) - {0})
    bounds = np.array([0, *cuts], dtype=np.int64)
    offsets = np.array([draw(st.integers(0, 3 << 16)) for _ in bounds], dtype=np.int64)
    modes = [draw(st.sampled_from([0, 1, 2, 3, 4])) for _ in bounds]
    merges = [draw(st.booleans()) for _ in bounds]
    return positions, bounds, offsets, modes, merges, bool(draw(st.booleans()))


@SETTINGS
@given(staged_frame())
def test_staging_kernels_agree_with_numpy(case):
    """piece_blocks and stage_pieces (the AVX2 loops here, the portable ones in the portable run) against
    numpy: per piece its changes, blocks, first and last block; then every mode's staged arrays."""
    need_native()
    ext = kernels.EXTENSION
    assert ext is not None
    positions, bounds, offsets, modes, merges, add = case
    count = len(positions)
    gaps_u64 = np.diff(positions, prepend=-1) - 1
    gaps = [((gaps_u64 >> (8 * j)) & 0xFF).astype(np.uint8) for j in range(4)]
    rng = np.random.default_rng(count)
    planes = [rng.integers(1, 256, count, dtype=np.uint8) for _ in range(2)]
    stats = [np.empty(len(bounds), dtype=np.int64) for _ in range(4)]
    assert ext.piece_blocks(count, gaps, bounds, offsets, *stats) == positions[-1] + 1
    check_piece_blocks(stats, positions, bounds, offsets)
    table, buf, merged = lay_out(stats, bounds, offsets, modes, merges)
    carry = np.empty(len(bounds), dtype=np.int64)
    assert ext.stage_pieces(count, gaps, planes, 2, int(add), table, buf, carry) == 1
    check_staged(buf, table, carry, positions, planes, add, merged)
