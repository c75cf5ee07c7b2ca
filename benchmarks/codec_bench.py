"""`weightsync bench codec`: our codec against the baselines, on versions from real optimizer steps.

For every case of the corpus (benchmarks/corpus.py) and every consecutive pair of
versions, in one run on the same bytes:

- ours: whole delta files as a publisher uploads them (frames packed into objects plus
  the stored manifest) in FORMAT v2 and v1, with the manifest's share; encode and
  decode+apply GB/s with 1 thread and with all cores (v2);
- baseline: per-tensor XOR + zstd level 1 (the RL-framework peers' codec), its payload
  bytes and encode / decode GB/s (single-threaded, as the peers run it);
- the zero-order entropy bound H(changed mask) + H(XOR values), per tensor;
- keyframes: ours vs full-snapshot zstd-1 on the first version;
- per core, same bytes, interleaved: our encode (v1, v2) vs the baseline's, our verified
  apply in place (v1: xxh3-128, v2: the tensor checksum) vs the baseline's verified decode
  (xxh3-128 of each result); the FORMAT v2 tensor checksum vs xxh3-128 over every tensor.

``--no-speed`` measures bytes only (fast: for the many sparse cases of the corpus).

Throughput is GB/s of raw model bytes (the new version's tensor payload), best of
``--repeats``, measured in memory so the disk is not what is timed. Results go to
benchmarks/results/codec.{json,md} and PNG plots next to them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from benchmarks import baselines
from benchmarks._frames import in_memory
from benchmarks.corpus import ensure_case
from weightsync.codec import Checkpoint, Decoder, Encoder, kernels
from weightsync.codec.checksum import tensor_sum
from weightsync.codec.encoder import Encoded
from weightsync.codec.frame import xxh3_128, zigzag
from weightsync.codec.pack import pack

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_CASES = ["bf16-lr1e-6", "bf16-lr1e-5", "fp8-lr1e-5", "mxfp4-lr1e-5", "nvfp4-lr1e-5", "moe-bf16"]
SPARSE_CASES = [f"{fmt}-lr1e-{k}" for k in (5, 6, 7, 8) for fmt in ("fp8", "mxfp4", "nvfp4")]
"""The quantized exports at densities from ~5 % (lr 1e-5) down to ~0.02 % (lr 1e-8): issue 11's size target."""


def _best(fn, repeats: int, setup=None) -> tuple[object, float]:
    best, out = float("inf"), None
    for _ in range(repeats):
        arg = setup() if setup else None
        t0 = time.perf_counter()
        out = fn(arg) if setup else fn()
        best = min(best, time.perf_counter() - t0)
    return out, best


def diff_bound(base: dict, new: dict) -> float:
    """Zero-order bound in bytes when values are zigzag differences (what our frames code), not XORs."""
    bits = 0.0
    for name, t in new.items():
        b = base.get(name)
        w = baselines.element_size(t.dtype)
        if b is None or b.dtype != t.dtype or b.shape != t.shape or t.data.size % w:
            bits += baselines.tensor_entropy_bits(None, t.data, w)
            continue
        old_v, new_v = baselines.as_elements(b.data, w), baselines.as_elements(t.data, w)
        changed = old_v != new_v
        k, n = int(np.count_nonzero(changed)), changed.size
        if k == 0:
            continue
        values = zigzag(new_v[changed] - old_v[changed])
        _, counts = np.unique(values, return_counts=True)
        p = counts / k
        bits += n * baselines._h2(k / n) + k * float(-(p * np.log2(p)).sum())
    return bits / 8


def _load(path: Path) -> tuple[Checkpoint, dict]:
    blob = (path / "model.safetensors").read_bytes()
    ck = Checkpoint.from_bytes({"model.safetensors": blob})
    tensors = {
        e.name: baselines.RawTensor(e.dtype.name, e.shape, ck.files[0].segment_bytes(e))
        for e in ck.files[0].layout.segments
        if e.kind == "tensor"
    }
    return ck, tensors


def published_bytes(encoded: Encoded) -> tuple[int, int]:
    """(frames, stored manifest) bytes of a version as a publisher uploads it: frames packed into
    store objects, the manifest naming them, with a model name, number, parent and step."""
    manifest, objects = pack(encoded)
    manifest.model, manifest.number, manifest.parent, manifest.step = "bench-model", 2, 1, 2
    return sum(len(o.data) for o in objects), len(manifest.encode())


