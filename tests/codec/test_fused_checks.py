"""Version 2 base checks fused into the apply pass, and the undo that restores an in-place base.

The Decoder checks a delta segment's base from the checksums its frames' apply pass takes
before patching each block (FORMAT §5.3, §10.2), so a wrong base is found only after
frames have written. Whatever fails once writing has started, an output that is the
base's own buffer must hold the base again when the error is raised.
"""

from __future__ import annotations

import numpy as np
import pytest
from _ckpt import mutate, safetensors_file

from weightsync.codec import Checkpoint, Decoder, Encoder, FrameRef, Manifest
from weightsync.codec import frame as fr
from weightsync.codec.checksum import reference_sum
from weightsync.codec.decoder import covered_segments
from weightsync.codec.dtypes import by_name
from weightsync.errors import BaseMismatch, ChecksumMismatch, CorruptData, TruncatedInput


def _located(enc: Encoder, new: Checkpoint, base: Checkpoint):
    encoded = enc.encode(new, base)
    offsets = np.cumsum([0] + [len(x.data) for x in encoded.frames])
    manifest = encoded.with_locations(lambda i, _: (None, int(offsets[i])))
    area = b"".join(x.data for x in encoded.frames)
    return manifest, lambda ref: memoryview(area)[ref.offset : ref.offset + ref.length]


