"""FORMAT v2 end to end: round trips, agreement with v1, checked bases and results, chains that never mix."""

from __future__ import annotations

import numpy as np
import pytest
from _ckpt import ALL_DTYPES, mutate, safetensors_file
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightsync.codec import Checkpoint, Decoder, Encoder, Manifest
from weightsync.codec.checksum import reference_sum
from weightsync.codec.dtypes import by_name
from weightsync.codec.frame import encode_delta
from weightsync.errors import BaseMismatch, ChecksumMismatch

DENSITIES = [0.0, 1e-3, 0.01, 0.3, 1.0]
SENTINEL = 0xA5


@st.composite
def versions(draw):
    """(base, new) checkpoints: tensors of any dtype and shape, each changed at its own density;
    sometimes a tensor added, dropped or reshaped, sometimes a second file."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    names = draw(st.lists(st.sampled_from(ALL_DTYPES), min_size=1, max_size=6))
    base, new = {}, {}
    for i, dt in enumerate(names):
        d = by_name(dt)
        group = 8 // np.gcd(d.bits, 8) if d.bits < 8 else 1  # sub-byte dtypes fill whole bytes
        shape = (int(draw(st.integers(0, 5)) * group), draw(st.sampled_from([1, 3, 64, 700])))
        data = rng.integers(0, 256, d.nbytes(shape), dtype=np.uint8)
        base[f"t{i}"] = (dt, shape, data)
        n = len(data) // d.width
        new[f"t{i}"] = (dt, shape, mutate(rng, data, d.width, int(n * draw(st.sampled_from(DENSITIES)))))
    edit = draw(st.sampled_from(["none", "add", "drop", "reshape"]))
    if edit == "add":
        new["added"] = ("F32", (3,), rng.integers(0, 256, 12, dtype=np.uint8))
    elif edit == "drop" and len(new) > 1:
        new.pop("t0")
    elif edit == "reshape":
        dt, shape, data = new["t0"]
        new["t0"] = (dt, (shape[0] * shape[1],), data)
    files_base = {"m.safetensors": safetensors_file(base, {"v": "1"})}
    files_new = {"m.safetensors": safetensors_file(new, {"v": "1"})}
    if draw(st.booleans()):
        blob = rng.integers(0, 256, draw(st.integers(0, 3000)), dtype=np.uint8)
        files_base["extra.bin"] = blob.tobytes()
        files_new["extra.bin"] = mutate(rng, blob, 1, draw(st.integers(0, 3))).tobytes()
    return Checkpoint.from_bytes(files_base), Checkpoint.from_bytes(files_new)


def _located(enc: Encoder, new: Checkpoint, base: Checkpoint | None):
    encoded = enc.encode(new, base)
    offsets = np.cumsum([0] + [len(fr.data) for fr in encoded.frames])
    manifest = encoded.with_locations(lambda i, fr: (None, int(offsets[i])))
    area = b"".join(fr.data for fr in encoded.frames)
    return manifest, lambda ref: memoryview(area)[ref.offset : ref.offset + ref.length]


def _decode(manifest: Manifest, read, base: Checkpoint | None, **kw) -> list[np.ndarray]:
    outputs = [np.full(f.size, SENTINEL, dtype=np.uint8) for f in manifest.files]
    Decoder(threads=2).decode(manifest, read, outputs, base, **kw)
    return outputs


@given(versions(), st.sampled_from([1024, 4096, 1 << 20]))
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_v2_round_trip_and_v1_agree(pair, chunk):
    base, new = pair
    decoded = {}
    for version in (1, 2):
        manifest, read = _located(Encoder(threads=2, chunk_bytes=chunk, format_version=version), new, base)
        again = Manifest.decode(manifest.encode())
        assert again.files == manifest.files and again.frames == manifest.frames and again.version == version
        decoded[version] = [o.tobytes() for o in _decode(again, read, base, verify_segments=True)]
        assert decoded[version] == [f.data.tobytes() for f in new.files]
        held = _held({f.layout.path: f.data.copy() for f in base.files})
        outputs = _in_place_outputs(again, held)
        Decoder(threads=2).decode(again, read, outputs, held)  # bases checked in the apply pass (v2)
        assert [o.tobytes() for o in outputs] == decoded[version]
        if version == 2:
            for f, fe in zip(new.files, manifest.files, strict=True):
                for seg, e in zip(f.layout.segments, fe.segments, strict=True):
                    assert e.digest == reference_sum(f.segment_bytes(seg), seg.dtype.width).hex()
            pieces = {(p.file, p.seg) for fr in manifest.frames for p in fr.pieces}
            unchanged = {
                (fi, si) for fi, fe in enumerate(manifest.files) for si, e in enumerate(fe.segments) if e.unchanged
            }
            assert not pieces & unchanged, "a segment equal to its base has no frame pieces"
    assert decoded[1] == decoded[2]


@given(versions())
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_v2_keyframes_round_trip(pair):
    _, new = pair
    manifest, read = _located(Encoder(threads=2, chunk_bytes=2048), new, None)
    assert manifest.kind == "keyframe" and all(e.base_offset is None for f in manifest.files for e in f.segments)
    assert [o.tobytes() for o in _decode(manifest, read, None)] == [f.data.tobytes() for f in new.files]


def _step(seed: int = 0, changed: float = 0.01) -> tuple[Checkpoint, Checkpoint]:
    rng = np.random.default_rng(seed)
    base = {f"w{i}": ("BF16", (64, 96), rng.integers(0, 256, 64 * 96 * 2, dtype=np.uint8)) for i in range(4)}
    base["f"] = ("F32", (300,), rng.integers(0, 256, 1200, dtype=np.uint8))
    base["still"] = ("BF16", (40,), rng.integers(0, 256, 80, dtype=np.uint8))
    new = {
        k: (d, s, v if k == "still" else mutate(rng, v, by_name(d).width, max(1, int(v.size * changed) // 2)))
        for k, (d, s, v) in base.items()
    }
    return (
        Checkpoint.from_bytes({"m.safetensors": safetensors_file(base)}),
        Checkpoint.from_bytes({"m.safetensors": safetensors_file(new)}),
    )


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("victim", ["w2", "still"])
def test_a_corrupted_base_is_refused_and_an_in_place_base_left_as_it_was(version, victim):
    """v1 checks every base before writing; v2 checks a segment that frames cover in their apply pass
    (after writing), one equal to its base ("still") before. Either way an in-place base is left as it was."""
    base, new = _step()
    manifest, read = _located(Encoder(chunk_bytes=4096, format_version=version), new, base)
    seg = next(s for s in base.files[0].layout.segments if s.name == victim)
    data = base.files[0].data.copy()
    data[seg.offset + seg.length // 2] ^= 0x10
    bad = Checkpoint.from_bytes({"m.safetensors": data})
    outputs = [np.full(f.size, SENTINEL, dtype=np.uint8) for f in manifest.files]
    with pytest.raises(BaseMismatch, match=victim):
        Decoder(threads=2).decode(manifest, read, outputs, bad)
    if version == 1 or victim == "still":
        assert all((o == SENTINEL).all() for o in outputs), "nothing written"
    in_place = bad.files[0].data.copy()
    with pytest.raises(BaseMismatch, match=victim):
        Decoder(threads=2).decode(manifest, read, [bad.files[0].data], bad)
    assert (bad.files[0].data == in_place).all(), "the base, decoded in place, is left as it was"


def test_a_frame_that_decodes_to_other_bytes_fails_its_segments_checksum():
    """v2 frames carry no hashes: a frame coding other bytes (valid, but wrong) is caught by the manifest."""
    base, new = _step(seed=3)
    manifest, read = _located(Encoder(chunk_bytes=1 << 20, format_version=2), new, base)
    ref = next(fr for fr in manifest.frames if len(fr.pieces) == 1 and fr.delta)
    e = manifest.files[0].segments[ref.pieces[0].seg]
    old = base.files[0].data[e.base_offset : e.base_offset + e.segment.length]
    liar = encode_delta(
        old, mutate(np.random.default_rng(1), old, e.segment.dtype.width, 5), e.segment.dtype, version=2
    )

    def lying_read(r):
        return liar if r == ref else read(r)

    with pytest.raises(ChecksumMismatch, match=e.segment.name):
        _decode(manifest, lying_read, base)


def test_a_tampered_digest_is_caught():
    base, new = _step(seed=4)
    manifest, read = _located(Encoder(format_version=2), new, base)
    doc = manifest.to_dict()
    lanes = doc["files"][0]["segments"]["digest"][2]
    doc["files"][0]["segments"]["digest"][2] = f"{(int(lanes, 16) + 1) % (1 << 64):016x}"
    import json

    tampered = Manifest.parse(json.dumps(doc).encode())
    with pytest.raises(ChecksumMismatch):
        _decode(tampered, read, base)


def test_chains_never_mix_formats():
    base, new = _step(seed=5)
    with pytest.raises(BaseMismatch, match="never mixes"):
        Encoder(format_version=2).encode(new, base, base_kind="xxh3-128")
    with pytest.raises(BaseMismatch):
        Encoder(format_version=1).encode(new, base, base_kind="sum64x16")
    assert Encoder(format_version=2).encode(new, base, base_kind="sum64x16").manifest.kind == "delta"
    assert Encoder(format_version=2).encode(new, base, base_kind="xxh3-128", keyframe=True).manifest.kind == "keyframe"
    v1, read = _located(Encoder(format_version=1), new, base)
    assert v1.version == 1
    with pytest.raises(ValueError):
        Encoder(format_version=3)


def test_v2_is_smaller_and_skips_unchanged_tensors():
    base, new = _step(seed=6, changed=0.0005)
    sizes = {}
    for version in (1, 2):
        encoded = Encoder(chunk_bytes=4096, format_version=version).encode(new, base)
        m = encoded.with_locations(lambda i, fr: ("ab" * 32, 0))
        sizes[version] = len(m.encode()) + sum(len(fr.data) for fr in encoded.frames)
        still = next(e for e in m.files[0].segments if e.segment.name == "still")
        assert still.unchanged
        assert any(p.seg == m.files[0].segments.index(still) for fr in m.frames for p in fr.pieces) == (version == 1)
    assert sizes[2] < sizes[1]


def _in_place_outputs(manifest: Manifest, held: Checkpoint) -> list[np.ndarray]:
    """Outputs for decoding onto `held` in place wherever the Decoder allows it (same file, nothing moved)."""
    by_path = held.by_path()
    outputs = []
    for f in manifest.files:
        b = held.files[0] if manifest.single_file and len(held.files) == 1 else by_path.get(f.path)
        movable = all(e.base_offset in (None, e.segment.offset) for e in f.segments)
        if b is not None and len(b.data) == f.size and f.size and movable:
            outputs.append(b.data)
        else:
            outputs.append(np.full(f.size, SENTINEL, dtype=np.uint8))
    return outputs


def _held(files: dict[str, np.ndarray]) -> Checkpoint:
    """A checkpoint whose arrays are the given ones (writable: an in-place decode writes into them)."""
    ck = Checkpoint.from_bytes({path: data.tobytes() for path, data in files.items()})
    return Checkpoint([type(f)(f.layout, files[f.layout.path]) for f in ck.files])


@given(versions(), st.sampled_from([1, 2]), st.data())
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_corruption_of_a_base_or_a_result_is_detected(pair, version, data):
    """Property: any flipped byte of a delta-coded base is refused (v1 before anything is written; v2 in
    the apply pass when frames cover the segment), and decoding in place leaves that base byte-identical;
    a delta frame that decodes to other bytes fails the result check against the manifest's digests."""
    base, new = pair
    manifest, read = _located(Encoder(threads=2, chunk_bytes=2048, format_version=version), new, base)
    deltas = [
        (fi, e)
        for fi, f in enumerate(manifest.files)
        for e in f.segments
        if e.base_offset is not None and e.segment.length
    ]
    if deltas:
        fi, e = data.draw(st.sampled_from(deltas))
        files = {f.layout.path: f.data.copy() for f in base.files}
        path = manifest.files[fi].path
        files[path][e.base_offset + data.draw(st.integers(0, e.segment.length - 1))] ^= 1 << data.draw(
            st.integers(0, 7)
        )
        outputs = [np.full(f.size, SENTINEL, dtype=np.uint8) for f in manifest.files]
        with pytest.raises(BaseMismatch):
            Decoder(threads=2).decode(manifest, read, outputs, Checkpoint.from_bytes(files))
        if version == 1 or e.unchanged:
            assert all((o == SENTINEL).all() for o in outputs)
        held = _held({p: d.copy() for p, d in files.items()})
        with pytest.raises(BaseMismatch):
            Decoder(threads=2).decode(manifest, read, _in_place_outputs(manifest, held), held)
        assert {f.layout.path: f.data.tobytes() for f in held.files} == {p: d.tobytes() for p, d in files.items()}
    frames = [ref for ref in manifest.frames if ref.delta]
    if not frames:
        return
    ref = data.draw(st.sampled_from(frames))
    seg = manifest.files[ref.pieces[0].file].segments[ref.pieces[0].seg].segment
    width = seg.dtype.width
    held = base.by_path()
    old = np.concatenate(
        [
            held[manifest.files[q.file].path].data[manifest.files[q.file].segments[q.seg].base_offset + q.offset :][
                : q.length
            ]
            for q in ref.pieces
        ]
    )
    other = mutate(np.random.default_rng(0), old, width, max(1, len(old) // width // 3))
    liar = encode_delta(old, other, seg.dtype, version=version)

    def lying(r):
        return liar if r == ref else read(r)

    with pytest.raises(ChecksumMismatch):
        # A v1 frame vouches only for itself (its own xxh3): the manifest's segment digests catch a
        # frame swapped for another only with verify_segments. v2 checks every segment by default.
        _decode(manifest, lying, base, verify_segments=version == 1)
    held = _held({f.layout.path: f.data.copy() for f in base.files})
    with pytest.raises(ChecksumMismatch):
        Decoder(threads=2).decode(
            manifest, lying, _in_place_outputs(manifest, held), held, verify_segments=version == 1
        )
    assert [f.data.tobytes() for f in held.files] == [f.data.tobytes() for f in base.files], "in place: base restored"


def test_a_changed_tensor_whose_checksum_equals_its_bases_is_still_coded():
    """Found by test_v2_round_trip_and_v1_agree: every byte of a 12-byte BOOL tensor changed, yet
    Σ d_i·(2i+1) = 0, so the linear checksum (FORMAT §10) is the base's. The encoder compares bytes,
    so the tensor is still coded (digest written, equal to base, with pieces) and decodes exactly."""
    old = np.array([228, 231, 29, 153, 129, 10, 238, 231, 165, 80, 162, 241], dtype=np.uint8)
    now = np.array([57, 152, 150, 146, 65, 75, 250, 202, 162, 235, 164, 113], dtype=np.uint8)
    assert reference_sum(old, 1) == reference_sum(now, 1) and not np.array_equal(old, now)
    base = Checkpoint.from_bytes({"m.safetensors": safetensors_file({"t": ("BOOL", (4, 3), old)})})
    new = Checkpoint.from_bytes({"m.safetensors": safetensors_file({"t": ("BOOL", (4, 3), now)})})
    manifest, read = _located(Encoder(format_version=2), new, base)
    e = manifest.files[0].segments[1]
    assert not e.unchanged and e.digest == e.base_digest
    doc = manifest.to_dict()["files"][0]["segments"]
    assert doc["digest"][1] == doc["base"][1], "written out, not null: null would claim equal bytes"
    again = Manifest.decode(manifest.encode())
    assert not again.files[0].segments[1].unchanged
    assert _decode(again, read, base)[0].tobytes() == new.files[0].data.tobytes()


@pytest.mark.parametrize("known", [False, True])
def test_an_unchanged_tensor_cut_into_frames_gets_none_as_if_compared_first(known):
    """A segment of at least chunk_bytes is coded without a compare first (encode_jobs.V2Job): its
    frames are dropped when none holds a change, so the manifest and frames are those of a compare
    first: the segment unchanged, no frame of it, its digest the base's; the others coded as before."""
    rng = np.random.default_rng(11)
    base_t = {
        "big": ("BF16", (64, 96), rng.integers(0, 256, 64 * 96 * 2, dtype=np.uint8)),
        "tail": ("F32", (300,), rng.integers(0, 256, 1200, dtype=np.uint8)),  # cut into frames, last one short
        "moved": ("BF16", (64, 96), rng.integers(0, 256, 64 * 96 * 2, dtype=np.uint8)),
        "small": ("BF16", (40,), rng.integers(0, 256, 80, dtype=np.uint8)),
    }
    new_t = dict(base_t)
    new_t["moved"] = ("BF16", (64, 96), mutate(rng, base_t["moved"][2], 2, 3))
    base = Checkpoint.from_bytes({"m.safetensors": safetensors_file(base_t)})
    new = Checkpoint.from_bytes({"m.safetensors": safetensors_file(new_t)})
    enc = Encoder(threads=2, chunk_bytes=1024)
    digests = None
    if known:
        first = enc.encode(new, base).manifest.files[0].segments
        digests = {("m.safetensors", e.segment.kind, e.segment.name): e.base_digest for e in first}
    encoded = enc.encode(new, base, base_digests=digests)
    m = encoded.manifest
    segs = {e.segment.name: (si, e) for si, e in enumerate(m.files[0].segments)}
    framed = {p.seg for fr in m.frames for p in fr.pieces}
    for name in ("big", "tail", "small"):
        si, e = segs[name]
        assert e.unchanged and si not in framed
        assert (
            e.digest
            == e.base_digest
            == reference_sum(new.files[0].segment_bytes(e.segment), e.segment.dtype.width).hex()
        )
    si, e = segs["moved"]
    assert not e.unchanged and si in framed
    assert len(encoded.frames) == 64 * 96 * 2 // 1024, "only the changed tensor's frames"
    assert all(p.seg == si for fr in m.frames for p in fr.pieces)
    offsets = np.cumsum([0] + [len(fr.data) for fr in encoded.frames])
    located = encoded.with_locations(lambda i, _: (None, int(offsets[i])))
    area = b"".join(fr.data for fr in encoded.frames)
    out = _decode(located, lambda r: memoryview(area)[r.offset : r.offset + r.length], base, verify_segments=True)
    assert out[0].tobytes() == new.files[0].data.tobytes()


@pytest.mark.parametrize("version", [1, 2])
def test_an_encoder_on_a_given_pool_writes_the_same_bytes_on_that_pool(version):
    """Encoder(pool=…) runs its jobs on that executor (the client's CPU pool, no threads started per encode):
    the same frames and manifest as an encoder with a pool of its own."""
    from concurrent.futures import ThreadPoolExecutor

    class Counting(ThreadPoolExecutor):
        jobs = 0

        def submit(self, *args, **kwargs):
            Counting.jobs += 1
            return super().submit(*args, **kwargs)

    base, new = _step(seed=3, changed=0.05)
    want = Encoder(threads=2, chunk_bytes=4096, format_version=version).encode(new, base)
    with Counting(2) as pool:
        got = Encoder(chunk_bytes=4096, format_version=version, pool=pool).encode(new, base)
    assert Counting.jobs > 0
    assert [fr.data for fr in got.frames] == [fr.data for fr in want.frames]
    assert got.manifest.encode() == want.manifest.encode()


def _owned(ck: Checkpoint) -> Checkpoint:
    """`ck` in writable buffers of its own (what a publisher keeps as its base)."""
    from weightsync.codec.checkpoint import CheckpointFile

    return Checkpoint([CheckpointFile(f.layout, np.array(f.data)) for f in ck.files], single_file=ck.single_file)


@given(versions(), st.sampled_from([1024, 4096, 1 << 20]))
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_a_keeping_encode_writes_the_same_bytes_and_leaves_the_base_holding_the_new_version(pair, chunk):
    """keep_base: the frames and manifest of an encode that leaves the base alone; where every segment is
    delta-coded at its own offset in a file of the same size (``kept``), the base's buffers hold the new
    version's bytes after, byte for byte; elsewhere (a tensor added, dropped or reshaped) they are untouched."""
    base, new = pair
    want = Encoder(threads=2, chunk_bytes=chunk).encode(new, base)
    mine = _owned(base)
    got = Encoder(threads=2, chunk_bytes=chunk).encode(new, mine, keep_base=True)
    assert [fr.data for fr in got.frames] == [fr.data for fr in want.frames]
    assert got.manifest.encode() == want.manifest.encode()
    in_place = [f.layout == b.layout for f, b in zip(new.files, base.files, strict=True)]
    same_layout = len(new.files) == len(base.files) and all(in_place)
    assert got.kept == same_layout
    held = [f.data.tobytes() for f in mine.files]
    if got.kept:
        assert held == [f.data.tobytes() for f in new.files]
    else:
        assert held == [f.data.tobytes() for f in base.files]


def test_a_keeping_encode_keeps_nothing_in_format_1_for_a_keyframe_or_into_read_only_bytes():
    base, new = _step(seed=5, changed=0.05)
    for enc, kw, own in (
        (Encoder(format_version=1), {}, True),
        (Encoder(), {"keyframe": True}, True),
        (Encoder(), {}, False),
    ):
        mine = _owned(base) if own else base
        got = enc.encode(new, mine, keep_base=True, **kw)
        assert not got.kept
        assert [f.data.tobytes() for f in mine.files] == [f.data.tobytes() for f in base.files]


@pytest.mark.parametrize("density", [1e-3, 0.3, 0.49, 1.0])
@pytest.mark.parametrize("add", [False, True])
def test_a_keeping_frame_is_byte_identical_whatever_its_method(density, add):
    """Sparse, dense planes (the sparse scan ran out of room and took back what it wrote) and STORED (made
    from the coded values, the base being the new bytes already): the same frame as without keep_base."""
    from weightsync.codec.frame import encode_delta_pieces, parse_header

    rng = np.random.default_rng(int(density * 1000) + add)
    for width, dt in ((1, "U8"), (2, "BF16")):
        n = 20_000
        base = rng.integers(0, 256, n * width, dtype=np.uint8)
        new = mutate(rng, base, width, int(n * density))
        cuts = [0, 3_000 * width, 11_000 * width, n * width]
        olds = [base[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
        news = [new[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]
        want = encode_delta_pieces(olds, news, by_name(dt), add=add, version=2)
        mine = [o.copy() for o in olds]
        got = encode_delta_pieces(mine, news, by_name(dt), add=add, version=2, keep_base=True)
        assert got == want, (width, parse_header(want).method)
        assert all(np.array_equal(m, x) for m, x in zip(mine, news, strict=True))
    with pytest.raises(ValueError):
        encode_delta_pieces([base.copy()], [new], by_name("U8"), version=1, keep_base=True)


@pytest.mark.parametrize("add", [False, True])
def test_a_keeping_frame_too_small_to_code_is_stored_from_its_coded_changes(add):
    """A frame of a few elements with one change codes sparse into more bytes than it holds (the sections'
    headers), so it goes STORED: made from the sparse changes, the base already holding the new bytes."""
    from weightsync.codec.frame import METHOD_STORED, encode_delta_pieces, parse_header

    base = np.arange(40, dtype=np.uint8)
    new = base.copy()
    new[7] ^= 0x5A
    olds, news = [base[:10], base[10:]], [new[:10], new[10:]]
    want = encode_delta_pieces(olds, news, by_name("BF16"), add=add, version=2)
    assert parse_header(want).method == METHOD_STORED
    mine = [o.copy() for o in olds]
    assert encode_delta_pieces(mine, news, by_name("BF16"), add=add, version=2, keep_base=True) == want
    assert all(np.array_equal(m, x) for m, x in zip(mine, news, strict=True))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(versions(), st.booleans())
def test_small_segments_compared_by_address_encode_as_compared_one_by_one(pair, known):
    """The encoder's native compare of small segments (Job._same) changes no byte of the output: the
    same frames and manifest as comparing each segment with the fused coder, base checksums known or not."""
    from weightsync.codec import encode_jobs

    base, new = pair
    digests = None
    if known:
        first = Encoder(format_version=2).encode(base).manifest
        digests = {(f.path, e.segment.kind, e.segment.name): e.digest for f in first.files for e in f.segments}

    def encode():
        out = Encoder(chunk_bytes=4096, format_version=2).encode(new, base, base_digests=digests)
        return out.manifest.to_json(), [fr.data for fr in out.frames]

    fast = encode()
    real = encode_jobs.Job._same
    encode_jobs.Job._same = lambda self, items, pool: ([], list(items))
    try:
        one_by_one = encode()
    finally:
        encode_jobs.Job._same = real
    assert fast == one_by_one


def test_the_compare_by_address_leaves_segments_of_arrays_it_cannot_address_to_the_coder():
    """Spans are addresses into plain contiguous byte arrays: a base held any other way, or a span past
    its array's end, is left to the per-segment compare, which slices safely."""
    from concurrent.futures import ThreadPoolExecutor

    from weightsync.codec.checkpoint import Segment
    from weightsync.codec.encode_jobs import Job
    from weightsync.codec.manifest import SegmentEntry

    bf16 = by_name("BF16")
    new = np.arange(64, dtype=np.uint8)
    rows = [[SegmentEntry(Segment("tensor", f"t{i}", bf16, (8,), 16 * i, 16), "", 16 * i) for i in range(4)]]
    items = [(0, i, e) for i, e in enumerate(rows[0])]
    with ThreadPoolExecutor(2) as pool:
        equal, left = Job(rows, [new], [new.copy()], level=1, chunk_bytes=4096)._same(items, pool)
        assert [e.segment.name for _, _, e in equal] == ["t0", "t1", "t2", "t3"] and left == []
        strided = np.zeros(128, dtype=np.uint8)[::2]
        strided[:] = new
        equal, left = Job(rows, [new], [strided], level=1, chunk_bytes=4096)._same(items, pool)
        assert equal == [] and left == items
        short = new[:40].copy()  # t2 and t3 reach past the base's end
        equal, left = Job(rows, [new], [short], level=1, chunk_bytes=4096)._same(items, pool)
        assert [e.segment.name for _, _, e in equal] == ["t0", "t1"] and left == items[2:]


def test_large_tensors_are_cut_at_chunk_bytes_and_small_ones_grouped_up_to_group_bytes():
    """FORMAT §4.5 as the encoder does it by default: a tensor of chunk_bytes (16 MiB) or more in frames of
    chunk_bytes, small ones sharing frames of at most GROUP_BYTES (a rank reading some of them fetches
    less), one between the two alone; with a chunk below GROUP_BYTES, groups of at most the chunk. The
    step decodes back exactly."""
    from weightsync.codec.encode_jobs import GROUP_BYTES
    from weightsync.codec.encoder import DEFAULT_CHUNK

    rng = np.random.default_rng(7)
    mib = 1 << 20
    assert 16 * mib == DEFAULT_CHUNK and 4 * mib == GROUP_BYTES
    sizes = {"big": 20 * mib, "middle": 6 * mib, **{f"small{i}": mib for i in range(8)}}
    base = {k: ("BF16", (n // 2,), rng.integers(0, 256, n, dtype=np.uint8)) for k, n in sizes.items()}
    new = {k: (d, s, mutate(rng, v, 2, 50)) for k, (d, s, v) in base.items()}
    base_ck = Checkpoint.from_bytes({"m.safetensors": safetensors_file(base)})
    new_ck = Checkpoint.from_bytes({"m.safetensors": safetensors_file(new)})

    def frames_of(enc: Encoder) -> tuple[Manifest, list[tuple[list[str], int]], object]:
        manifest, read = _located(enc, new_ck, base_ck)
        names = {(0, si): e.segment.name for si, e in enumerate(manifest.files[0].segments)}
        return manifest, [([names[p.file, p.seg] for p in r.pieces], r.raw_len) for r in manifest.frames], read

    manifest, frames, read = frames_of(Encoder())
    assert sorted(n for f, n in frames if f == ["big"]) == [4 * mib, 16 * mib]
    assert (["middle"], 6 * mib) in frames
    grouped = [(f, n) for f, n in frames if f[0].startswith("small")]
    assert sum(len(f) for f, _ in grouped) == 8 and all(n <= GROUP_BYTES for _, n in grouped)
    assert len(frames) == 2 + 1 + 2
    out = _decode(manifest, read, base_ck)
    assert [o.tobytes() for o in out] == [f.data.tobytes() for f in new_ck.files]
    _, small, _ = frames_of(Encoder(chunk_bytes=2 * mib))
    assert max(n for _, n in small) <= 2 * mib and sum(len(f) for f, _ in small if f[0].startswith("small")) == 8
