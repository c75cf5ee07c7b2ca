"""`layout_of` keeps safetensors layouts by (path, size, header bytes): a repeated header is not parsed
again, and anything that differs in them is."""

from __future__ import annotations

import numpy as np
import pytest
from _ckpt import safetensors_file
from hypothesis import given, settings
from hypothesis import strategies as st

from weightsync.codec import checkpoint
from weightsync.codec import safetensors as st_
from weightsync.codec.checkpoint import layout_of


@pytest.fixture(autouse=True)
def _fresh_cache():
    checkpoint._layouts.clear()
    checkpoint._layouts_bytes = 0
    yield
    checkpoint._layouts.clear()
    checkpoint._layouts_bytes = 0


def _file(seed: int, n: int = 3, meta: str = "1") -> np.ndarray:
    rng = np.random.default_rng(seed)
    tensors = {f"t{i}": ("BF16", (4, 8), rng.integers(0, 256, 64, dtype=np.uint8)) for i in range(n)}
    return np.frombuffer(safetensors_file(tensors, {"v": meta}), np.uint8)


def _parsed(path: str, data: np.ndarray) -> checkpoint.FileLayout:
    """What `layout_of` answers without its cache (the parse itself)."""
    checkpoint._layouts.clear()
    checkpoint._layouts_bytes = 0
    return layout_of(path, data)


def test_a_repeated_header_is_not_parsed_again(monkeypatch):
    first = layout_of("m.safetensors", _file(0))
    calls = []
    real = st_.parse
    monkeypatch.setattr(st_, "parse", lambda header, size: calls.append(1) or real(header, size))
    again = layout_of("m.safetensors", _file(1))  # other tensor bytes, the same header
    assert again is first
    assert calls == []
    other = layout_of("m.safetensors", _file(0, meta="2"))  # another header
    assert calls == [1]
    assert other is not first and other == _parsed("m.safetensors", _file(0, meta="2"))


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(["m.safetensors", "other.safetensors", "x.bin"]),
    st.integers(0, 3),
    st.sampled_from(["none", "truncate", "extend", "header_byte", "length_prefix"]),
)
def test_layouts_kept_or_not_are_the_parses(path, n, edit):
    base = _file(0, n)
    layout_of("m.safetensors", base)  # kept for the unedited file
    data = base.copy()
    if edit == "truncate":
        data = data[:-1]
    elif edit == "extend":
        data = np.concatenate([data, np.zeros(2, np.uint8)])
    elif edit == "header_byte":
        data[20] ^= 0x01  # inside the JSON: another name, or no JSON
    elif edit == "length_prefix":
        data[0] ^= 0x40
    want = _parsed(path, data)
    checkpoint._layouts.clear()
    checkpoint._layouts_bytes = 0
    layout_of("m.safetensors", base)
    assert layout_of(path, data) == want
    assert layout_of(path, data) == want  # and again, from the cache where it was kept


def test_a_file_that_is_no_safetensors_is_a_blob_and_not_kept():
    data = np.frombuffer(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json here!}", np.uint8)
    layout = layout_of("m.safetensors", data)
    assert [s.kind for s in layout.segments] == ["blob"]
    assert not checkpoint._layouts


def test_the_cache_is_bounded_by_header_bytes(monkeypatch):
    files = [_file(0, meta=str(i)) for i in range(6)]
    header = st_.header_length(bytes(files[0][:8]), len(files[0]))
    monkeypatch.setattr(checkpoint, "LAYOUT_CACHE_BYTES", 3 * header)
    for f in files:
        layout_of("m.safetensors", f)
    assert len(checkpoint._layouts) == 3
    assert checkpoint._layouts_bytes == 3 * header
    kept = [key[2] for key in checkpoint._layouts]
    assert kept == [bytes(f[:header]) for f in files[3:]]  # the most recent
