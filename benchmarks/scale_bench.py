"""`weightsync bench scale`: weightsync against a full reload and against XOR + zstd-1, one model, one run.

Issue 11's scale case. The model is a corpus case (``--case``, e.g. ``bf16-lr1e-6`` = 45 MB MiniLM,
``moe-bf16-x4`` = 436 MB) or a Llama-style model generated to a size (``--model-bytes 200M``;
benchmarks/_llama.py: random init, real AdamW steps at lr 1e-6 on random tokens, bf16 export) on
whatever device is there. Live tensors sit on that device (CUDA when there is one, else the CPU).
For every version after the first, on the same bytes (weightsync and the two others take turns
going first from one version to the next):

* weightsync, against an embedded ``weightsync serve`` on loopback: ``Publisher.publish`` of the
  delta, then two subscribers ``prepare`` + ``apply`` (verification on) at once, each in a process
  of its own as inference engines are (one per GPU or tensor-parallel group; two subscribers in one
  Python process would share its GIL) (end to end = publish call → the last subscriber applied);
  then a third subscriber alone, in this process (prepare + apply: the figure compared with the
  other paths);
* a full reload from local disk: ``safetensors.torch.load_file(device=...)`` + ``copy_`` into live
  tensors, first with a cold page cache (``posix_fadvise(DONTNEED)`` on every file; residency
  checked with ``mincore``), then warm;
* per-tensor XOR + zstd-1: encode on all cores, then decode on all cores + XOR into live tensors.

After each version every set of live tensors is checked bit for bit against the version's files
(AssertionError if not). Version 0 seeds everything, version 1 is a warm-up; figures are medians
over the rest. Nothing is asserted about time: it measures. Writes ``scale_<label>.json`` and
``.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import re
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks._scale_paths import Alternatives, files, load_live, page_cache_check, sync

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "KI": 1 << 10, "MI": 1 << 20, "GI": 1 << 30}


def parse_bytes(text: str) -> int:
    """``436M``, ``2G``, ``1.5GiB``, ``4000000`` → bytes (K/M/G decimal, Ki/Mi/Gi binary)."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([KMGT]I?)?B?\s*", text.upper())
    if m is None or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 436M, 2G)")
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


# ---------------------------------------------------------------------------------------------------
# the model


def corpus_source(case: str, versions: int) -> tuple[list[Path], dict]:
    """The case's version directories (generated if missing) and what describes them."""
    from benchmarks.corpus import ensure_case, read_meta

    dirs = ensure_case(case, versions - 1)[:versions]
    records = read_meta(case)["records"]
    return dirs, {"case": case, "changed_fraction": [r["changed_fraction"] for r in records[1:versions]]}


def generated_source(
    nbytes: int, versions: int, device: str, cache: Path, lr: float | None = None
) -> tuple[list[Path], dict]:
    """A Llama-style model of about `nbytes`, trained on `device` at `lr` (benchmarks/_llama.py), cached."""
    from dataclasses import asdict

    from benchmarks._llama import DEFAULT_LR, LlamaShape, ensure_versions

    shape = LlamaShape.for_bytes(nbytes)
    lr = DEFAULT_LR if lr is None else lr
    dirs, meta = ensure_versions(shape, versions, cache, device=device, lr=lr)
    return dirs, {
        "model_bytes_asked": nbytes,
        "llama": asdict(shape),
        "lr": lr,
        "changed_fraction": meta["changed_fraction"],
    }


# ---------------------------------------------------------------------------------------------------
# weightsync


