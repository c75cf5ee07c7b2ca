"""codec.parts.merge_parts: the parts of a multi-part publish merge into one ordinary manifest.

Disjoint parts (each rank encoding its own files against its own previous part, the
partitioning free to change between versions) merge to a manifest that describes what one
publisher of the union would (the same files, layouts and segment digests) and decodes on the
parent version, byte for byte, to the union.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import pytest
from _ckpt import mutate, safetensors_file
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightsync.codec import Checkpoint, Decoder, Encoder, Manifest
from weightsync.codec.parts import PartConflict, _content, merge_parts

CONFIG = b'{"architectures": ["Moe"], "hidden": 64}\n'


def _union(rng: np.random.Generator, files: int) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """(base, new): `files` safetensors files of distinct tensors, each tensor changed a little, and a config."""
    base, new = {"config.json": CONFIG}, {"config.json": CONFIG}
    for j in range(files):
        old_t, new_t = {}, {}
        for i in range(int(rng.integers(1, 4))):
            dt, width = [("BF16", 2), ("F32", 4), ("U8", 1)][int(rng.integers(0, 3))]
            n = int(rng.choice([1, 7, 300, 3000]))
            data = rng.integers(0, 256, n * width, dtype=np.uint8)
            old_t[f"layers.{j}.w{i}"] = (dt, (n,), data)
            new_t[f"layers.{j}.w{i}"] = (dt, (n,), mutate(rng, data, width, int(rng.integers(0, n + 1))))
        base[f"model-{j:02d}.safetensors"] = safetensors_file(old_t)
        new[f"model-{j:02d}.safetensors"] = safetensors_file(new_t)
    return base, new


def _split(rng: np.random.Generator, paths: list[str], world: int) -> list[list[str]]:
    """Weight files dealt to `world` ranks (each gets one at least); the config to a random non-empty set of them."""
    weights = [p for p in paths if p.endswith(".safetensors")]
    order = rng.permutation(len(weights))
    ranks: list[list[str]] = [[] for _ in range(world)]
    for k, i in enumerate(order):
        ranks[k % world if k < world else int(rng.integers(0, world))].append(weights[i])
    holders = [r for r in range(world) if rng.random() < 0.5] or [0]
    for r in holders:
        ranks[r].append("config.json")
    return ranks


def _located(manifest_of, name: str, areas: dict[str, bytes]) -> Manifest:
    offsets = np.cumsum([0] + [len(fr.data) for fr in manifest_of.frames])
    digest = hashlib.sha256(name.encode()).hexdigest()
    areas[digest] = b"".join(fr.data for fr in manifest_of.frames)
    return manifest_of.with_locations(lambda i, fr: (digest, int(offsets[i])))


def _described(m: Manifest) -> list[tuple[str, object]]:
    return sorted((f.path, _content(f)) for f in m.files)


@given(
    seed=st.integers(0, 2**32 - 1),
    files=st.integers(1, 5),
    old_world=st.integers(1, 4),
    new_world=st.integers(1, 4),
    version=st.sampled_from([1, 2]),
    chunk=st.sampled_from([1024, 1 << 20]),
)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_disjoint_parts_merge_to_the_union(seed, files, old_world, new_world, version, chunk) -> None:
    rng = np.random.default_rng(seed)
    base, new = _union(rng, files)
    old_world, new_world = min(old_world, files), min(new_world, files)
    held = _split(rng, sorted(base), old_world)  # what each rank published last time: its own base
    parts_now = _split(rng, sorted(new), new_world)
    areas: dict[str, bytes] = {}
    parts = []
    for rank, paths in enumerate(parts_now):
        enc = Encoder(threads=1, chunk_bytes=chunk, format_version=version, frames_per_file=True)
        mine = held[rank] if rank < len(held) else []
        own_base = Checkpoint.from_bytes({p: base[p] for p in mine}) if mine else None
        encoded = enc.encode(Checkpoint.from_bytes({p: new[p] for p in paths}), own_base)
        m = _located(encoded, f"part{rank}", areas)
        m.model, m.parent, m.step = "m", 4, 10
        parts.append(m)
    merged = Manifest.decode(merge_parts(parts).encode())  # an ordinary manifest: it round-trips

    one = Encoder(threads=1, chunk_bytes=chunk, format_version=version).encode(
        Checkpoint.from_bytes(new), Checkpoint.from_bytes(base)
    )
    assert _described(merged) == _described(one.manifest)
    assert [f.path for f in merged.files] == list(dict.fromkeys(p for ps in parts_now for p in sorted(ps)))
    assert (merged.model, merged.parent, merged.step) == ("m", 4, 10)

    outputs = [np.zeros(f.size, np.uint8) for f in merged.files]

    def read(ref):
        return memoryview(areas[ref.object])[ref.offset : ref.offset + ref.length]

    Decoder(threads=1).decode(merged, read, outputs, Checkpoint.from_bytes(base), verify_segments=True)
    assert {f.path: o.tobytes() for f, o in zip(merged.files, outputs, strict=True)} == new


def _parts(files: list[dict[str, bytes]]) -> list[Manifest]:
    out = []
    for f in files:
        m = (
            Encoder(threads=1, frames_per_file=True)
            .encode(Checkpoint.from_bytes(f), None)
            .with_locations(lambda i, fr: ("o" * 64, 0))
        )
        m.model, m.parent, m.step = "m", 1, 5
        out.append(m)
    return out


def _st(name: str, value: int) -> bytes:
    return safetensors_file({name: ("U8", (4,), np.full(4, value, np.uint8))})


def test_one_part_is_itself() -> None:
    (m,) = _parts([{"a.safetensors": _st("x", 1)}])
    assert merge_parts([m]) is m


@pytest.mark.parametrize(
    ("files", "fields", "says"),
    [
        ([{"a.safetensors": _st("x", 1)}, {"a.safetensors": _st("x", 2)}], {}, "different bytes"),
        ([{"a.safetensors": _st("x", 1)}, {"b.safetensors": _st("x", 1)}], {}, "tensor 'x'"),
        ([{"a.safetensors": _st("x", 1)}, {"b.safetensors": _st("y", 1)}], {1: {"parent": 2}}, "parent"),
        ([{"a.safetensors": _st("x", 1)}, {"b.safetensors": _st("y", 1)}], {1: {"step": 6}}, "step"),
        (
            [{"a.safetensors": _st("x", 1)}, {"b.safetensors": _st("y", 1)}],
            {1: {"metadata": {"k": 1}}, 0: {"metadata": {"k": 2}}},
            "metadata",
        ),
    ],
)
def test_conflicting_parts_are_refused(files, fields, says) -> None:
    with pytest.raises(PartConflict, match=says):
        merge_parts(_with(files, fields))


def _with(files, fields):
    parts = _parts(files)
    for rank, change in fields.items():
        parts[rank] = dataclasses.replace(parts[rank], **change)
    return parts


def test_identical_non_weight_files_are_kept_once() -> None:
    parts = _parts(
        [{"a.safetensors": _st("x", 1), "config.json": CONFIG}, {"b.safetensors": _st("y", 1), "config.json": CONFIG}]
    )
    merged = merge_parts(parts)
    assert sorted(f.path for f in merged.files) == ["a.safetensors", "b.safetensors", "config.json"]
