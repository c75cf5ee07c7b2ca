"""A Llama-style decoder in plain torch, sized to a byte budget, trained for real steps: the scale bench's model.

The recipe is device_probe.py's (issue 11's H100 model), without the transformers package: random
initialisation (normal, std 0.02; RMSNorm weights 1), bf16 parameters, AdamW at lr 1e-6 (fused on
CUDA, foreach on the CPU) on random tokens (the CPU computes the forward in fp32), untied
embeddings, tensor names as Hugging Face's Llama checkpoints (``model.layers.0.self_attn.q_proj.weight``
...). Version 0 is the state after one step: Adam's first step moves nearly every weight by lr, so
the versions that follow are steady-state steps, where only weights with |w| below ~256·lr change
in bf16: 0.5-0.7 % of the elements at lr 1e-6 (run Y), 2.1-2.9 % at 5e-6 (a 100 MB model's steps
2-4 on the CPU), about the density of issue 11's 5.63 GB case (Adam's first step at 1e-6: 2.75 %);
``lr`` picks it. The fraction falls a little from step to step as Adam's second moments grow.

:func:`ensure_versions` caches the exported versions under ``<cache>/llama-h…-l…-v…-<device>/v0000
...`` keyed by the shape, the recipe and the device kind (CPU and CUDA kernels give different bytes).
"""

from __future__ import annotations

import json
import math
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

GENERATOR_VERSION = 2  # bump when anything changes the bytes produced
MAX_VOCAB = 32000  # device_probe's LlamaConfig