def _subscriber_process(conn: Any, url: str, model: str, name: str, version: int, first: str, device: str) -> None:
    """A subscriber in a process of its own, holding its live tensors on `device`: what the end to end's
    subscribers run. Requests on `conn`: ("update", N) → prepare + apply to version N, answered with the
    phase times and ``end`` (``time.monotonic()``, one clock for every process on the box); ("check",
    dir) → None once the tensors hold that version bit for bit, else the AssertionError's text;
    ("close", None) → exit."""
    from weightsync.client import Subscriber

    stage = device if device.startswith("cuda") else None
    live = load_live(Path(first), device)
    with Subscriber(url, model, name=name, version=version, report=False) as sub:
        conn.send("ready")
        while True:
            what, arg = conn.recv()
            if what == "close":
                return
            if what == "check":
                try:
                    check({name: live}, Path(arg), device)
                    conn.send(None)
                except AssertionError as exc:
                    conn.send(str(exc))
                continue
            t0 = time.monotonic()
            prepared = sub.prepare(arg, device=stage)
            t1 = time.monotonic()
            sub.apply(live, prepared)
            sync(device)
            t2 = time.monotonic()
            del prepared
            conn.send({"prepare_s": t1 - t0, "apply_s": t2 - t1, "prepare_apply_s": t2 - t0, "end": t2})


class SubscriberProcess:
    """Handle on a :func:`_subscriber_process` (started with ``spawn``: CUDA does not survive a fork)."""

    def __init__(self, url: str, model: str, name: str, version: int, first: Path, device: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.name = name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_subscriber_process, args=(child, url, model, name, version, str(first), device), daemon=True
        )
        self.proc.start()
        child.close()
        self._answer(600)  # "ready": loaded, connected

    def _answer(self, timeout: float) -> Any:
        if not self.conn.poll(timeout):
            raise RuntimeError(f"subscriber process {self.name} did not answer in {timeout:.0f} s")
        try:
            return self.conn.recv()
        except EOFError:
            raise RuntimeError(f"subscriber process {self.name} exited ({self.proc.exitcode})") from None

    def start_update(self, version: int) -> None:
        self.conn.send(("update", version))

    def result(self) -> dict[str, float]:
        return self._answer(600)

    def check(self, vdir: Path) -> None:
        self.conn.send(("check", str(vdir)))
        failed = self._answer(600)
        if failed is not None:
            raise AssertionError(failed)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("close", None))
            except OSError:
                pass
            self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


