"""The plan bundle's framing (weightsync/bundle.py): round trips, and every malformed body is BadResponse."""

from __future__ import annotations

import hashlib
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
from hypothesis import given
from hypothesis import strategies as st

from weightsync import bundle, errors

blobs = st.lists(st.binary(max_size=300), max_size=5)


def _named(datas: list[bytes]) -> dict[str, bytes]:
    return {hashlib.sha256(d + bytes([i])).hexdigest(): d for i, d in enumerate(datas)}


@given(plan=st.binary(max_size=200), datas=blobs)
def test_round_trip(plan: bytes, datas: list[bytes]) -> None:
    objects = _named(datas)
    got = list(bundle.parts(bundle.encode(plan, objects)))
    assert got[0][0] == bundle.PLAN and bytes(got[0][1]) == plan
    assert {n: bytes(d) for n, d in got[1:]} == objects


@given(plan=st.binary(max_size=50), datas=blobs, data=st.data())
def test_a_truncated_body_is_refused_or_a_prefix_of_the_parts(plan: bytes, datas: list[bytes], data) -> None:
    """Cut inside a part: BadResponse. Cut between parts: the parts before the cut (a reader fetches the
    objects missing the usual way; HTTP's Content-Length catches a connection cut short anyway)."""
    objects = _named(datas)
    body = bundle.encode(plan, objects)
    ends, at = [], len(bundle.encode(plan, {}))
    for name, d in objects.items():
        ends.append(at)
        at += bundle.part_overhead(name) + len(d)
    cut = data.draw(st.integers(0, len(body) - 1))
    if cut in ends:
        got = list(bundle.parts(body[:cut]))
        assert [n for n, _ in got[1:]] == list(objects)[: ends.index(cut)]
    else:
        with pytest.raises(errors.BadResponse):
            list(bundle.parts(body[:cut]))


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"XXXX\x01\x00\x00\x00", "bad magic"),
        (bundle.head()[:4] + b"\x02\x00\x00\x00", "version 2"),
        (bundle.head(), "no plan"),
        (bundle.head() + bundle.part_header("a" * 64, 0), "unexpected part"),  # an object before the plan
        (bundle.encode(b"{}", {}) + bundle.part_header("not-a-digest", 0), "unexpected part"),
        (bundle.encode(b"{}", {}) + bundle.part_header(bundle.PLAN, 0), "unexpected part"),  # a second plan
        (bundle.head() + b"\x04\x00\xff\xfe\xfd\xfc" + bytes(8), "not ASCII"),
    ],
)
def test_malformed(body: bytes, why: str) -> None:
    with pytest.raises(errors.BadResponse, match=why):
        list(bundle.parts(body))


_HASHER = ThreadPoolExecutor(1, thread_name_prefix="test-bundle-hash")


def _received(
    body: bytes, cuts: list[int], size: int | None = None, *, hasher: bool = False, **options
) -> tuple[bytes, dict[str, tuple[bytes, str | None]]]:
    """`body` fed to a Receiver (of `size`, the length its header would give; `options` its others) in the pieces
    `cuts` make, then finished; with `hasher`, hashed on a thread it is given and finished without waiting (the
    futures are resolved here)."""
    r = bundle.Receiver(size=size, hasher=_HASHER if hasher else None, **options)
    at = 0
    for cut in [*sorted(cuts), len(body)]:
        r.feed(body[at:cut])
        at = cut
    if not hasher:
        plan, objects = r.finish()
        return bytes(plan), {n: (bytes(d), h) for n, (d, h) in objects.items()}
    plan, pending = r.finish_pending()
    return bytes(plan), {n: (bytes(d), h.result() if isinstance(h, Future) else h) for n, (d, h) in pending.items()}


