"""`weightsync bench e2e`: the fixed cost of one version end to end, delta vs keyframe, in one process.

One run starts the embedded server (SQLite + filesystem, fsync'd commits) on
loopback and, in this process, one publisher and one subscriber per model. The
subscriber holds the model's tensors in CPU torch tensors (loaded from the
corpus's first version). For every later version of the corpus case (real
AdamW steps, default MiniLM bf16 at lr 1e-6: ~1.7 % of elements change) it
times, interleaved so machine noise hits both alike:

* delta: ``Publisher.publish`` (a delta on the previous version) →
  ``Subscriber.prepare`` → ``Subscriber.apply`` into the tensors;
* keyframe: the same version published as a keyframe to a second model →
  prepare → apply (whole-tensor replacements).

The first version is a warm-up and is not counted; the figures are medians. Each version starts
once both subscribers' replica reports of the versions before are sent (``Subscriber.wait_reported``):
a report is sent in the background after an apply, and one still in flight competes with the next
version's encode for the cores (on a 2-core box, 3-7 ms of a delta's encode); a version is timed from
a machine where the one before has finished, as versions minutes apart are. ``--back-to-back`` times
them without that wait.
The split comes from the publisher's ``PublishResult.timings`` (begin, encode,
upload, commit, cache) and the subscriber's ``timings`` (plan, download,
decode, apply). A delta small enough for one request (publishVersion, docs/API.md
"One request per version") shows that request under upload and no commit.
Commit latency is the client's round trip of the commit call (commitPublish,
loopback: the server's own work plus one local HTTP exchange), over ``--commits``
extra publishes that take the three requests (``inline_bytes=0``); after each, a
follower's plan request (holder named, as ``Subscriber.prepare`` asks it) is
timed too; and the same publishes made in one request each, that request timed.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
PUBLISH_PHASES = ("begin_s", "encode_s", "upload_s", "commit_s", "cache_s")
PREPARE_PHASES = ("plan_s", "download_s", "decode_s")
# What the server says it spent (its Server-Timing answers): publishVersion's phases, a plan bundle's read.
SERVER_PUBLISH = ("server_begin_s", "server_store_s", "server_commit_s")
SERVER_PREPARE = ("server_plan_s",)


def _median(values: Iterable[float]) -> float:
    """The median of the values that are not NaN (NaN when none is)."""
    kept = [v for v in values if not math.isnan(v)]
    return statistics.median(kept) if kept else math.nan


def _pct(values: list[float], p: float) -> float:
    """The p-th percentile (nearest rank) of `values`."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]


def _version(pub: Any, sub: Any, tensors: dict, path: Path, *, keyframe: bool) -> dict[str, float]:
    """Publish `path`, prepare and apply it into `tensors`; the phase times of that one version."""
    t0 = time.perf_counter()
    result = pub.publish(path, keyframe=keyframe)
    t1 = time.perf_counter()
    prepared = sub.prepare(result.version)
    t2 = time.perf_counter()
    sub.apply(tensors, prepared)
    t3 = time.perf_counter()
    if result.kind != ("keyframe" if keyframe else "delta"):
        raise AssertionError(f"published a {result.kind}, wanted {'keyframe' if keyframe else 'delta'}")
    row = {"total_s": t3 - t0, "publish_s": t1 - t0, "prepare_s": t2 - t1, "apply_s": t3 - t2}
    row.update({k: result.timings.get(k, 0.0) for k in PUBLISH_PHASES})
    row.update({k: getattr(sub, "timings", {}).get(k, 0.0) for k in PREPARE_PHASES})
    # NaN where the server said nothing (a publish in three requests): shown as "–", not as 0.
    row.update({k: result.timings.get(k, math.nan) for k in SERVER_PUBLISH})
    row.update({k: getattr(sub, "timings", {}).get(k, math.nan) for k in SERVER_PREPARE})
    row["bytes_up"] = float(result.bytes_sent)
    row["bytes_down"] = float(prepared.bytes_received)
    return row


def _check(tensors: dict, path: Path) -> None:
    """The tensors hold exactly the version at `path` (bit for bit)."""
    import torch
    from safetensors.torch import load_file

    want = load_file(str(path / "model.safetensors"))
    for name, t in want.items():
        if not torch.equal(tensors[name].view(torch.uint8), t.view(torch.uint8)):
            raise AssertionError(f"{name} differs from {path}")


