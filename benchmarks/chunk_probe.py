"""Frame size against the Python around each frame: encode and a device's `prepare` at several chunk sizes.

Each frame costs Python around its kernels (its sections, checksums, a pool job) in the encode and
in the decode for a device, and that Python holds the GIL: it bounds how many threads help. This
generates a Llama-style model of ``SIZE`` (benchmarks/_llama.py, real AdamW steps on the device,
lr 1e-6), takes one steady-state step and, for each ``--chunks`` size (FORMAT §4.5; small tensors
are grouped to at most ``encode_jobs.GROUP_BYTES`` whatever the chunk), measures on the same bytes:

- the encode of the step on 1 and ``--threads`` threads (``Encoder(chunk_bytes=…)``);
- ``inplace.prepare`` of it for ``--device`` (decode into per-tensor changes and stage them there:
  the host half of a GPU subscriber's prepare; ``cpu`` stages into host memory) on 1 and
  ``--threads`` threads;
- the frames' and manifest's bytes; every prepared update is checked to hold the step's change count.

Medians of ``--rounds`` after a warm-up; rounds of the sizes are interleaved so machine noise hits
each alike. Prints a markdown table and writes JSON to ``--out`` (and the table beside it) when given.

    PYTHONPATH=src:. python -m benchmarks.chunk_probe 1G [--device cuda] [--threads 16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks._frames import in_memory
from benchmarks._llama import LlamaShape, trajectory
from benchmarks.codec_bench import machine
from benchmarks.device_probe import _safetensors_bytes
from benchmarks.scale_bench import parse_bytes
from weightsync.client import inplace
from weightsync.codec.checkpoint import Checkpoint
from weightsync.codec.encoder import Encoder


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).cpu().numpy().view(np.uint8).reshape(-1).copy()


def step(size: int, device: str) -> tuple[Checkpoint, Checkpoint, int]:
    """(base, new) checkpoints of one steady-state AdamW step of a Llama-style model of `size` bytes, and
    how many bf16 elements changed."""
    steps = trajectory(LlamaShape.for_bytes(size), 2, device=device)
    next(steps)  # Adam's first step moves nearly every weight
    v1, v2 = ({k: _bytes(v) for k, v in next(steps).items()} for _ in "ab")
    changed = sum(int(np.count_nonzero(v1[k].view(np.uint16) != v2[k].view(np.uint16))) for k in v1)
    return (
        Checkpoint.from_bytes({"model.safetensors": _safetensors_bytes(v1)}),
        Checkpoint.from_bytes({"model.safetensors": _safetensors_bytes(v2)}),
        changed,
    )


def run(size: int, chunks: list[int], threads: int, device: str, rounds: int) -> dict:
    base, new, changed = step(size, device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    cases: dict[int, tuple] = {}
    for chunk in chunks:
        frames = in_memory(Encoder(chunk_bytes=chunk).encode(new, base))
        sizes = {
            "frames": len(frames.manifest.frames),
            "delta_bytes": len(frames.area),
            "manifest_bytes": len(frames.manifest.encode()),
        }
        encoders = {t: Encoder(chunk_bytes=chunk, threads=t) for t in {1, threads}}
        cases[chunk] = (frames, sizes, encoders)
    times: dict[tuple[int, str], list[float]] = {}
    for r in range(1 + rounds):  # the first round warms up (pools, scratch, kernels)
        for chunk, (frames, _, encoders) in cases.items():
            for t in sorted({1, threads}):
                t0 = time.perf_counter()
                encoders[t].encode(new, base)
                encode_s = time.perf_counter() - t0
                t0 = time.perf_counter()
                prepared = inplace.prepare(
                    [frames.manifest], frames.read, model="probe", base=1, target=2, threads=t, device=device
                )
                sync()
                prepare_s = time.perf_counter() - t0
                if prepared.changed_elements != changed:
                    raise AssertionError(f"prepare found {prepared.changed_elements} changes, the step made {changed}")
                del prepared
                if r:
                    times.setdefault((chunk, f"encode_s_{t}"), []).append(encode_s)
                    times.setdefault((chunk, f"prepare_s_{t}"), []).append(prepare_s)
    out = {
        "machine": machine(),
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else device,
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "model_bytes": sum(len(f.data) for f in new.files),
        "changed_elements": changed,
        "threads": threads,
        "rounds": rounds,
        "chunks": {},
    }
    for chunk, (_, sizes, _) in cases.items():
        row = dict(sizes)
        row.update({k: statistics.median(v) for (c, k), v in times.items() if c == chunk})
        out["chunks"][str(chunk)] = row
    return out


def table(r: dict) -> str:
    t = r["threads"]
    lines = [
        f"Machine: {r['machine']}; device {r['device']}. Run: {r['when']}. Model {r['model_bytes'] / 1e9:.2f} GB, "
        f"{r['changed_elements']:,} elements changed; medians of {r['rounds']} rounds.\n",
        f"| chunk | frames | frames + manifest (bytes) | encode 1 thread | encode {t} "
        f"| prepare 1 thread | prepare {t} |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for chunk, row in r["chunks"].items():
        ms = [f"{row[k] * 1e3:.1f} ms" for k in ("encode_s_1", f"encode_s_{t}", "prepare_s_1", f"prepare_s_{t}")]
        lines.append(
            f"| {int(chunk) >> 20} MiB | {row['frames']} | {row['delta_bytes'] + row['manifest_bytes']:,} | "
            + " | ".join(ms)
            + " |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.chunk_probe", description=__doc__.splitlines()[0])
    ap.add_argument("size", type=parse_bytes, nargs="?", default=parse_bytes("1G"))
    ap.add_argument("--chunks", default="4M,16M", help="chunk sizes, comma-separated (MiB with M)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    chunks = [int(c.strip().upper().removesuffix("M")) << 20 for c in args.chunks.split(",")]
    result = run(args.size, chunks, args.threads, args.device, args.rounds)
    print(table(result))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        args.out.with_suffix(".md").write_text(table(result) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
