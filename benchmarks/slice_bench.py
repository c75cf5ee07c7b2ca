"""Slice subscribers (issue 14): 8 inference ranks, each holding 1/8 of the experts plus the shared tensors.

Publishes the versions of a cached corpus case (default ``moe-bf16-x4``: 436 MB per version, real
AdamW steps, 4 layers x 32 experts) to a real server (the embedded default, or PostgreSQL + SeaweedFS
with ``--backend s3pg``). Then 8 subscriber processes run at once; rank s holds every non-expert
tensor and the experts whose index is s mod 8, loaded from version 1, and follows every later version
with ``Subscriber(tensors=predicate)``: ``prepare`` (fetch only the frames of its slice, check,
decode) and ``apply`` in place. After each version every held tensor is compared bit for bit with the
trainer's. A whole subscriber (no selection) measures the whole delta first, and rank 0 runs once
alone (its times without 7 other ranks on the same cores), in the same run.

    PYTHONPATH=src python -m benchmarks.slice_bench [--backend embedded|s3pg] [--versions 5] [--out FILE]

One JSON line per (rank, version) is appended to ``--out``; a summary line per backend is printed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

RANKS = 8
ROOT = Path(__file__).resolve().parents[1]


def mine(rank: int, ranks: int):
    """Rank `rank`'s selection: shared tensors, and experts whose index is `rank` mod `ranks`."""

    def chosen(name: str) -> bool:
        parts = name.split(".")
        if "experts" not in parts:
            return True
        return int(parts[parts.index("experts") + 1]) % ranks == rank

    return chosen


def frames_for(prepared, chosen) -> int:
    """Bytes of the frames holding a piece of a selected tensor (what a slice must fetch at least)."""
    total = 0
    for m in prepared.manifests:
        for ref in m.frames:
            if any(chosen(m.files[p.file].segments[p.seg].segment.name) for p in ref.pieces):
                total += ref.length
    return total


def load(path: Path, chosen) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys() if chosen is None or chosen(k)}  # noqa: SIM118


def bits(t):
    return t.contiguous().view(-1).view(__import__("torch").uint8)


def subscriber(
    url: str, model: str, rank: int, ranks: int, versions: list[str], barrier, out, name: str = "rank"
) -> None:
    import torch

    from weightsync.client import Subscriber

    chosen = mine(rank, ranks)
    held = load(Path(versions[0]) / "model.safetensors", chosen)
    with Subscriber(url, model, name=f"{name}-{rank}", version=1, tensors=chosen) as sub:
        barrier.wait()
        for i in range(1, len(versions)):
            t0 = time.perf_counter()
            prepared = sub.prepare(i + 1)
            t1 = time.perf_counter()
            pause = sub.apply(held, prepared)
            t2 = time.perf_counter()
            manifest = sum(len(m.encode()) for m in prepared.manifests)
            want = load(Path(versions[i]) / "model.safetensors", chosen)
            same = all(torch.equal(bits(held[k]), bits(want[k])) for k in want) and set(want) == set(held)
            out.put(
                {
                    "rank": rank,
                    "run": name,
                    "version": i + 1,
                    "tensors": len(held),
                    "held_bytes": sum(t.numel() * t.element_size() for t in held.values()),
                    "bytes_received": prepared.bytes_received,
                    "frames_covering": frames_for(prepared, chosen),
                    "manifest_bytes": manifest,
                    "prepare_s": round(t1 - t0, 4),
                    "apply_call_s": round(t2 - t1, 4),
                    "pause_s": round(pause, 4),
                    "bit_identical": same,
                }
            )