def run(versions: list[Path], url: str, *, settle: bool = True) -> dict[str, Any]:
    """Time every version after the first two (v0 seeds both models, v1 warms up); medians per kind.

    `settle`: each version starts once every subscriber's replica reports are sent."""
    from safetensors.torch import load_file

    from weightsync.client import Publisher, Subscriber

    rows: dict[str, list[dict[str, float]]] = {"delta": [], "keyframe": []}
    models = {"delta": "e2e-delta", "keyframe": "e2e-keyframe"}
    pubs = {k: Publisher(url, m) for k, m in models.items()}
    subs = {k: Subscriber(url, m, name=f"bench-{k}", report=True) for k, m in models.items()}
    try:
        tensors: dict[str, dict] = {}
        for kind in rows:
            first = pubs[kind].publish(versions[0])
            tensors[kind] = load_file(str(versions[0] / "model.safetensors"))
            subs[kind].version = first.version
        for i, path in enumerate(versions[1:]):
            for kind in rows:  # interleaved: both kinds see the same machine state
                if settle:
                    for s in subs.values():
                        s.wait_reported(timeout=60)
                row = _version(pubs[kind], subs[kind], tensors[kind], path, keyframe=kind == "keyframe")
                if i:
                    rows[kind].append(row)
                print(
                    f"{kind:8s} v{i + 1}: total {row['total_s'] * 1e3:7.1f} ms  publish {row['publish_s'] * 1e3:6.1f}"
                    f" (commit {row['commit_s'] * 1e3:5.1f})  prepare {row['prepare_s'] * 1e3:6.1f}"
                    f"  apply {row['apply_s'] * 1e3:6.1f}{'' if i else '  (warm-up)'}",
                    flush=True,
                )
        for kind in rows:
            _check(tensors[kind], versions[-1])
    finally:
        for p in pubs.values():
            p.close()
        for s in subs.values():
            s.close()
    out: dict[str, Any] = {}
    for kind, rs in rows.items():
        out[kind] = {k: _median(r[k] for r in rs) for k in rs[0]}
    commits = [r["commit_s"] for rs in rows.values() for r in rs]
    out["commit_p50_ms"] = _pct(commits, 50) * 1e3
    out["commit_p90_ms"] = _pct(commits, 90) * 1e3
    out["ratio"] = out["keyframe"]["total_s"] / out["delta"]["total_s"]
    out["versions"] = len(rows["delta"])
    return out


def commit_latency(url: str, versions: list[Path], repeats: int) -> tuple[list[float], list[float], list[float]]:
    """Round trips of the commit call alone, of a follower's plan after each commit, and of publishVersion.

    `repeats` publishes of alternating versions in three requests (``inline_bytes=0``), commit
    timed; after each, a follower holding the previous version asks for the plan to the new head
    with its holder name (what `Subscriber.prepare` asks first), timed. Interleaved with them, the
    same publishes to another model in one request each (publishVersion), that request timed.
    Returns (commit seconds, plan seconds, publishVersion seconds).
    """
    from weightsync.client import Publisher, Subscriber

    commits: list[float] = []
    plans: list[float] = []
    whole: list[float] = []
    # inline_bytes=0: begin, upload and commitPublish, so the commit is a request of its own to time
    with (
        Publisher(url, "e2e-commit", inline_bytes=0) as pub,
        Publisher(url, "e2e-one-request") as one,
        Subscriber(url, "e2e-commit", name="bench-follower") as sub,
    ):
        for i in range(repeats + 1):
            r = pub.publish(versions[i % 2])
            w = one.publish(versions[i % 2])
            if i:  # the first one is a keyframe and a warm-up
                commits.append(r.timings["commit_s"])
                if "commit_s" not in w.timings:  # it went in one request
                    whole.append(w.timings["upload_s"])
                t = time.perf_counter()
                sub.api.get_plan("e2e-commit", have=r.version - 1, holder=sub.name)
                plans.append(time.perf_counter() - t)
    return commits, plans, whole


