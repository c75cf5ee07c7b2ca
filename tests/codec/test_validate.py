"""Publish-time validation (codec/validate.py): every bad checkpoint of issue 12 refused in one line; the
safetensors parser checked against its own oracle and the reference implementation (hypothesis)."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import numpy as np
import pytest
from _bad_ckpt import BAD, PICKLE, SHARD2, shard, sharded
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from weightsync.codec import Checkpoint, Encoder, Manifest, Segment, diff, patch
from weightsync.codec import safetensors as st_
from weightsync.codec.checkpoint import FileLayout, layout_of
from weightsync.codec.dtypes import BY_NAME, U8
from weightsync.codec.validate import check_publishable, validate_for_publish
from weightsync.errors import FormatError, InvalidCheckpoint, SafetensorsError


@pytest.mark.parametrize("make, message", [(m, msg) for _, m, msg in BAD], ids=[case for case, _, _ in BAD])
def test_bad_checkpoints_are_refused_in_one_line(tmp_path: Path, make, message: str) -> None:
    path = make(tmp_path)
    with pytest.raises(InvalidCheckpoint) as caught:
        validate_for_publish(Checkpoint.open(path), source=str(path))
    text = str(caught.value)
    assert "\n" not in text and re.search(message, text), text
    assert isinstance(caught.value, FormatError) and caught.value.code == "invalid-checkpoint"
    assert caught.value.status == 422 and caught.value.exit_code == 1


def test_a_valid_sharded_checkpoint_passes_unchanged(tmp_path: Path) -> None:
    ck = Checkpoint.open(sharded(tmp_path / "ck"))
    checked = validate_for_publish(ck)
    assert checked.checkpoint is ck and checked.left_out == () and checked.warnings == ()


def test_pickles_next_to_safetensors_are_left_out_with_one_warning(tmp_path: Path) -> None:
    root = sharded(tmp_path / "ck")
    (root / "training_args.bin").write_bytes(PICKLE)
    (root / "optimizer.PT").write_bytes(PICKLE)  # suffixes compare case-insensitively
    checked = validate_for_publish(Checkpoint.open(root))
    assert checked.left_out == ("optimizer.PT", "training_args.bin")
    assert [f.layout.path for f in checked.checkpoint.files] == [
        "config.json",
        "model-00001-of-00002.safetensors",
        SHARD2,
        "model.safetensors.index.json",
    ]
    (warning,) = checked.warnings
    assert "\n" not in warning and warning.endswith(": optimizer.PT, training_args.bin") and "convert" in warning


def test_every_broken_shard_is_counted_and_the_first_named(tmp_path: Path) -> None:
    root = sharded(tmp_path / "ck")
    for p in root.glob("*.safetensors"):
        p.write_bytes(b"")
    with pytest.raises(InvalidCheckpoint, match=r"^model-00001-of-00002\.safetensors: .* \(and 1 more invalid"):
        validate_for_publish(Checkpoint.open(root))


def test_safetensors_files_without_a_tensor_are_no_weights() -> None:
    ck = Checkpoint.from_bytes({"model.safetensors": st_.serialize([], {"format": "pt"}), "config.json": b"{}"})
    with pytest.raises(InvalidCheckpoint, match="hold no tensor"):
        validate_for_publish(ck, source="run-7")


def test_listing_is_bounded() -> None:
    ck = Checkpoint.from_bytes({f"tok{i}.json": b"{}" for i in range(40)})
    with pytest.raises(
        InvalidCheckpoint, match=r": tok0\.json, tok1\.json, tok10\.json, tok11\.json, tok12\.json and 35 more$"
    ):
        validate_for_publish(ck)


def test_opening_diff_and_patch_stay_permissive(tmp_path: Path) -> None:
    """Only publishing is strict: a broken shard is still opened, diffed and patched byte for byte (a blob)."""
    base = sharded(tmp_path / "base")
    new = sharded(tmp_path / "new", seed=5)
    (new / SHARD2).write_bytes((new / SHARD2).read_bytes()[:300_000])
    assert Checkpoint.open(new).by_path()[SHARD2].layout.segments[0].kind == "blob"
    diff(base, new, tmp_path / "d.wsd")
    patch(base, tmp_path / "d.wsd", tmp_path / "out")
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == {
        p.name: p.read_bytes() for p in new.iterdir()
    }


# --- the same rules on a manifest's layouts alone (what the service checks) --------------------------------------


def _manifest_layouts(ck: Checkpoint) -> list[FileLayout]:
    """The layouts a manifest of `ck` describes, after a trip through the manifest's bytes."""
    manifest = Encoder().encode(ck).with_locations(lambda i, fr: ("a" * 64, 0))
    return [f.layout for f in Manifest.decode(manifest.encode()).files]