def whole(url: str, model: str, versions: list[str]) -> list[dict]:
    """The whole update per version (no selection), for the ratio."""
    from weightsync.client import Subscriber

    held = load(Path(versions[0]) / "model.safetensors", None)
    rows = []
    with Subscriber(url, model, name="whole", version=1) as sub:
        for i in range(1, len(versions)):
            t0 = time.perf_counter()
            prepared = sub.prepare(i + 1)
            t1 = time.perf_counter()
            sub.apply(held, prepared)
            t2 = time.perf_counter()
            rows.append(
                {
                    "version": i + 1,
                    "bytes_received": prepared.bytes_received,
                    "prepare_s": round(t1 - t0, 4),
                    "apply_call_s": round(t2 - t1, 4),
                }
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.slice_bench", description=__doc__.split("\n")[0])
    ap.add_argument("--case", type=Path, default=ROOT / "benchmarks" / ".cache" / "moe-bf16-x4")
    ap.add_argument("--versions", type=int, default=5)
    ap.add_argument("--backend", default="embedded", choices=["embedded", "s3pg"])
    ap.add_argument("--ranks", type=int, default=RANKS)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "slices.jsonl")
    args = ap.parse_args(argv)
    from benchmarks.sync_bench import server
    from weightsync.client import Publisher

    versions = [str(v) for v in sorted(args.case.glob("v*"))[: args.versions]]
    if len(versions) < 2:
        raise SystemExit(f"{args.case}: need at least 2 versions (python -m benchmarks.corpus generate)")
    work = Path(tempfile.mkdtemp(prefix="slice-bench-"))
    model = "moe-slices"
    with server(args.backend, work) as url:
        with Publisher(url, model) as pub:
            for i, v in enumerate(versions):
                pub.publish(Path(v), step=i + 1)
        every = whole(url, model, versions)
        ctx = mp.get_context("spawn")
        # Rank 0 alone first: its times without 7 other ranks sharing the cores.
        barrier, out = ctx.Barrier(1), ctx.Queue()
        solo = ctx.Process(target=subscriber, args=(url, model, 0, args.ranks, versions, barrier, out, "solo"))
        solo.start()
        alone = [out.get(timeout=900) for _ in range(len(versions) - 1)]
        solo.join(60)
        barrier, out = ctx.Barrier(args.ranks), ctx.Queue()
        procs = [
            ctx.Process(target=subscriber, args=(url, model, r, args.ranks, versions, barrier, out))
            for r in range(args.ranks)
        ]
        for p in procs:
            p.start()
        rows = [out.get(timeout=900) for _ in range(args.ranks * (len(versions) - 1))]
        for p in procs:
            p.join(60)
    machine = f"{platform.machine()} {platform.processor() or ''} {mp.cpu_count()} cores".strip()
    by_version = {w["version"]: w for w in every}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as f:
        for r in [*alone, *rows]:
            w = by_version[r["version"]]
            r |= {
                "backend": args.backend,
                "machine": machine,
                "whole_bytes": w["bytes_received"],
                "fraction_of_whole": round(r["bytes_received"] / w["bytes_received"], 4),
                "over_frames": round(r["bytes_received"] / (r["frames_covering"] + r["manifest_bytes"]), 4),
            }
            f.write(json.dumps(r) + "\n")
    summary = {
        "backend": args.backend,
        "machine": machine,
        "ranks": args.ranks,
        "versions": len(versions) - 1,
        "all_bit_identical": all(r["bit_identical"] for r in [*alone, *rows]),
        "whole_MB_median": round(statistics.median(w["bytes_received"] for w in every) / 1e6, 2),
        "slice_MB_median": round(statistics.median(r["bytes_received"] for r in rows) / 1e6, 2),
        "fraction_median": statistics.median(r["fraction_of_whole"] for r in rows),
        "fraction_max": max(r["fraction_of_whole"] for r in rows),
        "over_frames_max": max(r["over_frames"] for r in rows),
        "whole_prepare_s_median": statistics.median(w["prepare_s"] for w in every),
        "whole_apply_s_median": statistics.median(w["apply_call_s"] for w in every),
        "slice_prepare_s_median": statistics.median(r["prepare_s"] for r in rows),
        "slice_apply_s_median": statistics.median(r["apply_call_s"] for r in rows),
        "slice_pause_s_median": statistics.median(r["pause_s"] for r in rows),
        "solo_prepare_s_median": statistics.median(r["prepare_s"] for r in alone),
        "solo_apply_s_median": statistics.median(r["apply_call_s"] for r in alone),
        "solo_fraction_median": statistics.median(r["fraction_of_whole"] for r in alone),
    }
    print(json.dumps(summary), flush=True)
    return 0 if summary["all_bit_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
