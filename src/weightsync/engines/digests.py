"""What an engine's parameter digests must be for a version: SHA-256 per engine parameter, from the checkpoint.

vLLM's ``/weight_checker`` answers the SHA-256 of every parameter's bytes
(docs/ENGINES.md "vLLM facts"). An engine fuses some checkpoint tensors into
one parameter: ``qkv_proj`` is ``q_proj``, ``k_proj``, ``v_proj`` concatenated on
dim 0, ``gate_up_proj`` is ``gate_proj``, ``up_proj``. A dim-0 concatenation of
row-major tensors is the concatenation of their bytes, so the expected digest
of a fused parameter is the SHA-256 of its parts' bytes in order, read straight
from the safetensors files: no torch, no copy (memory maps).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from weightsync.codec import safetensors
from weightsync.codec.checkpoint import SAFETENSORS_SUFFIX
from weightsync.engines.errors import UnverifiableEngine

FUSED: tuple[tuple[str, tuple[str, ...]], ...] = (
    (".qkv_proj.", (".q_proj.", ".k_proj.", ".v_proj.")),
    (".gate_up_proj.", (".gate_proj.", ".up_proj.")),
)
"""Engine parameter part → the checkpoint parts concatenated on dim 0 into it, in order (vLLM's
``stacked_params_mapping`` of its Llama-family models)."""


def sources(name: str) -> tuple[str, ...]:
    """The checkpoint tensors whose dim-0 concatenation is the engine parameter ``name``, in order."""
    for fused, parts in FUSED:
        if fused in name:
            return tuple(name.replace(fused, part, 1) for part in parts)
    return (name,)


@dataclass(frozen=True)
class TensorBytes:
    """Where one checkpoint tensor's bytes lie: a file and a byte range in it."""

    path: Path
    start: int
    end: int
    dtype: str


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
            out[span.name] = TensorBytes(path, span.start, span.end, span.dtype.name)
    return out


def expected(directory: str | os.PathLike[str], names: Iterable[str], *, threads: int | None = None) -> dict[str, str]:
    """The SHA-256 hex digest each engine parameter in ``names`` must have when the engine holds ``directory``.

    UnverifiableEngine, before any hashing, when a parameter's sources are not
    all in the checkpoint or do not share one dtype.
    """
    tensors = index(directory)
    plan: dict[str, list[TensorBytes]] = {}
    for name in names:
        parts = sources(name)
        missing = [p for p in parts if p not in tensors]
        if missing:
            raise UnverifiableEngine(
                f"engine parameter {name!r} has no source in the checkpoint (looked for {', '.join(missing)})"
            )
        spans = [tensors[p] for p in parts]
        if len({s.dtype for s in spans}) != 1:
            raise UnverifiableEngine(f"engine parameter {name!r} fuses tensors of different dtypes")
        plan[name] = spans
    maps: dict[Path, np.ndarray] = {}
    for spans in plan.values():
        for s in spans:
            if s.path not in maps:
                size = s.path.stat().st_size
                maps[s.path] = np.memmap(s.path, dtype=np.uint8, mode="r", shape=(size,))

    def digest(spans: list[TensorBytes]) -> str:
        h = hashlib.sha256()
        for s in spans:
            h.update(maps[s.path][s.start : s.end].data)  # hashlib releases the GIL on large buffers
        return h.hexdigest()

    workers = threads or min(8, os.cpu_count() or 1)
    with ThreadPoolExecutor(workers, thread_name_prefix="weightsync-sha") as pool:
        futures = {name: pool.submit(digest, spans) for name, spans in plan.items()}
        return {name: fut.result() for name, fut in futures.items()}


def differing(engine: Mapping[str, str], want: Mapping[str, str]) -> list[str]:
    """Parameters whose digests differ, or that only one side has, sorted."""
    return sorted(k for k in engine.keys() | want.keys() if engine.get(k) != want.get(k))