def _file_sizes(base: Checkpoint, new: Checkpoint, version: int) -> dict:
    frames, manifest = published_bytes(Encoder(threads=1, format_version=version).encode(new, base))
    return {"frames_bytes": frames, "manifest_bytes": manifest}


def _ours_delta(base: Checkpoint, new: Checkpoint, threads: int, repeats: int) -> dict:
    enc = Encoder(threads=threads)
    encoded, t_enc = _best(lambda: enc.encode(new, base), repeats)
    frames = in_memory(encoded)
    dec = Decoder(threads=threads)
    outputs = [np.empty(f.layout.size, dtype=np.uint8) for f in new.files]
    _, t_dec = _best(lambda: dec.decode(frames.manifest, frames.read, outputs, base), repeats)
    for out, f in zip(outputs, new.files, strict=True):
        if not np.array_equal(out, f.data):
            raise AssertionError("our round trip is not exact")

    def fresh_base() -> Checkpoint:  # untimed: the subscriber already holds the base
        return Checkpoint([type(f)(f.layout, f.data.copy()) for f in base.files])

    def in_place(ck: Checkpoint) -> Checkpoint:
        dec.decode(frames.manifest, frames.read, [f.data for f in ck.files], ck)
        return ck

    applied, t_apply = _best(in_place, repeats, setup=fresh_base)
    for out, f in zip(applied.files, new.files, strict=True):
        if not np.array_equal(out.data, f.data):
            raise AssertionError("our in-place apply is not exact")
    packed_frames, stored_manifest = published_bytes(encoded)
    return {
        "frames_bytes": packed_frames,
        "manifest_bytes": stored_manifest,
        "encode_s": t_enc,
        "decode_s": t_dec,
        "apply_s": t_apply,
        "sparse_frames": sum(1 for fr in encoded.frames if fr.delta),
    }


def _per_core(base_ck: Checkpoint, new_ck: Checkpoint, base_t: dict, new_t: dict, repeats: int) -> dict:
    """One thread each, measurements interleaved (ours v1, ours v2, baseline, ...), best of `repeats` each.

    On a shared machine the load drifts during a run; alternating the codecs gives them the
    same conditions, which back-to-back blocks of repeats do not. Our apply is verified as a
    subscriber runs it: bases checked, results checked (v1: xxh3-128; v2: the tensor checksum).
    """
    encoders = {v: Encoder(threads=1, format_version=v) for v in (1, 2)}
    dec = Decoder(threads=1)
    located = {v: in_memory(enc.encode(new_ck, base_ck)) for v, enc in encoders.items()}
    peer = baselines.xor_zstd1_encode(base_t, new_t, 1, checksum=True)
    best = dict.fromkeys(["v1_enc", "v2_enc", "base_enc", "v1_apply", "v2_apply", "base_dec"], float("inf"))
    for _ in range(repeats):
        for v, enc in encoders.items():
            t0 = time.perf_counter()
            enc.encode(new_ck, base_ck)
            best[f"v{v}_enc"] = min(best[f"v{v}_enc"], time.perf_counter() - t0)
        t0 = time.perf_counter()
        baselines.xor_zstd1_encode(base_t, new_t, 1)  # the peers' encode, without even a checksum
        best["base_enc"] = min(best["base_enc"], time.perf_counter() - t0)
        for v, frames in located.items():
            target = Checkpoint([type(f)(f.layout, f.data.copy()) for f in base_ck.files])  # untimed
            t0 = time.perf_counter()
            dec.decode(frames.manifest, frames.read, [f.data for f in target.files], target)  # verified
            best[f"v{v}_apply"] = min(best[f"v{v}_apply"], time.perf_counter() - t0)
            if target.files[0].data.tobytes() != new_ck.files[0].data.tobytes():
                raise AssertionError(f"our verified v{v} apply is not exact")
        t0 = time.perf_counter()
        baselines.xor_zstd1_decode(base_t, peer)  # result verified (xxh3-128 per tensor)
        best["base_dec"] = min(best["base_dec"], time.perf_counter() - t0)
    raw = sum(t.data.size for t in new_t.values())
    return {k: raw / v / 1e9 for k, v in best.items()}


