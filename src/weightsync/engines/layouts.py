"""Where each checkpoint tensor lies in vLLM's parameters, per tensor-parallel rank (Llama family, vLLM 0.32).

A vLLM parameter on rank ``r`` of a tensor-parallel group of size ``t`` is made
of pieces of checkpoint tensors laid along one dimension: each :class:`Piece` is
``length`` indices of ``source`` along ``dim``, from ``start`` in the source, at
``offset`` in the parameter (all other dimensions whole). What no piece covers
is padding, and vLLM's loader writes zeros there (``VocabParallelEmbedding.
weight_loader``: ``param[n:].fill_(0)``). The layer kinds, as vLLM 0.32 loads
them (``vllm/model_executor/layers/linear.py``, ``vllm/model_executor/
parameter.py``, ``vllm/model_executor/layers/vocab_parallel_embedding.py``,
``vllm/model_executor/models/llama.py``):

- **replicated** (norms, row-parallel biases): the whole tensor on every rank.
- **column** (``ColumnParallelLinear``): rows ``[r*n, (r+1)*n)`` of the
  tensor, ``n = rows / t``.
- **row** (``RowParallelLinear``: ``o_proj``, ``down_proj``): columns
  ``[r*n, (r+1)*n)``, ``n = columns / t`` (dim 1).
- **merged** (``MergedColumnParallelLinear``: ``gate_up_proj``): each part's
  column slice, one after the other (gate rows then up rows of this rank).
- **qkv** (``QKVParallelLinear``): this rank's ``heads / t`` query heads, then
  its key heads and its value heads; with fewer key/value heads than ranks
  each key/value head is replicated on ``t / kv_heads`` consecutive ranks
  (rank ``r`` holds head ``r // (t / kv_heads)``).
- **vocab** (``VocabParallelEmbedding``, ``ParallelLMHead``): the vocabulary
  padded to a multiple of 64, split evenly; rank ``r`` holds the real rows of
  ``[r*n, (r+1)*n)`` and zeros for the padded ones (a rank may hold only
  padding).
- **concatenated** (tensor parallel size 1): the dim-0 concatenation of the
  parameter's :func:`sources` (a fused parameter, or a plain copy). At size 1
  every kind but the vocabulary is this, so every parameter vLLM names gets
  a layout there (any layer type, as disk mode always checked them).

A parameter whose layout cannot be derived (an unknown name on more than one
rank, shapes or head counts that do not divide, a missing source) raises
UnverifiableEngine naming it. :func:`gather` and :func:`chunks` give a rank's
parameter bytes from the checkpoint's; :func:`element_map` says where changed
elements of a checkpoint tensor land on a rank. Pure functions over shapes and
numpy arrays: no torch, no vLLM. ``tests/engines/test_layouts.py`` checks every
kind against vLLM 0.32's own loaders, rank by rank.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from weightsync.engines.errors import UnverifiableEngine

VOCAB_PADDING = 64
"""vLLM's ``DEFAULT_VOCAB_PADDING_SIZE``: embedding and LM-head rows are padded to a multiple of it."""

FUSED: tuple[tuple[str, tuple[str, ...]], ...] = (
    (".qkv_proj.", (".q_proj.", ".k_proj.", ".v_proj.")),
    (".gate_up_proj.", (".gate_proj.", ".up_proj.")),
)
"""Engine parameter part → the checkpoint parts fused into it, in order (vLLM's ``hf_to_vllm_mapper``
``orig_to_new_stacked`` of its Llama-family models: shard ids q, k, v and 0, 1)."""

_QKV = re.compile(r"\.qkv_proj\.(weight|bias)$")
_MERGED = re.compile(r"\.gate_up_proj\.(weight|bias)$")
_ROW = re.compile(r"\.(o_proj|down_proj)\.weight$")
_ROW_BIAS = re.compile(r"\.(o_proj|down_proj)\.bias$")
_VOCAB = re.compile(r"(^|\.)(embed_tokens|lm_head)\.(weight|bias)$")
_NORM = re.compile(r"(^|\.)\w*norm\.(weight|bias)$")


def sources(name: str) -> tuple[str, ...]:
    """The checkpoint tensors the engine parameter ``name`` is made of, in order (itself when not fused)."""
    for fused, parts in FUSED:
        if fused in name:
            return tuple(name.replace(fused, part, 1) for part in parts)
    return (name,)


