"""The subscriber's in-process `prepare` + verified `apply` into live CUDA tensors, phase by phase (no server).

A quick look on the lent GPU machine (about a minute after the model's steps), for tuning between
full runs of ``benchmarks.scale_bench``: a Llama-style model of ``SIZE`` (benchmarks/_llama.py, real
AdamW steps on the GPU), the v1 → v2 delta encoded in memory, then rounds of prepare (decode + stage
on the GPU) and apply (base check, writes, result check) into tensors reset to v1, each timed, with
the GPU memory the update took beyond the live model; the result is checked bit for bit. Then one
round under cProfile (the top of each phase) and the checksum of every tensor on the GPU.

With ``--compare`` the rounds alternate with the reference path (``WEIGHTSYNC_STAGE_FRAMES=0``: decode,
compose, then stage: client/stage_frames.py), medians of each side from the same run; ``--device cpu``
times the host half of a GPU subscriber's `prepare` on a box without one (staging "on" the CPU; the default
without CUDA).

    PYTHONPATH=src:. python3 -m benchmarks.gpu_profile 5.63G [--threads N] [--profile] [--compare] [--device cpu]
    PYTHONPATH=src:. python3 -m benchmarks.gpu_profile --case moe-bf16-x4 --compare   # a corpus case's step
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import time

import numpy as np
import torch

from benchmarks._frames import in_memory
from benchmarks._llama import LlamaShape, trajectory
from benchmarks.device_probe import _safetensors_bytes
from benchmarks.scale_bench import parse_bytes
from weightsync import devsum
from weightsync.client import inplace
from weightsync.client.tensors import HostOps
from weightsync.codec.checkpoint import Checkpoint
from weightsync.codec.encoder import Encoder


def _case_step(case: str) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The corpus case's versions 1 and 2 (benchmarks/corpus.py: real optimizer steps), as each tensor's bytes;
    SystemExit unless every tensor is bf16 (the rounds view them so)."""
    from benchmarks import corpus
    from weightsync.client.tensors import load

    dirs = corpus.ensure_case(case)
    out = []
    for d in dirs[1:3]:
        tensors = load(d)
        if any(t.dtype != torch.bfloat16 for t in tensors.values()):
            raise SystemExit(f"--case {case}: not every tensor is bf16")
        out.append({k: t.view(torch.int16).numpy().view(np.uint8).reshape(-1) for k, t in tensors.items()})
    return out[0], out[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("size", type=parse_bytes, nargs="?", default=parse_bytes("5.63G"))
    ap.add_argument("--rounds", type=int, default=4, help="rounds (the first is a warm-up)")
    ap.add_argument("--threads", type=int, help="decode threads (default: prepare's)")
    ap.add_argument("--profile", action="store_true", help="one more round under cProfile")
    ap.add_argument("--compare", action="store_true", help="alternate rounds with the reference staging path")
    ap.add_argument("--device", default="auto", help="where the live tensors are: auto (cuda if any), cuda, cpu")
    ap.add_argument("--case", help="a bf16 corpus case's step v1 -> v2, not a generated Llama (e.g. moe-bf16-x4)")
    args = ap.parse_args()
    dev = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    cuda = dev.startswith("cuda")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    t0 = time.perf_counter()
    if args.case:
        v1, v2 = _case_step(args.case)
    else:
        steps = trajectory(LlamaShape.for_bytes(args.size), 2, device=dev)
        next(steps)  # Adam's first step moves nearly every weight: the versions after it are steady-state steps
        v1, v2 = ({k: v.view(torch.int16).numpy().view(np.uint8).reshape(-1) for k, v in next(steps).items()}
                  for _ in "ab")  # fmt: skip
        del steps
    if cuda:
        torch.cuda.empty_cache()
    base_ck = Checkpoint.from_bytes({"model.safetensors": _safetensors_bytes(v1)})
    new_ck = Checkpoint.from_bytes({"model.safetensors": _safetensors_bytes(v2)})
    frames = in_memory(Encoder().encode(new_ck, base_ck))
    del base_ck, new_ck
    print(f"model {sum(a.size for a in v1.values()) / 1e9:.2f} GB, delta {len(frames.area) / 1e6:.1f} MB,"
          f" {time.perf_counter() - t0:.0f} s", flush=True)  # fmt: skip

    live = {k: torch.from_numpy(a).view(torch.bfloat16).to(dev) for k, a in v1.items()}
    keep = {k: v.clone() for k, v in live.items()}

    def one_round(reference: bool = False) -> dict[str, float]:
        for k, v in live.items():
            v.copy_(keep[k])
        sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        held = torch.cuda.memory_allocated() if cuda else 0
        os.environ["WEIGHTSYNC_STAGE_FRAMES"] = "0" if reference else "1"
        try:
            t = time.perf_counter()
            p = inplace.prepare(
                [frames.manifest], frames.read, model="m", base=1, target=2, device=dev, threads=args.threads
            )
            sync()
            t1 = time.perf_counter()
        finally:
            del os.environ["WEIGHTSYNC_STAGE_FRAMES"]
        a = inplace.apply(live, p, model="m", version=1, verify=True, strict=True)
        sync()
        t2 = time.perf_counter()
        row = {
            "prepare_s": t1 - t,
            "apply_s": t2 - t1,
            "pause_s": a.pause,
            "base_check_s": a.base_check_s,
            "result_check_s": a.result_check_s,
            "changed": p.changed_elements,
        }
        if cuda:
            row["staging_bytes_per_changed"] = (torch.cuda.max_memory_allocated() - held) / max(p.changed_elements, 1)
            hosts = [u.ops.staged.operands for u in p.updates.values() if isinstance(u.ops, HostOps)]
            row["staging_pinned"] = float(bool(hosts) and all(torch.from_numpy(a).is_pinned() for a in hosts))
        for k, v in live.items():
            if not torch.equal(v.view(torch.int16).cpu(), torch.from_numpy(v2[k]).view(torch.int16)):
                raise AssertionError(f"{k} is not bit-identical")
        return row

    sides = ["staged from the frames", "reference"] if args.compare else ["staged from the frames"]
    rows: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
    for _ in range(args.rounds):
        for side in sides:
            rows[side].append(one_round(reference=side == "reference"))
            print(side, {k: round(v, 4) for k, v in rows[side][-1].items()}, flush=True)
    for side in sides:
        got = rows[side][1:] or rows[side]
        print(f"bit-identical; {side}, medians after the warm-up:",
              {k: round(statistics.median(r[k] for r in got), 4) for k in got[0]})  # fmt: skip
    if args.compare:
        mine, ref = (statistics.median(r["prepare_s"] for r in rows[s][1:] or rows[s]) for s in sides)
        print(f"prepare: staged from the frames {mine * 1e3:.1f} ms, reference {ref * 1e3:.1f} ms: {ref / mine:.2f}x")
    tensors = list(live.values())
    for _ in range(2 if cuda else 0):
        torch.cuda.synchronize()
        t = time.perf_counter()
        devsum.tensor_sums(tensors)
        torch.cuda.synchronize()
        took = time.perf_counter() - t
        rate = sum(x.numel() * x.element_size() for x in tensors) / took / 1e9
        print(f"checksum of every tensor on the GPU: {took * 1e3:.1f} ms ({rate:.0f} GB/s)")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        one_round()
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(20)
        print(out.getvalue())


if __name__ == "__main__":
    main()
