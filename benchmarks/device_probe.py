"""GPU-box probe for issue 11: the FORMAT v2 checksum on CUDA, and how the codec scales with cores.

Run on the lent GPU machine (one script, a few minutes); prints one JSON object and writes it to
``$OUT/device_probe.json`` when ``OUT`` is set. It measures, on real deltas from a real optimizer
step of a Llama-style model (random init, fused AdamW, lr 1e-6, random tokens):

- the checksum on the GPU equals the CPU kernels' (every element width, random starts, odd sizes)
  and its speed and scratch memory on the model's tensors;
- a STREAM-like host copy (1 and all threads): the memory bandwidth figure the issue compares to;
- our encode and verified in-place apply with 1 and all threads, against per-tensor XOR + zstd-1
  (encode 1 thread; decode + apply on all cores), same bytes, same run;
- the subscriber's in-place path, in process (no server): the v1→v2 delta decoded with
  ``client.inplace.prepare`` (decode + stage) into live tensors on the device holding v1, then
  ``apply`` with verification (base check, writes, result check through client/verify.py):
  prepare_s, apply_s, pause (first write → result check passed), GPU staging memory, and the
  old verification (pageable ``.cpu()`` + one-thread xxh3) for comparison. Median of 3 after a warm-up;
- ``publish_async``'s snapshot (client/tensors.py ``snapshot_state_dict``, what it calls before
  returning): time from call to return for the model's weights resident on the device, with reused
  (pinned on CUDA) buffers as a Publisher keeps them, against the old pageable serialization; the
  bytes are checked equal to a plain safetensors serialization of the same tensors.

    PYTHONPATH=src:. python3 benchmarks/device_probe.py --hidden 3072 --layers 26
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import xxhash
import zstandard

from benchmarks._frames import in_memory
from weightsync.client import inplace
from weightsync.client.verify import HostHasher
from weightsync.codec import kernels
from weightsync.codec.checkpoint import Checkpoint
from weightsync.codec.checksum import tensor_sum as host_sum
from weightsync.codec.encoder import Decoder, Encoder
from weightsync.codec.frame import xxh3_128
from weightsync.devsum import tensor_sum as device_sum


def _timed(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def checksum_agreement(device: str) -> dict:
    """The GPU's sums equal the host kernels' for every width, odd sizes and random starts."""
    rng = np.random.default_rng(7)
    checked = 0
    for dtype, width in [
        (torch.uint8, 1),
        (torch.bfloat16, 2),
        (torch.float16, 2),
        (torch.float32, 4),
        (torch.int64, 8),
        (torch.float8_e4m3fn, 1),
    ]:
        for n in [1, 7, 1000, 65_537, 3_000_001]:
            start = int(rng.integers(0, 1 << 40))
            raw = rng.integers(0, 256, size=n * width, dtype=np.uint8)
            t = torch.from_numpy(raw).view(dtype).to(device)
            if device_sum(t, start=start) != host_sum(raw, width, start=start):
                raise AssertionError(f"checksum differs on {device}: {dtype} n={n} start={start}")
            checked += 1
    return {"cases": checked, "equal": True}


def stream_copy(gb: float, threads: int) -> float:
    """GB/s of a chunked numpy copy (read + write counted once, as STREAM's copy does)."""
    n = int(gb * 1e9)
    src = np.ones(n, dtype=np.uint8)
    dst = np.empty_like(src)
    chunk = -(-n // (threads * 8))

    def part(i: int) -> None:
        dst[i : i + chunk] = src[i : i + chunk]

    with ThreadPoolExecutor(threads) as pool:

        def run() -> None:
            list(pool.map(part, range(0, n, chunk)))

        run()
        t = _timed(run)
    return 2 * n / t / 1e9


def model_step(hidden: int, layers: int, device: str) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """A real AdamW step of a random-init Llama-style model: (base, new) host copies of its bf16 weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3 // 256 * 256,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 128),
        num_key_value_heads=max(1, hidden // 128),
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(device=device, dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device == "cuda")

    def snapshot() -> dict[str, np.ndarray]:
        return {
            k: v.detach().reshape(-1).view(torch.int16).cpu().numpy().view(np.uint8).copy()
            for k, v in model.state_dict().items()
        }

    def step() -> None:
        tokens = torch.randint(0, cfg.vocab_size, (2, 256), device=device)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # Adam's first step moves nearly everything by lr; the probe wants a steady-state step
    base = snapshot()
    step()
    new = snapshot()
    return base, new


def _safetensors_bytes(tensors: dict[str, np.ndarray]) -> bytes:
    header = {}
    offset = 0
    for name, arr in tensors.items():
        header[name] = {"dtype": "BF16", "shape": [arr.size // 2], "data_offsets": [offset, offset + arr.size]}
        offset += arr.size
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return len(h).to_bytes(8, "little") + h + b"".join(a.tobytes() for a in tensors.values())


def codec_scaling(base: dict[str, np.ndarray], new: dict[str, np.ndarray], threads: int) -> dict:
    raw = sum(a.size for a in new.values())
    changed = sum(int(np.count_nonzero(base[k].view(np.uint16) != new[k].view(np.uint16))) for k in new)
    base_ck = Checkpoint.from_bytes({"model.safetensors": _safetensors_bytes(base)})
    new_ck = Checkpoint.from_bytes({"model.safetensors": _safetensors_bytes(new)})
    out: dict = {"raw_bytes": raw, "density": changed / (raw // 2)}
    for t in (1, threads):
        enc = Encoder(threads=t)
        encoded = enc.encode(new_ck, base_ck)
        out[f"encode_s_{t}"] = _timed(lambda enc=enc: enc.encode(new_ck, base_ck), 2)
        frames = in_memory(encoded)
        out["delta_bytes"] = len(frames.area)
        out["manifest_bytes"] = len(frames.manifest.encode())
        dec = Decoder(threads=t)

        live = Checkpoint([type(f)(f.layout, f.data.copy()) for f in base_ck.files])
        times = []
        for _ in range(3):  # the subscriber already holds the base: the reset is not timed
            for f, b in zip(live.files, base_ck.files, strict=True):
                f.data[:] = b.data
            t0 = time.perf_counter()
            dec.decode(frames.manifest, frames.read, [f.data for f in live.files], live)  # base and result verified
            times.append(time.perf_counter() - t0)
        out[f"apply_s_{t}"] = statistics.median(times)
        for f, n in zip(live.files, new_ck.files, strict=True):
            if not np.array_equal(f.data, n.data):
                raise AssertionError("our in-place apply is not exact")
    # The baseline: per-tensor XOR + zstd-1; decode + XOR + xxh3 check on all cores.
    cctx = zstandard.ZstdCompressor(level=1)
    t0 = time.perf_counter()
    peer = {k: (cctx.compress(np.bitwise_xor(base[k], new[k]).tobytes()), xxhash.xxh3_128_digest(new[k])) for k in new}
    out["baseline_encode_s_1"] = time.perf_counter() - t0
    out["baseline_bytes"] = sum(len(v[0]) for v in peer.values())
    local = threading.local()  # a ZstdDecompressor is not thread-safe: one per thread, as the peers do

    def peer_decode(k: str) -> None:
        dctx = getattr(local, "dctx", None) or zstandard.ZstdDecompressor()
        local.dctx = dctx
        x = np.frombuffer(dctx.decompress(peer[k][0], max_output_size=base[k].size), dtype=np.uint8)
        res = np.bitwise_xor(base[k], x)
        if xxhash.xxh3_128_digest(res) != peer[k][1]:
            raise AssertionError("baseline decode is not exact")

    for t in (1, threads):
        with ThreadPoolExecutor(t) as pool:
            out[f"baseline_decode_s_{t}"] = _timed(lambda pool=pool: list(pool.map(peer_decode, list(peer))), 2)
    return out


def subscriber_apply(
    base: dict[str, np.ndarray], new: dict[str, np.ndarray], threads: int, device: str, versions: int = 3
) -> dict:
    """prepare + verified apply of the base→new delta into live `device` tensors holding base (no server)."""
    cuda = device == "cuda"
    base_ck = Checkpoint.from_bytes({"model.safetensors": _safetensors_bytes(base)})
    new_ck = Checkpoint.from_bytes({"model.safetensors": _safetensors_bytes(new)})
    frames = in_memory(Encoder(threads=threads).encode(new_ck, base_ck))
    del base_ck, new_ck

    live = {k: torch.from_numpy(a).view(torch.bfloat16).to(device) for k, a in base.items()}
    keep = {k: v.clone() for k, v in live.items()}  # v1 again before each version: not timed
    model_bytes = sum(a.size for a in base.values())
    hasher = HostHasher(threads=threads)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    reserved0 = 0
    if cuda:
        gc.collect()
        torch.cuda.empty_cache()
        sync()
        reserved0 = torch.cuda.memory_reserved()  # the live model and its v1 copy
        torch.cuda.reset_peak_memory_stats()
    runs = []
    changed = touched = 0
    paths: tuple[str, ...] = ()
    for _ in range(1 + versions):  # the first is the warm-up
        for k, v in live.items():
            v.copy_(keep[k])
        sync()
        t0 = time.perf_counter()
        prepared = inplace.prepare(
            [frames.manifest], frames.read, model="probe", base=1, target=2, threads=threads, device=device
        )
        sync()
        prepare_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        applied = inplace.apply(live, prepared, model="probe", version=1, verify=True, strict=True, hasher=hasher)
        apply_s = time.perf_counter() - t0
        runs.append(
            {
                "prepare_s": prepare_s,
                "apply_s": apply_s,
                "pause_s": applied.pause,  # first write → result check passed (the check runs inside apply)
                "write_s": applied.pause - applied.result_check_s,
                "base_check_s": applied.base_check_s,
                "result_check_s": applied.result_check_s,
            }
        )
        changed, touched, paths = prepared.changed_elements, applied.tensors, applied.verified_by
        del prepared, applied
    for k, v in live.items():
        if not np.array_equal(v.view(torch.int16).cpu().numpy().view(np.uint8), new[k]):
            raise AssertionError(f"in-place apply is not bit-identical on {k}")
    out: dict = {k: statistics.median(r[k] for r in runs[1:]) for k in runs[0]}
    out["prepare_apply_s"] = out["prepare_s"] + out["apply_s"]
    out.update(
        {
            "verified_by": list(paths),
            "tensors": touched,
            "changed_elements": changed,
            "model_bytes": model_bytes,
            "hasher": {"threads": hasher.workers, "buffers": hasher.buffers, "buffer_bytes": hasher.buffer_bytes},
        }
    )
    if cuda:
        staging = torch.cuda.max_memory_reserved() - reserved0
        out["gpu_staging_bytes"] = staging
        out["gpu_staging_bytes_per_changed_element"] = staging / max(changed, 1)
    # Before client/verify.py: one check = pageable .cpu() and one-thread xxh3 of every touched tensor.
    t0 = time.perf_counter()
    for v in live.values():
        xxh3_128(v.view(torch.int16).cpu().numpy())
    out["old_one_check_s"] = time.perf_counter() - t0
    return out


def publish_async_snapshot(weights: dict[str, np.ndarray], threads: int, device: str) -> dict:
    """publish_async's blocking part: the snapshot of the weights on `device`, call to return (median of 3)."""
    import safetensors.torch

    from weightsync.client.tensors import SnapshotBuffers, snapshot_state_dict

    sd = {k: torch.from_numpy(a).view(torch.bfloat16).to(device) for k, a in weights.items()}
    nbytes = sum(a.size for a in weights.values())
    pool = SnapshotBuffers()
    held: list[np.ndarray] = []

    def take() -> None:
        # As in a Publisher: the previous snapshot stays alive (its base), so two buffers alternate.
        held.append(snapshot_state_dict(sd, buffers=pool, threads=threads))
        del held[:-1]

    t0 = time.perf_counter()
    take()  # the first call allocates (and pins) the buffers
    first = time.perf_counter() - t0
    take()
    second = time.perf_counter() - t0 - first
    snapshot_s = _timed(take)
    snap = held[-1]
    expected = _safetensors_bytes(weights)
    header = int.from_bytes(snap[:8].tobytes(), "little") + 8
    exact = snap[header:].tobytes() == expected[int.from_bytes(expected[:8], "little") + 8 :]
    loaded = safetensors.torch.load(snap.tobytes())  # the reference reader finds each tensor's bytes
    plain = set(loaded) == set(weights) and all(
        loaded[k].view(torch.uint8).numpy().tobytes() == a.tobytes() for k, a in weights.items()
    )
    if not (exact and plain):
        raise AssertionError("the snapshot's bytes differ from a plain safetensors serialization")
    old_s = _timed(lambda: _old_serialize(sd), 1)
    del held[:]
    return {
        "bytes": nbytes,
        "snapshot_s": snapshot_s,
        "snapshot_gbps": nbytes / snapshot_s / 1e9,
        "first_call_s": first,
        "second_call_s": second,
        "buffers_allocated": pool.allocated,
        "pinned": device == "cuda",
        "old_pageable_serialize_s": old_s,
        "bytes_equal_safetensors": True,
    }


def _old_serialize(sd: dict) -> np.ndarray:
    """The serializer publish_async used before: pageable ``.cpu()`` per tensor, then one more host copy."""
    from weightsync.client.tensors import dtype_name
    from weightsync.codec import safetensors as st

    datas = [t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy() for t in sd.values()]
    specs = [(k, dtype_name(t.dtype), tuple(t.shape), len(d)) for (k, t), d in zip(sd.items(), datas, strict=True)]
    header = st.serialize_header(specs, {"format": "pt"})
    out = np.empty(len(header) + sum(len(d) for d in datas), dtype=np.uint8)
    out[: len(header)] = np.frombuffer(header, dtype=np.uint8)
    pos = len(header)
    for d in datas:
        out[pos : pos + len(d)] = d
        pos += len(d)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=3072)
    ap.add_argument("--layers", type=int, default=26)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument(
        "--parts",
        default="checksum,stream,codec,apply",
        help="comma-separated parts to run: checksum, stream, codec, apply, publish_async (the model step always runs)",
    )
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    res: dict = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "cpus": os.cpu_count(),
        "kernels": type(kernels.active()).__name__,
        "xxhash": xxhash.VERSION,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "hidden": args.hidden,
        "layers": args.layers,
    }
    if "checksum" in parts:
        res["checksum_agreement"] = checksum_agreement(device)
    if "stream" in parts:
        res["stream_copy_gbps_1"] = stream_copy(2.0, 1)
        res[f"stream_copy_gbps_{args.threads}"] = stream_copy(2.0, args.threads)
    t0 = time.perf_counter()
    base, new = model_step(args.hidden, args.layers, device)
    res["model_step_s"] = time.perf_counter() - t0
    gc.collect()  # the model and its optimizer state are gone: give their GPU memory back
    if device == "cuda":
        torch.cuda.empty_cache()
    if "checksum" in parts:
        # Checksum speed on the device: every tensor of the model, resident on the GPU.
        resident = [torch.from_numpy(a).view(torch.bfloat16).to(device) for a in new.values()]
        torch.cuda.reset_peak_memory_stats() if device == "cuda" else None
        before = torch.cuda.memory_allocated() if device == "cuda" else 0
        t = _timed(lambda: [device_sum(x) for x in resident])
        res["device_checksum_s"] = t
        res["device_checksum_gbps"] = sum(x.numel() * 2 for x in resident) / t / 1e9
        if device == "cuda":
            res["device_checksum_scratch_bytes"] = torch.cuda.max_memory_allocated() - before
        del resident
        host = list(new.values())
        with ThreadPoolExecutor(args.threads) as pool:
            res["host_checksum_gbps_all"] = (
                sum(a.size for a in host) / _timed(lambda: list(pool.map(lambda a: host_sum(a, 2), host)), 2) / 1e9
            )
    if "codec" in parts:
        res["codec"] = codec_scaling(base, new, args.threads)
    if "apply" in parts:
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        res["subscriber_apply"] = subscriber_apply(base, new, args.threads, device)
    if "publish_async" in parts:
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        res["publish_async"] = publish_async_snapshot(new, args.threads, device)
    text = json.dumps(res, indent=1)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "device_probe.json").write_text(text)


if __name__ == "__main__":
    main()