@dataclass(frozen=True)
class LlamaShape:
    """The model's dimensions (key/value heads = attention heads, as device_probe's config)."""

    vocab: int
    hidden: int
    layers: int
    intermediate: int
    heads: int

    @property
    def per_layer(self) -> int:
        h, i = self.hidden, self.intermediate
        return 4 * h * h + 3 * h * i + 2 * h

    @property
    def params(self) -> int:
        return 2 * self.vocab * self.hidden + self.hidden + self.layers * self.per_layer

    @classmethod
    def of(cls, hidden: int, layers: int, vocab: int = MAX_VOCAB) -> LlamaShape:
        """device_probe's shape rule: SwiGLU width ~8/3 hidden, 128-wide heads (64 below 1024)."""
        step = 256 if hidden >= 768 else 64
        head_dim = 128 if hidden >= 1024 else 64
        return cls(vocab, hidden, layers, max(step, hidden * 8 // 3 // step * step), max(1, hidden // head_dim))

    @classmethod
    def for_bytes(cls, nbytes: int) -> LlamaShape:
        """The shape whose bf16 weights come closest to `nbytes`, with Llama's depth-to-width ratio.

        Depth follows hidden / 118 (3072 → 26 layers, the issue's H100 model); the vocabulary is
        32000 unless its two embedding matrices would exceed half the model (small budgets).
        """
        want = nbytes // 2
        best: LlamaShape | None = None
        for hidden in range(64, 16385, 64):
            if hidden >= 1024 and hidden % 128:
                continue  # 128-wide heads (cls.of): a width they do not divide has no attention shape
            vocab = max(256, min(MAX_VOCAB, want // (4 * hidden) // 64 * 64))
            shape = cls.of(hidden, max(1, round(hidden / 118)), vocab)
            if best is None or abs(shape.params - want) < abs(best.params - want):
                best = shape
        assert best is not None
        rest = want - (best.params - best.layers * best.per_layer)
        return cls.of(best.hidden, max(1, round(rest / best.per_layer)), best.vocab)


class Llama(nn.Module):
    """Pre-RMSNorm decoder, RoPE causal attention, SwiGLU MLP; parameters keyed by checkpoint name."""

    def __init__(self, shape: LlamaShape, *, device: str, compute: torch.dtype = torch.bfloat16):
        super().__init__()
        self.shape = shape
        self.compute = compute
        h, i = shape.hidden, shape.intermediate
        dims: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (shape.vocab, h)}
        for n in range(shape.layers):
            p = f"model.layers.{n}."
            dims |= {p + f"self_attn.{k}_proj.weight": (h, h) for k in "qkvo"}
            dims |= {
                p + "mlp.gate_proj.weight": (i, h),
                p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
            }
            dims |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
        dims |= {"model.norm.weight": (h,), "lm_head.weight": (shape.vocab, h)}
        self.names = list(dims)
        self.p = nn.ParameterDict(
            {
                n.replace(".", "/"): nn.Parameter(
                    torch.ones(d, device=device, dtype=torch.bfloat16)
                    if len(d) == 1
                    else torch.empty(d, device=device, dtype=torch.bfloat16).normal_(0.0, 0.02)
                )
                for n, d in dims.items()
            }
        )

    def w(self, name: str) -> torch.Tensor:
        """A bf16 parameter as the forward computes with it (cast: gradients flow back in bf16)."""
        return self.p[name.replace(".", "/")].to(self.compute)

    def named_weights(self) -> dict[str, torch.Tensor]:
        """The bf16 weights under their checkpoint names, copied to host memory (what an export writes)."""
        return {n: self.p[n.replace(".", "/")].detach().to("cpu", copy=True).contiguous() for n in self.names}

    def _rms(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(x.dtype) * self.w(name)

    def _rope(self, x: torch.Tensor) -> torch.Tensor:
        t, d = x.shape[-2], x.shape[-1]
        inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
        ang = torch.outer(torch.arange(t, device=x.device, dtype=torch.float32), inv)
        cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
        a, b = x[..., ::2], x[..., 1::2]
        return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)

    def lm_loss(self, ids: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy of `ids` (batch, time)."""
        s = self.shape
        x = F.embedding(ids, self.w("model.embed_tokens.weight"))
        bsz, t, h = x.shape
        for n in range(s.layers):
            p = f"model.layers.{n}."
            y = self._rms(x, p + "input_layernorm.weight")
            q, k, v = (
                F.linear(y, self.w(p + f"self_attn.{c}_proj.weight"))
                .view(bsz, t, s.heads, h // s.heads)
                .transpose(1, 2)
                for c in "qkv"
            )
            a = F.scaled_dot_product_attention(self._rope(q), self._rope(k), v, is_causal=True)
            x = x + F.linear(a.transpose(1, 2).reshape(bsz, t, h), self.w(p + "self_attn.o_proj.weight"))
            y = self._rms(x, p + "post_attention_layernorm.weight")
            gate = F.silu(F.linear(y, self.w(p + "mlp.gate_proj.weight"))) * F.linear(
                y, self.w(p + "mlp.up_proj.weight")
            )
            x = x + F.linear(gate, self.w(p + "mlp.down_proj.weight"))
        logits = F.linear(self._rms(x, "model.norm.weight"), self.w("lm_head.weight"))
        return F.cross_entropy(logits[:, :-1].float().reshape(-1, s.vocab), ids[:, 1:].reshape(-1))


def trajectory(shape: LlamaShape, steps: int, *, device: str, seed: int = 0, lr: float = 1e-6) -> Iterator[dict]:
    """Weights after the first step (version 0), then after each of `steps` more AdamW steps."""
    torch.manual_seed(seed)
    cuda = device.startswith("cuda")
    # Parameters, gradients and optimizer state are bf16 everywhere; the CPU computes the forward in
    # fp32, which CPUs without bf16 units run ~3x faster (the step's updates are what matter here).
    model = Llama(shape, device=device, compute=torch.bfloat16 if cuda else torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=cuda, foreach=not cuda)
    batch, seq = (2, 256) if cuda else (1, 128)  # random tokens: the batch only sets the step's cost
    gen = torch.Generator(device=device).manual_seed(seed)
    for _ in range(steps + 1):
        ids = torch.randint(0, shape.vocab, (batch, seq), device=device, generator=gen)
        model.lm_loss(ids).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        yield model.named_weights()


def _changed(base: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> float:
    """Fraction of bf16 elements whose bits differ between two versions."""
    diff = sum(int((base[k].view(torch.int16) != v.view(torch.int16)).sum()) for k, v in new.items())
    return diff / sum(v.numel() for v in new.values())


DEFAULT_LR = 1e-6


def ensure_versions(
    shape: LlamaShape,
    versions: int,
    cache: Path,
    *,
    device: str,
    lr: float = DEFAULT_LR,
    log: Callable[[str], None] = print,
) -> tuple[list[Path], dict]:
    """Version directories v0000 .. v{versions-1} (each ``model.safetensors``) and their meta, generated if missing
    (AdamW at `lr`: a cache of its own per lr)."""
    from safetensors.torch import save_file

    key = {
        "generator": GENERATOR_VERSION,
        "shape": asdict(shape),
        "lr": lr,
        "seed": 0,
        "device": device.split(":")[0],
    }
    at = "" if lr == DEFAULT_LR else f"-lr{lr:g}"
    root = cache / f"llama-h{shape.hidden}-l{shape.layers}-v{shape.vocab}-{key['device']}{at}"
    dirs = [root / f"v{i:04d}" for i in range(versions)]
    try:
        meta = json.loads((root / "meta.json").read_text())
        if (
            meta["key"] == key
            and meta["versions"] >= versions
            and all((d / "model.safetensors").is_file() for d in dirs)
        ):
            return dirs, meta
    except (OSError, ValueError, KeyError):
        pass
    log(
        f"generating a {shape.params * 2 / 1e6:.0f} MB Llama-style model ({shape}), {versions} versions on {device}"
        f" at lr {lr:g}"
    )
    shutil.rmtree(root, ignore_errors=True)
    t0, prev, fractions = time.perf_counter(), None, []
    for i, weights in enumerate(trajectory(shape, versions - 1, device=device, lr=lr)):
        dirs[i].mkdir(parents=True)
        save_file(weights, str(dirs[i] / "model.safetensors"), metadata={"format": "pt"})
        if prev is not None:
            fractions.append(_changed(prev, weights))
            log(f"  v{i}: {100 * fractions[-1]:.3f} % of elements changed")
        prev = weights
    meta = {
        "key": key,
        "versions": versions,
        "seconds": round(time.perf_counter() - t0, 1),
        "changed_fraction": fractions,
    }
    (root / "meta.json").write_text(json.dumps(meta, indent=1))
    return dirs, meta


def human_size(nbytes: float) -> str:
    """Decimal units, as the corpus names its sizes: ``436M``, ``2G``."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.{0 if nbytes % scale == 0 or nbytes >= 100 * scale else 1}f}{unit}"
    return f"{math.floor(nbytes)}B"