class Weightsync:
    """One publisher and three subscribers of one model: two in processes of their own run the end to end,
    the third, in this process, alone."""

    def __init__(self, url: str, first: Path, device: str, *, keyframes: bool = True) -> None:
        from weightsync.client import Publisher, Subscriber

        self.device = device
        self.keyframes, self.keyframe_count = keyframes, 0
        self.stage = device if device.startswith("cuda") else None  # prepare stages on the GPU there
        self.url = url
        self.pub = Publisher(url, "scale")
        version = self.pub.publish(first).version
        # publish_async from the trainer's tensors on the device, to its own model (its first call warms
        # the pinned snapshot buffers and publishes the keyframe its deltas build on).
        self.async_pub = Publisher(url, "scale-async")
        self.async_pub.publish_async(load_live(first, device)).result()
        # No replica reports: on this one box the server's ledger writes would land in other paths' timings.
        self.sub = Subscriber(url, "scale", name="scale-alone", version=version, report=False)
        self.live = load_live(first, device)
        self.e2e: list[SubscriberProcess] = []
        for i in range(2):
            self.e2e.append(SubscriberProcess(url, "scale", f"scale-e2e-{i}", version, first, device))

    def close(self) -> None:
        self.pub.close()
        self.async_pub.close()
        self.sub.close()
        for p in self.e2e:
            p.close()

    def check(self, vdir: Path) -> None:
        """Every subscriber's tensors hold the version in `vdir` bit for bit (AssertionError if not)."""
        check({"weightsync subscriber alone": self.live}, vdir, self.device)
        for p in self.e2e:
            p.check(vdir)

    def _update(self, version: int) -> dict[str, float]:
        """The lone subscriber prepares and applies `version` into its tensors; its phase times."""
        sub = self.sub
        import torch

        cuda = self.device.startswith("cuda")
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        prepared = sub.prepare(version, device=self.stage)
        t1 = time.perf_counter()
        pause = sub.apply(self.live, prepared)
        sync(self.device)
        t2 = time.perf_counter()
        row = {"prepare_s": t1 - t0, "apply_s": t2 - t1, "prepare_apply_s": t2 - t0, "pause_s": pause}
        if cuda:
            # Peak GPU memory allocated by prepare + apply beyond what the process held before (the model's
            # live tensors and the other paths' included there): the staged update and any scratch.
            row["staging_bytes"] = float(torch.cuda.max_memory_allocated() - before)
        row |= {k: sub.timings.get(k, 0.0) for k in ("plan_s", "server_plan_s", "download_s", "decode_s")}
        row["bytes_down"] = float(prepared.bytes_received)
        del prepared  # its staging goes back before the next path runs
        return row

    def version(self, vdir: Path, timed: bool = True) -> dict[str, float]:
        """Publish `vdir`, bring every subscriber to it; the times and bytes of this version.

        Also ``publish_async`` of the version's tensors on the device (its own model) and, on timed
        versions, the version as a keyframe by a fresh publisher (each keyframe stays stored: disk).
        """
        t0 = time.monotonic()  # the subscriber processes' clock too
        result = self.pub.publish(vdir)
        publish_s = time.monotonic() - t0
        if result.kind != "delta":
            raise AssertionError(f"published a {result.kind}, wanted a delta")
        for p in self.e2e:
            p.start_update(result.version)
        both = [p.result() for p in self.e2e]
        row = {
            "ws_publish_s": publish_s,
            "ws_encode_s": result.timings.get("encode_s", 0.0),
            "ws_bytes_up": float(result.bytes_sent),
            "ws_e2e_s": max(r["end"] for r in both) - t0,
            "ws_e2e_prepare_apply_s": max(r["prepare_apply_s"] for r in both),
        }
        alone = self._update(result.version)
        row |= {f"ws_{k}": v for k, v in alone.items()}
        row |= self._publish_async(vdir)
        if self.keyframes and timed:
            row |= self._keyframe(vdir)
        return row

    def _publish_async(self, vdir: Path) -> dict[str, float]:
        """``publish_async`` of the version's tensors held on the device: time to return, time to committed."""
        state = load_live(vdir, self.device)  # the trainer's weights
        sync(self.device)
        t0 = time.perf_counter()
        future = self.async_pub.publish_async(state)
        t1 = time.perf_counter()
        result = future.result()
        t2 = time.perf_counter()
        if result.kind != "delta":
            raise AssertionError(f"publish_async published a {result.kind}, wanted a delta")
        return {"ws_async_return_s": t1 - t0, "ws_async_publish_s": t2 - t0}

    def _keyframe(self, vdir: Path) -> dict[str, float]:
        """The version published as a keyframe by a new publisher of a new model (a fresh trainer run)."""
        from weightsync.client import Publisher

        self.keyframe_count += 1
        with Publisher(self.url, f"scale-key-{self.keyframe_count}") as pub:
            t0 = time.perf_counter()
            result = pub.publish(vdir, keyframe=True)
            elapsed = time.perf_counter() - t0
        if result.kind != "keyframe":
            raise AssertionError(f"published a {result.kind}, wanted a keyframe")
        return {
            "ws_keyframe_publish_s": elapsed,
            "ws_keyframe_bytes_up": float(result.bytes_sent),
            "ws_keyframe_encode_s": result.timings.get("encode_s", 0.0),
            "ws_keyframe_upload_s": result.timings.get("upload_s", 0.0),
        }


# ---------------------------------------------------------------------------------------------------
# the run


def check(live_sets: dict[str, dict[str, Any]], vdir: Path, device: str) -> None:
    """Every set of live tensors holds exactly the version in `vdir` (AssertionError naming path and tensor)."""
    import torch

    want = load_live(vdir, device)
    for path, live in live_sets.items():
        if set(live) != set(want):
            raise AssertionError(f"{path}: tensor names differ from {vdir}")
        for name, t in want.items():
            if not torch.equal(live[name].view(-1).view(torch.uint8), t.view(-1).view(torch.uint8)):
                raise AssertionError(f"{path}: {name} is not bit-identical to {vdir}")


