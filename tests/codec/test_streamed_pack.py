"""A version packed as it encodes: frames handed on in order while the rest encode (`Encoder.encode`'s
`on_frame`; a delta's frame once it is final), objects made as soon as their last frame is in (`pack.Packer`),
the same objects as `pack`."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from _ckpt import safetensors_file
from hypothesis import given, settings
from hypothesis import strategies as st

from weightsync.codec import Checkpoint, Encoder
from weightsync.codec.encode_jobs import EncodedFrame, InOrder
from weightsync.codec.pack import Packer, pack


def _frame(n: int, tag: int) -> EncodedFrame:
    return EncodedFrame(bytes([tag % 256]) * n, False, "U8", n, ())


def _checkpoint(seed: int, tensors: int = 5, elements: int = 3000) -> Checkpoint:
    rng = np.random.default_rng(seed)
    body = {f"t{i}": ("BF16", (elements,), rng.integers(0, 256, 2 * elements, dtype=np.uint8)) for i in range(tensors)}
    return Checkpoint.from_bytes({"m.safetensors": safetensors_file(body)})


@given(st.lists(st.integers(0, 300), max_size=30), st.integers(1, 700))
@settings(max_examples=200, deadline=None)
def test_the_packer_makes_the_objects_pack_makes_handing_on_all_but_the_last(sizes, target) -> None:
    class Frames:  # what pack and Packer.finish read of an encode: its frames, located
        def __init__(self, frames):
            self.frames = frames

        def with_locations(self, locate):
            return [locate(i, fr) for i, fr in enumerate(self.frames)]

    frames = [_frame(n, i) for i, n in enumerate(sizes)]
    want_where, want = pack(Frames(frames), target_bytes=target)
    handed = []
    packer = Packer(target_bytes=target, on_object=handed.append)
    for fr in frames:
        packer.add(fr)
    where, got = packer.finish(Frames(frames))
    assert where == want_where
    assert [(o.digest, o.data) for o in got] == [(o.digest, o.data) for o in want]
    assert handed == got[:-1]
    assert b"".join(o.data for o in got) == b"".join(fr.data for fr in frames)


def test_a_packer_refuses_an_encode_whose_frames_it_was_not_given() -> None:
    class Frames:
        frames = [_frame(3, 0), _frame(4, 1)]

    packer = Packer(target_bytes=10)
    packer.add(Frames.frames[0])
    with pytest.raises(ValueError, match="1 frames packed, the encode made 2"):
        packer.finish(Frames())


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_a_keyframe_s_frames_are_handed_on_in_order_and_are_its_frames(threads: int) -> None:
    ck = _checkpoint(7)
    seen: list[EncodedFrame] = []
    callers: set[int] = set()

    def on_frame(fr: EncodedFrame) -> None:
        callers.add(threading.get_ident())
        seen.append(fr)

    plain = Encoder(threads=threads, chunk_bytes=1024).encode(ck)
    handed = Encoder(threads=threads, chunk_bytes=1024).encode(ck, on_frame=on_frame)
    assert len(plain.frames) > 8
    assert [fr.data for fr in seen] == [fr.data for fr in handed.frames] == [fr.data for fr in plain.frames]
    assert handed.manifest.encode() == plain.manifest.encode()


def test_each_frame_is_handed_on_as_soon_as_it_is_made_not_after_the_encode(monkeypatch) -> None:
    """On one thread the frames are made one after another: each is handed on before the next is made."""
    from weightsync.codec import encode_jobs

    made: list[int] = []
    real = encode_jobs.encode_key

    def counted(*args, **kwargs):
        made.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(encode_jobs, "encode_key", counted)
    seen: list[int] = []
    encoded = Encoder(threads=1, chunk_bytes=1024).encode(_checkpoint(9), on_frame=lambda fr: seen.append(len(made)))
    assert len(encoded.frames) > 8
    assert seen == list(range(1, len(encoded.frames) + 1))


def test_the_publishers_helping_pool_hands_frames_on_in_order() -> None:
    """The publisher's encode runs on a HelpingPool (the calling thread takes jobs from the back): the order
    handed on is still the frames' own."""
    from weightsync.client._pool import HelpingPool, cpu_pool

    ck = _checkpoint(11, tensors=8)
    seen: list[EncodedFrame] = []
    handed = Encoder(chunk_bytes=1024, pool=HelpingPool(cpu_pool())).encode(ck, on_frame=seen.append)
    assert [fr.data for fr in seen] == [fr.data for fr in handed.frames]
    assert [fr.data for fr in handed.frames] == [
        fr.data for fr in Encoder(threads=1, chunk_bytes=1024).encode(ck).frames
    ]


def test_frames_are_handed_on_only_in_format_2() -> None:
    base, new = _checkpoint(1), _checkpoint(2)
    with pytest.raises(ValueError, match="format 2"):
        Encoder(format_version=1).encode(new, on_frame=lambda fr: None)
    with pytest.raises(ValueError, match="format 2"):
        Encoder(format_version=1).encode(new, base, on_frame=lambda fr: None)
    for keyframe in (True, False):
        got: list[EncodedFrame] = []
        encoded = Encoder(format_version=2, chunk_bytes=1024).encode(new, base, keyframe=keyframe, on_frame=got.append)
        assert got and [fr.data for fr in got] == [fr.data for fr in encoded.frames]


