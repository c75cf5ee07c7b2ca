"""What an engine's parameter digests must be for a version: SHA-256 per engine parameter, from the checkpoint.

vLLM's ``/weight_checker`` answers the SHA-256 of every parameter's bytes
(docs/ENGINES.md "vLLM facts"). An engine fuses some checkpoint tensors into
one parameter: ``qkv_proj`` is ``q_proj``, ``k_proj``, ``v_proj`` concatenated on
dim 0, ``gate_up_proj`` is ``gate_proj``, ``up_proj``. A dim-0 concatenation of
row-major tensors is the concatenation of their bytes, so the expected digest
of a fused parameter is the SHA-256 of its parts' bytes in order, read straight
from the safetensors files: no torch, no copy (memory maps).

A tensor-parallel engine answers one digest per parameter per rank, each of
that rank's slice: engines/layouts.py says which pieces of which checkpoint
tensors the slice is (and where vLLM pads with zeros), and the slice's bytes
are hashed in that order. Such digests are keyed :func:`rank_key`
(``tp<rank>/<size>:<name>``); at size 1 the key is the bare name.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from weightsync.codec import safetensors
from weightsync.codec.checkpoint import SAFETENSORS_SUFFIX
from weightsync.codec.dtypes import UINT, by_name
from weightsync.engines import layouts
from weightsync.engines.errors import UnverifiableEngine
from weightsync.engines.layouts import FUSED, sources

__all__ = [
    "EMPTY",
    "FUSED",
    "TensorBytes",
    "bytes_dropped",
    "differing",
    "expected",
    "index",
    "parse_key",
    "rank_key",
    "sources",
]

RANK_KEY = re.compile(r"^tp(\d+)/(\d+):(.+)$")
"""A parameter on one rank of a tensor-parallel engine: ``tp<rank>/<size>:<name>`` (:func:`rank_key`)."""


def rank_key(name: str, rank: int, size: int) -> str:
    """The key of parameter ``name`` on ``rank`` of a tensor-parallel group of ``size``: the bare name at size 1."""
    return name if size == 1 else f"tp{rank}/{size}:{name}"


def parse_key(key: str) -> tuple[str, int, int]:
    """``(name, rank, size)`` of a key made by :func:`rank_key`."""
    found = RANK_KEY.match(key)
    if found is None:
        return key, 0, 1
    rank, size = int(found.group(1)), int(found.group(2))
    if not 0 <= rank < size:
        raise UnverifiableEngine(f"engine parameter key {key!r}: rank {rank} is not in a group of {size}")
    return found.group(3), rank, size


@dataclass(frozen=True)
class TensorBytes:
    """Where one checkpoint tensor's bytes lie: a file and a byte range in it; its dtype and shape."""

    path: Path
    start: int
    end: int
    dtype: str
    shape: tuple[int, ...] = ()


def index(directory: str | os.PathLike[str]) -> dict[str, TensorBytes]:
    """Every tensor of the top-level safetensors files of ``directory`` (what vLLM loads), by name.

    Headers are parsed completely (weightsync.codec.safetensors); a tensor name
    in two files raises UnverifiableEngine (which one the engine loaded is unknown).
    """
    out: dict[str, TensorBytes] = {}
    root = Path(directory)
    for path in sorted(root.iterdir()):
        if not path.name.endswith(SAFETENSORS_SUFFIX) or path.name.startswith(".") or not path.is_file():
            continue
        size = path.stat().st_size
        with open(path, "rb") as f:
            total = safetensors.header_length(f.read(8), size)
            f.seek(0)
            layout = safetensors.parse(f.read(total), size)
        for span in layout.tensors:
            if span.name in out:
                raise UnverifiableEngine(f"tensor {span.name!r} is in both {out[span.name].path.name} and {path.name}")
            out[span.name] = TensorBytes(path, span.start, span.end, span.dtype.name, span.shape)
    return out


