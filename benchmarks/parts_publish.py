"""Multi-part publish wall time per version for N = 1, 2, 4 parts (issue 14), on loopback.

Splits each version of a cached single-file case (default ``moe-bf16-x4``) into 4 expert-group
safetensors files (experts by index mod 4; the non-expert tensors go with group 0), starts a
``weightsync serve`` on loopback, and publishes every version with N part publisher processes
(rank r holds groups r, r+N, ...), each keeping its own previous part in memory. Prints one JSON
line per (N, version): wall time from the barrier to the commit, bytes, and per-part throughput.

    PYTHONPATH=src python benchmarks/parts_publish.py [--case DIR] [--versions 5]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import sys
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


def rank_main(url: str, model: str, rank: int, world: int, dirs: list[str], barrier, out) -> None:
    from weightsync.client import Publisher

    with Publisher(url, model, part=(rank, world) if world > 1 else None, encoder_threads=1) as pub:
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
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
    from _serve import spawn_serve  # the tests' loopback server helper

    work = Path(tempfile.mkdtemp(prefix="parts-bench-"))
    dirs = []
    for i, v in enumerate(sorted(Path(args.case).glob("v*"))[: args.versions]):
        split(v, work / f"v{i}")
        dirs.append(str(work / f"v{i}"))
    server = spawn_serve(
        ["--data", str(work / "data"), "--host", "127.0.0.1", "--log-level", "warning"], log_path=work / "server.log"
    )
    try:
        for world in (int(w) for w in args.worlds.split(",")):
            barrier, out = mp.Barrier(world), mp.Queue()
            procs = [
                mp.Process(target=rank_main, args=(server.url, f"parts-n{world}", r, world, dirs, barrier, out))
                for r in range(world)
            ]
            for p in procs:
                p.start()
            rows = [out.get(timeout=600) for _ in range(world * len(dirs))]
            for p in procs:
                p.join()
            for step in range(len(dirs)):
                mine = [r for r in rows if r[1] == step]
                wall = max(r[3] for r in mine)
                raw = mine[0][4] if world == 1 else sum(r[4] for r in mine)
                line = {
                    "parts": world,
                    "version": step + 1,
                    "kind": mine[0][6],
                    "wall_s": round(wall, 3),
                    "raw_bytes": raw,
                    "sent_bytes": sum(r[5] for r in mine),
                    "per_part_MBps": round(raw / world / wall / 1e6, 1),
                }
                print(json.dumps(line), flush=True)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