def _staging(base: Checkpoint, new: Checkpoint) -> dict | None:
    """Bytes per changed element that `Subscriber.prepare(device=...)` stages for `apply`, measured on the CPU
    (the staging is the same torch code on a GPU); None without torch."""
    try:
        import torch  # noqa: F401  (the SDK's tensor paths need it)
    except ImportError:
        return None
    from weightsync.client.inplace import prepare

    frames = in_memory(Encoder().encode(new, base))
    prepared = prepare([frames.manifest], frames.read, model="bench", base=1, target=2, device="cpu")
    changed = sum(u.changed_elements for u in prepared.updates.values() if u.ops)
    by_width: dict[int, int] = {}
    for u in prepared.updates.values():
        if u.ops:
            by_width[u.dtype.width] = by_width.get(u.dtype.width, 0) + u.changed_elements
    return {"staged_bytes": prepared.staged_bytes, "changed": changed, "changed_by_width": by_width}


def _checksum_speed(new: Checkpoint, repeats: int, threads: int) -> dict:
    """GB/s of the tensor checksum (FORMAT §10) and of xxh3-128 over every segment of `new`, same bytes."""
    segs = [
        (f.segment_bytes(s), s.dtype.width if s.dtype.width in (1, 2, 4, 8) else 1)
        for f in new.files
        for s in f.layout.segments
        if s.length
    ]
    raw = sum(len(b) for b, _ in segs)
    _, t1 = _best(lambda: [tensor_sum(b, w) for b, w in segs], repeats)
    _, tn = _best(lambda: [tensor_sum(b, w, threads=threads) for b, w in segs], repeats)
    _, tx = _best(lambda: [xxh3_128(b) for b, _ in segs], repeats)
    return {"checksum_gbps_1": raw / t1 / 1e9, "checksum_gbps_all": raw / tn / 1e9, "xxh3_gbps_1": raw / tx / 1e9}


def _ours_key(new: Checkpoint, repeats: int, threads: int) -> dict:
    enc = Encoder(threads=threads)
    encoded, t_enc = _best(lambda: enc.encode(new, None), repeats)
    return {"bytes": sum(len(fr.data) for fr in encoded.frames), "encode_s": t_enc}


def _zipnn_key(tensors: dict, repeats: int) -> dict | None:
    """ZipNN on the keyframe (all tensors concatenated, one call per dtype group); None if not installed."""
    try:
        import zipnn
    except ImportError:
        return None
    kinds = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
    total, t_enc, t_dec = 0, 0.0, 0.0
    groups: dict[str, list] = {}
    for t in tensors.values():
        groups.setdefault(kinds.get(t.dtype, "uint8"), []).append(t.data.tobytes())
    for kind, parts in groups.items():
        raw = b"".join(parts)
        codec = zipnn.ZipNN(
            input_format="byte",
            bytearray_dtype=kind if kind != "uint8" else "bfloat16",
            method="zstd" if kind == "uint8" else "AUTO",
        )
        # ZipNN mutates its input buffer: every call gets a fresh copy (made outside the timing).
        best_e = best_d = float("inf")
        for _ in range(repeats):
            buf = bytearray(raw)
            t0 = time.perf_counter()
            packed = codec.compress(buf)
            best_e = min(best_e, time.perf_counter() - t0)
            t0 = time.perf_counter()
            out = codec.decompress(bytes(packed))
            best_d = min(best_d, time.perf_counter() - t0)
        if bytes(out) != raw:
            raise AssertionError("ZipNN round trip is not exact")
        total += len(packed)
        t_enc += best_e
        t_dec += best_d
    return {"bytes": total, "encode_s": t_enc, "decode_s": t_dec}


def _density(base_t: dict, new_t: dict) -> float:
    changed, total = 0, 0
    for tname, t in new_t.items():
        b = base_t.get(tname)
        if b is not None and b.dtype == t.dtype and b.shape == t.shape:
            w = baselines.element_size(t.dtype)
            x = baselines.as_elements(t.data, w) != baselines.as_elements(b.data, w)
            changed += int(np.count_nonzero(x))
            total += x.size
    return changed / max(total, 1)


def _size_row(base_ck: Checkpoint, new_ck: Checkpoint, base_t: dict, new_t: dict) -> dict:
    """Whole delta files, v1 and v2, against the baseline's payload, for one pair."""
    row: dict = {"raw": sum(t.data.size for t in new_t.values()), "density": _density(base_t, new_t)}
    row["baseline"] = baselines.xor_zstd1(base_t, new_t, level=1)
    for v in (1, 2):
        sizes = _file_sizes(base_ck, new_ck, v)
        row[f"v{v}_frames"], row[f"v{v}_manifest"] = sizes["frames_bytes"], sizes["manifest_bytes"]
        row[f"v{v}_file"] = sizes["frames_bytes"] + sizes["manifest_bytes"]
    return row