def run(
    versions: list[Path],
    device: str,
    threads: int,
    log: Any = print,
    *,
    keyframes: bool = True,
    server_workers: int = 1,
) -> dict[str, Any]:
    """Every path on every version (v0 seeds, v1 warms up); per-version rows and the page-cache check.

    `server_workers`: the embedded server's worker processes (``weightsync serve --workers``).

    The paths take turns going first (weightsync on odd versions, the alternatives on even ones), so
    that what one leaves behind (dirty pages, the server's background work) hits both alike.
    """
    from benchmarks._serve import serve

    rows: list[dict[str, float]] = []
    args = ["--workers", str(server_workers)] if server_workers > 1 else []
    with tempfile.TemporaryDirectory(prefix="weightsync-scale-bench-") as tmp, serve(Path(tmp), args=args) as url:
        ws = Weightsync(url, versions[0], device, keyframes=keyframes)
        others = Alternatives(versions[0], device, threads)
        try:
            page_cache = page_cache_check(files(versions[0])[0])
            for i, vdir in enumerate(versions[1:], 1):
                steps = [partial(ws.version, vdir, i > 1), partial(others.version, versions[i - 1], vdir)]
                row: dict[str, float] = {}
                for step in steps if i % 2 else steps[::-1]:
                    row |= step()
                ws.check(vdir)
                check({"reload": others.reloaded, "xor-zstd": others.xored}, vdir, device)
                log(
                    f"v{i}{' (warm-up)' if i == 1 else ''}: weightsync prepare+apply {row['ws_prepare_apply_s']:.3f} s"
                    f" (publish {row['ws_publish_s']:.3f}, e2e {row['ws_e2e_s']:.3f})  reload warm"
                    f" {row['reload_warm_s']:.3f} cold {row['reload_cold_s']:.3f}  xor-zstd apply"
                    f" {row['xor_apply_s']:.3f} encode {row['xor_encode_s']:.3f}  publish_async returned"
                    f" {row['ws_async_return_s']:.3f}"
                    + (
                        f"  keyframe publish {row['ws_keyframe_publish_s']:.3f}"
                        if "ws_keyframe_publish_s" in row
                        else ""
                    )
                    + "  bit-identical"
                )
                if i > 1:
                    rows.append(row)
        finally:
            ws.close()
            others.close()
    return {"rows": rows, "page_cache": page_cache}


def summarize(rows: list[dict[str, float]]) -> dict[str, Any]:
    """Medians per figure and the ratios issue 11 asks for (weightsync's time over the other path's)."""
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    pa = med["ws_prepare_apply_s"]
    return {
        "medians": med,
        "ratios": {
            "weightsync_over_reload_warm": pa / med["reload_warm_s"],
            "weightsync_over_reload_cold": pa / med["reload_cold_s"],
            "weightsync_over_xor_zstd": pa / med["xor_apply_s"],
            "publish_over_xor_encode": med["ws_publish_s"] / med["xor_encode_s"],
            "xor_bytes_over_weightsync_bytes": med["xor_bytes"] / med["ws_bytes_down"],
        },
    }


