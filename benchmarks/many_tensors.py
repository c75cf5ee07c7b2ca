"""Per-tensor cost of the codec's stages, at growing tensor counts (a 1T-parameter MoE has 50-70K tensors).

    python -m benchmarks.many_tensors --counts 5000 20000 40000

For each count, one safetensors file of that many small bf16 tensors (64 elements each) and a
second version with every 50th byte flipped (a scaling probe of per-tensor overhead, not a
compression figure: the bytes are random), then, timed once each in this process: opening both
versions (the safetensors layout), encoding the delta, packing it, the manifest's encode and parse,
and decoding it into a copy of the base (checked byte for byte). Prints seconds per stage and
microseconds per tensor; a stage whose µs per tensor grows with the count is not linear.
"""

from __future__ import annotations

import argparse
import json
import struct
import time

import numpy as np

from weightsync.codec.checkpoint import Checkpoint
from weightsync.codec.decoder import Decoder
from weightsync.codec.encoder import Encoder
from weightsync.codec.manifest import Manifest
from weightsync.codec.pack import pack


def _versions(n: int, seed: int = 0) -> tuple[bytes, bytes]:
    """Two safetensors files of `n` 64-element bf16 tensors; the second has every 50th byte flipped."""
    rng = np.random.default_rng(seed)
    header, at = {}, 0
    for i in range(n):
        header[f"model.layers.{i // 1000}.mlp.experts.{i % 1000}.w"] = {
            "dtype": "BF16",
            "shape": [64],
            "data_offsets": [at, at + 128],
        }
        at += 128
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    base = np.frombuffer(rng.bytes(at), np.uint8)
    new = base.copy()
    new[::50] ^= 1
    head = struct.pack("<Q", len(text)) + text
    return head + base.tobytes(), head + new.tobytes()


def run(n: int) -> dict[str, float]:
    """Seconds per stage for `n` tensors."""
    one, two = _versions(n)
    out: dict[str, float] = {}
    t = time.perf_counter()
    base = Checkpoint.from_bytes({"m.safetensors": one})
    new = Checkpoint.from_bytes({"m.safetensors": two})
    out["open"] = time.perf_counter() - t
    t = time.perf_counter()
    encoded = Encoder().encode(new, base)
    out["encode"] = time.perf_counter() - t
    t = time.perf_counter()
    manifest, objects = pack(encoded, target_bytes=64 << 20)
    out["pack"] = time.perf_counter() - t
    t = time.perf_counter()
    stored = manifest.encode()
    out["manifest encode"] = time.perf_counter() - t
    t = time.perf_counter()
    parsed = Manifest.decode(stored)
    out["manifest parse"] = time.perf_counter() - t
    blobs = {o.digest: o.data for o in objects}
    target = np.array(base.files[0].data)
    t = time.perf_counter()
    Decoder().decode(parsed, lambda r: memoryview(blobs[r.object])[r.offset : r.offset + r.length], [target], base)
    out["decode"] = time.perf_counter() - t
    if target.tobytes() != two:
        raise AssertionError(f"{n} tensors: the decoded version differs")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.many_tensors", description=__doc__.splitlines()[0])
    ap.add_argument("--counts", type=int, nargs="+", default=[5000, 20000, 40000])
    args = ap.parse_args(argv)
    print("| tensors | " + " | ".join(["open", "encode", "pack", "manifest encode", "manifest parse", "decode"]) + " |")
    print("|---:|" + "---:|" * 6)
    for n in args.counts:
        got = run(n)
        cells = [f"{v:.3f} s ({v / n * 1e6:.0f} µs)" for v in got.values()]
        print(f"| {n} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
