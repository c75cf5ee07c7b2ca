"""Two small models written directly in torch, trained for real steps to produce version trajectories.

- :class:`MiniBert`: the BERT encoder of all-MiniLM-L6-v2 (post-LN, learned absolute position and
  token-type embeddings, erf-GELU), parameter names identical to the shipped checkpoint, plus an MLM
  head tied to the word embeddings with a fresh output bias (the bias is not exported).
- :class:`TinyMoE`: a decoder-only mixture-of-experts transformer (pre-RMSNorm, RoPE causal attention,
  top-k softmax router, SwiGLU experts stored as separate per-expert tensors ``layers.L.experts.E.w1``).

Dropout is left out on purpose: it would only add RNG state to the trajectory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int = 30522
    hidden_size: int = 384
    num_hidden_layers: int = 6
    num_attention_heads: int = 12
    intermediate_size: int = 1536
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12

    @classmethod
    def from_json(cls, d: dict) -> BertConfig:
        if d.get("hidden_act", "gelu") != "gelu" or d.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError("MiniBert implements only hidden_act=gelu with absolute position embeddings")
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


class MiniBert(nn.Module):
    """Parameters live in a flat ParameterDict keyed by the checkpoint's tensor names."""

    def __init__(self, cfg: BertConfig, weights: dict[str, torch.Tensor]):
        super().__init__()
        self.cfg = cfg
        self.names = [n for n, t in weights.items() if t.is_floating_point()]
        # ParameterDict keys may not contain "."; keep a mapping.
        self.p = nn.ParameterDict({n.replace(".", "/"): nn.Parameter(weights[n].float().clone()) for n in self.names})
        self.buffers_ = {n: t.clone() for n, t in weights.items() if not t.is_floating_point()}
        self.mlm_bias = nn.Parameter(torch.zeros(cfg.vocab_size))

    def w(self, name: str) -> torch.Tensor:
        return self.p[name.replace(".", "/")]

    def named_weights(self) -> dict[str, torch.Tensor]:
        """Exportable tensors under their checkpoint names (fp32 masters + non-float buffers)."""
        out = {n: self.w(n).detach() for n in self.names}
        out.update(self.buffers_)
        return out

    def _ln(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        return F.layer_norm(
            x, (x.shape[-1],), self.w(prefix + ".weight"), self.w(prefix + ".bias"), self.cfg.layer_norm_eps
        )

    def _lin(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        return F.linear(x, self.w(prefix + ".weight"), self.w(prefix + ".bias"))

    def encode(self, ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        cfg = self.cfg
        b, t = ids.shape
        pos = torch.arange(t)
        x = (
            F.embedding(ids, self.w("embeddings.word_embeddings.weight"))
            + self.w("embeddings.position_embeddings.weight")[pos]
            + self.w("embeddings.token_type_embeddings.weight")[torch.zeros_like(ids)]
        )
        x = self._ln(x, "embeddings.LayerNorm")
        nh = cfg.num_attention_heads
        hd = cfg.hidden_size // nh
        bias = None
        if attention_mask is not None:
            bias = (1.0 - attention_mask[:, None, None, :].float()) * torch.finfo(torch.float32).min
        for i in range(cfg.num_hidden_layers):
            pre = f"encoder.layer.{i}."

            def heads(y: torch.Tensor) -> torch.Tensor:
                return y.view(b, t, nh, hd).transpose(1, 2)

            q = heads(self._lin(x, pre + "attention.self.query"))
            k = heads(self._lin(x, pre + "attention.self.key"))
            v = heads(self._lin(x, pre + "attention.self.value"))
            scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
            if bias is not None:
                scores = scores + bias
            ctx = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, cfg.hidden_size)
            x = self._ln(self._lin(ctx, pre + "attention.output.dense") + x, pre + "attention.output.LayerNorm")
            h = F.gelu(self._lin(x, pre + "intermediate.dense"))  # erf GELU, as BERT's "gelu"
            x = self._ln(self._lin(h, pre + "output.dense") + x, pre + "output.LayerNorm")
        return x

    def mlm_loss(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """labels: -100 where no prediction is asked. The decoder is tied to the word embeddings."""
        h = self.encode(ids)
        sel = labels != -100
        logits = F.linear(h[sel], self.w("embeddings.word_embeddings.weight"), self.mlm_bias)
        return F.cross_entropy(logits, labels[sel])


@dataclass(frozen=True)
class MoEConfig:
    vocab_size: int = 30522
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    experts: int = 8
    top_k: int = 2
    expert_hidden: int = 512
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    init_std: float = 0.02
    # Per-expert router bias at init, spread linearly over [-router_skew, +router_skew]: a stand-in for
    # the load imbalance of a trained router, so that small batches leave some experts unrouted.
    router_skew: float = 0.5


class TinyMoE(nn.Module):
    def __init__(self, cfg: MoEConfig, seed: int):
        super().__init__()
        self.cfg = cfg
        g = torch.Generator().manual_seed(seed)
        h, f = cfg.hidden, cfg.expert_hidden
        shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (cfg.vocab_size, h)}
        for layer in range(cfg.layers):
            p = f"layers.{layer}."
            shapes[p + "attn_norm.weight"] = (h,)
            for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
                shapes[p + f"attn.{n}.weight"] = (h, h)
            shapes[p + "ffn_norm.weight"] = (h,)
            shapes[p + "router.weight"] = (cfg.experts, h)
            shapes[p + "router.bias"] = (cfg.experts,)
            for e in range(cfg.experts):
                shapes[p + f"experts.{e}.w1"] = (f, h)  # gate
                shapes[p + f"experts.{e}.w3"] = (f, h)  # up
                shapes[p + f"experts.{e}.w2"] = (h, f)  # down
        shapes["norm.weight"] = (h,)
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
        self.names = list(shapes)
        params = {}
        for n, s in shapes.items():
            if n.endswith("norm.weight"):
                t = torch.ones(s)
            elif n.endswith("router.bias"):
                t = torch.linspace(cfg.router_skew, -cfg.router_skew, cfg.experts)
            else:
                t = torch.randn(s, generator=g) * cfg.init_std
            params[n.replace(".", "/")] = nn.Parameter(t)
        self.p = nn.ParameterDict(params)
        hd = h // cfg.heads
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        self._inv_freq = inv
        self.last_routed: list[set[int]] = []

    def w(self, name: str) -> torch.Tensor:
        return self.p[name.replace(".", "/")]

    def named_weights(self) -> dict[str, torch.Tensor]:
        return {n: self.w(n).detach() for n in self.names}

    def expert_params(self, layer: int, expert: int) -> list[torch.Tensor]:
        return [self.w(f"layers.{layer}.experts.{expert}.{k}") for k in ("w1", "w2", "w3")]

    def _rms(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.w(name), self.cfg.norm_eps)

    def _rope(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[-2]
        ang = torch.arange(t, dtype=torch.float32)[:, None] * self._inv_freq[None, :]
        cos, sin = ang.cos(), ang.sin()
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)

    def lm_loss(self, ids: torch.Tensor) -> torch.Tensor:
        """Next-token loss; records in ``last_routed`` which experts each layer routed tokens to."""
        cfg = self.cfg
        b, t = ids.shape
        nh, hd = cfg.heads, cfg.hidden // cfg.heads
        x = F.embedding(ids, self.w("embed_tokens.weight"))
        self.last_routed = []
        for layer in range(cfg.layers):
            p = f"layers.{layer}."
            y = self._rms(x, p + "attn_norm.weight")
            q, k, v = (
                F.linear(y, self.w(p + f"attn.{n}.weight")).view(b, t, nh, hd).transpose(1, 2)
                for n in ("q_proj", "k_proj", "v_proj")
            )
            a = F.scaled_dot_product_attention(self._rope(q), self._rope(k), v, is_causal=True)
            x = x + F.linear(a.transpose(1, 2).reshape(b, t, cfg.hidden), self.w(p + "attn.o_proj.weight"))
            y = self._rms(x, p + "ffn_norm.weight").reshape(b * t, cfg.hidden)
            probs = F.linear(y, self.w(p + "router.weight"), self.w(p + "router.bias")).softmax(-1)
            topw, topi = probs.topk(cfg.top_k, dim=-1)
            topw = topw / topw.sum(-1, keepdim=True)
            out = torch.zeros_like(y)
            routed = set()
            for e in range(cfg.experts):
                tok, slot = (topi == e).nonzero(as_tuple=True)
                if tok.numel() == 0:
                    continue  # expert unused: its tensors take no part in the graph, grad stays None
                routed.add(e)
                w1, w2, w3 = self.expert_params(layer, e)
                ye = y[tok]
                he = F.silu(F.linear(ye, w1)) * F.linear(ye, w3)
                out = out.index_add(0, tok, F.linear(he, w2) * topw[tok, slot, None])
            self.last_routed.append(routed)
            x = x + out.view(b, t, cfg.hidden)
        x = self._rms(x, "norm.weight")
        logits = F.linear(x[:, :-1], self.w("lm_head.weight"))
        return F.cross_entropy(logits.reshape(-1, cfg.vocab_size), ids[:, 1:].reshape(-1))