def target(source: str) -> str:
    """The engine parameter checkpoint tensor ``source`` is loaded into (the inverse of :func:`sources`)."""
    for fused, parts in FUSED:
        for part in parts:
            if part in source:
                return source.replace(part, fused, 1)
    return source


@dataclass(frozen=True)
class ModelConfig:
    """What the layouts need of a model's ``config.json`` (None: the file does not say).

    ``head_dim`` is the config's, else ``hidden_size // num_attention_heads``
    (as vLLM's Llama attention computes it); ``num_key_value_heads`` defaults to
    ``num_attention_heads`` (no grouped-query attention).
    """

    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    vocab_size: int | None = None
    vocab_padding: int = VOCAB_PADDING

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> ModelConfig:
        def number(key: str) -> int | None:
            value = doc.get(key)
            return value if type(value) is int and value > 0 else None

        heads = number("num_attention_heads")
        head_dim = number("head_dim")
        hidden = number("hidden_size")
        if head_dim is None and heads and hidden and hidden % heads == 0:
            head_dim = hidden // heads
        return cls(heads, number("num_key_value_heads") or heads, head_dim, number("vocab_size"))

    @classmethod
    def read(cls, directory: str | os.PathLike[str]) -> ModelConfig:
        """The ``config.json`` of a checkpoint directory; an empty config when there is none.

        UnverifiableEngine when it is there but not a JSON object.
        """
        path = Path(directory) / "config.json"
        try:
            doc = json.loads(path.read_bytes())
        except FileNotFoundError:
            return cls()
        except ValueError as exc:
            raise UnverifiableEngine(f"{path} is not JSON: {exc}") from exc
        if not isinstance(doc, dict):
            raise UnverifiableEngine(f"{path} is not a JSON object")
        return cls.from_dict(doc)


@dataclass(frozen=True)
class Piece:
    """``length`` indices of checkpoint tensor ``source`` along ``dim``, from ``start``, at ``offset`` in the parameter.

    Every other dimension is whole.
    """

    source: str
    dim: int
    start: int
    length: int
    offset: int


@dataclass(frozen=True)
class Layout:
    """One engine parameter on one rank: its shape and the pieces it is made of (the rest is zeros).

    Every piece lies along ``dim``; ``sources`` names every checkpoint tensor
    the parameter is made of on some rank, with its shape (a rank may hold no
    piece of one: a padding-only vocabulary shard). A 0-d tensor counts as
    shape ``(1,)`` (vLLM's loaders reshape it so).
    """

    name: str
    kind: str
    rank: int
    size: int
    shape: tuple[int, ...]
    dim: int
    pieces: tuple[Piece, ...]
    sources: tuple[tuple[str, tuple[int, ...]], ...]

    def source_shape(self, source: str) -> tuple[int, ...]:
        for name, shape in self.sources:
            if name == source:
                return shape
        raise KeyError(source)

    @property
    def padding(self) -> tuple[tuple[int, int], ...]:
        """The ``(offset, length)`` ranges along ``dim`` that no piece covers: zeros in the engine."""
        out, at = [], 0
        for p in sorted(self.pieces, key=lambda p: p.offset):
            if p.offset > at:
                out.append((at, p.offset - at))
            at = p.offset + p.length
        if at < self.shape[self.dim]:
            out.append((at, self.shape[self.dim] - at))
        return tuple(out)

    @property
    def whole(self) -> bool:
        """True when the parameter's bytes are its pieces' sources' bytes, whole, in offset order (no padding)."""
        return (
            (self.dim == 0 or len(self.pieces) == 1)
            and not self.padding
            and all(p.start == 0 and p.length == _as_nd(self.source_shape(p.source))[self.dim] for p in self.pieces)
        )


def _rows(shape: tuple[int, ...]) -> int:
    return shape[0] if shape else 1


def _as_nd(shape: tuple[int, ...]) -> tuple[int, ...]:
    return shape if shape else (1,)


def _divide(name: str, what: str, n: int, size: int) -> int:
    if n % size:
        raise UnverifiableEngine(f"engine parameter {name!r}: {what} {n} does not divide into {size} ranks")
    return n // size


def _check(name: str, rank: int, size: int) -> None:
    if size < 1 or not 0 <= rank < size:
        raise UnverifiableEngine(f"engine parameter {name!r}: rank {rank} of a tensor-parallel size {size}")


