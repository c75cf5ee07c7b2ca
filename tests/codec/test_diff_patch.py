"""Offline diff/patch on files and directories: byte-identical output or a named error and no OUT."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _ckpt import ALL_DTYPES, mutate, safetensors_file
from hypothesis import given, settings
from hypothesis import strategies as st

from weightsync.codec import Decoder, Encoder, diff, patch, read_container
from weightsync.codec.dtypes import by_name
from weightsync.errors import BaseMismatch, FormatError, WeightsyncError

SMALL = Encoder(chunk_bytes=4096, threads=2)  # small chunks: exercises splitting and grouping
SMALL_BY_VERSION = {v: Encoder(chunk_bytes=4096, threads=2, format_version=v) for v in (1, 2)}


def make_tensors(rng, dtypes, big=False):
    out = {}
    for i, name in enumerate(dtypes):
        dt = by_name(name)
        shape = (64, 96) if big and i % 3 == 0 else (int(rng.integers(1, 9)), 8)
        out[f"layer.{i}.{name.lower()}"] = (name, shape, rng.integers(0, 256, dt.nbytes(shape), dtype=np.uint8))
    return out


def step(rng, tensors, changed_fraction):
    out = {}
    for name, (dt, shape, data) in tensors.items():
        width = by_name(dt).width
        n = len(data) // width
        out[name] = (dt, shape, mutate(rng, data, width, int(n * changed_fraction)))
    return out


def write(path: Path, content: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return path


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("fraction", [0.0, 0.01, 0.5, 1.0])
def test_file_round_trip_every_dtype(tmp_path, fraction, version):
    rng = np.random.default_rng(7)
    base = make_tensors(rng, ALL_DTYPES, big=True)
    new = step(rng, base, fraction)
    a = write(tmp_path / "a.safetensors", safetensors_file(base, {"step": "1"}))
    b = write(tmp_path / "b.safetensors", safetensors_file(new, {"step": "2"}))
    stats = diff(a, b, tmp_path / "d.wsd", encoder=SMALL_BY_VERSION[version])
    # v2: tensors equal to their base get no frame; only the header (its metadata changed) is left
    assert stats.frames > 1 if fraction or version == 1 else stats.frames == 1
    patch(a, tmp_path / "d.wsd", tmp_path / "out.safetensors")
    assert (tmp_path / "out.safetensors").read_bytes() == b.read_bytes()


def test_directory_with_added_removed_reshaped_and_retyped_tensors(tmp_path):
    rng = np.random.default_rng(11)
    base = make_tensors(rng, ["BF16", "F32", "F8_E4M3", "U8"], big=True)
    new = step(rng, base, 0.02)
    name_bf16 = "layer.0.bf16"
    new.pop("layer.3.u8")  # removed
    new["added.weight"] = ("F16", (5, 3), rng.integers(0, 256, 30, dtype=np.uint8))  # added
    dt, shape, data = base["layer.1.f32"]
    new["layer.1.f32"] = ("F32", (shape[0] * shape[1],), data)  # reshaped
    new["layer.2.f8_e4m3"] = ("U8", base["layer.2.f8_e4m3"][1], base["layer.2.f8_e4m3"][2])  # retyped
    old_dir, new_dir = tmp_path / "v1", tmp_path / "v2"
    write(old_dir / "model-00001.safetensors", safetensors_file(base))
    write(old_dir / "config.json", b'{"hidden": 384}')
    write(old_dir / "gone.txt", b"removed in v2")
    write(new_dir / "model-00001.safetensors", safetensors_file(new, {"format": "pt"}))
    write(new_dir / "model-00002.safetensors", safetensors_file({name_bf16: new[name_bf16]}))
    write(new_dir / "config.json", b'{"hidden": 385}')
    write(new_dir / "sub" / "tokenizer.json", b'{"vocab": []}')
    write(new_dir / "empty.bin", b"")
    diff(old_dir, new_dir, tmp_path / "d.wsd", encoder=SMALL)
    out = tmp_path / "out"
    patch(old_dir, tmp_path / "d.wsd", out)
    got = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    want = sorted(p.relative_to(new_dir).as_posix() for p in new_dir.rglob("*") if p.is_file())
    assert got == want
    for rel in want:
        assert (out / rel).read_bytes() == (new_dir / rel).read_bytes(), rel


def test_unchanged_version_costs_almost_nothing(tmp_path):
    rng = np.random.default_rng(5)
    base = make_tensors(rng, ["BF16"] * 20, big=True)
    a = write(tmp_path / "a.safetensors", safetensors_file(base))
    stats = diff(a, a, tmp_path / "d.wsd")
    assert stats.delta_bytes < stats.raw_bytes / 50


@pytest.mark.parametrize("version", [1, 2])
def test_wrong_base_fails_and_writes_nothing(tmp_path, version):
    rng = np.random.default_rng(1)
    base = make_tensors(rng, ["BF16", "F32"], big=True)
    new = step(rng, base, 0.05)
    a = write(tmp_path / "a.safetensors", safetensors_file(base))
    b = write(tmp_path / "b.safetensors", safetensors_file(new))
    diff(a, b, tmp_path / "d.wsd", encoder=Encoder(format_version=version))
    with pytest.raises(BaseMismatch, match="layer"):
        patch(b, tmp_path / "d.wsd", tmp_path / "out.safetensors")
    assert os.listdir(tmp_path) == sorted(os.listdir(tmp_path)) and not (tmp_path / "out.safetensors").exists()
    assert sorted(os.listdir(tmp_path)) == ["a.safetensors", "b.safetensors", "d.wsd"]


@given(st.data())
@settings(max_examples=60, deadline=None)
def test_damaged_delta_raises_named_error_and_writes_nothing(tmp_path_factory, data):
    tmp_path = tmp_path_factory.mktemp("dmg")
    rng = np.random.default_rng(3)
    base = make_tensors(rng, ["BF16", "F32", "U8"], big=True)
    new = step(rng, base, 0.03)
    a = write(tmp_path / "a.safetensors", safetensors_file(base))
    b = write(tmp_path / "b.safetensors", safetensors_file(new))
    diff(a, b, tmp_path / "d.wsd", encoder=SMALL_BY_VERSION[data.draw(st.sampled_from([1, 2]))])
    blob = bytearray((tmp_path / "d.wsd").read_bytes())
    action = data.draw(st.sampled_from(["flip", "truncate", "junk"]))
    if action == "flip":
        pos = data.draw(st.integers(0, len(blob) - 1))
        blob[pos] ^= 1 << data.draw(st.integers(0, 7))
    elif action == "truncate":
        blob = blob[: data.draw(st.integers(0, len(blob) - 1))]
    else:
        blob = bytearray(data.draw(st.binary(max_size=200)))
    (tmp_path / "d.wsd").write_bytes(bytes(blob))
    out = tmp_path / "out.safetensors"
    try:
        patch(a, tmp_path / "d.wsd", out)
    except WeightsyncError:
        assert not out.exists()
        assert sorted(os.listdir(tmp_path)) == ["a.safetensors", "b.safetensors", "d.wsd"]
        return
    assert out.read_bytes() == b.read_bytes()  # a flip that changes nothing decodable, e.g. JSON key order


def test_container_rejects_foreign_files(tmp_path):
    with pytest.raises(FormatError):
        read_container(b"PK\x03\x04" + bytes(100))
    with pytest.raises(FormatError):
        read_container(b"")


def test_invalid_safetensors_is_carried_as_a_blob(tmp_path):
    a = write(tmp_path / "a.safetensors", b"\xff" * 100)
    b = write(tmp_path / "b.safetensors", b"\xff" * 99 + b"\x00")
    diff(a, b, tmp_path / "d.wsd")
    patch(a, tmp_path / "d.wsd", tmp_path / "c.safetensors")
    assert (tmp_path / "c.safetensors").read_bytes() == b.read_bytes()


def test_patch_refuses_non_empty_output_directory(tmp_path):
    (tmp_path / "v1").mkdir()
    write(tmp_path / "v1" / "x.bin", b"abc")
    write(tmp_path / "v2" / "x.bin", b"abd")
    diff(tmp_path / "v1", tmp_path / "v2", tmp_path / "d.wsd")
    write(tmp_path / "out" / "keep.txt", b"mine")
    with pytest.raises(FileExistsError):
        patch(tmp_path / "v1", tmp_path / "d.wsd", tmp_path / "out")
    assert (tmp_path / "out" / "keep.txt").read_bytes() == b"mine"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_decoder_threads_agree(tmp_path):
    rng = np.random.default_rng(8)
    base = make_tensors(rng, ["BF16"] * 6, big=True)
    new = step(rng, base, 0.01)
    a = write(tmp_path / "a.safetensors", safetensors_file(base))
    b = write(tmp_path / "b.safetensors", safetensors_file(new))
    diff(a, b, tmp_path / "d.wsd", encoder=Encoder(threads=1, chunk_bytes=2048))
    patch(a, tmp_path / "d.wsd", tmp_path / "c1", decoder=Decoder(threads=1))
    patch(a, tmp_path / "d.wsd", tmp_path / "c4", decoder=Decoder(threads=4))
    assert (tmp_path / "c1").read_bytes() == (tmp_path / "c4").read_bytes() == b.read_bytes()


def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "weightsync", *args], cwd=cwd, capture_output=True, text=True)


def test_cli_diff_patch_and_one_line_errors(tmp_path):
    rng = np.random.default_rng(2)
    base = make_tensors(rng, ["BF16", "F32"], big=True)
    new = step(rng, base, 0.02)
    write(tmp_path / "a.safetensors", safetensors_file(base))
    write(tmp_path / "b.safetensors", safetensors_file(new))
    r = _cli("diff", "a.safetensors", "b.safetensors", "-o", "d.wsd", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert '"bytes"' in r.stdout
    r = _cli("patch", "a.safetensors", "d.wsd", "-o", "c.safetensors", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "c.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    for args in (
        ["patch", "b.safetensors", "d.wsd", "-o", "x.safetensors"],
        ["patch", "a.safetensors", "a.safetensors", "-o", "x.safetensors"],
        ["patch", "a.safetensors", "missing.wsd", "-o", "x.safetensors"],
        ["diff", "a.safetensors", "nope.safetensors", "-o", "x.wsd"],
    ):
        r = _cli(*args, cwd=tmp_path)
        assert r.returncode != 0
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("weightsync: error:"), r.stderr
        assert "Traceback" not in r.stderr
        assert not (tmp_path / "x.safetensors").exists() and not (tmp_path / "x.wsd").exists()


@pytest.mark.parametrize("version", [1, 2])
def test_decode_in_place_into_the_base_buffer(version):
    from weightsync.codec import Checkpoint

    rng = np.random.default_rng(12)
    base = make_tensors(rng, ["BF16", "F32", "U8"], big=True)
    new = step(rng, base, 0.02)
    a = bytearray(safetensors_file(base))
    b = safetensors_file(new)
    base_ck = Checkpoint.from_bytes({"m.safetensors": a})
    encoded = SMALL_BY_VERSION[version].encode(Checkpoint.from_bytes({"m.safetensors": b}), base_ck)
    frames = [fr.data for fr in encoded.frames]
    offsets = np.cumsum([0] + [len(x) for x in frames])
    manifest = encoded.with_locations(lambda i, fr: (None, int(offsets[i])))
    area = b"".join(frames)
    buf = base_ck.files[0].data
    Decoder(threads=2).decode(manifest, lambda r: area[r.offset : r.offset + r.length], [buf], base_ck)
    assert bytes(a) == b
