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
