"""Frames: exact round trips for every dtype and density, and only named errors on bad input."""

from __future__ import annotations

import numpy as np
import pytest
import zstandard
from _ckpt import ALL_DTYPES, mutate
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightsync.codec import frame as fr
from weightsync.codec.dtypes import by_name
from weightsync.errors import (
    BadMagic,
    BaseMismatch,
    ChecksumMismatch,
    CorruptData,
    LimitExceeded,
    TruncatedInput,
    UnsupportedVersion,
    WeightsyncError,
)

DENSITIES = ["zero", "one", "1%", "50%", "100%"]


def changed_count(density: str, n: int) -> int:
    return {"zero": 0, "one": min(1, n), "1%": max(1, n // 100) if n else 0, "50%": n // 2, "100%": n}[density]


@st.composite
def tensor_bytes(draw):
    dtype = by_name(draw(st.sampled_from(ALL_DTYPES)))
    shape = draw(st.lists(st.integers(0, 40), min_size=0, max_size=3))
    count = int(np.prod(shape)) if shape else 1
    # Sub-byte dtypes must fill whole bytes: 2 F4 or 4 F6 elements per group.
    group = 8 // np.gcd(dtype.bits, 8) if dtype.bits < 8 else 1
    count -= count % group
    nbytes = count * dtype.bits // 8
    seed = draw(st.integers(0, 2**32 - 1))
    smooth = draw(st.booleans())
    rng = np.random.default_rng(seed)
    if smooth:  # weights-like: little entropy in the high bytes
        base = np.repeat(rng.integers(0, 4, max(1, nbytes // 7 + 1), dtype=np.uint8), 7)[:nbytes]
    else:
        base = rng.integers(0, 256, nbytes, dtype=np.uint8)
    return dtype, base, rng


@given(
    tensor_bytes(),
    st.sampled_from(DENSITIES),
    st.sampled_from([1, 3]),
    st.sampled_from([None, True, False]),
    st.sampled_from(fr.VERSIONS),
)
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_delta_round_trip(case, density, level, add, version):
    dtype, base, rng = case
    n = len(base) // dtype.width
    new = mutate(rng, base, dtype.width, changed_count(density, n))
    frame = fr.encode_delta(base, new, dtype, level=level, add=add, version=version)
    target = base.copy()
    head = fr.apply_frame(frame, target)
    assert head.delta and head.raw_len == len(new) and head.version == version
    assert head.add == (fr.uses_add(dtype) if add is None else add)
    assert target.tobytes() == new.tobytes()
    assert fr.decode_frame(frame, base).tobytes() == new.tobytes()


@given(tensor_bytes(), st.sampled_from([1, 3]), st.sampled_from(fr.VERSIONS))
@settings(max_examples=200, deadline=None)
def test_keyframe_round_trip(case, level, version):
    dtype, data, _ = case
    frame = fr.encode_key(data, dtype, level=level, version=version)
    assert fr.decode_frame(frame).tobytes() == data.tobytes()


@given(tensor_bytes(), st.sampled_from(DENSITIES))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_a_v2_frame_is_the_v1_frame_without_its_hashes(case, density):
    """FORMAT §4.1: same payload; version byte 2, both hash fields zero, its own header checksum."""
    dtype, base, rng = case
    new = mutate(rng, base, dtype.width, changed_count(density, len(base) // dtype.width))
    for one, two in [
        (fr.encode_delta(base, new, dtype), fr.encode_delta(base, new, dtype, version=2)),
        (fr.encode_key(new, dtype), fr.encode_key(new, dtype, version=2)),
    ]:
        assert one[fr.HEADER_SIZE :] == two[fr.HEADER_SIZE :]
        assert two[4] == 2 and two[24:56] == bytes(32) and one[5:24] == two[5:24]
        assert fr.parse_header(two).version == 2 and not fr.parse_header(two).checked


def test_v2_frames_check_nothing_themselves_and_refuse_hashes():
    dt, base, new = _pair()
    frame = fr.encode_delta(base, new, dt, version=2)
    other = mutate(np.random.default_rng(9), base, 2, 1)
    fr.apply_frame(frame, other)  # no base hash to refuse it: the v2 manifest's checksums do (FORMAT §5.3)
    with pytest.raises(CorruptData):
        fr.parse_header(_forge(frame, base=b"\x01" * 16))
    with pytest.raises(CorruptData):
        fr.parse_header(_forge(frame, result=b"\x01" * 16))
    with pytest.raises(ValueError):
        fr.encode_delta_pieces([base], [new], dt, version=2, piece_hashes=[])
    with pytest.raises(UnsupportedVersion):
        fr.encode_key(new, dt, version=3)


def test_density_selects_method():
    dtype = by_name("BF16")
    rng = np.random.default_rng(1)
    base = rng.integers(0, 256, 20000, dtype=np.uint8)
    sparse = fr.encode_delta(base, mutate(rng, base, 2, 100), dtype)
    dense = fr.encode_delta(base, mutate(rng, base, 2, 6000), dtype)
    assert fr.parse_header(sparse).method == fr.METHOD_SPARSE
    assert fr.parse_header(dense).method in (fr.METHOD_PLANES, fr.METHOD_STORED)


def test_incompressible_keyframe_is_stored_raw():
    data = np.random.default_rng(2).integers(0, 256, 4096, dtype=np.uint8)
    frame = fr.encode_key(data, by_name("U8"))
    assert fr.parse_header(frame).method == fr.METHOD_STORED
    assert len(frame) == fr.HEADER_SIZE + len(data)


def _pair(seed=3, n=5000, changed=60, dtype="BF16"):
    dt = by_name(dtype)
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, n * dt.width, dtype=np.uint8)
    new = mutate(rng, base, dt.width, changed)
    return dt, base, new


def test_wrong_base_is_refused_and_untouched():
    dt, base, new = _pair()
    frame = fr.encode_delta(base, new, dt)
    other = mutate(np.random.default_rng(9), base, 2, 1)
    before = other.copy()
    with pytest.raises(BaseMismatch):
        fr.apply_frame(frame, other)
    assert other.tobytes() == before.tobytes()


@pytest.mark.parametrize("add", [True, False])
@pytest.mark.parametrize("changed", [60, 9000])
def test_result_mismatch_restores_base(add, changed):
    dt, base, new = _pair(changed=changed)
    frame = bytearray(fr.encode_delta(base, new, dt, add=add))
    # Forge a different result hash with a valid header checksum: decoding must
    # notice, raise, and leave the target holding the base again.
    head = bytes(frame[: fr.HEADER_SIZE - 8])
    head = head[:40] + bytes(16)
    import struct

    import xxhash

    frame[: fr.HEADER_SIZE] = head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head))
    target = base.copy()
    with pytest.raises(ChecksumMismatch):
        fr.apply_frame(bytes(frame), target)
    assert target.tobytes() == base.tobytes()


@pytest.mark.parametrize("changed", [0, 60, 4000])
@given(data=st.data())
@settings(max_examples=150, deadline=None)
def test_corrupted_or_truncated_frames_raise_named_errors(changed, data):
    dt, base, new = _pair(changed=changed)
    frame = bytearray(fr.encode_delta(base, new, dt))
    action = data.draw(st.sampled_from(["flip", "truncate", "junk", "extend"]))
    if action == "flip":
        pos = data.draw(st.integers(0, len(frame) - 1))
        frame[pos] ^= 1 << data.draw(st.integers(0, 7))
    elif action == "truncate":
        frame = frame[: data.draw(st.integers(0, len(frame) - 1))]
    elif action == "junk":
        frame = bytearray(data.draw(st.binary(min_size=0, max_size=300)))
    else:
        frame += data.draw(st.binary(min_size=1, max_size=20))
    target = base.copy()
    try:
        fr.apply_frame(bytes(frame), target)
    except WeightsyncError:
        return
    # A change that still decodes must have produced exactly `new` (e.g. a flip in
    # trailing padding is impossible, so this means the frame was unchanged in effect).
    assert target.tobytes() == new.tobytes()


def _forge(frame: bytes, **fields) -> bytes:
    import struct

    import xxhash

    names = ["magic", "version", "flags", "dtype", "method", "raw_len", "payload_len", "base", "result", "check"]
    vals = dict(zip(names, fr._HEADER.unpack(frame[: fr.HEADER_SIZE]), strict=True))
    vals.update(fields)
    head = fr._HEADER.pack(*[vals[n] for n in names])[: fr.HEADER_SIZE - 8]
    return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head)) + frame[fr.HEADER_SIZE :]


@pytest.mark.parametrize(
    "fields, error",
    [
        ({"magic": b"XXXX"}, BadMagic),
        ({"version": 3}, UnsupportedVersion),
        ({"version": 0}, UnsupportedVersion),
        ({"flags": 0x81}, UnsupportedVersion),
        ({"method": 9}, UnsupportedVersion),
        ({"dtype": 200}, WeightsyncError),
        ({"raw_len": fr.MAX_FRAME_RAW + 2}, LimitExceeded),
        ({"raw_len": 10001}, CorruptData),
        ({"payload_len": 1 << 40}, TruncatedInput),
    ],
)
def test_header_validation(fields, error):
    dt, base, new = _pair()
    frame = _forge(fr.encode_delta(base, new, dt), **fields)
    with pytest.raises(error):
        fr.apply_frame(frame, base.copy())


def test_decompression_bomb_is_refused_before_allocating():
    # A zstd section that declares far more output than the frame allows.
    import zstandard

    dt = by_name("U8")
    data = np.zeros(1000, dtype=np.uint8)
    frame = bytearray(fr.encode_key(data, dt))
    assert fr.parse_header(bytes(frame)).method == fr.METHOD_PLANES
    bomb = zstandard.ZstdCompressor(level=1).compress(bytes(50_000_000))
    section = fr._SECTION.pack(fr.CODING_ZSTD, len(bomb)) + bomb
    forged = _forge(bytes(frame[: fr.HEADER_SIZE]) + section, payload_len=len(section))
    with pytest.raises(LimitExceeded):
        fr.apply_frame(forged, np.zeros(1000, dtype=np.uint8))


def test_target_size_must_match():
    dt, base, new = _pair()
    frame = fr.encode_delta(base, new, dt)
    with pytest.raises(LimitExceeded):
        fr.apply_frame(frame, np.zeros(7, dtype=np.uint8))


@given(st.lists(st.integers(-(2**15), 2**15 - 1), max_size=50))
def test_zigzag_inverts(values):
    d = np.array(values, dtype=np.int16).view(np.uint16)
    z = fr.zigzag(d)
    assert fr.unzigzag(z).tolist() == d.tolist()
    assert all(int(a) == (2 * abs(v) - (v < 0)) for a, v in zip(z, values, strict=True))


def _weights_like(rng: np.random.Generator, n: int) -> np.ndarray:
    """bf16 bytes of normal(0, 0.02) weights: a sign-and-exponent byte of ~3 bits and a random low byte."""
    f32 = (rng.standard_normal(n) * 0.02).astype(np.float32)
    return (f32.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)


def test_default_level_planes_skip_short_matches_and_code_smaller(monkeypatch):
    """The default level codes byte planes with PLANE_MATCH (no matches shorter than 7 bytes): a weights-like
    keyframe comes out smaller than with level 1's own match finder, and keyframe and one-ulp delta frames
    decode to the same bytes either way. (On real optimizer steps the delta sections are 2-3 % smaller too,
    docs/SCALE-RUNS.md run X; synthetic uniform changes show no such gain, so it is not asserted here.)"""
    rng = np.random.default_rng(7)
    dt = by_name("BF16")
    base = _weights_like(rng, 1 << 18)
    new = base.view(np.uint16).copy()
    at = rng.choice(len(new), len(new) // 50, replace=False)
    new[at] += rng.choice(np.array([1, 0xFFFF], dtype=np.uint16), len(at))  # one ulp up or down
    new = new.view(np.uint8)

    def frames() -> tuple[bytes, bytes]:
        return fr.encode_key(new, dt), fr.encode_delta(base, new, dt, version=fr.VERSION_2)

    tuned = frames()
    monkeypatch.setattr(fr, "PLANE_MATCH", {})  # level 1's own parameters
    monkeypatch.setattr(fr._local, "cctx", {}, raising=False)  # compressors made afresh
    plain = frames()
    for t, p in zip(tuned, plain, strict=True):
        assert fr.parse_header(t).method == fr.parse_header(p).method != fr.METHOD_STORED
    low_plane = len(new) // 2  # random: stored raw either way
    assert len(plain[0]) - len(tuned[0]) > 0.05 * (len(plain[0]) - low_plane)  # the high plane: > 5 % smaller
    assert fr.decode_frame(tuned[0]).tobytes() == fr.decode_frame(plain[0]).tobytes() == new.tobytes()
    assert fr.decode_frame(tuned[1], base).tobytes() == fr.decode_frame(plain[1], base).tobytes() == new.tobytes()


def _step_like(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """A bf16 tensor and an optimizer step of it: 2 % of the elements moved, by one ulp for ~80 % of them and by
    2 to 8 ulps (ever rarer) for the rest, up or down (the corpus's steps: 81 % of the changes are one ulp)."""
    base = _weights_like(rng, n)
    new = base.view(np.uint16).copy()
    at = rng.choice(n, n // 50, replace=False)
    size = np.minimum(rng.geometric(0.8, len(at)), 8).astype(np.uint16)
    new[at] += np.where(rng.random(len(at)) < 0.5, size, (0x10000 - size.astype(np.uint32)).astype(np.uint16))
    return base, new.view(np.uint8)


def _in_a_thread_without_literals(monkeypatch: pytest.MonkeyPatch, call):
    """`call()` on a fresh thread (its own zstd contexts) where the zstd build offers no literals-only coding."""
    import threading

    monkeypatch.setattr(fr, "_new_literals_context", lambda: None)
    got: list = []
    worker = threading.Thread(target=lambda: got.append(call()))
    worker.start()
    worker.join()
    return got[0]


def test_the_literals_coder_is_available():
    """cffi is a dependency: without it delta planes silently fall back to the match coding (larger, slower)."""
    assert fr._literals_context() is not None


def test_a_delta_codes_its_low_value_plane_as_literals_smaller(monkeypatch):
    """The value plane below the top byte goes as Huffman-coded literals (FORMAT §4.4): on a step-like delta the
    frame comes out smaller than with the match coding alone, and both decode to the same bytes."""
    rng = np.random.default_rng(11)
    dt = by_name("BF16")
    base, new = _step_like(rng, 1 << 18)
    frame = fr.encode_delta(base, new, dt, version=fr.VERSION_2)
    matched = _in_a_thread_without_literals(monkeypatch, lambda: fr.encode_delta(base, new, dt, version=fr.VERSION_2))
    assert fr.parse_header(frame).method == fr.parse_header(matched).method == fr.METHOD_SPARSE
    assert len(frame) < len(matched)
    assert fr.decode_frame(frame, base).tobytes() == fr.decode_frame(matched, base).tobytes() == new.tobytes()


def test_the_value_plane_as_literals_is_the_smaller_coding_or_the_match_coding():
    """A plane that literals code near Huffman's floor of one bit a byte (mostly one value, as a step's top value
    plane) is coded with the match finder too and the smaller kept; a step's low value plane keeps its literals."""
    rng = np.random.default_rng(5)
    skewed = (rng.random(1 << 18) < 0.002).astype(np.uint8)  # 0.2 % ones: runs of zeros
    literal, matched = fr._section(skewed, fr.DEFAULT_LEVEL, literals=True), fr._section(skewed, fr.DEFAULT_LEVEL)
    assert literal == matched
    assert len(fr._literals(skewed.data.cast("B"))) > 4 * len(matched[1])  # literals alone: far larger here
    size = np.minimum(rng.geometric(0.8, 1 << 18), 8)  # a step's changes in ulps, zigzag-coded: 2s - (s < 0)
    low = (2 * size - (rng.random(len(size)) < 0.5)).astype(np.uint8)
    literal, matched = fr._section(low, fr.DEFAULT_LEVEL, literals=True), fr._section(low, fr.DEFAULT_LEVEL)
    for coded in (literal, matched):
        coding, stored = fr._SECTION.unpack(coded[0])
        assert coding == fr.CODING_ZSTD and stored == len(coded[1])
        assert zstandard.ZstdDecompressor().decompress(coded[1]) == low.tobytes()
    assert len(literal[1]) <= len(matched[1])
    assert fr._section(low, 3, literals=True) == fr._section(low, 3)  # other levels: as asked


def test_without_the_literals_coder_value_planes_take_the_match_coding(monkeypatch):
    rng = np.random.default_rng(9)
    _, new = _step_like(rng, 1 << 16)
    plane = np.ascontiguousarray(new[::2])
    assert _in_a_thread_without_literals(
        monkeypatch, lambda: fr._section(plane, fr.DEFAULT_LEVEL, literals=True)
    ) == fr._section(plane, fr.DEFAULT_LEVEL)
