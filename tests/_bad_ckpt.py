"""Checkpoints a publisher must refuse (issue 12 "Why"), written to disk, with the one-line error each must get.

Shared by the codec tests (tests/codec/test_validate.py) and the SDK/CLI tests
(tests/client/test_publish_guards.py), so both refuse exactly the same inputs.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
from _ckpt import safetensors_file

SHARD_BYTES = 400_000
"""Each shard of `sharded` is a little over this: a cut to 300,000 bytes lands inside its last tensor."""


def shard(seed: int) -> bytes:
    """A safetensors shard of two BF16 tensors and an F32 one, ~400 kB."""
    rng = np.random.default_rng(seed)
    return safetensors_file(
        {
            f"layers.{seed}.attn.weight": ("BF16", (250, 400), rng.integers(0, 256, 200_000, dtype=np.uint8)),
            f"layers.{seed}.mlp.weight": ("BF16", (250, 396), rng.integers(0, 256, 198_000, dtype=np.uint8)),
            f"layers.{seed}.norm.weight": ("F32", (500,), rng.integers(0, 256, 2_000, dtype=np.uint8)),
        },
        {"format": "pt"},
    )


def sharded(root: Path, *, seed: int = 0) -> Path:
    """A Hugging Face-style sharded checkpoint: two shards, their index and a config."""
    root.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for i in (1, 2):
        name = f"model-0000{i}-of-00002.safetensors"
        (root / name).write_bytes(shard(seed + i))
        weight_map.update({t: name for t in _tensor_names(seed + i)})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (root / "config.json").write_text('{"hidden_size": 400}')
    return root


def _tensor_names(seed: int) -> list[str]:
    return [f"layers.{seed}.attn.weight", f"layers.{seed}.mlp.weight", f"layers.{seed}.norm.weight"]


SHARD2 = "model-00002-of-00002.safetensors"


def raw_safetensors(doc: dict, data_len: int) -> bytes:
    """A file with header `doc` taken as given (offsets unchecked) and `data_len` data bytes."""
    body = json.dumps(doc).encode()
    return struct.pack("<Q", len(body)) + body + bytes(data_len)


def _with_shard2(root: Path, content: Callable[[bytes], bytes]) -> Path:
    """`sharded`, then shard 2 replaced by `content(its bytes)`."""
    sharded(root)
    (root / SHARD2).write_bytes(content((root / SHARD2).read_bytes()))
    return root


def _garbage_json(data: bytes) -> bytes:
    n = struct.unpack("<Q", data[:8])[0]
    mid = 8 + n // 2
    return data[:mid] + b"\x00garbage" + data[mid + 8 :]


def _f32(begin: int, end: int, shape: int = 2) -> dict:
    return {"dtype": "F32", "shape": [shape], "data_offsets": [begin, end]}


def _single(root: Path, name: str, data: bytes) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / name).write_bytes(data)
    return root / name


def _dir(root: Path, files: dict[str, bytes]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (root / name).write_bytes(data)
    return root


PICKLE = b"\x80\x02}q\x00."  # pickle.dumps({}, protocol=2): what torch.save's legacy format starts like

# (id, write it under a directory → the path to publish, regex its one-line error must match)
BAD: list[tuple[str, Callable[[Path], Path], str]] = [
    (
        "shard-cut-to-300000-bytes",
        lambda r: _with_shard2(r, lambda d: d[:300_000]),
        rf"^{SHARD2}: tensor 'layers\.2\.mlp\.weight' ends at byte \d+ but the file has 300000 bytes$",
    ),
    ("zero-byte-shard", lambda r: _with_shard2(r, lambda d: b""), rf"^{SHARD2}: the file is empty \(0 bytes\)$"),
    (
        "header-length-0x7fff",
        lambda r: _with_shard2(r, lambda d: struct.pack("<Q", 0x7FFF_FFFF_FFFF_FFFF) + d[8:]),
        rf"^{SHARD2}: header length 9223372036854775807 \(0x7fffffffffffffff\) is over the 100,000,000-byte cap$",
    ),
    ("garbage-json-header", lambda r: _with_shard2(r, _garbage_json), rf"^{SHARD2}: header is not valid JSON: "),
    (
        "overlapping-tensors",
        lambda r: _with_shard2(r, lambda d: raw_safetensors({"a": _f32(0, 8), "b": _f32(4, 12)}, 12)),
        rf"^{SHARD2}: tensor 'b' starts at byte \d+, inside tensor 'a' \[\d+, \d+\)$",
    ),
    (
        "gap-between-tensors",
        lambda r: _with_shard2(r, lambda d: raw_safetensors({"a": _f32(0, 8), "b": _f32(12, 20)}, 20)),
        rf"^{SHARD2}: bytes \[\d+, \d+\) after tensor 'a' belong to no tensor$",
    ),
    (
        "dtype-shape-not-the-range",
        lambda r: _with_shard2(r, lambda d: raw_safetensors({"a": _f32(0, 8, shape=3)}, 8)),
        rf"^{SHARD2}: tensor 'a': F32 \[3\] needs 12 bytes but data_offsets \[0, 8\] hold 8$",
    ),
    ("empty-directory", lambda r: _dir(r / "empty", {}), r"empty: no files to publish$"),
    (
        "only-config-json",
        lambda r: _dir(r / "ck", {"config.json": b"{}"}),
        r"ck: no safetensors weights \(\*\.safetensors\) among its files: config\.json$",
    ),
    (
        "model-pt-alone",
        lambda r: _single(r, "model.pt", PICKLE),
        r"model\.pt: a pickle checkpoint, which weightsync does not publish: convert to safetensors",
    ),
    (
        "pytorch-model-bin-alone",
        lambda r: _dir(r / "ck", {"pytorch_model.bin": PICKLE, "config.json": b"{}"}),
        r"ck: only pickle weights \(pytorch_model\.bin\), which weightsync does not publish: convert to safetensors",
    ),
    ("readme-md-alone", lambda r: _single(r, "readme.md", b"# my model\n"), r"readme\.md: not a safetensors file"),
]
