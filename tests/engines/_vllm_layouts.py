"""vLLM's own weight loaders on CPU tensors, one tensor-parallel rank at a time: what each rank's parameters hold.

Run with the vLLM venv's interpreter (``tests/engines/test_layouts.py`` does)::

    .venv-vllm/bin/python tests/engines/_vllm_layouts.py OUT

Tensor parallelism above 1 cannot run on vLLM's CPU executor here, so this builds
vLLM 0.32's parallel layers of a Llama model directly (``QKVParallelLinear``,
``RowParallelLinear``, ``MergedColumnParallelLinear``, ``RMSNorm``,
``VocabParallelEmbedding``, ``ParallelLMHead``, under the parameter names vLLM's
``LlamaForCausalLM`` gives them) with the tensor-parallel rank and size faked,
and loads a checkpoint into them with vLLM's own ``AutoWeightsLoader`` and
``LlamaModel.hf_to_vllm_mapper`` (the shard ids q, k, v and 0, 1 its Llama
``load_weights`` uses). The rank and size are faked where every layer and
parameter reads them: ``get_tensor_model_parallel_rank/_world_size`` return
``vllm.distributed.parallel_state._TP.rank_in_group/.world_size``, and ``_TP`` is
set to an object with only those two attributes (so a loader that needed the
real process group would fail here, not pass silently).

For each model (``MODELS``) it writes, under ``OUT/<model>/``:

- ``ckpt/`` a checkpoint (``model.safetensors`` with Hugging Face names, random
  bf16 values; ``config.json``; ``column.safetensors`` the tensors of one more
  layer, a ``ColumnParallelLinear`` named ``column``, since no Llama parameter is
  one), and ``changed/`` the same with random elements of every tensor changed;
- ``ranks/tp<size>-r<rank>.safetensors`` every vLLM parameter of that rank after
  loading ``ckpt/`` (parameters are first filled with the byte 0xA5, so bytes
  the loaders do not write show), and ``...-changed.safetensors`` after loading
  ``changed/`` on top;

and ``OUT/index.json``: ``{model: [sizes]}``.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
import vllm.distributed.parallel_state as parallel_state  # noqa: E402
from _make_llama import config as tiny_config  # noqa: E402
from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.layernorm import RMSNorm  # noqa: E402
from vllm.model_executor.layers.linear import (  # noqa: E402
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.vocab_parallel_embedding import (  # noqa: E402
    ParallelLMHead,
    VocabParallelEmbedding,
)
from vllm.model_executor.models.llama import LlamaModel  # noqa: E402
from vllm.model_executor.models.utils import AutoWeightsLoader  # noqa: E402

MODELS: dict[str, tuple[dict[str, object], tuple[int, ...]]] = {
    # The tiny Llama of the engine tests: 4 heads, 2 key/value heads (replicated at size 4).
    "tiny": ({}, (1, 2, 4)),
    # 8 heads of 16, 2 key/value heads (replicated at 4 and 8), biases everywhere, a vocabulary of
    # 1000 (padded to 1024: the last rank holds 104 real rows at size 8).
    "gqa-bias": (
        dict(
            vocab_size=1000,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=1,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=16,
            attention_bias=True,
            mlp_bias=True,
        ),
        (1, 2, 4, 8),
    ),
    # A vocabulary of 100 (padded to 128): at size 8 rank 6 holds 4 real rows, rank 7 only padding;
    # one key/value head for 8 ranks; head_dim left to hidden_size // heads.
    "small-vocab": (
        dict(
            vocab_size=100,
            hidden_size=64,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=8,
            num_key_value_heads=1,
            head_dim=None,
        ),
        (1, 2, 4, 8),
    ),
}


def fake_tp(rank: int, size: int) -> None:
    parallel_state._TP = types.SimpleNamespace(rank_in_group=rank, world_size=size)  # type: ignore[assignment]


def build(cfg) -> nn.Module:  # noqa: ANN001
    """vLLM's layers of a Llama model under the names ``LlamaForCausalLM.named_parameters()`` gives."""
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    attn_bias = getattr(cfg, "attention_bias", False)
    mlp_bias = getattr(cfg, "mlp_bias", False)
    root = nn.Module()
    root.model = nn.Module()
    root.model.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
    layers = []
    for _ in range(cfg.num_hidden_layers):
        layer = nn.Module()
        layer.self_attn = nn.Module()
        layer.self_attn.qkv_proj = QKVParallelLinear(cfg.hidden_size, head_dim, heads, kv, bias=attn_bias)
        layer.self_attn.o_proj = RowParallelLinear(heads * head_dim, cfg.hidden_size, bias=attn_bias)
        layer.mlp = nn.Module()
        layer.mlp.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, bias=mlp_bias)
        layer.mlp.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=mlp_bias)
        layer.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        layer.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        layers.append(layer)
    root.model.layers = nn.ModuleList(layers)
    root.model.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
    root.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
    # No Llama parameter is a plain ColumnParallelLinear: one more layer, with a bias, for that kind.
    root.column = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, bias=True)
    return root