def _size_summary(rows: list[dict]) -> dict:
    """Means over the pairs, and the worst pair (file / baseline): the target is "never larger"."""
    mean = {k: statistics.fmean(r[k] for r in rows) for k in rows[0]}
    out = {
        "density": mean["density"],
        "density_min": min(r["density"] for r in rows),
        "density_max": max(r["density"] for r in rows),
        "baseline_bytes": mean["baseline"],
    }
    for v in (1, 2):
        out[f"v{v}_file_bytes"] = mean[f"v{v}_file"]
        out[f"v{v}_manifest_bytes"] = mean[f"v{v}_manifest"]
        out[f"v{v}_manifest_share"] = mean[f"v{v}_manifest"] / mean[f"v{v}_file"]
        out[f"v{v}_file_vs_baseline"] = mean[f"v{v}_file"] / mean["baseline"]
        out[f"v{v}_file_vs_baseline_worst"] = max(r[f"v{v}_file"] / r["baseline"] for r in rows)
    return out


def run_sizes(name: str, steps: int, pairs: int, cache: Path | None) -> dict:
    """Bytes only: whole v1 and v2 files against the baseline's payload, every pair of the case."""
    dirs = ensure_case(name, steps, cache) if cache else ensure_case(name, steps)
    loaded = [_load(d) for d in dirs[: pairs + 1]]
    rows = [_size_row(b, n, bt, nt) for (b, bt), (n, nt) in zip(loaded, loaded[1:], strict=False)]
    return {"case": name, "pairs": len(rows), "raw_bytes": rows[0]["raw"], **_size_summary(rows)}