def table(r: dict[str, Any]) -> str:
    """The per-phase medians, delta beside keyframe, in milliseconds (a markdown table)."""
    lines = ["| phase (median ms) | delta | keyframe |", "|---|---:|---:|"]

    def ms(v: float) -> str:
        return "–" if math.isnan(v) else f"{v * 1e3:.1f}"

    order = ("total_s", "publish_s", *PUBLISH_PHASES[:3], *SERVER_PUBLISH, *PUBLISH_PHASES[3:], "prepare_s")
    for k in (*order, *PREPARE_PHASES[:1], *SERVER_PREPARE, *PREPARE_PHASES[1:], "apply_s"):
        label = (
            f"  server: {k.removeprefix('server_').removesuffix('_s')}"
            if k.startswith("server_")
            else k.removesuffix("_s")
        )
        lines.append(f"| {label} | {ms(r['delta'][k])} | {ms(r['keyframe'][k])} |")
    for k in ("bytes_up", "bytes_down"):
        lines.append(f"| {k} (KB) | {r['delta'][k] / 1e3:.0f} | {r['keyframe'][k] / 1e3:.0f} |")
    lines.append(f"\nkeyframe / delta end to end: **{r['ratio']:.2f}x**; ")
    lines[-1] += (
        f"commit p50 {r['commit_p50_ms']:.1f} ms, p90 {r['commit_p90_ms']:.1f} ms "
        f"({r['commit_samples']} commits, client round trip)"
    )
    if "plan_p50_ms" in r:
        lines[-1] += f"; a follower's plan after each: p50 {r['plan_p50_ms']:.1f} ms, p90 {r['plan_p90_ms']:.1f} ms"
    if "publish_version_p50_ms" in r:
        lines[-1] += (
            f"; the same publishes in one request (publishVersion, client round trip): "
            f"p50 {r['publish_version_p50_ms']:.1f} ms, p90 {r['publish_version_p90_ms']:.1f} ms"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="weightsync bench e2e", description=__doc__.splitlines()[0])
    ap.add_argument("--case", default="bf16-lr1e-6", help="corpus case (benchmarks/corpus.py)")
    ap.add_argument("--versions", type=int, default=4, help="timed versions (one more is the warm-up)")
    ap.add_argument("--commits", type=int, default=20, help="extra publishes timed for commit latency")
    ap.add_argument(
        "--back-to-back",
        action="store_true",
        help="start each version as soon as the one before is applied (its replica reports may be in flight)",
    )
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if args.versions < 3:
        ap.error("--versions must be at least 3 (medians)")
    sys.path.insert(0, str(ROOT))
    from benchmarks._serve import serve
    from benchmarks.codec_bench import machine
    from benchmarks.corpus import ensure_case

    versions = ensure_case(args.case, args.versions + 1)[: args.versions + 2]
    with tempfile.TemporaryDirectory(prefix="weightsync-e2e-bench-") as tmp, serve(Path(tmp)) as url:
        result = run(versions, url, settle=not args.back_to_back)
        commits, plans, whole = commit_latency(url, versions, args.commits) if args.commits else ([], [], [])
    if commits:
        result["commit_p50_ms"] = _pct(commits, 50) * 1e3
        result["commit_p90_ms"] = _pct(commits, 90) * 1e3
        result["plan_p50_ms"] = _pct(plans, 50) * 1e3
        result["plan_p90_ms"] = _pct(plans, 90) * 1e3
    if whole:
        result["publish_version_p50_ms"] = _pct(whole, 50) * 1e3
        result["publish_version_p90_ms"] = _pct(whole, 90) * 1e3
    result["commit_samples"] = len(commits) or 2 * result["versions"]
    result.update(
        machine=machine(),
        when=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        case=args.case,
        settled=not args.back_to_back,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    plain = dict(result)  # NaN (the server said nothing) as null
    for kind in ("delta", "keyframe"):
        plain[kind] = {k: None if math.isnan(v) else v for k, v in result[kind].items()}
    (args.out / "e2e.json").write_text(json.dumps(plain, indent=1))
    how = "back to back" if args.back_to_back else "each after the replica reports before it were sent"
    md = f"Machine: {result['machine']}. Run: {result['when']}. Case {args.case}; versions {how}.\n\n{table(result)}\n"
    (args.out / "e2e.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