def layout(
    name: str,
    shapes: Mapping[str, tuple[int, ...]],
    config: ModelConfig | None = None,
    *,
    rank: int = 0,
    size: int = 1,
) -> Layout:
    """The layout of engine parameter ``name`` on ``rank`` of ``size``, from the checkpoint's tensor ``shapes``.

    ``config`` gives the head counts (needed to split ``qkv_proj`` over more
    than one rank) and the vocabulary size (else the embedding's rows).
    UnverifiableEngine naming the parameter when a source is missing or the
    layout cannot be derived.
    """
    _check(name, rank, size)
    config = config or ModelConfig()
    parts = sources(name)
    missing = [p for p in parts if p not in shapes]
    if missing:
        raise UnverifiableEngine(
            f"engine parameter {name!r} has no source in the checkpoint (looked for {', '.join(missing)})"
        )
    got = {p: tuple(shapes[p]) for p in parts}
    if _VOCAB.search(name):
        return vocab(name, parts[0], got[parts[0]], config, rank=rank, size=size)
    if size == 1:
        return concatenated(name, parts, got)
    if _QKV.search(name):
        q, k, v = parts
        return qkv(name, q, k, v, got, config, rank=rank, size=size)
    if _MERGED.search(name):
        return merged(name, parts, got, rank=rank, size=size)
    if _ROW.search(name):
        return row(name, parts[0], got[parts[0]], rank=rank, size=size)
    if _NORM.search(name) or _ROW_BIAS.search(name):
        return replicated(name, parts[0], got[parts[0]], rank=rank, size=size)
    raise UnverifiableEngine(
        f"engine parameter {name!r}: its tensor-parallel layout is unknown (not a Llama-family layer)"
    )


def concatenated(name: str, parts: Sequence[str], shapes: Mapping[str, tuple[int, ...]]) -> Layout:
    """``parts`` whole, one after the other on dim 0 (one rank)."""
    dims = [_as_nd(shapes[p]) for p in parts]
    if len({d[1:] for d in dims}) != 1:
        raise UnverifiableEngine(f"engine parameter {name!r} fuses tensors of different shapes {dims}")
    pieces, at = [], 0
    for p, d in zip(parts, dims, strict=True):
        pieces.append(Piece(p, 0, 0, d[0], at))
        at += d[0]
    shape = shapes[parts[0]] if len(parts) == 1 else (at, *dims[0][1:])
    return Layout(name, "concatenated", 0, 1, shape, 0, tuple(pieces), tuple((p, shapes[p]) for p in parts))


def replicated(name: str, source: str, shape: tuple[int, ...], *, rank: int = 0, size: int = 1) -> Layout:
    """The whole tensor on every rank (norms, row-parallel biases)."""
    _check(name, rank, size)
    piece = Piece(source, 0, 0, _rows(shape), 0)
    return Layout(name, "replicated", rank, size, shape, 0, (piece,), ((source, shape),))


def column(name: str, source: str, shape: tuple[int, ...], *, rank: int = 0, size: int = 1) -> Layout:
    """``ColumnParallelLinear``: this rank's equal share of the rows (output features)."""
    _check(name, rank, size)
    full = _as_nd(shape)
    n = _divide(name, "rows", full[0], size)
    piece = Piece(source, 0, rank * n, n, 0)
    return Layout(name, "column", rank, size, (n, *full[1:]), 0, (piece,), ((source, shape),))


def row(name: str, source: str, shape: tuple[int, ...], *, rank: int = 0, size: int = 1) -> Layout:
    """``RowParallelLinear``: this rank's equal share of the columns (input features, dim 1)."""
    _check(name, rank, size)
    if len(shape) != 2:
        raise UnverifiableEngine(f"engine parameter {name!r}: a row-parallel weight of shape {shape} is not 2-D")
    n = _divide(name, "columns", shape[1], size)
    piece = Piece(source, 1, rank * n, n, 0)
    return Layout(name, "row", rank, size, (shape[0], n), 1, (piece,), ((source, shape),))