def run_case(name: str, steps: int, pairs: int, repeats: int, cache: Path | None) -> dict:
    dirs = ensure_case(name, steps, cache) if cache else ensure_case(name, steps)
    loaded = [_load(d) for d in dirs[: pairs + 1]]
    threads_all = os.cpu_count() or 1
    rows = []
    for (base_ck, base_t), (new_ck, new_t) in zip(loaded, loaded[1:], strict=False):
        raw = sum(t.data.size for t in new_t.values())
        one = _ours_delta(base_ck, new_ck, 1, repeats)
        many = _ours_delta(base_ck, new_ck, threads_all, repeats)
        peer = baselines.measure_xor_zstd1(base_t, new_t, level=1, repeats=repeats)
        peer_v = baselines.measure_xor_zstd1(base_t, new_t, level=1, repeats=repeats, checksum=True)
        core = _per_core(base_ck, new_ck, base_t, new_t, repeats)
        rows.append(
            {
                **_size_row(base_ck, new_ck, base_t, new_t),
                "ours": one["frames_bytes"],
                "bound_diff": diff_bound(base_t, new_t),
                "apply1": raw / one["apply_s"] / 1e9,
                "applyN": raw / many["apply_s"] / 1e9,
                "bound": baselines.entropy_bound(base_t, new_t),
                "enc1": raw / one["encode_s"] / 1e9,
                "encN": raw / many["encode_s"] / 1e9,
                "dec1": raw / one["decode_s"] / 1e9,
                "decN": raw / many["decode_s"] / 1e9,
                "base_enc": raw / peer["encode_s"] / 1e9,
                "base_dec": raw / peer["decode_s"] / 1e9,
                "base_dec_verified": raw / peer_v["decode_s"] / 1e9,
                **{f"pc_{k}": v for k, v in core.items()},
            }
        )
    first_ck, first_t = loaded[0]
    staging = _staging(loaded[0][0], loaded[1][0])
    sums = _checksum_speed(loaded[1][0], repeats, threads_all)
    key = _ours_key(first_ck, repeats, threads_all)
    snap = baselines.measure_snapshot_zstd1(first_t, level=1, repeats=repeats)
    zn = _zipnn_key(first_t, repeats)
    raw0 = sum(t.data.size for t in first_t.values())
    mean = {k: statistics.fmean(r[k] for r in rows) for k in rows[0]}
    return {
        "case": name,
        "pairs": len(rows),
        "tensors": len(first_t),
        "raw_bytes": raw0,
        **_size_summary(rows),
        "ours_bytes": mean["ours"],
        "bound_bytes": mean["bound"],
        "ratio_ours": mean["raw"] / mean["v2_file"],
        "ratio_baseline": mean["raw"] / mean["baseline"],
        "ratio_bound": mean["raw"] / mean["bound"] if mean["bound"] else float("inf"),
        "ours_vs_baseline": mean["baseline"] / mean["v2_file"],
        "pct_of_bound": mean["bound"] / mean["v2_file"] * 100,
        "bound_diff_bytes": mean["bound_diff"],
        "pct_of_diff_bound": mean["bound_diff"] / mean["v2_file"] * 100,
        "apply_gbps_1": mean["apply1"],
        "apply_gbps_all": mean["applyN"],
        "encode_gbps_1": mean["enc1"],
        "encode_gbps_all": mean["encN"],
        "decode_gbps_1": mean["dec1"],
        "decode_gbps_all": mean["decN"],
        "baseline_encode_gbps": mean["base_enc"],
        "baseline_decode_gbps": mean["base_dec"],
        "baseline_decode_verified_gbps": mean["base_dec_verified"],
        **{f"per_core_{k}_gbps": mean[f"pc_{k}"] for k in ("v1_enc", "v2_enc", "base_enc", "v1_apply", "v2_apply")},
        "per_core_base_dec_gbps": mean["pc_base_dec"],
        "encode_vs_baseline_1": mean["pc_v2_enc"] / mean["pc_base_enc"],
        "apply_vs_baseline_verified_1": mean["pc_v2_apply"] / mean["pc_base_dec"],
        "v1_encode_vs_baseline_1": mean["pc_v1_enc"] / mean["pc_base_enc"],
        "v1_apply_vs_baseline_verified_1": mean["pc_v1_apply"] / mean["pc_base_dec"],
        "staged_bytes_per_change": staging["staged_bytes"] / max(staging["changed"], 1) if staging else None,
        "staged_changes_by_width": staging["changed_by_width"] if staging else None,
        "threads_all": threads_all,
        "kernels": kernels.active().name,
        **sums,
        "keyframe_ratio_ours": raw0 / key["bytes"],
        "keyframe_ratio_snapshot_zstd1": raw0 / snap["bytes"],
        "keyframe_encode_gbps_all": raw0 / key["encode_s"] / 1e9,
        "keyframe_ratio_zipnn": raw0 / zn["bytes"] if zn else None,
        "zipnn_encode_gbps": raw0 / zn["encode_s"] / 1e9 if zn else None,
        "zipnn_decode_gbps": raw0 / zn["decode_s"] / 1e9 if zn else None,
    }


def machine() -> str:
    """The CPU (its name, x86 family and model: VMs name only the vendor), cores, L3, the guest scheduler's vCPU
    packing where its kernel has one, Python and numpy: what the figures of a run depend on."""
    cpu = platform.processor() or platform.machine()
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, sep, value = line.partition(":")
            if not sep:
                if info:
                    break  # the first processor's block is enough
                continue
            info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    cpu = info.get("model name", cpu)
    if "cpu family" in info and "model" in info:
        cpu += f" (family {info['cpu family']} model {info['model']})"
    parts = [cpu, f"{os.cpu_count()} cores"]
    l3 = _l3_bytes()
    if l3:
        parts.append(f"L3 {l3 >> 20} MiB")
    pack = vcpu_pack()
    if pack is not None:
        parts.append(f"vCPU packing {pack}")
    return ", ".join(parts) + f", Python {platform.python_version()}, numpy {np.__version__}"


def _l3_bytes() -> int | None:
    """The first CPU's level-3 cache size in bytes (None: not told, as on some VMs)."""
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            if (index / "level").read_text().strip() != "3":
                continue
            size = (index / "size").read_text().strip()  # e.g. "16384K"
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        try:
            return int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
        except (ValueError, IndexError):
            return None
    return None


VCPU_PACK = Path("/proc/sys/kernel/sched_vcpu_pack")
"""A guest kernel knob of some VMs, not in mainline Linux (session 42's 2-core box: 15). There, after an idle spell
of tens of ms, two threads woken together were seen on one vCPU, and a two-thread apply took as long as one
thread (docs/SCALE-RUNS.md, run AS)."""