def table(r: dict[str, Any]) -> str:
    """The paths side by side (markdown): bytes moved, median time, weightsync's time over the path's."""
    m, ratio, n = r["medians"], r["ratios"], r["threads"]

    def mb(key: str) -> str:
        return f"{m[key] / 1e6:.2f} MB"

    def ms(key: str) -> str:
        return f"{m[key] * 1e3:.1f}"

    rows = [
        ("**weightsync** `prepare` + `apply` (verified), one subscriber alone", mb("ws_bytes_down"),
         ms("ws_prepare_apply_s"), "1.00"),
        (f"  `prepare`: plan {ms('ws_plan_s')} (server {ms('ws_server_plan_s')}) / download {ms('ws_download_s')}"
         f" / decode {ms('ws_decode_s')}",
         "", ms("ws_prepare_s"), ""),
        (f"  `apply` call (pause {ms('ws_pause_s')})", "", ms("ws_apply_s"), ""),
        (f"weightsync `publish` of the delta (encode {ms('ws_encode_s')})", mb("ws_bytes_up"), ms("ws_publish_s"), ""),
        (f"weightsync `publish_async` of the device's tensors: returns in {ms('ws_async_return_s')}, committed",
         "", ms("ws_async_publish_s"), ""),
        ("weightsync end to end: publish → 2 subscribers applied (at once, a process each, same box)",
         f"{(m['ws_bytes_up'] + 2 * m['ws_bytes_down']) / 1e6:.2f} MB", ms("ws_e2e_s"), ""),
        ("full reload (`load_file` + `copy_`), warm page cache", mb("reload_bytes"), ms("reload_warm_s"),
         f"**{ratio['weightsync_over_reload_warm']:.2f}**"),
        (f"full reload, cold page cache ({100 * m['reload_cold_resident']:.0f} % resident after eviction)",
         mb("reload_bytes"), ms("reload_cold_s"), f"**{ratio['weightsync_over_reload_cold']:.2f}**"),
        (f"XOR + zstd-1: decode ({n} threads) + XOR into the live tensors", mb("xor_bytes"), ms("xor_apply_s"),
         f"**{ratio['weightsync_over_xor_zstd']:.2f}**"),
        (f"XOR + zstd-1: encode ({n} threads)", mb("xor_bytes"), ms("xor_encode_s"), ""),
    ]  # fmt: skip
    if "ws_keyframe_publish_s" in m:
        rows.append(
            (f"weightsync `publish` of the version as a keyframe, fresh publisher (encode {ms('ws_keyframe_encode_s')},"
             f" upload {ms('ws_keyframe_upload_s')})", mb("ws_keyframe_bytes_up"), ms("ws_keyframe_publish_s"), "")
        )  # fmt: skip
    lines = [
        "| path (median of the versions) | bytes moved | ms | weightsync prepare+apply ÷ this |",
        "|---|---:|---:|---:|",
    ]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    if "ws_staging_bytes" in m:
        per = m["ws_staging_bytes"] / r["changed_elements"] if r.get("changed_elements") else float("nan")
        lines.append(
            f"\nGPU staging (peak memory allocated by one subscriber's `prepare` + `apply` beyond what it held"
            f" before): {m['ws_staging_bytes'] / 1e6:.1f} MB, {per:.2f} bytes per changed element."
        )
    pc = r["page_cache"]
    lines.append(
        f"\nPage cache: after `posix_fadvise(DONTNEED)` {100 * pc['resident_after_evict']:.0f} % of the file stayed"
        f" resident (after a read: {100 * pc['resident_after_read']:.0f} %): eviction"
        f" {'took' if pc['eviction_took_effect'] else 'did NOT take'} effect; a cold read ran at"
        f" {pc['cold_read_gbps']:.2f} GB/s against {pc['warm_read_gbps']:.2f} GB/s warm"
        f" ({pc['cold_over_warm']:.1f}x the time). XOR + zstd-1 moves"
        f" {ratio['xor_bytes_over_weightsync_bytes']:.2f}x weightsync's bytes; weightsync's publish takes"
        f" {ratio['publish_over_xor_encode']:.2f}x its encode."
    )
    return "\n".join(lines)


