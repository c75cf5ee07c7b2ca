"""Per-tensor cost of the codec's stages, at growing tensor counts (a 1T-parameter MoE has 50-70K tensors).

    python -m benchmarks.many_tensors --counts 5000 20000 40000

For each count, one safetensors file of that many small bf16 tensors (64 elements each) and a
second version with every 50th byte flipped (a scaling probe of per-tensor overhead, not a
compression figure: the bytes are random), then, timed once each in this process: opening both
versions (the safetensors layout), encoding the delta, packing it, the manifest's encode and parse,
and decoding it into a copy of the base (checked byte for byte). Prints seconds per stage and
microseconds per tensor; a stage whose µs per tensor grows with the count is not linear.

    python -m benchmarks.many_tensors --sdk --counts 20000 [--elements 2048 --versions 6]

The same probe through the SDK against an embedded ``weightsync serve`` on loopback: a model of
that many bf16 tensors of ``--elements`` elements each, versions that each change 2 % of the
elements (every 50th, a different one each version: synthetic, for the per-tensor cost, not the
bytes), published with ``Publisher.publish``, brought into live torch tensors with
``Subscriber.prepare`` + ``apply`` (verified), and, side by side in the same run, a full reload
of each version from a warm page cache (``load_file`` + ``copy_``). Medians over the versions
after the first delta; the live tensors are checked bit for bit against the last version.
"""

from __future__ import annotations

import argparse
import json
import struct
import time
from pathlib import Path

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


def _sdk_versions(root: Path, n: int, elements: int, versions: int) -> list[Path]:
    """`versions` directories of one safetensors file of `n` bf16 tensors; each version changes 2 % of elements."""
    import torch
    from safetensors.torch import save_file

    rng = np.random.default_rng(0)
    flat = rng.standard_normal(n * elements, dtype=np.float32)
    bits = (flat.view(np.uint32) >> 16).astype(np.uint16)  # bf16: the top half of each float32
    out = []
    for v in range(versions):
        if v:
            bits[v % 50 :: 50] ^= 1  # every 50th element's lowest mantissa bit, another phase each version
        tensors = {
            f"model.layers.{i // 1000}.mlp.experts.{i % 1000}.w": torch.from_numpy(
                bits[i * elements : (i + 1) * elements].copy()
            ).view(torch.bfloat16)
            for i in range(n)
        }
        d = root / f"v{v}"
        d.mkdir(parents=True)
        save_file(tensors, str(d / "model.safetensors"))
        out.append(d)
    return out


def sdk_run(n: int, *, elements: int = 2048, versions: int = 6) -> dict[str, float]:
    """Median seconds of publish, prepare, apply (and its pause) and a warm reload, for `n` tensors."""
    import statistics
    import tempfile

    import torch
    from safetensors.torch import load_file

    from benchmarks._scale_paths import reload
    from benchmarks._serve import serve
    from weightsync.client import Publisher, Subscriber

    rows: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="weightsync-many-tensors-") as tmp:
        vdirs = _sdk_versions(Path(tmp) / "versions", n, elements, versions)
        files = [d / "model.safetensors" for d in vdirs]
        with serve(Path(tmp)) as url, Publisher(url, "many") as pub:
            first = pub.publish(vdirs[0]).version
            live = {k: t.clone() for k, t in load_file(str(files[0])).items()}
            reloaded = {k: t.clone() for k, t in live.items()}
            with Subscriber(url, "many", name="many", version=first, report=False) as sub:
                for i, vdir in enumerate(vdirs[1:], 1):
                    t0 = time.perf_counter()
                    version = pub.publish(vdir).version
                    t1 = time.perf_counter()
                    prepared = sub.prepare(version)
                    t2 = time.perf_counter()
                    pause = sub.apply(live, prepared)
                    t3 = time.perf_counter()
                    reload(reloaded, [files[i]], "cpu")
                    t4 = time.perf_counter()
                    row = {"publish": t1 - t0, "prepare": t2 - t1, "apply": t3 - t2, "pause": pause}
                    rows.append(row | {"prepare + apply": t3 - t1, "reload": t4 - t3})
        want = load_file(str(files[-1]))
        for name, t in want.items():
            if not torch.equal(live[name].view(torch.uint8), t.view(torch.uint8)):
                raise AssertionError(f"{n} tensors: {name} differs from the last version after the updates")
    rows = rows[1:] or rows  # the first delta warms up
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


SDK_STAGES = ["publish", "prepare", "apply", "pause", "prepare + apply", "reload"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.many_tensors", description=__doc__.splitlines()[0])
    ap.add_argument("--counts", type=int, nargs="+", default=[5000, 20000, 40000])
    ap.add_argument("--sdk", action="store_true", help="through the SDK and a served instance, against a reload")
    ap.add_argument("--elements", type=int, default=2048, help="bf16 elements per tensor (--sdk)")
    ap.add_argument("--versions", type=int, default=6, help="versions published (--sdk; the first delta warms up)")
    args = ap.parse_args(argv)
    if args.sdk:
        print(f"| tensors (x {args.elements} bf16) | " + " | ".join(SDK_STAGES) + " | prepare + apply ÷ reload |")
        print("|---:|" + "---:|" * (len(SDK_STAGES) + 1))
        for n in args.counts:
            got = sdk_run(n, elements=args.elements, versions=args.versions)
            cells = [f"{got[k] * 1e3:.0f} ms ({got[k] / n * 1e6:.1f} µs)" for k in SDK_STAGES]
            ratio = got["prepare + apply"] / got["reload"]
            print(f"| {n} | " + " | ".join(cells) + f" | {ratio:.2f}x |", flush=True)
        return 0
    print("| tensors | " + " | ".join(["open", "encode", "pack", "manifest encode", "manifest parse", "decode"]) + " |")
    print("|---:|" + "---:|" * 6)
    for n in args.counts:
        got = run(n)
        cells = [f"{v:.3f} s ({v / n * 1e6:.0f} µs)" for v in got.values()]
        print(f"| {n} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
