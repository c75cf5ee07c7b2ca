"""Tensor-parallel layouts (engines/layouts.py) against vLLM 0.32's own weight loaders, and their pure math.

Tensor parallelism above 1 cannot run on vLLM's CPU executor here (one CPU worker,
no process group of several ranks), so the loaders are exercised directly:
``_vllm_layouts.py``, run with the vLLM venv's interpreter, builds vLLM's parallel
layers of three Llama configurations (the tiny Llama of ``_make_llama.py``; one
with 8 heads, 2 key/value heads and biases; one whose vocabulary of 100 leaves a
rank with only padding) for every rank of tensor-parallel sizes 1, 2, 4 (and 8
where the heads divide), with the rank and size faked, loads a checkpoint through
vLLM's ``AutoWeightsLoader`` with its Llama shard ids, and writes what every rank's
parameters hold. The tests compare that with :func:`layouts.gather`, with
:func:`digests.expected` (what disk mode checks ``/weight_checker`` against), and
with :func:`layouts.element_map` after random elements changed. The hypothesis
tests check the layout math itself (no vLLM needed).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from _vllm import require_vllm
from hypothesis import given, settings
from hypothesis import strategies as st

from weightsync.codec import safetensors
from weightsync.codec.dtypes import UINT
from weightsync.engines import UnverifiableEngine, digests, layouts
from weightsync.engines.layouts import Layout, ModelConfig
from weightsync.engines.vllm import by_parameter

SCRIPT = Path(__file__).with_name("_vllm_layouts.py")
MODELS = {"tiny": [1, 2, 4], "gqa-bias": [1, 2, 4, 8], "small-vocab": [1, 2, 4, 8]}


def checkpoint(directory: Path) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint directory's safetensors files."""
    return {n: a for path in sorted(directory.glob("*.safetensors")) for n, a in read(path).items()}


