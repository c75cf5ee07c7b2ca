"""The C kernels against the numpy reference: same bytes for every width, method and operation.

The reference (kernels.REFERENCE) is the definition; the native kernels must agree bit for
bit on random inputs, frames encoded by either must be byte-identical, and the golden
frames must decode identically through both.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _ckpt import ALL_DTYPES
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightsync.codec import decode_frame, kernels
from weightsync.codec import frame as fr
from weightsync.codec.dtypes import UINT, by_name
from weightsync.errors import ChecksumMismatch, CorruptData

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


@pytest.mark.parametrize("impl", IMPLS, ids=lambda k: k.name)
def test_sparse_position_past_the_end_writes_nothing(impl):
    target = np.arange(16, dtype=np.uint8)
    gaps = [np.array([3, 20], dtype=np.uint8)] + [np.zeros(2, dtype=np.uint8)] * 3  # positions 3 and 24
    values = [np.array([1, 1], dtype=np.uint8), np.array([0, 0], dtype=np.uint8)]
    before = target.copy()
    assert not impl.apply_sparse(target, 2, kernels.OP_XOR, 2, gaps, values)
    assert np.array_equal(target, before)


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


@pytest.mark.parametrize("threads", [1, 2, 4])
@pytest.mark.parametrize("keyframe", [False, True])
def test_hashing_in_the_coding_pass_gives_every_segments_own_hash(threads, keyframe):
    # The encoder hashes each byte once, inside the frame tasks (whole segments from the
    # coder, segments cut across frames chained chunk by chunk): the manifest must hold
    # exactly the xxh3-128 of each segment's bytes, and the known base hashes passed in.
    from _ckpt import safetensors_file

    from weightsync.codec import Checkpoint, Decoder, Encoder

    rng = np.random.default_rng(threads)
    tensors = {f"t{i}": ("BF16", (int(rng.integers(1, 40)), 64), None) for i in range(30)}
    tensors["big"] = ("BF16", (300, 64), None)  # 38 KB: cut into chunks
    tensors["empty"] = ("F32", (0, 4), None)
    base_t = {k: (d, s, rng.integers(0, 256, by_name(d).nbytes(s), dtype=np.uint8)) for k, (d, s, _) in tensors.items()}
    new_t = {}
    for k, (d, s, data) in base_t.items():
        data = data.copy()
        data[rng.random(len(data)) < 0.02] ^= 1
        new_t[k] = (d, s, data)
    base = Checkpoint.from_bytes({"m.safetensors": safetensors_file(base_t, {})})
    new = Checkpoint.from_bytes({"m.safetensors": safetensors_file(new_t, {})})
    enc = Encoder(threads=threads, chunk_bytes=4096)
    encoded = enc.encode(new, base, keyframe=keyframe)
    assert len(encoded.frames) > 5
    for f, fe in zip(new.files, encoded.manifest.files, strict=True):
        bf = base.files[0]
        for seg, entry in zip(f.layout.segments, fe.segments, strict=True):
            assert entry.xxh3 == fr.xxh3_128(f.segment_bytes(seg)).hex(), seg.name
            if not keyframe:
                other = next(s for s in bf.layout.segments if s.key == seg.key)
                assert entry.base_xxh3 == fr.xxh3_128(bf.segment_bytes(other)).hex(), seg.name
    known = {("m.safetensors", e.segment.kind, e.segment.name): "ab" * 16 for e in encoded.manifest.files[0].segments}
    again = enc.encode(new, base, base_hashes=known)
    assert all(e.base_xxh3 == "ab" * 16 for e in again.manifest.files[0].segments)
    frames = [x.data for x in encoded.frames]
    offsets = np.cumsum([0] + [len(x) for x in frames])
    manifest = encoded.with_locations(lambda i, _: (None, int(offsets[i])))
    area = b"".join(frames)
    out = [np.empty(f.layout.size, dtype=np.uint8) for f in new.files]
    Decoder(threads=threads).decode(
        manifest, lambda r: area[r.offset : r.offset + r.length], out, base, verify_segments=True
    )
    assert out[0].tobytes() == new.files[0].data.tobytes()