def merged(
    name: str, parts: Sequence[str], shapes: Mapping[str, tuple[int, ...]], *, rank: int = 0, size: int = 1
) -> Layout:
    """``MergedColumnParallelLinear``: each part's column-parallel share, in order, on dim 0."""
    _check(name, rank, size)
    dims = [_as_nd(shapes[p]) for p in parts]
    if len({d[1:] for d in dims}) != 1:
        raise UnverifiableEngine(f"engine parameter {name!r} fuses tensors of different shapes {dims}")
    pieces, at = [], 0
    for p, d in zip(parts, dims, strict=True):
        n = _divide(name, f"{p} rows", d[0], size)
        pieces.append(Piece(p, 0, rank * n, n, at))
        at += n
    return Layout(
        name, "merged", rank, size, (at, *dims[0][1:]), 0, tuple(pieces), tuple((p, shapes[p]) for p in parts)
    )


def qkv(
    name: str,
    q: str,
    k: str,
    v: str,
    shapes: Mapping[str, tuple[int, ...]],
    config: ModelConfig,
    *,
    rank: int = 0,
    size: int = 1,
) -> Layout:
    """``QKVParallelLinear``: this rank's query heads, then its key heads, then its value heads, on dim 0.

    With fewer key/value heads than ranks, vLLM gives each rank one key/value
    head and replicates each head on ``size // kv_heads`` consecutive ranks.
    """
    _check(name, rank, size)
    srcs = ((q, shapes[q]), (k, shapes[k]), (v, shapes[v]))
    dims = [_as_nd(s) for _, s in srcs]
    if len({d[1:] for d in dims}) != 1:
        raise UnverifiableEngine(f"engine parameter {name!r} fuses tensors of different shapes {dims}")
    if size == 1:
        out = concatenated(name, (q, k, v), shapes)
        return Layout(name, "qkv", 0, 1, out.shape, 0, out.pieces, out.sources)
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    if heads is None or kv_heads is None or head_dim is None:
        raise UnverifiableEngine(
            f"engine parameter {name!r}: splitting it over {size} ranks needs the head counts and head_dim "
            "of the model's config.json"
        )
    if dims[0][0] != heads * head_dim or dims[1][0] != kv_heads * head_dim or dims[2][0] != kv_heads * head_dim:
        raise UnverifiableEngine(
            f"engine parameter {name!r}: q/k/v rows {dims[0][0]}/{dims[1][0]}/{dims[2][0]} do not match "
            f"{heads}/{kv_heads} heads of {head_dim}"
        )
    q_rows = _divide(name, "attention heads", heads, size) * head_dim
    if kv_heads >= size:
        kv_rows = _divide(name, "key/value heads", kv_heads, size) * head_dim
        kv_start = rank * kv_rows
    else:
        replicas = _divide(name, "ranks per key/value head", size, kv_heads)
        kv_rows, kv_start = head_dim, (rank // replicas) * head_dim
    pieces = (
        Piece(q, 0, rank * q_rows, q_rows, 0),
        Piece(k, 0, kv_start, kv_rows, q_rows),
        Piece(v, 0, kv_start, kv_rows, q_rows + kv_rows),
    )
    return Layout(name, "qkv", rank, size, (q_rows + 2 * kv_rows, *dims[0][1:]), 0, pieces, srcs)


def vocab(
    name: str, source: str, shape: tuple[int, ...], config: ModelConfig, *, rank: int = 0, size: int = 1
) -> Layout:
    """``VocabParallelEmbedding`` / ``ParallelLMHead``: the vocabulary padded to a multiple of 64, split evenly.

    Rank ``r`` holds rows ``[r*n, (r+1)*n)`` of the padded vocabulary: the
    checkpoint's rows that exist, then zeros. (vLLM's LoRA-added vocabulary
    is not laid out here: the checkpoint's vocabulary is the whole one.)
    """
    _check(name, rank, size)
    full = _as_nd(shape)
    vocab_size = config.vocab_size or full[0]
    if vocab_size != full[0]:
        raise UnverifiableEngine(
            f"engine parameter {name!r}: {full[0]} rows in the checkpoint but vocab_size {vocab_size} in the config"
        )
    padded = -(-vocab_size // config.vocab_padding) * config.vocab_padding
    n = _divide(name, "padded vocabulary rows", padded, size)
    start, end = min(rank * n, vocab_size), min((rank + 1) * n, vocab_size)
    pieces = (Piece(source, 0, start, end - start, 0),) if end > start else ()
    return Layout(name, "vocab", rank, size, (n, *full[1:]), 0, pieces, ((source, shape),))


# --- bytes ------------------------------------------------------------------------------------


def _views(layout: Layout, arrays: Mapping[str, np.ndarray]) -> tuple[np.dtype[Any], dict[str, np.ndarray]]:
    """Each source as ``(outer, along dim, inner)``, checked against the layout's shapes; their one dtype."""
    out: dict[str, np.ndarray] = {}
    for source, shape in layout.sources:
        a = arrays[source]
        if tuple(a.shape) != tuple(shape):
            raise UnverifiableEngine(f"engine parameter {layout.name!r}: {source} is {a.shape}, expected {shape}")
        nd = _as_nd(shape)
        out[source] = a.reshape(math.prod(nd[: layout.dim]), nd[layout.dim], math.prod(nd[layout.dim + 1 :]))
    dtypes = {a.dtype for a in out.values()}
    if len(dtypes) != 1:
        raise UnverifiableEngine(f"engine parameter {layout.name!r} fuses tensors of different dtypes")
    return dtypes.pop(), out


def gather(layout: Layout, arrays: Mapping[str, np.ndarray]) -> np.ndarray:
    """The parameter's values on its rank, from the checkpoint tensors ``arrays`` (by name): zeros where padded."""
    dtype, views = _views(layout, arrays)
    shape = _as_nd(layout.shape)
    out = np.zeros((math.prod(shape[: layout.dim]), shape[layout.dim], math.prod(shape[layout.dim + 1 :])), dtype)
    for p in layout.pieces:
        out[:, p.offset : p.offset + p.length] = views[p.source][:, p.start : p.start + p.length]
    return out.reshape(layout.shape)


def chunks(layout: Layout, arrays: Mapping[str, np.ndarray], *, block_bytes: int = 1 << 22) -> Iterator[np.ndarray]:
    """The parameter's bytes in order, as contiguous arrays: :func:`gather` without building the parameter.

    Pieces along dim 0 come out as views of the sources (no copy: memory maps
    stay maps); along another dim, blocks of about ``block_bytes`` are copied.
    """
    dtype, views = _views(layout, arrays)
    shape = _as_nd(layout.shape)
    along, inner = shape[layout.dim], math.prod(shape[layout.dim + 1 :])
    outer = math.prod(shape[: layout.dim])
    segments: list[tuple[int, Piece | None, int]] = [(p.offset, p, p.length) for p in layout.pieces]
    segments += [(offset, None, length) for offset, length in layout.padding]
    segments.sort(key=lambda s: s[0])
    if outer == 1:
        for _, piece, length in segments:
            if piece is None:
                yield np.zeros(length * inner, dtype)
            else:
                yield views[piece.source][0, piece.start : piece.start + length].reshape(-1)
        return
    step = max(1, block_bytes // max(1, along * inner * dtype.itemsize))
    for i in range(0, outer, step):
        block = np.zeros((min(step, outer - i), along, inner), dtype)
        for offset, piece, length in segments:
            if piece is not None:
                block[:, offset : offset + length] = views[piece.source][
                    i : i + step, piece.start : piece.start + length
                ]
        yield block.reshape(-1)


def element_map(layout: Layout, source: str, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where elements of checkpoint tensor ``source`` (flat ``indices``) land in the parameter on this rank.

    Returns ``(which, where)``: ``indices[which]`` are the elements this rank
    holds, at flat positions ``where`` of the parameter (an element held in two
    pieces appears twice). Elements of other ranks' slices are left out.
    """
    src = _as_nd(layout.source_shape(source))
    dst = _as_nd(layout.shape)
    flat = np.asarray(indices, dtype=np.int64).reshape(-1)
    size = math.prod(src)
    if flat.size and (flat.min() < 0 or flat.max() >= size):
        raise IndexError(f"element index out of range for {source} of shape {src}")
    inner_src = math.prod(src[layout.dim + 1 :])
    inner_dst = math.prod(dst[layout.dim + 1 :])
    outer, rest = np.divmod(flat, src[layout.dim] * inner_src)
    along, inner = np.divmod(rest, inner_src)
    which: list[np.ndarray] = []
    where: list[np.ndarray] = []
    for p in layout.pieces:
        if p.source != source:
            continue
        hit = np.flatnonzero((along >= p.start) & (along < p.start + p.length))
        which.append(hit)
        where.append((outer[hit] * dst[layout.dim] + along[hit] - p.start + p.offset) * inner_dst + inner[hit])
    if not which:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(which), np.concatenate(where)
