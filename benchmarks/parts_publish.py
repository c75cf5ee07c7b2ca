"""Multi-part publish wall time per version for N = 1, 2, 4 parts (issue 14), on loopback.

Splits each version of a cached single-file case (default ``moe-bf16-x4``) into 4 expert-group
safetensors files (experts by index mod 4; the non-expert tensors go with group 0), and for each N
starts a fresh ``weightsync serve`` on loopback (the embedded default, or PostgreSQL + SeaweedFS with
``--backend s3pg``) and publishes every version with N part publisher processes (rank r holds groups
r, r+N, ...), each keeping its own previous part in memory. ``--cap 100M|1G|10G`` caps each rank's
upload with the client's token bucket, as ``weightsync bench sync`` caps its links (one link per
rank: N ranks have N links). Prints one JSON line per (N, version): wall time from the barrier to
the commit, bytes, and per-part throughput; ``--out`` appends them to a file.

    PYTHONPATH=src:. python -m benchmarks.parts_publish [--case DIR] [--versions 5] [--backend s3pg] [--cap 1G]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import tempfile
import time
from pathlib import Path

GROUPS = 4


def split(src: Path, dest: Path) -> None:
    """Write src/model.safetensors as GROUPS expert-group files under dest."""
    from weightsync.codec import Checkpoint
    from weightsync.codec.safetensors import serialize

    (f,) = Checkpoint.open(src / "model.safetensors").files
    groups: list[list] = [[] for _ in range(GROUPS)]
    for seg in f.layout.segments:
        if seg.kind != "tensor":
            continue
        m = re.search(r"experts?\.(\d+)\.", seg.name)
        groups[int(m.group(1)) % GROUPS if m else 0].append(
            (seg.name, seg.dtype.name, seg.shape, f.segment_bytes(seg).tobytes())
        )
    dest.mkdir(parents=True, exist_ok=True)
    for g, ts in enumerate(groups):
        (dest / f"group-{g}.safetensors").write_bytes(serialize(ts))


def rank_main(url: str, model: str, rank: int, world: int, dirs: list[str], barrier, out, cap: float | None) -> None:
    from weightsync.client import Publisher

    part = (rank, world) if world > 1 else None
    with Publisher(url, model, part=part, encoder_threads=1, bandwidth=cap) as pub:
        for step, d in enumerate(dirs):
            part = Path(tempfile.mkdtemp(prefix=f"r{rank}-"))
            for g in range(rank, GROUPS, world):
                os.link(Path(d) / f"group-{g}.safetensors", part / f"group-{g}.safetensors")
            barrier.wait()
            t = time.perf_counter()
            r = pub.publish(part, step=step)
            out.put((world, step, rank, time.perf_counter() - t, r.raw_bytes, r.bytes_sent, r.kind))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default=str(Path(__file__).parent / ".cache" / "moe-bf16-x4"))
    ap.add_argument("--versions", type=int, default=5)
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--backend", default="embedded", choices=["embedded", "s3pg"])
    ap.add_argument("--cap", default=None, choices=[None, "100M", "1G", "10G"], help="per-rank upload cap (bit/s)")
    ap.add_argument("--out", type=Path, default=None, help="append the JSON lines to this file too")
    args = ap.parse_args()
    from benchmarks.sync_bench import CAPS, server

    cap = CAPS[args.cap] if args.cap else None
    work = Path(tempfile.mkdtemp(prefix="parts-bench-"))
    dirs = []
    for i, v in enumerate(sorted(Path(args.case).glob("v*"))[: args.versions]):
        split(v, work / f"v{i}")
        dirs.append(str(work / f"v{i}"))
    for world in (int(w) for w in args.worlds.split(",")):
        # A fresh server per N: no object of an earlier run is already stored (content addressing).
        (work / f"n{world}").mkdir()
        with server(args.backend, work / f"n{world}") as url:
            barrier, out = mp.Barrier(world), mp.Queue()
            procs = [
                mp.Process(target=rank_main, args=(url, f"parts-n{world}", r, world, dirs, barrier, out, cap))
                for r in range(world)
            ]
            for p in procs:
                p.start()
            rows = [out.get(timeout=1800) for _ in range(world * len(dirs))]
            for p in procs:
                p.join()
        for step in range(len(dirs)):
            mine = [r for r in rows if r[1] == step]
            wall = max(r[3] for r in mine)
            raw = mine[0][4] if world == 1 else sum(r[4] for r in mine)
            line = {
                "backend": args.backend,
                "cap": args.cap or "none",
                "parts": world,
                "version": step + 1,
                "kind": mine[0][6],
                "wall_s": round(wall, 3),
                "raw_bytes": raw,
                "sent_bytes": sum(r[5] for r in mine),
                "per_part_MBps": round(raw / world / wall / 1e6, 1),
            }
            print(json.dumps(line), flush=True)
            if args.out is not None:
                with args.out.open("a") as f:
                    f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
