"""An inference server's update loop: load once, then apply each new version in place.

Pulls the model into a directory (byte-identical files), loads its tensors,
then watches the server: for every new version it prepares the update (download
and decode, while serving would go on) and applies it in place into the very
tensors the model computes with, printing the pause. A version that cannot be
applied in place (a tensor added or reshaped) is pulled and loaded afresh.

    python examples/inference_loop.py --model demo --dir /tmp/demo [--updates 10]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

from weightsync import errors
from weightsync.client import Subscriber
from weightsync.client.tensors import load


def forward(tensors: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The trainer's MLP (Linear, GELU, ...) evaluated straight from the bf16 tensors."""
    layers = sorted({int(k.split(".")[0]) for k in tensors if k.endswith(".weight")})
    for i, layer in enumerate(layers):
        x = F.linear(x, tensors[f"{layer}.weight"], tensors[f"{layer}.bias"])
        if i < len(layers) - 1:
            x = F.gelu(x)
    return x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server", default=os.environ.get("WEIGHTSYNC_SERVER", "http://127.0.0.1:8400"))
    ap.add_argument("--model", default="demo")
    ap.add_argument("--dir", default="./demo-weights", help="Checkout directory for the initial load.")
    ap.add_argument("--updates", type=int, default=0, help="Exit after this many updates (0: run forever).")
    ap.add_argument("--name", default=None, help="Subscriber name in the replica ledger.")
    args = ap.parse_args()

    sub = Subscriber(args.server, args.model, token=os.environ.get("WEIGHTSYNC_TOKEN"), name=args.name)
    try:
        if sub.api.head(args.model) is None:
            print(f"waiting for the first version of {args.model}...", flush=True)
            next(sub.watch(after=0))
        pulled = sub.pull(args.dir)
        tensors = load(args.dir)
        probe = torch.randn(
            4, tensors[sorted(k for k in tensors if k.endswith(".weight"))[0]].shape[1], dtype=torch.bfloat16
        )
        print(
            f"loaded v{pulled.version}: {len(tensors)} tensors ({pulled.bytes_received / 1024:.1f} KiB "
            f"received); probe {forward(tensors, probe).float().norm():.6f}",
            flush=True,
        )
        done = 0
        for version in sub.watch():
            try:
                prepared = sub.prepare(version.number)
                pause = sub.apply(tensors, prepared)
            except errors.ReloadRequired as exc:
                print(f"v{version.number}: {exc}; reloading", flush=True)
                t = time.perf_counter()
                sub.pull(args.dir, version.number)
                tensors = load(args.dir)
                pause = time.perf_counter() - t
            else:
                print(
                    f"v{version.number} (step {version.step}): paused {pause * 1e3:.2f} ms to change "
                    f"{prepared.changed_elements} elements; prepared in {prepared.seconds:.3f}s from "
                    f"{prepared.bytes_received / 1024:.1f} KiB; probe {forward(tensors, probe).float().norm():.6f}",
                    flush=True,
                )
            done += 1
            if args.updates and done >= args.updates:
                break
    finally:
        sub.close()


if __name__ == "__main__":
    main()
