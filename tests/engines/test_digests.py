"""Expected engine digests from checkpoint files (fused layouts), and vLLM's checksum keys: no engine needed."""

from __future__ import annotations

import hashlib
import json
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


def test_parameters_the_engine_emptied_are_told_apart_from_empty_tensors() -> None:
    engine = {"qkv": digests.EMPTY, "empty": digests.EMPTY, "norm": "aa"}
    assert digests.bytes_dropped(engine, {"qkv": "bb", "empty": digests.EMPTY, "norm": "cc"}) == ["qkv"]


def test_differing_names_changed_and_one_sided_parameters() -> None:
    assert digests.differing({"a": "1", "b": "2", "c": "3"}, {"a": "1", "b": "x", "d": "4"}) == ["b", "c", "d"]
    assert digests.differing({"a": "1"}, {"a": "1"}) == []


def test_checksum_keys_are_read_per_tensor_parallel_rank_and_other_splits_refused() -> None:
    assert by_parameter({"dp0:pp0:pcp0:tp0:lm_head.weight": "aa", "dp1:pp0:pcp0:tp0:lm_head.weight": "aa"}) == {
        "lm_head.weight": "aa"
    }
    disagree = by_parameter({"dp0:pp0:pcp0:tp0:w": "aa", "dp1:pp0:pcp0:tp0:w": "bb"})
    assert disagree == {"w": "dp-disagree"}
    two = {"dp0:pp0:pcp0:tp0:w": "aa", "dp0:pp0:pcp0:tp1:w": "bb", "dp1:pp0:pcp0:tp1:w": "cc"}
    assert by_parameter(two) == {"tp0/2:w": "aa", "tp1/2:w": "dp-disagree"}
    assert [digests.parse_key(k) for k in sorted(by_parameter(two))] == [("w", 0, 2), ("w", 1, 2)]
    assert digests.parse_key("model.norm.weight") == ("model.norm.weight", 0, 1)
    with pytest.raises(EngineError, match=r"'v' on tensor-parallel ranks \[1\] of 2"):
        by_parameter({"dp0:pp0:pcp0:tp0:w": "aa", "dp0:pp0:pcp0:tp1:w": "bb", "dp0:pp0:pcp0:tp0:v": "cc"})
    with pytest.raises(UnverifiableEngine, match="pipeline or context parallel"):
        by_parameter({"dp0:pp0:pcp0:tp0:w": "aa", "dp0:pp1:pcp0:tp0:v": "bb"})
    with pytest.raises(EngineError, match="dp:pp:pcp:tp:name"):
        by_parameter({"w": "aa"})
    with pytest.raises(EngineError, match="dp:pp:pcp:tp:name"):
        by_parameter({"dp0:pp0:pcp0:rank1:w": "aa"})


def test_each_ranks_slice_is_hashed_as_vllm_lays_it_out(tmp_path: Path) -> None:
    """Oracle: numpy slicing written out by hand from vLLM 0.32's loaders (linear.py, vocab_parallel_embedding.py)."""
    rng = np.random.default_rng(3)
    heads, kv, hd, hidden, inter, vocab = 4, 2, 2, 3, 4, 70  # 70 rows pad to 128: 32 per rank of 4
    shapes = {
        f"{ATTN}.q_proj.weight": (heads * hd, hidden),
        f"{ATTN}.k_proj.weight": (kv * hd, hidden),
        f"{ATTN}.v_proj.weight": (kv * hd, hidden),
        f"{ATTN}.o_proj.weight": (hidden, heads * hd),
        f"{MLP}.gate_proj.weight": (inter, hidden),
        f"{MLP}.up_proj.weight": (inter, hidden),
        f"{MLP}.down_proj.weight": (hidden, inter),
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
    }
    a = {n: rng.integers(0, 1 << 16, s, dtype=np.uint16) for n, s in shapes.items()}
    _write(tmp_path / "model.safetensors", {n: ("BF16", x.shape, x.tobytes()) for n, x in a.items()})
    config = {"num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd, "vocab_size": vocab}
    (tmp_path / "config.json").write_text(json.dumps(config))

    def sha(*parts: np.ndarray) -> str:
        return hashlib.sha256(b"".join(np.ascontiguousarray(p).tobytes() for p in parts)).hexdigest()

    def slice_of(name: str, r: int, t: int) -> list[np.ndarray]:
        q, k, v = (a[f"{ATTN}.{p}_proj.weight"] for p in "qkv")
        if name.endswith("qkv_proj.weight"):
            kv_r = r // (t // kv) if kv < t else r  # fewer kv heads than ranks: each one on t // kv ranks
            kv_n = hd if kv < t else kv * hd // t
            return [
                q[r * 8 // t : (r + 1) * 8 // t],
                k[kv_r * kv_n : (kv_r + 1) * kv_n],
                v[kv_r * kv_n : (kv_r + 1) * kv_n],
            ]
        if name.endswith("gate_up_proj.weight"):
            n = inter // t
            return [a[f"{MLP}.gate_proj.weight"][r * n : (r + 1) * n], a[f"{MLP}.up_proj.weight"][r * n : (r + 1) * n]]
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w = a[name]
            n = w.shape[1] // t
            return [w[:, r * n : (r + 1) * n]]
        if name.endswith("embed_tokens.weight"):
            n = 128 // t
            rows = a[name][r * n : (r + 1) * n]
            return [rows, np.zeros((n - len(rows), hidden), np.uint16)]
        return [a[name]]

    names = [
        f"{ATTN}.qkv_proj.weight",
        f"{ATTN}.o_proj.weight",
        f"{MLP}.gate_up_proj.weight",
        f"{MLP}.down_proj.weight",
        "model.embed_tokens.weight",
        "model.norm.weight",
    ]
    for t in (1, 2, 4):
        keys = {digests.rank_key(n, r, t): (n, r) for n in names for r in range(t)}
        got = digests.expected(tmp_path, keys)
        assert got == {key: sha(*slice_of(n, r, t)) for key, (n, r) in keys.items()}, t
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(UnverifiableEngine, match="qkv_proj.*config.json"):
        digests.expected(tmp_path, [digests.rank_key(names[0], 0, 2)])
    assert digests.expected(tmp_path, names[:1])  # one rank needs no config


def test_a_vocabulary_not_a_multiple_of_64_is_hashed_with_vllms_zero_rows(tmp_path: Path) -> None:
    rows = np.arange(100 * 4, dtype=np.uint16).reshape(100, 4)
    _write(tmp_path / "model.safetensors", {"lm_head.weight": ("BF16", (100, 4), rows.tobytes())})
    want = hashlib.sha256(rows.tobytes() + bytes(28 * 4 * 2)).hexdigest()  # padded to 128 rows
    assert digests.expected(tmp_path, ["lm_head.weight"]) == {"lm_head.weight": want}


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