def expected(directory: str | os.PathLike[str], names: Iterable[str], *, threads: int | None = None) -> dict[str, str]:
    """The SHA-256 hex digest each engine parameter in ``names`` must have when the engine holds ``directory``.

    A name is a parameter's, or a :func:`rank_key` for one rank of a
    tensor-parallel engine: that rank's slice is hashed, laid out as vLLM
    loads it (engines/layouts.py; the head counts and vocabulary size from the
    directory's ``config.json``, read only for sizes above 1). A parameter that
    is its sources' bytes whole (size 1: plain and fused parameters) is hashed
    straight from the memory-mapped files; a slice is hashed in views and
    blocks, never a whole copy of the model. UnverifiableEngine, before any
    hashing, when a parameter's sources are not all in the checkpoint, do not
    share one dtype, or its layout cannot be derived.
    """
    tensors = index(directory)
    shapes = {n: t.shape for n, t in tensors.items()}
    keys = {key: parse_key(key) for key in names}
    config = layouts.ModelConfig.read(directory) if any(size > 1 for _, _, size in keys.values()) else None
    plan: dict[str, layouts.Layout] = {}
    for key, (name, rank, size) in keys.items():
        lay = layouts.layout(name, shapes, config, rank=rank, size=size)
        dtypes = {tensors[s].dtype for s, _ in lay.sources}
        if len(dtypes) != 1:
            raise UnverifiableEngine(f"engine parameter {name!r} fuses tensors of different dtypes")
        if not lay.whole and by_name(dtypes.pop()).bits % 8:
            raise UnverifiableEngine(f"engine parameter {key!r}: a slice of packed sub-byte elements")
        plan[key] = lay
    maps: dict[Path, np.ndarray] = {}
    for lay in plan.values():
        for s, _ in lay.sources:
            path = tensors[s].path
            if path not in maps:
                maps[path] = np.memmap(path, dtype=np.uint8, mode="r", shape=(path.stat().st_size,))

    def array(name: str) -> np.ndarray:
        t = tensors[name]
        return maps[t.path][t.start : t.end].view(UINT[by_name(t.dtype).width]).reshape(t.shape)

    def digest(lay: layouts.Layout) -> str:
        h = hashlib.sha256()  # hashlib releases the GIL on large buffers
        if lay.whole:
            for p in sorted(lay.pieces, key=lambda p: p.offset):
                t = tensors[p.source]
                h.update(maps[t.path][t.start : t.end].data)
        else:
            for chunk in layouts.chunks(lay, {s: array(s) for s, _ in lay.sources}):
                h.update(chunk.data)
        return h.hexdigest()

    workers = threads or min(8, os.cpu_count() or 1)
    with ThreadPoolExecutor(workers, thread_name_prefix="weightsync-sha") as pool:
        futures = {key: pool.submit(digest, lay) for key, lay in plan.items()}
        return {key: fut.result() for key, fut in futures.items()}


EMPTY = hashlib.sha256(b"").hexdigest()
"""The SHA-256 of no bytes: what ``/weight_checker`` answers for a parameter left with 0 elements."""


def bytes_dropped(engine: Mapping[str, str], want: Mapping[str, str]) -> list[str]:
    """Parameters whose engine digest is that of no bytes where the version has some, sorted.

    vLLM's CPU backend empties every unquantized Linear weight after loading
    where oneDNN takes the layer (``UnquantizedLinearMethod.process_weights_after_loading``
    → ``dispatch_cpu_unquantized_gemm(layer, remove_weight=True)``, seen on an
    AVX-512 BF16 CPU): the weight lives on in a packed handle, the parameter is a
    0-element tensor, and ``/weight_checker`` cannot show those weights.
    """
    return sorted(k for k, d in engine.items() if d == EMPTY and want.get(k, EMPTY) != EMPTY)


def differing(engine: Mapping[str, str], want: Mapping[str, str]) -> list[str]:
    """Parameters whose digests differ, or that only one side has, sorted."""
    return sorted(k for k in engine.keys() | want.keys() if engine.get(k) != want.get(k))