def test_a_valid_manifest_passes(tmp_path: Path) -> None:
    check_publishable(_manifest_layouts(Checkpoint.open(sharded(tmp_path / "ck"))))


@pytest.mark.parametrize("make, message", [(m, msg) for _, m, msg in BAD], ids=[case for case, _, _ in BAD])
def test_a_manifest_of_a_bad_checkpoint_is_refused(tmp_path: Path, make, message: str) -> None:
    """What a publisher that skipped validation would send (broken shards as blobs) is refused from the manifest."""
    with pytest.raises(InvalidCheckpoint):
        check_publishable(_manifest_layouts(Checkpoint.open(make(tmp_path))))


def _seg(kind: str, name: str, dtype: str, shape: tuple[int, ...], offset: int, length: int) -> Segment:
    return Segment(kind, name, BY_NAME[dtype], shape, offset, length)


_HEADER = _seg("header", "", "U8", (16,), 0, 16)


@pytest.mark.parametrize(
    "segments, size, message",
    [
        ([_seg("blob", "", "U8", (40,), 0, 40)], 40, "does not start with a safetensors header segment"),
        ([_seg("header", "", "U8", (8,), 0, 8)], 8, "does not start with a safetensors header segment"),
        ([_seg("header", "", "U8", (15,), 0, 16)], 16, "does not start with a safetensors header segment"),
        ([_HEADER, _seg("blob", "", "U8", (8,), 16, 8)], 24, "a blob segment at byte 16"),
        ([_HEADER, _seg("header", "", "U8", (8,), 16, 8)], 24, "a header segment at byte 16"),
        (
            [_HEADER, _seg("tensor", "a", "F32", (2,), 16, 8), _seg("tensor", "a", "F32", (2,), 24, 8)],
            32,
            "repeated or reserved",
        ),
        ([_HEADER, _seg("tensor", "__metadata__", "F32", (2,), 16, 8)], 24, "repeated or reserved"),
        ([_HEADER, _seg("tensor", "a", "F32", (3,), 16, 8)], 24, "does not follow its dtype and shape"),
        ([_HEADER, _seg("tensor", "a", "F32", (2,), 17, 8)], 25, "does not follow its dtype and shape"),
        ([_HEADER, _seg("tensor", "a", "F32", (2,), 16, 8)], 30, "end at byte 24 but the file has 30 bytes"),
        ([_HEADER, _seg("tensor", "a", "U8", (2**40, 2**40, 0), 16, 0)], 16, "overflows 64 bits"),
    ],
)
def test_a_manifest_layout_that_no_parse_makes_is_refused(segments, size, message) -> None:
    with pytest.raises(InvalidCheckpoint, match=f"^m.safetensors: .*{re.escape(message)}"):
        check_publishable([FileLayout("m.safetensors", size, tuple(segments))])


def test_version_rules_on_layouts() -> None:
    weights = FileLayout("m.safetensors", 24, (_HEADER, _seg("tensor", "a", "F32", (2,), 16, 8)))
    check_publishable([weights, FileLayout("config.json", 2, (Segment("blob", "", U8, (2,), 0, 2),))])
    pickle = FileLayout("extra/Optim.PTH", 2, (Segment("blob", "", U8, (2,), 0, 2),))
    with pytest.raises(InvalidCheckpoint, match=r"^version 3: pickle files are not published \(extra/Optim\.PTH\)"):
        check_publishable([weights, pickle], source="version 3")
    with pytest.raises(InvalidCheckpoint, match="hold no tensor"):
        check_publishable([FileLayout("m.safetensors", 16, (_HEADER,))])
    with pytest.raises(InvalidCheckpoint, match="no files to publish"):
        check_publishable([])


# --- the parser: random valid layouts, random single mutations --------------------------------------------------

_NAMES = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=6)


