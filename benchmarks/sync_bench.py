"""`weightsync bench sync`: publish → every subscriber applied, deltas vs full snapshots, over capped links.

One run starts a real server (the embedded default: SQLite + filesystem; or
PostgreSQL + SeaweedFS with ``--backend s3pg``), a publisher (this process) and K
subscribers (separate processes), all on loopback. Each link is capped by the
client's token bucket: the publisher's upload and each subscriber's download.
Subscribers hold the model's tensors in memory (torch, loaded from a pull of the
first version), and for every new version run ``prepare`` (download + decode off
the critical path) and ``apply`` (in place: the only part that pauses serving).

Per version we record: the publish call's start → each subscriber's apply end
(latency), bytes on the wire (uploaded, downloaded per subscriber), the pause,
and the wire floor: upload bytes / cap + download bytes / cap (store and
forward through the server). "Full" ships every version as a keyframe (a
compressed full snapshot) through the same path, so the comparison isolates
what deltas buy.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

from benchmarks._serve import serve

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
CAPS = {"100M": 100e6 / 8, "1G": 1e9 / 8, "10G": 10e9 / 8}


@contextmanager
def server(backend: str, workdir: Path):
    """`weightsync serve` on the embedded default, or on PostgreSQL + SeaweedFS for "s3pg"; yields its URL."""
    with ExitStack() as stack:
        args: list[str] = []
        env = dict(os.environ)
        if backend == "s3pg":
            sys.path.insert(0, str(ROOT / "tests"))
            from _pg import fresh_database
            from _seaweed import seaweed_server

            sw = stack.enter_context(seaweed_server())
            db = stack.enter_context(fresh_database("ws_bench"))
            args = ["--catalog", db, "--store", "s3://bench/weights", "--s3-endpoint", sw.endpoint_url]
            env.update(sw.env())
        yield stack.enter_context(serve(workdir, args=args, env=env))


def subscriber_main(args: argparse.Namespace) -> int:
    """One subscriber process: pull the first version, load its tensors, then prepare + apply each new one."""
    from safetensors.torch import load_file

    from weightsync.client import Subscriber

    out = open(args.out, "a", buffering=1)  # noqa: SIM115 - the follower's log, open until the process ends
    sub = Subscriber(args.server, args.model, name=args.name, bandwidth=args.bandwidth, report=True)
    first = sub.pull(args.dir)
    tensors = load_file(str(Path(args.dir) / "model.safetensors"))
    sub.version = first.version
    out.write(json.dumps({"ready": first.version}) + "\n")
    done = 0
    current = first.version
    while done < args.versions:
        for v in sub.watch(after=current, timeout=30):
            t0 = time.time()
            prepared = sub.prepare(v.number)
            t1 = time.time()
            pause = sub.apply(tensors, prepared)
            t2 = time.time()
            out.write(
                json.dumps(
                    {
                        "version": v.number,
                        "applied_at": t2,
                        "prepare_s": t1 - t0,
                        "pause_s": pause,
                        "apply_call_s": t2 - t1,
                        "bytes": prepared.bytes_received,
                    }
                )
                + "\n"
            )
            current = v.number
            done += 1
            break
    sub.close()
    return 0


def read_lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_mode(url: str, versions: list[Path], cap_name: str, mode: str, subscribers: int, work: Path) -> dict:
    from weightsync.client import Publisher

    model = f"bench-{mode}-{cap_name.lower()}"
    cap = CAPS[cap_name]
    pub = Publisher(url, model, bandwidth=cap)
    pub.publish(versions[0], step=0, keyframe=True)
    procs, outs = [], []
    for i in range(subscribers):
        out = work / f"{model}-sub{i}.jsonl"
        outs.append(out)
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "benchmarks.sync_bench",
                    "_subscriber",
                    "--server",
                    url,
                    "--model",
                    model,
                    "--name",
                    f"sub{i}",
                    "--bandwidth",
                    str(cap),
                    "--dir",
                    str(work / f"{model}-sub{i}"),
                    "--versions",
                    str(len(versions) - 1),
                    "--out",
                    str(out),
                ],
                cwd=ROOT,
            )
        )
    try:
        wait_until(lambda: all(any("ready" in r for r in read_lines(o)) for o in outs), procs, 300)
        rows = []
        for i, vdir in enumerate(versions[1:], start=1):
            t_call = time.time()
            res = pub.publish(vdir, step=i, keyframe=(mode == "full"))
            t_commit = time.time()
            wait_until(
                lambda res=res: all(any(r.get("version") == res.version for r in read_lines(o)) for o in outs),
                procs,
                600,
            )
            subs = [next(r for r in read_lines(o) if r.get("version") == res.version) for o in outs]
            down = max(s["bytes"] for s in subs)
            floor = res.bytes_sent / cap + down / cap
            codec = res.timings.get("encode_s", 0.0) + statistics.fmean(s["apply_call_s"] for s in subs)
            rows.append(
                {
                    "version": res.version,
                    "kind": res.kind,
                    "raw_bytes": res.raw_bytes,
                    "apply_call_s": [s["apply_call_s"] for s in subs],
                    "bytes_up": res.bytes_sent,
                    "bytes_down": down,
                    "latencies": [s["applied_at"] - t_call for s in subs],
                    "publish_s": t_commit - t_call,
                    "encode_s": res.timings.get("encode_s"),
                    "pauses": [s["pause_s"] for s in subs],
                    "prepare_s": [s["prepare_s"] for s in subs],
                    "wire_floor_s": floor,
                    "floor_plus_codec_s": floor + codec,
                }
            )
    finally:
        stop_all(procs)
        pub.close()
    lat = sorted(x for r in rows for x in r["latencies"])
    pauses = sorted(x for r in rows for x in r["pauses"])
    return {
        "cap": cap_name,
        "mode": mode,
        "versions": rows,
        "latency_p50_s": _pct(lat, 50),
        "latency_p95_s": _pct(lat, 95),
        "pause_p50_ms": _pct(pauses, 50) * 1e3,
        "pause_p95_ms": _pct(pauses, 95) * 1e3,
        "bytes_up_mean": statistics.fmean(r["bytes_up"] for r in rows),
        "bytes_down_mean": statistics.fmean(r["bytes_down"] for r in rows),
        "wire_floor_mean_s": statistics.fmean(r["wire_floor_s"] for r in rows),
        "floor_plus_codec_mean_s": statistics.fmean(r["floor_plus_codec_s"] for r in rows),
        "publish_p50_s": _pct(sorted(r["publish_s"] for r in rows), 50),
        "encode_p50_s": _pct(sorted(r["encode_s"] or 0.0 for r in rows), 50),
        "prepare_p50_s": _pct(sorted(x for r in rows for x in r["prepare_s"]), 50),
        "apply_call_p50_s": _pct(sorted(x for r in rows for x in r["apply_call_s"]), 50),
        "raw_bytes": rows[0]["raw_bytes"],
    }


def _pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    k = (len(values) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def stop_all(procs: list[subprocess.Popen[bytes]]) -> None:
    """Terminate the subscriber processes; kill those still there 10 s later."""
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()


def wait_until(cond, procs, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        dead = [p for p in procs if p.poll() is not None and p.returncode != 0]
        if dead:
            raise RuntimeError(f"a subscriber exited with {dead[0].returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError("subscribers did not finish in time")
        time.sleep(0.02)


def table(results: list[dict]) -> str:
    lines = [
        "| backend | link | mode | bytes up / version | bytes down / subscriber | latency p50 / p95 s "
        "| wire floor s | floor + codec s | latency ÷ (floor + codec) | pause p50 / p95 ms |",
        "|" + "---|" * 10,
    ]
    for r in results:
        lines.append(
            f"| {r['backend']} | {r['cap']} | {r['mode']} | {r['bytes_up_mean'] / 1e6:.2f} MB | "
            f"{r['bytes_down_mean'] / 1e6:.2f} MB | {r['latency_p50_s']:.2f} / {r['latency_p95_s']:.2f} | "
            f"{r['wire_floor_mean_s']:.2f} | {r['floor_plus_codec_mean_s']:.2f} | "
            f"{r['latency_p50_s'] / r['floor_plus_codec_mean_s']:.2f} | "
            f"{r['pause_p50_ms']:.1f} / {r['pause_p95_ms']:.1f} |"
        )
    return "\n".join(lines)


def breakdown(results: list[dict]) -> str:
    lines = [
        "| backend | link | mode | publish call p50 s (encode) | subscriber prepare p50 s | apply call p50 s |",
        "|" + "---|" * 6,
    ]
    for r in results:
        lines.append(
            f"| {r['backend']} | {r['cap']} | {r['mode']} | {r['publish_p50_s']:.3f} ({r['encode_p50_s']:.3f}) "
            f"| {r['prepare_p50_s']:.3f} | {r['apply_call_p50_s']:.3f} |"
        )
    return "\n".join(lines)


def speedups(results: list[dict]) -> str:
    lines = ["| backend | link | full p50 s | delta p50 s | delta speed-up | bytes saved |", "|" + "---|" * 6]
    by = {(r["backend"], r["cap"], r["mode"]): r for r in results}
    for (backend, cap, mode), r in by.items():
        if mode != "delta" or (backend, cap, "full") not in by:
            continue
        f = by[(backend, cap, "full")]
        lines.append(
            f"| {backend} | {cap} | {f['latency_p50_s']:.2f} | {r['latency_p50_s']:.2f} | "
            f"**{f['latency_p50_s'] / r['latency_p50_s']:.1f}x** | "
            f"{f['bytes_down_mean'] / r['bytes_down_mean']:.0f}x |"
        )
    return "\n".join(lines)


def plots(results: list[dict], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    groups = sorted({(r["backend"], r["cap"]) for r in results})
    fig, axes = plt.subplots(1, len(groups), figsize=(4.2 * len(groups), 3.8), squeeze=False)
    for ax, (backend, cap) in zip(axes[0], groups, strict=True):
        for r in results:
            if (r["backend"], r["cap"]) != (backend, cap):
                continue
            xs = [v["version"] for v in r["versions"]]
            ax.plot(xs, [max(v["latencies"]) for v in r["versions"]], marker="o", label=f"{r['mode']} (slowest sub)")
            ax.plot(xs, [v["wire_floor_s"] for v in r["versions"]], linestyle="--", label=f"{r['mode']} wire floor")
        ax.set_title(f"{backend}, {cap}bit/s links")
        ax.set_xlabel("version")
        ax.set_ylabel("publish → all applied (s)")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    fig.tight_layout()
    p = out / "sync_latency.png"
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    return paths


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "_subscriber":
        sp = argparse.ArgumentParser()
        for a in ("--server", "--model", "--name", "--dir", "--out"):
            sp.add_argument(a, required=True)
        sp.add_argument("--bandwidth", type=float, required=True)
        sp.add_argument("--versions", type=int, required=True)
        return subscriber_main(sp.parse_args(argv[1:]))
    ap = argparse.ArgumentParser(prog="weightsync bench sync", description=__doc__.splitlines()[0])
    ap.add_argument("--case", default="bf16-lr1e-6", help="corpus case (benchmarks/corpus.py)")
    ap.add_argument("--versions", type=int, default=4, help="timed versions per run")
    ap.add_argument("--subscribers", type=int, default=2)
    ap.add_argument("--caps", nargs="*", default=["100M", "1G", "10G"], choices=list(CAPS))
    ap.add_argument("--modes", nargs="*", default=["delta", "full"], choices=["delta", "full"])
    ap.add_argument("--backends", nargs="*", default=["embedded"], choices=["embedded", "s3pg"])
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from benchmarks.corpus import ensure_case

    versions = ensure_case(args.case, args.versions)[: args.versions + 1]
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for backend in args.backends:
        for cap in args.caps:
            for mode in args.modes:
                # A fresh server and store per run: objects are content-addressed, so a second run
                # on the same store would find most of its objects already there.
                work = Path(tempfile.mkdtemp(prefix="weightsync-sync-bench-"))
                try:
                    with server(backend, work) as url:
                        r = run_mode(url, versions, cap, mode, args.subscribers, work)
                finally:
                    shutil.rmtree(work, ignore_errors=True)
                r["backend"] = backend
                results.append(r)
                print(
                    f"{backend} {cap} {mode}: p50 {r['latency_p50_s']:.2f}s p95 {r['latency_p95_s']:.2f}s, "
                    f"floor {r['wire_floor_mean_s']:.2f}s, floor+codec {r['floor_plus_codec_mean_s']:.2f}s, "
                    f"up {r['bytes_up_mean'] / 1e6:.2f} MB, down {r['bytes_down_mean'] / 1e6:.2f} MB, "
                    f"pause p50 {r['pause_p50_ms']:.1f} ms",
                    flush=True,
                )
    from benchmarks.codec_bench import machine

    doc = {
        "machine": machine(),
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "case": args.case,
        "subscribers": args.subscribers,
        "results": results,
    }
    (args.out / "sync.json").write_text(json.dumps(doc, indent=1))
    md = (
        f"Machine: {doc['machine']}. Run: {doc['when']}. Case {args.case}, {args.subscribers} subscribers, "
        f"{args.versions} versions.\n\n{table(results)}\n\n{speedups(results)}\n\n{breakdown(results)}\n"
    )
    (args.out / "sync.md").write_text(md)
    for p in plots(results, args.out):
        print(f"wrote {p}")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