def checkpoint(cfg, gen: torch.Generator) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """Random bf16 tensors under the Hugging Face names and shapes of ``cfg``."""
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    h, i = cfg.hidden_size, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}"
        shapes |= {
            f"{p}.self_attn.q_proj.weight": (heads * head_dim, h),
            f"{p}.self_attn.k_proj.weight": (kv * head_dim, h),
            f"{p}.self_attn.v_proj.weight": (kv * head_dim, h),
            f"{p}.self_attn.o_proj.weight": (h, heads * head_dim),
            f"{p}.mlp.gate_proj.weight": (i, h),
            f"{p}.mlp.up_proj.weight": (i, h),
            f"{p}.mlp.down_proj.weight": (h, i),
            f"{p}.input_layernorm.weight": (h,),
            f"{p}.post_attention_layernorm.weight": (h,),
        }
        if getattr(cfg, "attention_bias", False):
            shapes |= {
                f"{p}.self_attn.q_proj.bias": (heads * head_dim,),
                f"{p}.self_attn.k_proj.bias": (kv * head_dim,),
                f"{p}.self_attn.v_proj.bias": (kv * head_dim,),
                f"{p}.self_attn.o_proj.bias": (h,),
            }
        if getattr(cfg, "mlp_bias", False):
            shapes |= {f"{p}.mlp.gate_proj.bias": (i,), f"{p}.mlp.up_proj.bias": (i,), f"{p}.mlp.down_proj.bias": (h,)}
    shapes |= {"model.norm.weight": (h,), "lm_head.weight": (cfg.vocab_size, h)}
    shapes |= {"column.weight": (i, h), "column.bias": (i,)}  # the extra ColumnParallelLinear, not Llama's
    return {name: torch.randn(shape, generator=gen).to(torch.bfloat16) for name, shape in shapes.items()}


def changed(tensors: dict[str, torch.Tensor], gen: torch.Generator, count: int = 40) -> dict[str, torch.Tensor]:
    """``tensors`` with ``count`` random elements of each set to new random values."""
    out = {}
    for name, t in tensors.items():
        t = t.clone()
        flat = t.view(-1)
        at = torch.randint(0, flat.numel(), (count,), generator=gen)
        flat[at] = (torch.randn(count, generator=gen) * 3 + 7).to(torch.bfloat16)
        out[name] = t
    return out


def load(root: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    AutoWeightsLoader(root).load_weights(tensors.items(), mapper=LlamaModel.hf_to_vllm_mapper)


def params(root: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.data.detach().clone().contiguous() for name, p in root.named_parameters()}


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_default_dtype(torch.bfloat16)  # vLLM's model dtype (--dtype bfloat16)
    index: dict[str, list[int]] = {}
    for model, (overrides, sizes) in MODELS.items():
        cfg = tiny_config()
        for key, value in overrides.items():
            setattr(cfg, key, value)
        gen = torch.Generator().manual_seed(len(index))
        base = checkpoint(cfg, gen)
        new = changed(base, gen)
        for sub, tensors in (("ckpt", base), ("changed", new)):
            (out / model / sub).mkdir(parents=True)
            column = {n: t for n, t in tensors.items() if n.startswith("column.")}
            save_file(
                {n: t for n, t in tensors.items() if n not in column}, str(out / model / sub / "model.safetensors")
            )
            save_file(column, str(out / model / sub / "column.safetensors"))
            (out / model / sub / "config.json").write_text(cfg.to_json_string())
        (out / model / "ranks").mkdir()
        for size in sizes:
            for rank in range(size):
                fake_tp(rank, size)
                with set_current_vllm_config(VllmConfig()):  # RMSNorm (a CustomOp) reads it to pick a kernel
                    root = build(cfg)
                for p in root.parameters():
                    p.data.view(torch.uint8).fill_(0xA5)
                load(root, base)
                save_file(params(root), str(out / model / "ranks" / f"tp{size}-r{rank}.safetensors"))
                load(root, new)
                save_file(params(root), str(out / model / "ranks" / f"tp{size}-r{rank}-changed.safetensors"))
        index[model] = list(sizes)
    (out / "index.json").write_text(json.dumps(index))
    print(f"wrote {sum(map(sum, index.values()))} rank loads under {out}")


if __name__ == "__main__":
    main()
