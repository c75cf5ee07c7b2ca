"""A v2 manifest whose file structure was read before reuses it (manifest_v2's kept structures):
the same answers as the reference reader, for valid documents and for every defect it names."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_format_v2 import _located, versions

from weightsync.codec import Encoder, Manifest, manifest_v2
from weightsync.errors import WeightsyncError


def _doc(pair) -> dict:
    base, new = pair
    manifest, _ = _located(Encoder(chunk_bytes=4096, format_version=2), new, base)
    return json.loads(manifest.to_json())


def _read(doc: dict) -> Manifest | tuple[type, str]:
    """The manifest `doc` parses to, or its error's type and message."""
    try:
        return Manifest.parse(json.dumps(doc).encode())
    except WeightsyncError as exc:
        return type(exc), str(exc)


def _fresh(doc: dict) -> Manifest | tuple[type, str]:
    manifest_v2._structures.clear()
    return _read(doc)


def _after(first: dict, doc: dict) -> Manifest | tuple[type, str]:
    manifest_v2._structures.clear()
    _read(first)
    return _read(doc)


def _mutate(doc: dict, kind: str, row: int, value) -> dict:
    """A copy of `doc` with one cell (or column) of its first file's segments changed."""
    out = copy.deepcopy(doc)
    cols = out["files"][0]["segments"]
    row %= len(cols["kind"])
    if kind in ("digest", "base", "name", "dtype", "kind"):
        cols[kind][row] = value
    elif kind == "shape":
        shape = cols["shape"][row]
        if shape:
            shape[0] = value(shape[0])
        else:
            shape.append(value(1))
    elif kind == "base_offset":
        cols.setdefault("base_offset", [None] * len(cols["kind"]))[row] = value
    elif kind == "drop_base_offset":
        cols.pop("base_offset", None)
    elif kind == "digest_case" and isinstance(cols["digest"][row], str):
        cols["digest"][row] = cols["digest"][row].upper()
    elif kind == "base_length" and isinstance(cols["base"][row], str):
        cols["base"][row] = cols["base"][row][:-1]
    return out


CELLS = st.one_of(
    st.tuples(st.just("digest"), st.sampled_from([None, 5, "", "0" * 16, "0" * 32, "g" * 16, "0" * 17])),
    st.tuples(st.just("base"), st.sampled_from([None, 7, "0" * 16, "0" * 32, "0" * 15 + "Z"])),
    st.tuples(st.just("name"), st.sampled_from(["other", "", 3])),
    st.tuples(st.just("dtype"), st.sampled_from(["F32", "U8", "BF16", "nope"])),
    st.tuples(st.just("kind"), st.sampled_from(["tensor", "blob", "header", "x"])),
    st.tuples(
        st.just("shape"),
        st.sampled_from([float, lambda d: d == 1 or d, lambda d: d + 1, lambda d: -1, str]),
    ),
    st.tuples(st.just("base_offset"), st.sampled_from([None, 0, 8, -1, 1.0, True, 1 << 63])),
    st.tuples(st.sampled_from(["drop_base_offset", "digest_case", "base_length"]), st.none()),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(versions(), st.integers(0, 1000), CELLS)
def test_a_known_structure_gives_the_reference_readers_answer(pair, row, cell):
    doc = _doc(pair)
    changed = _mutate(doc, cell[0], row, cell[1])
    want = _fresh(changed)
    assert _after(doc, changed) == want
    assert _after(changed, doc) == _fresh(doc)  # and a defective document is never kept as a structure


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(versions())
def test_a_repeated_structure_is_read_without_its_segments_checks(pair):
    doc = _doc(pair)
    manifest_v2._structures.clear()
    first = _read(doc)
    assert isinstance(first, Manifest)
    assert manifest_v2._structures  # kept
    real = manifest_v2.check_segment

    def refuse(*args, **kwargs):
        raise AssertionError("the segments were checked again")

    manifest_v2.check_segment = refuse
    try:
        again = _read(doc)
    finally:
        manifest_v2.check_segment = real
    assert again == first


def _blob_doc(path: str, n: int, lanes: str) -> dict:
    """A keyframe manifest document of one empty file of `n` empty blob segments, each digest `lanes`."""
    segments = {"kind": ["blob"] * n, "name": [""] * n, "dtype": ["U8"] * n, "shape": [[0]] * n}
    segments.update(digest=[lanes] * n, base=[None] * n)
    return {
        "format": "weightsync.manifest",
        "version": 2,
        "kind": "keyframe",
        "model": "m",
        "number": None,
        "parent": None,
        "step": None,
        "metadata": {},
        "single_file": False,
        "objects": [],
        "files": [{"path": path, "size": 0, "segments": segments}],
        "frames": {"object": [], "offset": [], "length": [], "pieces": []},
    }


def test_structures_are_kept_for_a_bounded_number_of_files():
    manifest_v2._structures.clear()
    rng = np.random.default_rng(0)
    for i in range(manifest_v2._MAX_STRUCTURES + 5):
        lanes = rng.integers(0, 2**63, 1).astype("<u8").tobytes().hex()
        got = _read(_blob_doc(f"f{i}.bin", 1, lanes))
        assert isinstance(got, Manifest), got
    assert len(manifest_v2._structures) == manifest_v2._MAX_STRUCTURES
    assert ("f0.bin", 0) not in manifest_v2._structures


@pytest.fixture(autouse=True)
def _forget_structures():
    yield
    manifest_v2._structures.clear()


def test_structures_are_kept_for_a_bounded_number_of_rows(monkeypatch):
    """A server reads manifests from any publisher: however large their structures, the rows kept are bounded."""
    monkeypatch.setattr(manifest_v2, "_MAX_STRUCTURE_ROWS", 5)
    lanes = "0" * 16
    manifest_v2._structures.clear()
    assert isinstance(_read(_blob_doc("big.bin", 6, lanes)), Manifest)
    assert not manifest_v2._structures  # over the bound by itself: not kept
    for name in ("a.bin", "b.bin", "c.bin"):
        assert isinstance(_read(_blob_doc(name, 2, lanes)), Manifest)
    assert [key[0] for key in manifest_v2._structures] == ["b.bin", "c.bin"]  # 4 rows kept, the oldest out