def vcpu_pack() -> str | None:
    """The guest's vCPU packing setting (None: this kernel has none; "set" when it exists but cannot be read)."""
    try:
        return VCPU_PACK.read_text().strip() or None
    except FileNotFoundError:
        return None
    except OSError:
        return "set"


def table(results: list[dict]) -> str:
    head = (
        "| case | density | raw MB | ours KB (whole file, v2) | baseline KB | XOR bound KB | ours vs baseline "
        "| % of XOR bound | % of diff bound | encode GB/s 1t / all | apply in place GB/s 1t / all "
        "| decode to new buffer GB/s 1t / all | baseline enc / dec GB/s | keyframe ours / zstd-1 / ZipNN |\n|"
        + "---|"
        * 14
    )
    lines = [head]
    for r in results:
        lines.append(
            f"| {r['case']} | {r['density'] * 100:.2f} % | {r['raw_bytes'] / 1e6:.1f} | "
            f"{r['v2_file_bytes'] / 1e3:.1f} | {r['baseline_bytes'] / 1e3:.1f} | {r['bound_bytes'] / 1e3:.1f} | "
            f"**{r['ours_vs_baseline']:.2f}x** | {r['pct_of_bound']:.1f} % | {r['pct_of_diff_bound']:.1f} % | "
            f"{r['encode_gbps_1']:.2f} / {r['encode_gbps_all']:.2f} | "
            f"{r['apply_gbps_1']:.2f} / {r['apply_gbps_all']:.2f} | "
            f"{r['decode_gbps_1']:.2f} / {r['decode_gbps_all']:.2f} | "
            f"{r['baseline_encode_gbps']:.2f} / {r['baseline_decode_gbps']:.2f} | "
            f"{r['keyframe_ratio_ours']:.3f}x / {r['keyframe_ratio_snapshot_zstd1']:.3f}x / "
            + (f"{r['keyframe_ratio_zipnn']:.3f}x |" if r.get("keyframe_ratio_zipnn") else "n/a |")
        )
    return "\n".join(lines)


def sizes_table(results: list[dict]) -> str:
    """Whole delta files (frames + stored manifest) against the baseline's payload, v2 and v1."""
    lines = [
        "| case | pairs | density (min-max) | baseline KB | v2 file KB (manifest share) | v2 / baseline (worst pair) "
        "| v1 file KB (manifest share) | v1 / baseline (worst pair) |",
        "|" + "---|" * 8,
    ]
    for r in results:
        lines.append(
            f"| {r['case']} | {r['pairs']} | {r['density'] * 100:.3f} % ({r['density_min'] * 100:.3f}-"
            f"{r['density_max'] * 100:.3f}) | {r['baseline_bytes'] / 1e3:.1f} | "
            f"{r['v2_file_bytes'] / 1e3:.1f} ({r['v2_manifest_share'] * 100:.1f} %) | "
            f"**{r['v2_file_vs_baseline']:.3f}** ({r['v2_file_vs_baseline_worst']:.3f}) | "
            f"{r['v1_file_bytes'] / 1e3:.1f} ({r['v1_manifest_share'] * 100:.1f} %) | "
            f"{r['v1_file_vs_baseline']:.3f} ({r['v1_file_vs_baseline_worst']:.3f}) |"
        )
    return "\n".join(lines)


def speed_table(results: list[dict]) -> str:
    """Per-core speed against the baseline, same run, same bytes, interleaved (issue 11's CPU targets)."""
    lines = [
        "| case | kernels | encode GB/s 1t v1 / v2 | baseline encode 1t | v2 (v1) encode vs baseline "
        "| verified apply in place GB/s 1t v1 / v2 | baseline verified decode 1t | v2 (v1) apply vs baseline "
        "| checksum GB/s 1t / all | xxh3-128 GB/s 1t | staged bytes / changed element |",
        "|" + "---|" * 11,
    ]
    for r in results:
        lines.append(
            f"| {r['case']} | {r['kernels']} | {r['per_core_v1_enc_gbps']:.2f} / {r['per_core_v2_enc_gbps']:.2f} | "
            f"{r['per_core_base_enc_gbps']:.2f} | **{r['encode_vs_baseline_1']:.2f}x** "
            f"({r['v1_encode_vs_baseline_1']:.2f}x) | "
            f"{r['per_core_v1_apply_gbps']:.2f} / {r['per_core_v2_apply_gbps']:.2f} | "
            f"{r['per_core_base_dec_gbps']:.2f} | **{r['apply_vs_baseline_verified_1']:.2f}x** "
            f"({r['v1_apply_vs_baseline_verified_1']:.2f}x) | "
            f"{r['checksum_gbps_1']:.2f} / {r['checksum_gbps_all']:.2f} | {r['xxh3_gbps_1']:.2f} | "
            + (f"{r['staged_bytes_per_change']:.2f} |" if r.get("staged_bytes_per_change") else "n/a |")
        )
    return "\n".join(lines)


