"""The strict validators: safetensors headers and manifests reject every malformed input by name."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from _ckpt import safetensors_file
from hypothesis import given, settings
from hypothesis import strategies as st

from weightsync.codec import Checkpoint, Encoder, Manifest
from weightsync.codec import safetensors as st_
from weightsync.codec.checkpoint import check_path
from weightsync.errors import FormatError, InvalidName, SafetensorsError, WeightsyncError


def header(doc: dict) -> bytes:
    body = json.dumps(doc).encode()
    return struct.pack("<Q", len(body)) + body


@pytest.mark.parametrize(
    "doc, data_len",
    [
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, 4),  # too short for shape
        ({"a": {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}}, 4),  # unknown dtype
        ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, 4),  # negative dim
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, 4),  # reversed
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, 8),  # trailing bytes
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, 8),  # hole at start
        (
            {
                "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                "b": {"dtype": "F32", "shape": [1], "data_offsets": [2, 6]},
            },
            6,
        ),  # overlap
        ({"__metadata__": {"k": 1}}, 0),  # non-string metadata
        ({"a": {"dtype": "F4", "shape": [3], "data_offsets": [0, 1]}}, 1),  # partial byte
        ({"a": [1, 2]}, 0),  # entry not an object
    ],
)
def test_safetensors_rejects(doc, data_len):
    h = header(doc)
    with pytest.raises(SafetensorsError):
        st_.parse(h, len(h) + data_len)


def test_safetensors_header_length_bounds():
    with pytest.raises(SafetensorsError):
        st_.header_length(struct.pack("<Q", 10**12), 100)
    with pytest.raises(SafetensorsError):
        st_.parse(struct.pack("<Q", 2) + b"[]", 10)


@pytest.mark.parametrize(
    "raw, message",
    [
        (
            b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
            r"repeats the key 'a'",
        ),
        (b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"dtype":"F32"}}', r"repeats the key 'dtype'"),
        (b'{"__metadata__":{"x":NaN}}', r"NaN is not a JSON value"),
        (b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}} x', r"not valid JSON"),
        (
            b'{"a":{"dtype":"U8","shape":[' + b",".join([b"4294967296"] * 4000) + b'],"data_offsets":[0,4]}}',
            r"overflows 64 bits",
        ),  # refused before the product of the shape grows
        (b'{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4.0]}}', r"data_offsets \[0, 4.0\] are not"),
        (b'{"a":{"dtype":"U8","shape":[true],"data_offsets":[0,1]}}', r"shape \[True\] is not"),
    ],
)
def test_safetensors_strict_json_and_messages(raw, message):
    blob = struct.pack("<Q", len(raw)) + raw + bytes(4)
    with pytest.raises(SafetensorsError, match=message):
        st_.parse_file(blob)


@pytest.mark.parametrize(
    "blob, message",
    [
        (b"", r"^the file is empty \(0 bytes\)$"),
        (b"\x02\x00\x00", r"^the file has 3 bytes, fewer than the 8-byte header length$"),
        (struct.pack("<Q", 1) + b"{", r"^header length 1 is too short for a JSON object$"),
        (struct.pack("<Q", 20) + b"{}", r"^the header ends at byte 28 but the file has 10 bytes$"),
    ],
)
def test_safetensors_header_bounds_messages(blob, message):
    with pytest.raises(SafetensorsError, match=message):
        st_.parse_file(blob)


@pytest.mark.parametrize(
    "shape, offsets, accepted",
    [
        ([0, 2**64 - 1], [0, 0], True),  # 0 elements: no overflow on the way
        ([2**40, 2**40, 0], [0, 0], False),  # the element count overflows before the 0 (the reference refuses it)
        ([2**64], [0, 2**64], False),  # not a 64-bit integer
        ([2**62], [0, 2**64 - 1], False),  # the size in bits overflows
        ([3], [0, 2**64], False),
    ],
)
def test_safetensors_64_bit_rules_agree_with_the_reference(shape, offsets, accepted):
    raw = json.dumps({"a": {"dtype": "F32", "shape": shape, "data_offsets": offsets}}).encode()
    blob = struct.pack("<Q", len(raw)) + raw
    if accepted:
        assert st_.parse_file(blob).tensors[0].shape == tuple(shape)
    else:
        with pytest.raises(SafetensorsError):
            st_.parse_file(blob)
    safetensors = pytest.importorskip("safetensors")
    try:
        safetensors.deserialize(blob)
    except safetensors.SafetensorError:
        assert not accepted
    else:
        assert accepted


def test_safetensors_round_trip_with_library():
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    blob = safetensors_numpy.save({"a": a, "b": np.ones(3, np.int64)}, metadata={"m": "x"})
    layout = st_.parse(blob, len(blob))
    assert sorted(t.name for t in layout.tensors) == ["a", "b"] and layout.metadata == {"m": "x"}
    ours = st_.serialize([("a", "F32", (3, 4), a.tobytes())], {"m": "x"})
    assert safetensors_numpy.load(ours)["a"].tolist() == a.tolist()


@pytest.mark.parametrize(
    "path", ["", "/etc/passwd", "../x", "a/../b", "a//b", "a\\b", ".weightsync/state", "a/./b", "x\x00y", "a" * 2000]
)
def test_unsafe_paths_rejected(path):
    with pytest.raises(InvalidName):
        check_path(path)


def _manifest(version: int = 1):
    """A located delta manifest: "w" and "f" changed, "same" (and the header) equal to their base."""
    rng = np.random.default_rng(0)
    base = {
        "w": ("BF16", (64,), rng.integers(0, 256, 128, dtype=np.uint8)),
        "same": ("BF16", (8,), rng.integers(0, 256, 16, dtype=np.uint8)),
        "f": ("F32", (4,), rng.integers(0, 256, 16, dtype=np.uint8)),
    }
    new = {k: (d, s, v.copy()) for k, (d, s, v) in base.items()}
    new["w"][2][5] ^= 1
    new["f"][2][3] ^= 7
    ck = Checkpoint.from_bytes({"m.safetensors": safetensors_file(base)})
    ck2 = Checkpoint.from_bytes({"m.safetensors": safetensors_file(new)})
    return Encoder(format_version=version).encode(ck2, ck).with_locations(lambda i, fr: ("a" * 64, 100 * i))


@pytest.mark.parametrize("version", [1, 2])
def test_manifest_round_trip(version):
    m = _manifest(version)
    again = Manifest.decode(m.encode())
    assert again.to_json() == m.to_json() and again.version == version
    assert again.files == m.files and again.frames == m.frames


V1_MUTATIONS = [
    lambda d: d.update(version=3),
    lambda d: d.update(version=True),
    lambda d: d.update(format="other"),
    lambda d: d["files"][0].update(path="../escape"),
    lambda d: d["files"][0].update(size=d["files"][0]["size"] + 1),
    lambda d: d["files"][0]["segments"][1].update(offset=1),
    lambda d: d["files"][0]["segments"][1].update(dtype="F32"),
    lambda d: d["files"][0]["segments"][1].update(xxh3="XYZ"),
    lambda d: d["frames"][0].update(raw_len=d["frames"][0]["raw_len"] + 2),
    lambda d: d["frames"][0]["pieces"][0].__setitem__(0, 5),
    lambda d: d["frames"][0]["pieces"].append(list(d["frames"][0]["pieces"][0])),
    lambda d: d["frames"].pop(),
    lambda d: d["frames"][0].update(object="../../etc"),
    lambda d: d["frames"][0].update(raw_len=-1),
    lambda d: d.update(files="nope"),
]


def _seg(d, col):
    return d["files"][0]["segments"][col]


def _frames(d, col):
    return d["frames"][col]


V2_MUTATIONS = [
    lambda d: d.update(version=3),
    lambda d: d["files"][0].update(path="../escape"),
    lambda d: d["files"][0].update(size=d["files"][0]["size"] + 1),
    lambda d: _seg(d, "dtype").__setitem__(1, "F32"),  # the lengths no longer tile the file
    lambda d: _seg(d, "shape").__setitem__(1, [-1]),
    lambda d: _seg(d, "shape").__setitem__(1, [True]),  # a bool is not a dimension
    lambda d: _seg(d, "shape").__setitem__(1, [1 << 49]),
    lambda d: _seg(d, "shape").__setitem__(1, 4),
    lambda d: _seg(d, "dtype").__setitem__(1, ["BF16"]),  # not a name (unhashable)
    lambda d: _seg(d, "dtype").__setitem__(1, "F99"),
    lambda d: _seg(d, "digest").__setitem__(1, "XYZ"),
    lambda d: _seg(d, "digest").__setitem__(1, "00" * 16),  # two lanes' worth for a BF16 tensor
    lambda d: _seg(d, "digest").__setitem__(1, None),  # "equal to its base" but in a frame
    lambda d: _seg(d, "base").__setitem__(3, "00" * 8),  # one lane's worth for an F32 tensor (two lanes)
    lambda d: _seg(d, "base").__setitem__(2, None),  # neither digest nor base
    lambda d: _seg(d, "kind").__setitem__(1, "weights"),
    lambda d: _seg(d, "name").pop(),  # columns of unequal lengths
    lambda d: d["files"][0]["segments"].update(extra=[0, 0, 0, 0]),
    lambda d: d["files"][0]["segments"].update(base_offset=[None, "x", None, None]),
    lambda d: d["files"][0]["segments"].update(base_offset=[None, None]),
    lambda d: _frames(d, "pieces")[0].append([0, 2]),  # a piece of a segment equal to its base
    lambda d: _frames(d, "pieces")[0].append(list(_frames(d, "pieces")[0][0])),  # overlap
    lambda d: _frames(d, "pieces").__setitem__(0, []),
    lambda d: _frames(d, "pieces")[0].__setitem__(0, [0, 1, 0, 3]),  # half an element
    lambda d: _frames(d, "pieces")[0].__setitem__(0, [0, 1, 2]),
    lambda d: _frames(d, "object").__setitem__(0, 7),
    lambda d: _frames(d, "offset").append(0),
    lambda d: [_frames(d, c).pop() for c in ("object", "offset", "length", "pieces")],  # a segment left uncovered
    lambda d: d["objects"].append("b" * 64),  # an object no frame is in
    lambda d: d["objects"].__setitem__(0, "../../etc"),
    lambda d: d.update(files="nope"),
    lambda d: d.update(frames=[]),
]


@pytest.mark.parametrize(
    "version, mutation", [(1, m) for m in V1_MUTATIONS] + [(2, m) for m in V2_MUTATIONS], ids=lambda x: ""
)
def test_manifest_rejects(version, mutation):
    doc = _manifest(version).to_dict()
    Manifest.parse(json.dumps(doc).encode())  # the unmutated document is valid
    mutation(doc)
    with pytest.raises(WeightsyncError):
        Manifest.parse(json.dumps(doc).encode())


def test_v2_manifest_layout():
    """FORMAT §5.3: columns, lanes-only digests, no pieces or digest for segments equal to their base."""
    m = _manifest(2)
    doc = m.to_dict()
    segs = doc["files"][0]["segments"]
    assert segs["name"] == ["", "w", "same", "f"]
    assert segs["digest"][2] is None and segs["digest"][0] is None  # "same" and the header equal their base
    assert [len(x) for x in segs["base"]] == [16, 16, 16, 32]  # 8 hex bytes per lane: 1 lane, 1, 1, 2
    assert {p[1] for pieces in doc["frames"]["pieces"] for p in pieces} == {1, 3}
    assert doc["objects"] == ["a" * 64] and "raw_bytes" not in doc
    same = m.files[0].segments[2]
    assert same.unchanged and same.digest == same.base_digest and len(same.digest) == 32
    assert m.digest_kind == "sum64x16" and _manifest(1).digest_kind == "xxh3-128"


@given(st.binary(max_size=400))
@settings(max_examples=300)
def test_manifest_decode_fuzz_raises_only_named_errors(blob):
    with pytest.raises(FormatError):
        Manifest.decode(blob)


@given(st.data())
@settings(max_examples=200)
def test_manifest_bitflips_raise_only_named_errors(data):
    original = _manifest(data.draw(st.sampled_from([1, 2])))
    enc = bytearray(original.encode())
    pos = data.draw(st.integers(0, len(enc) - 1))
    enc[pos] ^= 1 << data.draw(st.integers(0, 7))
    try:
        got = Manifest.decode(bytes(enc))
    except FormatError:
        return
    # Some zstd header bits (e.g. the window size) do not change the decoded bytes;
    # the JSON checksum guarantees nothing else got through.
    assert got.to_json() == original.to_json()