@given(plan=st.binary(max_size=200), datas=blobs, data=st.data())
def test_a_body_received_in_any_pieces_gives_the_parts_and_their_hashes(plan: bytes, datas: list[bytes], data) -> None:
    """The receiver's parts are `parts`' of the whole body, however the body arrives, each object's SHA-256
    taken as it came (here the names are not the data's hashes: the hash is of the bytes received)."""
    objects = _named(datas)
    body = bundle.encode(plan, objects)
    cuts = data.draw(st.lists(st.integers(0, len(body)), max_size=8))
    got_plan, got = _received(body, cuts)
    assert got_plan == plan
    assert {n: d for n, (d, _) in got.items()} == objects
    assert all(h == hashlib.sha256(d).hexdigest() for d, h in got.values())


@given(plan=st.binary(max_size=50), datas=blobs, data=st.data())
def test_a_receiver_refuses_what_parts_refuses(plan: bytes, datas: list[bytes], data) -> None:
    """A body cut anywhere: the receiver gives what `parts` gives, or raises where it raises."""
    body = bundle.encode(plan, _named(datas))
    cut = data.draw(st.integers(0, len(body) - 1))
    try:
        want = [(n, bytes(d)) for n, d in bundle.parts(body[:cut])]
    except errors.BadResponse:
        with pytest.raises(errors.BadResponse):
            _received(body[:cut], [data.draw(st.integers(0, cut))])
        return
    got_plan, got = _received(body[:cut], [data.draw(st.integers(0, cut))])
    assert [(bundle.PLAN, got_plan), *((n, d) for n, (d, _) in got.items())] == want


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"XXXX\x01\x00\x00\x00", "bad magic"),
        (bundle.head()[:4] + b"\x02\x00\x00\x00", "version 2"),
        (bundle.head(), "no plan"),
        (bundle.head() + bundle.part_header("a" * 64, 0), "unexpected part"),
        (bundle.encode(b"{}", {}) + bundle.part_header("not-a-digest", 0), "unexpected part"),
        (bundle.encode(b"{}", {}) + bundle.part_header(bundle.PLAN, 0), "unexpected part"),
        (bundle.head() + b"\x04\x00\xff\xfe\xfd\xfc" + bytes(8), "not ASCII"),
        (b"WSP", "bad magic"),
    ],
)
def test_a_receiver_refuses_malformed_bodies(body: bytes, why: str) -> None:
    with pytest.raises(errors.BadResponse, match=why):
        _received(body, [1, 3])


@given(
    plan=st.binary(max_size=200),
    datas=blobs,
    data=st.data(),
    ahead=st.sampled_from([1, 7, 64, 1 << 30]),
    hasher=st.booleans(),
)
def test_a_body_of_known_length_gives_the_same_parts_and_hashes(
    plan: bytes, datas: list[bytes], data, ahead: int, hasher: bool
) -> None:
    """With the body's length the bytes land in one buffer, and with a hashing thread given, from HASH_AHEAD
    bytes on (made small here) the objects are hashed on it in steps, finished without waiting (the hashes
    still being taken handed back as futures); without one, as they arrive: the same parts, the same hashes."""
    objects = _named(datas)
    body = bundle.encode(plan, objects)
    cuts = data.draw(st.lists(st.integers(0, len(body)), max_size=8))
    saved = bundle.HASH_AHEAD
    bundle.HASH_AHEAD = ahead
    try:
        got_plan, got = _received(body, cuts, size=len(body), hasher=hasher)
    finally:
        bundle.HASH_AHEAD = saved
    assert got_plan == plan
    assert {n: d for n, (d, _) in got.items()} == objects
    assert all(h == hashlib.sha256(d).hexdigest() for d, h in got.values())


def test_a_body_longer_or_shorter_than_its_length_is_refused() -> None:
    body = bundle.encode(b"{}", _named([b"abc", b"defgh"]))
    with pytest.raises(errors.BadResponse, match="longer than its"):
        _received(body, [5], size=len(body) - 1)
    with pytest.raises(errors.BadResponse, match="truncated"):
        _received(body[:-2], [5], size=len(body))


