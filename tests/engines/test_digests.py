"""Expected engine digests from checkpoint files (fused layouts), and vLLM's checksum keys: no engine needed."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from weightsync import errors
from weightsync.codec.safetensors import serialize
from weightsync.engines import EngineError, UnverifiableEngine, digests
from weightsync.engines.vllm import PAUSE_MODES, VllmClient, by_parameter

ATTN = "model.layers.0.self_attn"
MLP = "model.layers.0.mlp"


def _tensors(seed: int = 0) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    rng = np.random.default_rng(seed)
    shapes = {
        f"{ATTN}.q_proj.weight": (8, 4),
        f"{ATTN}.k_proj.weight": (4, 4),
        f"{ATTN}.v_proj.weight": (4, 4),
        f"{ATTN}.o_proj.weight": (4, 8),
        f"{MLP}.gate_proj.weight": (6, 4),
        f"{MLP}.up_proj.weight": (6, 4),
        "model.norm.weight": (4,),
    }
    return {n: ("BF16", s, rng.bytes(2 * int(np.prod(s)))) for n, s in shapes.items()}


def _write(path: Path, tensors: dict[str, tuple[str, tuple[int, ...], bytes]]) -> None:
    path.write_bytes(serialize([(n, dt, shape, data) for n, (dt, shape, data) in tensors.items()]))


def test_fused_parameters_hash_their_parts_in_order(tmp_path: Path) -> None:
    t = _tensors()
    _write(tmp_path / "model.safetensors", t)
    (tmp_path / "config.json").write_text("{}")
    names = [f"{ATTN}.qkv_proj.weight", f"{ATTN}.o_proj.weight", f"{MLP}.gate_up_proj.weight", "model.norm.weight"]
    got = digests.expected(tmp_path, names)

    def sha(*parts: str) -> str:
        return hashlib.sha256(b"".join(t[p][2] for p in parts)).hexdigest()

    assert got == {
        names[0]: sha(f"{ATTN}.q_proj.weight", f"{ATTN}.k_proj.weight", f"{ATTN}.v_proj.weight"),
        names[1]: sha(f"{ATTN}.o_proj.weight"),
        names[2]: sha(f"{MLP}.gate_proj.weight", f"{MLP}.up_proj.weight"),
        names[3]: sha("model.norm.weight"),
    }


def test_tensors_are_found_across_shards_and_hidden_files_are_ignored(tmp_path: Path) -> None:
    t = _tensors()
    first = {k: v for k, v in t.items() if "self_attn" in k}
    _write(tmp_path / "model-00001-of-00002.safetensors", first)
    _write(tmp_path / "model-00002-of-00002.safetensors", {k: v for k, v in t.items() if k not in first})
    _write(tmp_path / ".partial.safetensors", _tensors(seed=1))  # not what vLLM loads
    assert set(digests.index(tmp_path)) == set(t)
    assert digests.expected(tmp_path, [f"{ATTN}.qkv_proj.weight"])


def test_what_cannot_be_derived_is_refused_before_hashing(tmp_path: Path) -> None:
    t = _tensors()
    _write(tmp_path / "model.safetensors", t)
    with pytest.raises(UnverifiableEngine, match="no source"):
        digests.expected(tmp_path, ["model.layers.0.self_attn.qkv_proj.weight_scale"])
    mixed = dict(t)
    mixed[f"{MLP}.up_proj.weight"] = ("F16", (6, 4), t[f"{MLP}.up_proj.weight"][2])
    _write(tmp_path / "model.safetensors", mixed)
    with pytest.raises(UnverifiableEngine, match="different dtypes"):
        digests.expected(tmp_path, [f"{MLP}.gate_up_proj.weight"])
    _write(tmp_path / "model.safetensors", t)
    _write(tmp_path / "extra.safetensors", {"model.norm.weight": t["model.norm.weight"]})
    with pytest.raises(UnverifiableEngine, match="both"):
        digests.index(tmp_path)


def test_differing_names_changed_and_one_sided_parameters() -> None:
    assert digests.differing({"a": "1", "b": "2", "c": "3"}, {"a": "1", "b": "x", "d": "4"}) == ["b", "c", "d"]
    assert digests.differing({"a": "1"}, {"a": "1"}) == []


def test_checksum_keys_of_unsliced_engines_are_read_and_sliced_ones_refused() -> None:
    assert by_parameter({"dp0:pp0:pcp0:tp0:lm_head.weight": "aa", "dp1:pp0:pcp0:tp0:lm_head.weight": "aa"}) == {
        "lm_head.weight": "aa"
    }
    disagree = by_parameter({"dp0:pp0:pcp0:tp0:w": "aa", "dp1:pp0:pcp0:tp0:w": "bb"})
    assert disagree == {"w": "dp-disagree"}
    with pytest.raises(UnverifiableEngine, match="sliced"):
        by_parameter({"dp0:pp0:pcp0:tp0:w": "aa", "dp0:pp0:pcp0:tp1:w": "bb"})
    with pytest.raises(EngineError, match="dp:pp:pcp:tp:name"):
        by_parameter({"w": "aa"})


def test_client_refuses_a_url_without_scheme_and_names_an_unreachable_engine() -> None:
    with pytest.raises(errors.InvalidArgument):
        VllmClient("127.0.0.1:8000")
    from _serve import free_port

    client = VllmClient(f"http://127.0.0.1:{free_port()}", timeout=2)
    try:
        assert not client.health()
        with pytest.raises(errors.WeightsyncError) as caught:
            client.pause("keep")
        assert caught.value.exit_code == errors.EXIT_UNAVAILABLE
    finally:
        client.close()
    assert PAUSE_MODES == ("keep", "wait", "abort")