@st.composite
def layouts(draw: st.DrawFn) -> tuple[bytes, list[tuple[str, str, tuple[int, ...], int, int]], dict | None]:
    """A valid file (header order and data order drawn apart, padding, metadata) and its tensors' absolute spans."""
    names = draw(st.lists(_NAMES.filter(lambda n: n != "__metadata__"), max_size=6, unique=True))
    tensors = []
    for name in names:
        dtype = BY_NAME[draw(st.sampled_from(sorted(BY_NAME)))]
        shape = draw(st.lists(st.integers(0, 5), max_size=3))
        count = 1
        for d in shape:
            count *= d
        if count * dtype.bits % 8:
            shape.append(8)  # sub-byte dtypes need whole bytes
        tensors.append((name, dtype.name, tuple(shape), dtype.nbytes(shape)))
    data_order = draw(st.permutations(tensors))
    doc: dict = {}
    offset = 0
    entries = {}
    for name, dt, shape, nbytes in data_order:
        entries[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    metadata = draw(st.none() | st.dictionaries(_NAMES, _NAMES, max_size=3))
    if metadata is not None:
        doc["__metadata__"] = metadata
    for name in draw(st.permutations(names)):
        doc[name] = entries[name]
    body = json.dumps(doc, ensure_ascii=draw(st.booleans())).encode() + b" " * draw(st.integers(0, 9))
    total = 8 + len(body)
    data = bytes(draw(st.binary(min_size=offset, max_size=offset)))
    spans = [
        (n, dt, s, total + entries[n]["data_offsets"][0], total + entries[n]["data_offsets"][1])
        for n, dt, s, _ in data_order
    ]
    return struct.pack("<Q", len(body)) + body + data, spans, metadata


def _tiles(layout: st_.SafetensorsLayout, size: int) -> bool:
    """The oracle, independent of the parser's own checks: spans tile [header_len, size) at their dtype's length."""
    cursor = layout.header_len
    for t in layout.tensors:
        if t.start != cursor or t.end - t.start != t.dtype.nbytes(t.shape):
            return False
        cursor = t.end
    return cursor == size


def _reference_accepts(blob: bytes) -> bool | None:
    """Whether the safetensors library (the Rust reference) accepts the file; None if it is not installed."""
    try:
        import safetensors
    except ImportError:
        return None
    try:
        safetensors.deserialize(blob)
    except safetensors.SafetensorError:
        return False
    return True


@given(layouts())
@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
def test_random_valid_layouts_parse(case) -> None:
    blob, spans, metadata = case
    layout = st_.parse_file(blob)
    assert layout == st_.parse(blob, len(blob))
    got = [(t.name, t.dtype.name, t.shape, t.start, t.end) for t in layout.tensors]
    assert sorted(got) == sorted(spans)  # zero-byte tensors may share an offset: their order is the header's
    assert [(s[3], s[4]) for s in got] == sorted((s[3], s[4]) for s in spans)
    assert layout.metadata == metadata and _tiles(layout, len(blob))
    assert _reference_accepts(blob) in (True, None)


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A valid file with one mutation: its header length, one data_offsets bound, or its size."""
    blob, spans, _ = draw(layouts())
    n = struct.unpack("<Q", blob[:8])[0]
    near = st.integers(-16, 16)
    what = draw(st.sampled_from(["length", "offset", "size"] if spans else ["length", "size"]))
    if what == "length":
        value = draw(st.integers(0, 2**64 - 1) | near.map(lambda d: max(0, n + d)))
        return struct.pack("<Q", value) + blob[8:]
    if what == "size":
        cut = draw(st.integers(1, 16))
        return blob[:-cut] if draw(st.booleans()) else blob + bytes(cut)
    doc = json.loads(blob[8 : 8 + n])
    name = draw(st.sampled_from([s[0] for s in spans]))
    bound = draw(st.integers(0, 1))
    old = doc[name]["data_offsets"][bound]
    doc[name]["data_offsets"][bound] = draw(st.integers(0, 2**64) | near.map(lambda d: max(0, old + d)))
    body = json.dumps(doc).encode()
    return struct.pack("<Q", len(body)) + body + blob[8 + n :]


@given(mutated())
@settings(max_examples=500, suppress_health_check=[HealthCheck.too_slow])
def test_a_mutated_header_is_refused_or_still_complete(blob: bytes) -> None:
    """Refused with a SafetensorsError, or a layout that still tiles the file; the reference and the
    manifest check (check_publishable) agree either way."""
    as_published = [layout_of("m.safetensors", np.frombuffer(blob, np.uint8))]
    try:
        layout = st_.parse_file(blob)
    except SafetensorsError as exc:
        event("refused")
        assert "\n" not in str(exc)
        assert _reference_accepts(blob) in (False, None)
        with pytest.raises(InvalidCheckpoint):
            check_publishable(as_published)  # the service refuses what the publisher refuses
        return
    event("still a complete layout")
    assert _tiles(layout, len(blob))
    assert _reference_accepts(blob) in (True, None)
    if layout.tensors:
        check_publishable(as_published)


def test_a_shard_parses_with_the_reference() -> None:
    assert _reference_accepts(shard(3)) in (True, None)
    assert _tiles(st_.parse_file(shard(3)), len(shard(3)))