@given(plan=st.binary(max_size=200), datas=blobs, data=st.data())
def test_an_unhashed_receiver_gives_the_same_parts_and_no_hashes(plan: bytes, datas: list[bytes], data) -> None:
    """hashed=False (a whole body read by `parts`): the same parts however the body arrives, each object's hash
    None (not a hash of nothing: a reader must not take it for one)."""
    objects = _named(datas)
    body = bundle.encode(plan, objects)
    cuts = data.draw(st.lists(st.integers(0, len(body)), max_size=8))
    got_plan, got = _received(body, cuts, len(body), hasher=True, hashed=False)
    assert got_plan == plan
    assert got == {n: (d, None) for n, d in objects.items()}


@given(plan=st.binary(max_size=200), datas=blobs, data=st.data(), hashed=st.booleans())
def test_a_body_received_into_the_buffer_gives_what_feeding_gives(
    plan: bytes, datas: list[bytes], data, hashed
) -> None:
    """A reader that receives straight into the buffer (`space`, then `took`: the client's direct path), in any
    pieces, gets the parts and hashes that feeding the same body gives."""
    objects = _named(datas)
    body = bundle.encode(plan, objects)
    r = bundle.Receiver(size=len(body), hasher=_HASHER, hashed=hashed)
    at = 0
    for cut in [*sorted(data.draw(st.lists(st.integers(0, len(body)), max_size=8))), len(body)]:
        space = r.space()
        assert space is not None and len(space) == len(body) - at
        space[: cut - at] = body[at:cut]
        r.took(cut - at)
        at = cut
    got_plan, got = r.finish()
    assert bytes(got_plan) == plan
    want = {n: (d, hashlib.sha256(d).hexdigest() if hashed else None) for n, d in objects.items()}
    assert {n: (bytes(d), h) for n, (d, h) in got.items()} == want


def test_took_more_than_the_buffer_holds_and_space_without_a_length_are_refused() -> None:
    body = bundle.encode(b"{}", _named([b"abc"]))
    r = bundle.Receiver(size=len(body))
    with pytest.raises(ValueError, match="left"):
        r.took(len(body) + 1)
    with pytest.raises(ValueError, match="left"):
        r.took(-1)
    assert bundle.Receiver().space() is None
    with pytest.raises(ValueError):
        bundle.Receiver().took(0)


@given(plan=st.binary(max_size=200), datas=blobs, data=st.data())
def test_parts_named_unhashed_are_left_to_their_reader_and_the_others_hashed(plan: bytes, datas: list[bytes], data):
    """`unhashed` (the parts a reader checks by their transfer digest): those parts come with no hash, every
    other object part with its SHA-256, however the body arrives."""
    objects = _named(datas)
    skip = set(data.draw(st.sets(st.sampled_from(sorted(objects)))) if objects else set())
    body = bundle.encode(plan, objects)
    cuts = data.draw(st.lists(st.integers(0, len(body)), max_size=8))
    _, got = _received(body, cuts, len(body), hasher=True, unhashed=skip)
    assert got == {n: (d, None if n in skip else hashlib.sha256(d).hexdigest()) for n, d in objects.items()}


@given(datas=blobs, junk=st.lists(st.text(max_size=120), max_size=4))
def test_transfer_digests_round_trip_and_malformed_entries_are_left_out(datas: list[bytes], junk: list[str]) -> None:
    """XXH3_HEADER's value: what `format_transfer_digests` writes parses back whole; an entry that is not an object's
    name and 32 lowercase hex digits is left out (its part is then hashed), never an error."""
    digests = {n: bundle.transfer_digest(d) for n, d in _named(datas).items()}
    value = bundle.format_transfer_digests(digests)
    assert bundle.parse_transfer_digests(value) == digests
    mixed = ",".join([value, *(j.replace(",", ";") for j in junk)]) if value else ",".join(junk)
    parsed = bundle.parse_transfer_digests(mixed)
    assert {k: v for k, v in parsed.items() if k in digests} == digests
    for name, value_ in parsed.items():
        assert len(name) == 64 and len(value_) == 32 and set(value_) <= set("0123456789abcdef")
    assert bundle.parse_transfer_digests("x=y, ,=,abc") == {}
    assert bundle.parse_transfer_digests(f"{'a' * 64}={'G' * 32}") == {}
