"""Golden bytes written by format version 1 must decode forever. Never regenerate them."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from weightsync.codec import decode_frame, parse_header, patch

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
INDEX = json.loads((GOLDEN / "index.json").read_text())


@pytest.mark.parametrize("entry", INDEX["frames"], ids=lambda e: e["frame"])
def test_golden_frame_decodes(entry):
    blob = (GOLDEN / entry["frame"]).read_bytes()
    assert hashlib.sha256(blob).hexdigest() == entry["sha256"], "golden file changed: never regenerate"
    assert parse_header(blob).method == entry["method"]
    base = None if entry["base"] is None else np.frombuffer((GOLDEN / entry["base"]).read_bytes(), np.uint8)
    assert decode_frame(blob, base).tobytes() == (GOLDEN / entry["expect"]).read_bytes()


def test_golden_methods_cover_every_method():
    assert {e["method"] for e in INDEX["frames"]} == {0, 1, 2}


def test_golden_container_patches(tmp_path):
    c = INDEX["container"]
    assert hashlib.sha256((GOLDEN / c["file"]).read_bytes()).hexdigest() == c["sha256"]
    patch(GOLDEN / c["base"], GOLDEN / c["file"], tmp_path / "out")
    want = sorted(p.relative_to(GOLDEN / c["expect"]) for p in (GOLDEN / c["expect"]).rglob("*") if p.is_file())
    got = sorted(p.relative_to(tmp_path / "out") for p in (tmp_path / "out").rglob("*") if p.is_file())
    assert got == want
    for rel in want:
        assert (tmp_path / "out" / rel).read_bytes() == (GOLDEN / c["expect"] / rel).read_bytes()


# --- FORMAT v2 samples (tests/golden/v2): the same inputs, frames without hashes, v2 manifests ---------

INDEX_V2 = json.loads((GOLDEN / "v2" / "index.json").read_text())


@pytest.mark.parametrize("entry", INDEX_V2["frames"], ids=lambda e: e["frame"])
def test_golden_v2_frame_decodes(entry):
    blob = (GOLDEN / "v2" / entry["frame"]).read_bytes()
    assert hashlib.sha256(blob).hexdigest() == entry["sha256"], "golden file changed: never regenerate"
    head = parse_header(blob)
    assert head.version == 2 and head.method == entry["method"] and not head.checked
    base = None if entry["base"] is None else np.frombuffer((GOLDEN / entry["base"]).read_bytes(), np.uint8)
    assert decode_frame(blob, base).tobytes() == (GOLDEN / entry["expect"]).read_bytes()


def test_golden_v2_frames_cover_every_method_and_the_v1_inputs():
    assert {e["method"] for e in INDEX_V2["frames"]} == {0, 1, 2}
    assert {e["expect"] for e in INDEX_V2["frames"]} == {e["expect"] for e in INDEX["frames"]}


@pytest.mark.parametrize("c", INDEX_V2["containers"], ids=lambda c: c["file"])
def test_golden_v2_container_patches(tmp_path, c):
    from weightsync.codec import read_container

    blob = (GOLDEN / c["file"]).read_bytes()
    assert hashlib.sha256(blob).hexdigest() == c["sha256"], "golden file changed: never regenerate"
    manifest, _ = read_container(blob)
    assert manifest.version == 2 and manifest.digest_kind == "sum64x16"
    patch(GOLDEN / c["base"], GOLDEN / c["file"], tmp_path / "out")
    expect = GOLDEN / c["expect"]
    if expect.is_file():
        assert (tmp_path / "out").read_bytes() == expect.read_bytes()
        return
    want = sorted(p.relative_to(expect) for p in expect.rglob("*") if p.is_file())
    assert sorted(p.relative_to(tmp_path / "out") for p in (tmp_path / "out").rglob("*") if p.is_file()) == want
    for rel in want:
        assert (tmp_path / "out" / rel).read_bytes() == (expect / rel).read_bytes()


def test_golden_v2_layout_sample_moves_bases_and_skips_an_unchanged_tensor():
    from weightsync.codec import read_container

    manifest, _ = read_container((GOLDEN / "v2" / "layout.wsd").read_bytes())
    segs = {e.segment.name: e for e in manifest.files[0].segments}
    assert segs["b"].unchanged and segs["b"].base_offset != segs["b"].segment.offset
    assert not any(p.seg == 3 for fr in manifest.frames for p in fr.pieces)  # "b" is segment 3: no pieces
