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


def _manifest():
    rng = np.random.default_rng(0)
    data = safetensors_file({"w": ("BF16", (64,), rng.integers(0, 256, 128, dtype=np.uint8))})
    ck = Checkpoint.from_bytes({"m.safetensors": data})
    return Encoder().encode(ck, ck).with_locations(lambda i, fr: ("a" * 64, 0))


def test_manifest_round_trip():
    m = _manifest()
    again = Manifest.decode(m.encode())
    assert again.to_json() == m.to_json()


@pytest.mark.parametrize(
    "mutation",
    [
        lambda d: d.update(version=2),
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
    ],
)
def test_manifest_rejects(mutation):
    doc = _manifest().to_dict()
    mutation(doc)
    with pytest.raises(WeightsyncError):
        Manifest.parse(json.dumps(doc).encode())


@given(st.binary(max_size=400))
@settings(max_examples=300)
def test_manifest_decode_fuzz_raises_only_named_errors(blob):
    with pytest.raises(FormatError):
        Manifest.decode(blob)


@given(st.data())
@settings(max_examples=200)
def test_manifest_bitflips_raise_only_named_errors(data):
    original = _manifest()
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
