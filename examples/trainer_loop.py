"""A training loop that publishes every step in the background.

Trains a small MLP on synthetic regression data with AdamW on the CPU, exports
the weights in bf16 after every optimizer step and hands them to
``Publisher.publish_async``: the state_dict is copied to host memory at once,
the diff, upload and commit run on a background thread, in order, while
training goes on. Between steps only a few % of the bf16 elements change
(RL-like small learning rate), so every publish after the first is a small delta.

    weightsync serve --data /tmp/ws-data &
    python examples/trainer_loop.py --model demo --steps 20
    python examples/inference_loop.py --model demo --dir /tmp/demo   # in another shell
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch import nn

from weightsync.client import Publisher


def build_model(width: int, hidden: int) -> nn.Module:
    return nn.Sequential(
        nn.Linear(width, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, width)
    )


def export(model: nn.Module) -> dict[str, torch.Tensor]:
    """The weights as inference serves them: bf16 (the fp32 masters stay with the optimizer)."""
    return {name: p.detach().to(torch.bfloat16) for name, p in model.state_dict().items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server", default=os.environ.get("WEIGHTSYNC_SERVER", "http://127.0.0.1:8400"))
    ap.add_argument("--model", default="demo")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=2e-6)
    ap.add_argument("--step-seconds", type=float, default=0.0, help="Sleep this long per step (pacing).")
    args = ap.parse_args()

    torch.manual_seed(0)
    model = build_model(args.width, args.hidden)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    x = torch.randn(1024, args.width)
    y = torch.sin(x @ torch.randn(args.width, args.width) / args.width**0.5)

    def report(fut) -> None:
        try:
            r = fut.result()
        except Exception as exc:  # noqa: BLE001 - show it and keep training
            print(f"publish failed: {exc}", flush=True)
            return
        print(
            f"  published v{r.version} ({r.kind}, step {r.step}): sent {r.bytes_sent / 1024:.1f} KiB of "
            f"{r.raw_bytes / 1024:.1f} KiB in {r.seconds:.2f}s",
            flush=True,
        )

    with Publisher(args.server, args.model, token=os.environ.get("WEIGHTSYNC_TOKEN")) as pub:
        futures = []
        for step in range(1, args.steps + 1):
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            t = time.perf_counter()
            fut = pub.publish_async(export(model), step=step, metadata={"loss": round(loss.item(), 6)})
            fut.add_done_callback(report)
            futures.append(fut)
            print(
                f"step {step}: loss {loss.item():.5f} (handed off in {(time.perf_counter() - t) * 1e3:.1f} ms)",
                flush=True,
            )
            if args.step_seconds:
                time.sleep(args.step_seconds)
        for fut in futures:
            fut.exception()  # wait for the last publishes before closing
    print("done", flush=True)


if __name__ == "__main__":
    main()