def code_version() -> str:
    """The commit the bench ran (``+dirty`` with uncommitted changes), or "unknown" outside a git checkout."""
    import subprocess

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout

    try:
        return git("rev-parse", "--short", "HEAD").strip() + ("+dirty" if git("status", "--porcelain").strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def describe(r: dict[str, Any]) -> str:
    """One line naming the model, the device, the machine and the run."""
    what = r["case"] if "case" in r else f"generated Llama-style {r['llama']}, AdamW lr {r.get('lr', 1e-6):g}"
    density = statistics.median(r["changed_fraction"]) if r["changed_fraction"] else float("nan")
    return (
        f"Model: {what}; {r['model_bytes'] / 1e6:.1f} MB in {r['tensors']} tensors; {100 * density:.2f} % of"
        f" elements changed per version (median). Live tensors on {r['device']}, torch intra-op threads:"
        f" {r['torch_threads']}. Server worker processes: {r.get('server_workers', 1)}."
        f" {r['versions']} versions after a warm-up. Machine: {r['machine']}."
        f" Run: {r['when']}, code {r['code']}."
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="weightsync bench scale", description=__doc__.splitlines()[0])
    model = ap.add_mutually_exclusive_group()
    model.add_argument("--case", help="a corpus case (benchmarks/corpus.py), e.g. bf16-lr1e-6, moe-bf16-x4")
    model.add_argument("--model-bytes", type=parse_bytes, help="generate a Llama-style model of this size (200M, 2G)")
    ap.add_argument(
        "--lr",
        type=float,
        help="AdamW's lr for a generated model (default 1e-6: 0.5-0.7 %% of elements change a step; 5e-6: "
        "2.1-2.9 %%, about issue 11's 2.75 %%); a corpus case has its own",
    )
    ap.add_argument("--versions", type=int, default=3, help="timed versions (one more is the warm-up)")
    ap.add_argument("--device", default="auto", help="where the live tensors are: auto (cuda if any), cpu, cuda")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="XOR + zstd-1 threads (all cores)")
    ap.add_argument("--torch-threads", type=int, help="torch's intra-op threads for the whole run (default: torch's)")
    ap.add_argument("--no-keyframes", action="store_true", help="skip the keyframe publishes (each stays stored)")
    ap.add_argument(
        "--server-workers",
        type=int,
        default=1,
        help="worker processes of the embedded server (weightsync serve --workers; one process takes "
        "~0.45 GB/s of uploads on the 2-core VM, its event loop's HTTP parsing the limit)",
    )
    ap.add_argument("--label", help="output name scale_<label>.{json,md} (default: the model and the device)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--cache", type=Path, default=ROOT / "benchmarks" / ".cache", help="generated models")
    args = ap.parse_args(argv)
    if args.versions < 3:
        ap.error("--versions must be at least 3 (medians)")
    if args.lr is not None and not args.model_bytes:
        ap.error("--lr is for a generated model (--model-bytes): a corpus case has its own")
    if args.lr is not None and not (math.isfinite(args.lr) and args.lr > 0):
        ap.error(f"--lr must be a number above 0, not {args.lr}")
    sys.path.insert(0, str(ROOT))
    import torch

    from benchmarks._llama import human_size
    from benchmarks.baselines import read_safetensors_header
    from benchmarks.codec_bench import machine

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    count = args.versions + 2  # v0 seeds, v1 warms up
    if args.model_bytes:
        dirs, info = generated_source(args.model_bytes, count, device, args.cache, args.lr)
        name = f"llama-{human_size(args.model_bytes)}"
    else:
        name = args.case or "bf16-lr1e-6"
        dirs, info = corpus_source(name, count)
    if args.server_workers < 1:
        ap.error("--server-workers must be at least 1")
    result = run(dirs, device, args.threads, keyframes=not args.no_keyframes, server_workers=args.server_workers)
    rows = result["rows"]
    result |= summarize(rows) | info
    headers = [read_safetensors_header(f)[0] for f in files(dirs[0])]
    tensors = [t for h in headers for k, t in h.items() if k != "__metadata__"]
    elements = sum(math.prod(t["shape"]) for t in tensors)
    result |= {
        "model_bytes": sum(f.stat().st_size for f in files(dirs[0])),
        "tensors": len(tensors),
        "elements": elements,
        "changed_elements": statistics.median(info["changed_fraction"][1:] or [float("nan")]) * elements,
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
        "threads": args.threads,
        "server_workers": args.server_workers,
        "torch_threads": torch.get_num_threads(),
        "versions": len(rows),
        "bit_identical": True,
        "machine": machine(),
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "code": code_version(),
    }
    label = args.label or f"{name}_{device.split(':')[0]}"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"scale_{label}.json").write_text(json.dumps(result, indent=1))
    md = f"{describe(result)}\n\n{table(result)}\n"
    (args.out / f"scale_{label}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