def _step(seed: int, changes: list[list[int]], small: int = 3, elements: int = 3000) -> tuple[Checkpoint, Checkpoint]:
    """A base and a next version: large bf16 tensors (each cut into frames of its own at chunk_bytes=1024) where
    tensor i changes the elements `changes[i]`, and `small` tensors below a frame that all change."""
    rng = np.random.default_rng(seed)
    base, new = {}, {}
    for i, where in enumerate(changes):
        b = rng.integers(0, 256, 2 * elements, dtype=np.uint8)
        n = b.copy()
        for e in where:
            n[2 * (e % elements)] ^= 0x5A
        base[f"big{i}"], new[f"big{i}"] = ("BF16", (elements,), b), ("BF16", (elements,), n)
    for i in range(small):
        b = rng.integers(0, 256, 200, dtype=np.uint8)
        base[f"small{i}"], new[f"small{i}"] = ("BF16", (100,), b), ("BF16", (100,), b ^ np.uint8(1))
    return (
        Checkpoint.from_bytes({"m.safetensors": safetensors_file(base)}),
        Checkpoint.from_bytes({"m.safetensors": safetensors_file(new)}),
    )


@given(
    changes=st.lists(st.lists(st.integers(0, 2999), max_size=4), min_size=1, max_size=6),
    small=st.integers(0, 3),
    threads=st.sampled_from([1, 2, 4]),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=60, deadline=None)
def test_a_delta_s_frames_are_handed_on_in_order_and_are_its_frames(changes, small, threads, seed) -> None:
    """Whichever chunks of which tensors change (a tensor with none has all its frames dropped), the frames handed
    on are the delta's frames, in order, and the encode is the one made without handing on."""
    base, new = _step(seed, changes, small)
    seen: list[EncodedFrame] = []
    plain = Encoder(threads=threads, chunk_bytes=1024).encode(new, base)
    handed = Encoder(threads=threads, chunk_bytes=1024).encode(new, base, on_frame=seen.append)
    assert [fr.data for fr in seen] == [fr.data for fr in handed.frames] == [fr.data for fr in plain.frames]
    assert handed.manifest.encode() == plain.manifest.encode()
    assert plain.manifest.kind == "delta"


def test_a_delta_frame_is_handed_on_once_its_tensor_is_known_to_change_not_after_the_encode(monkeypatch) -> None:
    """On one thread the frames are made in order. A frame of a tensor whose first chunk changed is handed on as
    soon as it is made; the unchanged frames of a tensor wait only for its first change (then go at once), and a
    tensor with no change at all hands on nothing."""
    from weightsync.codec import encode_jobs

    made: list[int] = []
    real = encode_jobs.encode_delta_pieces

    def counted(*args, **kwargs):
        made.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(encode_jobs, "encode_delta_pieces", counted)
    # big0 changes in its first chunk, big1 in none, big2 only in its last (each is 6 frames of ~1 KB).
    base, new = _step(5, [[0], [], [2999]], small=0)
    seen: list[int] = []
    encoded = Encoder(threads=1, chunk_bytes=1024).encode(new, base, on_frame=lambda fr: seen.append(len(made)))
    per = len(made) // 3
    assert len(encoded.frames) == 2 * per and per >= 4
    # big0's frames each as made; big2's all at once, when its last (changed) frame is made.
    assert seen == list(range(1, per + 1)) + [3 * per] * per


def test_a_hand_on_that_raises_fails_the_encode_and_nothing_follows_it() -> None:
    ck = _checkpoint(3)
    seen = []

    def on_frame(fr: EncodedFrame) -> None:
        seen.append(fr)
        if len(seen) == 3:
            raise OSError("upload refused")

    with pytest.raises(OSError, match="upload refused"):
        Encoder(threads=2, chunk_bytes=1024).encode(ck, on_frame=on_frame)
    assert len(seen) == 3


@given(st.integers(1, 40), st.integers(0, 2**32 - 1))
@settings(max_examples=40, deadline=None)
def test_results_made_in_any_order_on_any_threads_are_handed_on_in_order_once_one_at_a_time(count, seed) -> None:
    order = list(range(count))
    random.Random(seed).shuffle(order)
    got: list[int] = []
    inside = threading.Lock()

    def hand_on(fr: EncodedFrame) -> None:
        assert inside.acquire(blocking=False), "handed on twice at once"
        try:
            time.sleep(0.0002)
            got.append(fr.raw_len)
        finally:
            inside.release()

    dropped = {k for k in range(count) if random.Random(seed + k).random() < 0.3}  # given as None: not handed on
    in_order = InOrder(count, hand_on)
    with ThreadPoolExecutor(4) as pool:
        list(
            pool.map(lambda k: in_order.done(k, None if k in dropped else EncodedFrame(b"", False, "U8", k, ())), order)
        )
    assert got == [k for k in range(count) if k not in dropped]