def read(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file, as unsigned integers of its element width (bytes, not values)."""
    raw = path.read_bytes()
    total = safetensors.header_length(raw[:8], len(raw))
    out = {}
    for s in safetensors.parse(raw[:total], len(raw)).tensors:
        w = s.dtype.width
        out[s.name] = np.frombuffer(raw, UINT[w], count=(s.end - s.start) // w, offset=s.start).reshape(s.shape)
    return out


@pytest.fixture(scope="module")
def loads(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The output of ``_vllm_layouts.py``: checkpoints and what vLLM's loaders put on every rank."""
    python = require_vllm()
    out = tmp_path_factory.mktemp("vllm-layouts")
    done = subprocess.run([str(python), str(SCRIPT), str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads((out / "index.json").read_text()) == MODELS
    return out


def ranks(out: Path):  # noqa: ANN201
    for model, sizes in MODELS.items():
        for size in sizes:
            for rank in range(size):
                yield model, size, rank, out / model / "ranks" / f"tp{size}-r{rank}"


def layout_of(name: str, ckpt: dict[str, np.ndarray], config: ModelConfig, rank: int, size: int) -> Layout:
    if name.startswith("column."):  # the extra ColumnParallelLinear: no Llama parameter name says that kind
        return layouts.column(name, name, ckpt[name].shape, rank=rank, size=size)
    return layouts.layout(name, {n: a.shape for n, a in ckpt.items()}, config, rank=rank, size=size)


@pytest.mark.slow
def test_every_rank_holds_what_the_layout_gathers_from_the_checkpoint(loads: Path) -> None:
    checked = 0
    for model, size, rank, stem in ranks(loads):
        ckpt = checkpoint(loads / model / "ckpt")
        config = ModelConfig.read(loads / model / "ckpt")
        for name, held in read(stem.with_suffix(".safetensors")).items():
            lay = layout_of(name, ckpt, config, rank, size)
            assert lay.shape == held.shape, (model, size, rank, name)
            assert np.array_equal(layouts.gather(lay, ckpt), held), (model, size, rank, name)
            checked += 1
    assert checked == 17 * 7 + 15 * 15 + 11 * 15  # parameters x ranks: tiny (2 layers), gqa-bias, small-vocab


@pytest.mark.slow
def test_expected_digests_are_each_ranks_sha256_as_the_weight_checker_computes_it(loads: Path) -> None:
    for model, size, rank, stem in ranks(loads):
        held = read(stem.with_suffix(".safetensors"))
        keys = {digests.rank_key(name, rank, size): name for name in held if not name.startswith("column.")}
        want = digests.expected(loads / model / "ckpt", keys)
        got = {key: hashlib.sha256(held[name].tobytes()).hexdigest() for key, name in keys.items()}
        assert want == got, (model, size, rank, digests.differing(want, got))


@pytest.mark.slow
def test_a_tensor_parallel_weight_checker_answer_is_checked_rank_by_rank(loads: Path) -> None:
    """What VllmDisk does with ``/weight_checker`` (by_parameter, then expected on its keys, then differing),
    on the answer a size-4 engine would give: the SHA-256 of each rank's parameters, keyed as vLLM keys them."""
    answer = {}
    for model, size, rank, stem in ranks(loads):
        if model == "tiny" and size == 4:
            for name, held in read(stem.with_suffix(".safetensors")).items():
                if name.startswith("column."):
                    continue  # not a Llama parameter
                answer[f"dp0:pp0:pcp0:tp{rank}:{name}"] = hashlib.sha256(held.tobytes()).hexdigest()
    got = by_parameter(answer)
    assert len(got) == 4 * 15
    want = digests.expected(loads / "tiny" / "ckpt", sorted(got))
    assert digests.differing(got, want) == []
    qkv = "model.layers.1.self_attn.qkv_proj.weight"
    got["tp3/4:" + qkv] = hashlib.sha256(b"one rank holds other bytes").hexdigest()
    assert digests.differing(got, want) == ["tp3/4:" + qkv]


@pytest.mark.slow
def test_changed_checkpoint_elements_map_to_the_elements_vllm_changes_on_each_rank(loads: Path) -> None:
    for model, sizes in MODELS.items():
        old = checkpoint(loads / model / "ckpt")
        new = checkpoint(loads / model / "changed")
        config = ModelConfig.read(loads / model / "ckpt")
        changed = {n: np.flatnonzero(old[n].reshape(-1) != new[n].reshape(-1)) for n in old}
        assert all(len(ix) >= 8 for ix in changed.values())
        for size in sizes:
            reached = {n: np.zeros(old[n].size, bool) for n in old}
            for rank in range(size):
                stem = loads / model / "ranks" / f"tp{size}-r{rank}"
                before = read(stem.with_suffix(".safetensors"))
                after = read(stem.parent / f"{stem.name}-changed.safetensors")
                for name in before:
                    lay = layout_of(name, old, config, rank, size)
                    moved = np.flatnonzero(before[name].reshape(-1) != after[name].reshape(-1))
                    where_all = []
                    for source, _ in lay.sources:
                        which, where = layouts.element_map(lay, source, changed[source])
                        assert np.array_equal(
                            after[name].reshape(-1)[where], new[source].reshape(-1)[changed[source][which]]
                        )
                        reached[source][changed[source][which]] = True
                        where_all.append(where)
                    assert np.array_equal(np.unique(np.concatenate(where_all)), moved), (model, size, rank, name)
            for n, hit in reached.items():  # every changed element lands on some rank
                assert hit[changed[n]].all(), (model, size, n)


# --- the layout math, without vLLM ----------------------------------------------------------------


@st.composite
def models(draw: st.DrawFn) -> tuple[ModelConfig, dict[str, tuple[int, ...]], int]:
    """A Llama-shaped checkpoint's shapes, its config, and a tensor-parallel size the heads allow."""
    size = draw(st.sampled_from([1, 2, 4, 8]))
    heads = size * draw(st.integers(1, 3))
    kv = draw(st.sampled_from([d for d in range(1, heads + 1) if heads % d == 0 and (d % size == 0 or size % d == 0)]))
    head_dim, hidden = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    inter, vocab = size * draw(st.integers(1, 3)), draw(st.integers(1, 300))
    shapes = {
        "model.embed_tokens.weight": (vocab, hidden),
        "lm_head.weight": (vocab, hidden),
        "lm_head.bias": (vocab,),
        "m.q_proj.weight": (heads * head_dim, hidden),
        "m.k_proj.weight": (kv * head_dim, hidden),
        "m.v_proj.weight": (kv * head_dim, hidden),
        "m.q_proj.bias": (heads * head_dim,),
        "m.k_proj.bias": (kv * head_dim,),
        "m.v_proj.bias": (kv * head_dim,),
        "m.o_proj.weight": (hidden, heads * head_dim),
        "m.o_proj.bias": (hidden,),
        "m.gate_proj.weight": (inter, hidden),
        "m.up_proj.weight": (inter, hidden),
        "m.down_proj.weight": (hidden, inter),
        "m.input_layernorm.weight": (hidden,),
    }
    return ModelConfig(heads, kv, head_dim, vocab), shapes, size


PARAMS = (
    "model.embed_tokens.weight",
    "lm_head.weight",
    "lm_head.bias",
    "m.qkv_proj.weight",
    "m.qkv_proj.bias",
    "m.o_proj.weight",
    "m.o_proj.bias",
    "m.gate_up_proj.weight",
    "m.down_proj.weight",
    "m.input_layernorm.weight",
)


def arrays(shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """Every element distinct: its value says which source and which element it is."""
    out, base = {}, 1
    for name, shape in shapes.items():
        n = int(np.prod(shape))
        out[name] = np.arange(base, base + n, dtype=np.uint32).reshape(shape)
        base += n
    return out


@settings(max_examples=60, deadline=None)
@given(models())
def test_pieces_cover_each_parameter_once_and_each_source_as_vllm_shards_it(
    model: tuple[ModelConfig, dict[str, tuple[int, ...]], int],
) -> None:
    config, shapes, size = model
    for name in PARAMS:
        copies: dict[str, np.ndarray] = {}
        for rank in range(size):
            lay = layouts.layout(name, shapes, config, rank=rank, size=size)
            cover = np.zeros(lay.shape[lay.dim], int)
            for p in lay.pieces:
                assert p.start >= 0 and p.start + p.length <= lay.source_shape(p.source)[p.dim]
                cover[p.offset : p.offset + p.length] += 1
                copies.setdefault(p.source, np.zeros(lay.source_shape(p.source)[p.dim], int))
                copies[p.source][p.start : p.start + p.length] += 1
            for offset, length in lay.padding:
                cover[offset : offset + length] += 1
            assert (cover == 1).all(), (name, rank)
        for source, times in copies.items():
            kv = config.num_key_value_heads or 1
            replicas = size // kv if (".k_proj." in source or ".v_proj." in source) and kv < size else 1
            if name.endswith(("norm.weight", "o_proj.bias")):
                replicas = size
            assert (times == replicas).all(), (name, source)


@settings(max_examples=60, deadline=None)
@given(models(), st.data())
def test_gather_chunks_and_element_map_agree(
    model: tuple[ModelConfig, dict[str, tuple[int, ...]], int], data: st.DataObject
) -> None:
    config, shapes, size = model
    values = arrays(shapes)
    rank = data.draw(st.integers(0, size - 1))
    for name in PARAMS:
        lay = layouts.layout(name, shapes, config, rank=rank, size=size)
        param = layouts.gather(lay, values)
        assert param.shape == lay.shape
        block = data.draw(st.sampled_from([1, 7, 1 << 22]))
        assert np.concatenate(list(layouts.chunks(lay, values, block_bytes=block))).tobytes() == param.tobytes()
        rebuilt = np.zeros(param.size, param.dtype)
        for source, shape in lay.sources:
            which, where = layouts.element_map(lay, source, np.arange(int(np.prod(shape))))
            assert len(np.unique(where)) == len(where)
            rebuilt[where] = values[source].reshape(-1)[which]
        assert np.array_equal(rebuilt, param.reshape(-1))  # padding stays zero in both


def test_vocabulary_padding_and_kv_replication_follow_vllm_numbers() -> None:
    cfg = ModelConfig(8, 2, 16, 1000)
    shapes = {"lm_head.weight": (1000, 64)}
    last = layouts.layout("lm_head.weight", shapes, cfg, rank=7, size=8)
    assert last.shape == (128, 64) and last.pieces == (layouts.Piece("lm_head.weight", 0, 896, 104, 0),)
    assert last.padding == ((104, 24),)
    empty = layouts.layout("lm_head.weight", {"lm_head.weight": (100, 8)}, ModelConfig(vocab_size=100), rank=7, size=8)
    assert empty.pieces == () and empty.padding == ((0, 16),) and empty.shape == (16, 8)
    one = layouts.layout("lm_head.weight", shapes, cfg)
    assert one.shape == (1024, 64) and one.padding == ((1000, 24),) and not one.whole
    qkv = {f"a.{p}_proj.weight": (n * 16, 64) for p, n in (("q", 8), ("k", 2), ("v", 2))}
    r5 = layouts.layout("a.qkv_proj.weight", qkv, cfg, rank=5, size=8)
    assert [(p.start, p.length, p.offset) for p in r5.pieces] == [(80, 16, 0), (16, 16, 16), (16, 16, 32)]


def test_a_checkpoint_tensor_names_the_parameter_it_is_loaded_into() -> None:
    for source in ("m.q_proj.weight", "m.k_proj.weight", "m.v_proj.bias", "m.gate_proj.weight", "m.up_proj.weight"):
        assert source in layouts.sources(layouts.target(source))
    assert layouts.target("m.q_proj.weight") == "m.qkv_proj.weight"
    assert layouts.target("m.up_proj.weight") == "m.gate_up_proj.weight"
    assert layouts.target("model.norm.weight") == "model.norm.weight"


def test_what_cannot_be_laid_out_is_refused_naming_the_parameter() -> None:
    qkv = {f"a.{p}_proj.weight": (n * 16, 64) for p, n in (("q", 8), ("k", 2), ("v", 2))}
    with pytest.raises(UnverifiableEngine, match="a.qkv_proj.weight.*config.json"):
        layouts.layout("a.qkv_proj.weight", qkv, None, rank=0, size=2)
    with pytest.raises(UnverifiableEngine, match="a.qkv_proj.weight.*do not match"):
        layouts.layout("a.qkv_proj.weight", qkv, ModelConfig(8, 4, 16), rank=0, size=2)
    with pytest.raises(UnverifiableEngine, match="a.qkv_proj.weight.*3 ranks"):
        layouts.layout("a.qkv_proj.weight", qkv, ModelConfig(8, 2, 16), rank=0, size=3)
    with pytest.raises(UnverifiableEngine, match="'a.experts.w1'.*unknown"):
        layouts.layout("a.experts.w1", {"a.experts.w1": (4, 4)}, None, rank=1, size=2)
    assert layouts.layout("a.experts.w1", {"a.experts.w1": (4, 4)}).whole  # one rank: a plain copy
    with pytest.raises(UnverifiableEngine, match="vocab_size 99"):
        layouts.layout("lm_head.weight", {"lm_head.weight": (100, 8)}, ModelConfig(vocab_size=99))
    with pytest.raises(UnverifiableEngine, match="rank 2"):
        layouts.layout("m.norm.weight", {"m.norm.weight": (4,)}, None, rank=2, size=2)