def plots(results: list[dict], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["case"] for r in results]
    x = np.arange(len(names))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for i, (key, label) in enumerate(
        [
            ("ratio_baseline", "XOR + zstd-1 (peers)"),
            ("ratio_ours", "weightsync"),
            ("ratio_bound", "zero-order entropy bound"),
        ]
    ):
        ax.bar(x + (i - 1) * 0.27, [r[key] for r in results], 0.27, label=label)
    ax.set_xticks(x, names, rotation=15)
    ax.set_ylabel("compression ratio (raw / delta bytes)")
    ax.set_yscale("log")
    ax.set_title("Delta compression on real optimizer steps")
    ax.legend()
    fig.tight_layout()
    ratio_png = out / "codec_ratio.png"
    fig.savefig(ratio_png, dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for i, (key, label) in enumerate(
        [
            ("baseline_encode_gbps", "baseline encode"),
            ("encode_gbps_1", "ours encode 1t"),
            ("encode_gbps_all", "ours encode all"),
            ("baseline_decode_gbps", "baseline decode"),
            ("apply_gbps_1", "ours apply in place 1t"),
            ("apply_gbps_all", "ours apply in place all"),
        ]
    ):
        ax.bar(x + (i - 2.5) * 0.14, [r[key] for r in results], 0.14, label=label)
    ax.set_xticks(x, names, rotation=15)
    ax.set_ylabel("GB/s of raw model bytes")
    ax.set_title("Codec throughput")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    speed_png = out / "codec_throughput.png"
    fig.savefig(speed_png, dpi=110)
    plt.close(fig)
    return [ratio_png, speed_png]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="weightsync bench codec", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--cases", nargs="*", default=DEFAULT_CASES, help=f"sparse quantized cases: {' '.join(SPARSE_CASES)}"
    )
    ap.add_argument("--steps", type=int, default=8, help="optimizer steps (versions) per case")
    ap.add_argument("--pairs", type=int, default=4, help="consecutive version pairs measured per case")
    ap.add_argument("--repeats", type=int, default=3, help="timing repeats (best is kept)")
    ap.add_argument("--no-speed", action="store_true", help="bytes only: whole files v1 / v2 vs the baseline")
    ap.add_argument("--cache", type=Path, default=None, help="corpus cache directory")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    pairs = min(args.pairs, args.steps)
    results = []
    for case in args.cases:
        if args.no_speed:
            r = run_sizes(case, args.steps, pairs, args.cache)
        else:
            r = run_case(case, args.steps, pairs, args.repeats, args.cache)
        results.append(r)
        line = (
            f"{case}: density {r['density'] * 100:.3f} %, whole file v2 {r['v2_file_vs_baseline']:.3f} of the "
            f"baseline (worst pair {r['v2_file_vs_baseline_worst']:.3f}, "
            f"manifest {r['v2_manifest_share'] * 100:.1f} %), "
            f"v1 {r['v1_file_vs_baseline']:.3f} (manifest {r['v1_manifest_share'] * 100:.1f} %)"
        )
        if not args.no_speed:
            line += (
                f"; per core vs baseline: encode v2 {r['encode_vs_baseline_1']:.2f}x "
                f"(v1 {r['v1_encode_vs_baseline_1']:.2f}x), verified apply v2 "
                f"{r['apply_vs_baseline_verified_1']:.2f}x (v1 {r['v1_apply_vs_baseline_verified_1']:.2f}x)"
            )
        print(line, flush=True)
    doc = {"machine": machine(), "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "results": results}
    name = "codec_sizes" if args.no_speed else "codec"
    (args.out / f"{name}.json").write_text(json.dumps(doc, indent=1))
    md = f"Machine: {doc['machine']}. Run: {doc['when']}.\n\n{sizes_table(results)}\n"
    if not args.no_speed:
        md += f"\n{table(results)}\n\n{speed_table(results)}\n"
        for p in plots(results, args.out):
            print(f"wrote {p}")
    (args.out / f"{name}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