def _pair(seed: int = 0, *, retype: bool = False) -> tuple[Checkpoint, Checkpoint]:
    """Several BF16 and F32 tensors at ~2 % changed, one left alone; `retype`: one tensor changes dtype
    (same size), so a keyframe frame decodes into the middle of an in-place file."""
    rng = np.random.default_rng(seed)
    base = {f"w{i}": ("BF16", (64, 96), rng.integers(0, 256, 64 * 96 * 2, dtype=np.uint8)) for i in range(4)}
    base["f"] = ("F32", (300,), rng.integers(0, 256, 1200, dtype=np.uint8))
    base["still"] = ("BF16", (40,), rng.integers(0, 256, 80, dtype=np.uint8))
    new = {
        k: (d, s, v if k == "still" else mutate(rng, v, by_name(d).width, max(1, v.size // by_name(d).width // 50)))
        for k, (d, s, v) in base.items()
    }
    if retype:
        new["f"] = ("I32", (300,), rng.integers(0, 256, 1200, dtype=np.uint8))
    return (
        Checkpoint.from_bytes({"m.safetensors": safetensors_file(base)}),
        Checkpoint.from_bytes({"m.safetensors": safetensors_file(new)}),
    )


def _copy(ck: Checkpoint) -> Checkpoint:
    return Checkpoint([type(f)(f.layout, f.data.copy()) for f in ck.files])


def _in_place(manifest: Manifest, read, base: Checkpoint, **kw) -> None:
    Decoder(threads=2).decode(manifest, read, [f.data for f in base.files], base, **kw)


def _liar(manifest: Manifest, base: Checkpoint, ref: FrameRef, version: int = 2) -> bytes:
    """A delta frame in `ref`'s place that parses and applies, but codes one more change than the true one."""
    pieces = []
    for p in ref.pieces:
        e = manifest.files[p.file].segments[p.seg]
        assert e.base_offset is not None
        pieces.append(base.files[p.file].data[e.base_offset + p.offset :][: p.length])
    dtype = by_name(ref.dtype)
    old = np.concatenate(pieces)
    return fr.encode_delta(old, mutate(np.random.default_rng(7), old, dtype.width, 3), dtype, version=version)


def test_a_wrong_base_is_found_by_the_apply_pass_named_and_the_in_place_base_restored():
    base, new = _pair(1)
    manifest, read = _located(Encoder(chunk_bytes=4096, format_version=2), new, base)
    fused = covered_segments(manifest)
    names = {manifest.files[0].segments[si].segment.name for _, si in fused}
    assert names == {"w0", "w1", "w2", "w3", "f"}, "the header and 'still' equal their bases: checked apart"
    assert len(manifest.frames) > 6  # several frames applied, and undone, on two threads
    seg = next(s for s in base.files[0].layout.segments if s.name == "w3")
    data = base.files[0].data.copy()
    data[seg.offset + 5] ^= 0x01
    bad = Checkpoint.from_bytes({"m.safetensors": data})
    before = data.copy()
    with pytest.raises(BaseMismatch, match="'w3'"):
        _in_place(manifest, read, bad)
    assert np.array_equal(bad.files[0].data, before), "every frame applied was undone"
    # The same base, fixed, decodes in place: nothing of the failed attempt remains.
    good = _copy(base)
    _in_place(manifest, read, good, verify_segments=True)
    assert good.files[0].data.tobytes() == new.files[0].data.tobytes()


def test_a_result_mismatch_in_place_restores_the_base():
    base, new = _pair(2)
    manifest, read = _located(Encoder(chunk_bytes=4096, format_version=2), new, base)
    ref = next(r for r in manifest.frames if r.delta and len(r.pieces) == 1)
    name = manifest.files[0].segments[ref.pieces[0].seg].segment.name
    liar = _liar(manifest, base, ref)

    def lying(r: FrameRef):
        return liar if r == ref else read(r)

    held = _copy(base)
    with pytest.raises(ChecksumMismatch, match=repr(name)):
        _in_place(manifest, lying, held)
    assert held.files[0].data.tobytes() == base.files[0].data.tobytes()


def test_a_base_mismatch_is_reported_before_the_results_it_spoils():
    base, new = _pair(3)
    manifest, read = _located(Encoder(chunk_bytes=1 << 20, format_version=2), new, base)
    seg = next(s for s in base.files[0].layout.segments if s.name == "w1")
    data = base.files[0].data.copy()
    data[seg.offset + seg.length - 1] ^= 0x80
    out = [np.empty(f.size, dtype=np.uint8) for f in manifest.files]
    with pytest.raises(BaseMismatch, match="'w1'"):
        Decoder(threads=1).decode(manifest, read, out, Checkpoint.from_bytes({"m.safetensors": data}))
    # Without the base check, the same bytes fail their result check instead.
    with pytest.raises(ChecksumMismatch, match="'w1'"):
        Decoder(threads=1).decode(
            manifest, read, out, Checkpoint.from_bytes({"m.safetensors": data}), verify_base=False
        )


def test_a_damaged_frame_in_place_restores_what_the_others_applied():
    base, new = _pair(4)
    manifest, read = _located(Encoder(chunk_bytes=4096, format_version=2), new, base)
    victim = manifest.frames[len(manifest.frames) // 2]

    def damaged(r: FrameRef):
        return bytes(read(r))[: r.length // 2] if r == victim else read(r)

    held = _copy(base)
    with pytest.raises(TruncatedInput):
        _in_place(manifest, damaged, held)
    assert held.files[0].data.tobytes() == base.files[0].data.tobytes()


def test_keyframe_pieces_in_an_in_place_file_are_put_back():
    base, new = _pair(5, retype=True)
    manifest, read = _located(Encoder(chunk_bytes=4096, format_version=2), new, base)
    assert any(not r.delta for r in manifest.frames), "a tensor coded whole inside a delta"
    ref = next(r for r in manifest.frames if r.delta)
    liar = _liar(manifest, base, ref)
    held = _copy(base)
    with pytest.raises(ChecksumMismatch):
        _in_place(manifest, lambda r: liar if r == ref else read(r), held)
    assert held.files[0].data.tobytes() == base.files[0].data.tobytes()
    _in_place(manifest, read, held)
    assert held.files[0].data.tobytes() == new.files[0].data.tobytes()


def test_version_1_in_place_restores_every_frame_on_a_late_failure():
    """A v1 frame vouches for itself only; a swapped one passes, and verify_segments catches it at the end:
    every frame applied by then is undone."""
    base, new = _pair(6)
    manifest, read = _located(Encoder(chunk_bytes=4096, format_version=1), new, base)
    ref = next(r for r in manifest.frames if r.delta and len(r.pieces) == 1)
    liar = _liar(manifest, base, ref, version=1)
    held = _copy(base)
    with pytest.raises(ChecksumMismatch):
        _in_place(manifest, lambda r: liar if r == ref else read(r), held, verify_segments=True)
    assert held.files[0].data.tobytes() == base.files[0].data.tobytes()


def test_an_undo_that_cannot_read_its_frame_again_says_the_output_holds_neither_version():
    base, new = _pair(7)
    manifest, read = _located(Encoder(chunk_bytes=4096, format_version=2), new, base)
    seg = next(s for s in base.files[0].layout.segments if s.name == "w0")
    data = base.files[0].data.copy()
    data[seg.offset] ^= 0x04
    bad = Checkpoint.from_bytes({"m.safetensors": data})
    calls: dict[FrameRef, int] = {}

    def once(r: FrameRef):
        calls[r] = calls.get(r, 0) + 1
        if calls[r] > 1:
            raise CorruptData("gone")
        return read(r)

    with pytest.raises(BaseMismatch) as info:
        _in_place(manifest, once, bad)
    assert any("holds neither version" in n for n in getattr(info.value, "__notes__", []))


def test_an_undo_that_reads_other_bytes_is_noticed_by_its_checksums():
    base, new = _pair(8)
    manifest, read = _located(Encoder(chunk_bytes=1 << 20, format_version=2), new, base)
    ref = next(r for r in manifest.frames if r.delta and len(r.pieces) == 1)
    liar = _liar(manifest, base, ref)
    seg = manifest.files[0].segments[ref.pieces[0].seg].segment
    data = base.files[0].data.copy()
    data[seg.offset] ^= 0x04
    bad = Checkpoint.from_bytes({"m.safetensors": data})
    calls: dict[FrameRef, int] = {}

    def flaky(r: FrameRef):  # the right frame first, another on the second read (the undo)
        calls[r] = calls.get(r, 0) + 1
        return liar if r == ref and calls[r] > 1 else read(r)

    with pytest.raises(BaseMismatch) as info:
        _in_place(manifest, flaky, bad)
    assert any("holds neither version" in n for n in getattr(info.value, "__notes__", []))


def test_undo_frame_inverts_both_operations_and_refuses_keyframes():
    rng = np.random.default_rng(9)
    dtype = by_name("BF16")
    base = rng.integers(0, 256, 4000, dtype=np.uint8)
    new = mutate(rng, base, 2, 40)
    for add in (False, True):
        for version in (1, 2):
            blob = fr.encode_delta(base, new, dtype, add=add, version=version)
            t = base.copy()
            fr.apply_frame_pieces(blob, [t[:1000], t[1000:]], verify_base=False)
            assert t.tobytes() == new.tobytes()
            assert fr.undo_frame(blob, [t[:1000], t[1000:]]) is None
            assert t.tobytes() == base.tobytes()
        blob = fr.encode_delta(base, new, dtype, add=add, version=2)
        t = base.copy()
        _, sums = fr.apply_frame_sums(blob, [t[:1000], t[1000:]], [0, 500], before=True)
        assert [s.before for s in sums] == [reference_sum(base[:1000], 2), reference_sum(base[1000:], 2, start=500)]
        assert [s.after for s in sums] == [reference_sum(new[:1000], 2), reference_sum(new[1000:], 2, start=500)]
        assert fr.undo_frame(blob, [t[:1000], t[1000:]], [0, 500]) == [s.before for s in sums]
        assert t.tobytes() == base.tobytes()
    key = fr.encode_key(new, dtype, version=2)
    with pytest.raises(ValueError):
        fr.undo_frame(key, [base.copy()])
    _, sums = fr.apply_frame_sums(key, [base.copy()], [0])
    assert sums[0].before is None and sums[0].after == reference_sum(new, 2)
