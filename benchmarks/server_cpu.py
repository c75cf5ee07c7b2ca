"""The server's CPU per request on a version's path: what one ``weightsync serve`` process spends per answer.

    python -m benchmarks.server_cpu [--case bf16-lr1e-6] [--requests 400] [--publishes 40] [--rounds 3]
        [--catalog postgresql://…]

A fleet's followers each ask for every version's plan, so the server's CPU per plan request sets how
many followers one process brings to a version in a given time (the rest goes to relays). This probe
starts an embedded server (SQLite + filesystem, fsync'd commits) on loopback and reads the server
process's CPU time (``/proc/<pid>/stat``, user + system, all its threads) around:

* ``GET /healthz``: the HTTP stack and middleware alone;
* a follower's plan: ``GET /plan`` from one version to the next with its holder name and ``inline``
  (the plan and its objects in one answer, as ``Subscriber.prepare`` asks), the holder's lease held
  already (a follower's steady state: the plan writes nothing);
* the same plan at a second server process on the same catalog and store, which did not take the
  version's upload (what every other worker of a ``--workers N`` server is, or a server restarted
  since the publish);
* ``--watchers`` followers long-polling ``watch`` at that second process: its CPU while they wait,
  and the time from a commit's answer through the first process until the first and every one of
  them has its answer (a commit through another process is found by reading the catalog, or, on PostgreSQL,
  heard at once through its announcement: with ``--catalog postgresql://…`` (an empty database)
  both processes use it, and the followers are measured again at a second pair of processes that
  only poll, ``WEIGHTSYNC_ANNOUNCE=false``, the baseline);
* a delta publish: in one request (publishVersion) as ``Publisher.publish`` sends a small one, else
  as it sends a larger one (begin, uploads, commit; the table says which), the
  versions of the corpus case alternating, with 50 ms idle after each so the commit record written
  off the answer is counted too (18 deltas a model after an uncounted keyframe: the default keyframe
  policy makes the 20th version of a chain a keyframe). Each publish's model file is its corpus
  version's with one element more changed, another each time (:func:`contents`), so its objects are
  new to the store, as a trainer's are: alternating the two versions alone makes every delta from
  the third on one whose data object the store holds already, which the server commits another way
  (it asks the store about every object: ``Ops._publish_held``), and that is what this measured
  before session 40.

Rounds repeat the three so that machine noise hits them alike; the figures are medians over rounds
of the mean per request. Linux only (``/proc``). Writes ``server_cpu.json`` and ``.md`` under ``--out``.
Nothing is asserted: it measures.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"


def process_cpu(pid: int) -> float:
    """Seconds of CPU (user + system, every thread) process `pid` has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def per_request(
    pid: int, n: int, call: Any, idle_s: float = 0.0, before: Callable[[], None] | None = None
) -> tuple[float, float]:
    """(server CPU seconds per call, median wall seconds of a call) over `n` calls of `call`; `before` runs
    ahead of each call, outside its wall time (work of this process only: the server's CPU counts it)."""
    walls = []
    cpu0 = process_cpu(pid)
    for _ in range(n):
        if before is not None:
            before()
        t = time.perf_counter()
        call()
        walls.append(time.perf_counter() - t)
        if idle_s:
            time.sleep(idle_s)
    return (process_cpu(pid) - cpu0) / n, statistics.median(walls)


CHAIN = 18
"""Delta publishes per model: the default keyframe policy (a chain of 20 versions) makes the next one a keyframe."""


def run(
    versions: list[Path],
    requests: int,
    publishes: int,
    rounds: int,
    watchers: int = 100,
    catalog: str | None = None,
) -> dict[str, Any]:
    """Per round, each request kind's server CPU and wall per request; medians over rounds. With `catalog` (a
    PostgreSQL URL) the followers are measured also at processes that only poll (`watch_polling`)."""
    from weightsync.client import Publisher

    rows: dict[str, list[tuple[float, float]]] = {"healthz": [], "plan": [], "plan_other": [], "publish": []}
    with _pair(catalog, announce=True) as (server, other):
        with Publisher(server.url, "cpu-plan") as seeder:
            seeded = [seeder.publish(versions[i % 2]).version for i in range(3)]
        figures = _measure(server, other, versions, seeded, requests, publishes, rounds, rows)
        figures["watch"] = _watchers(server, other, versions, watchers, rounds, "cpu-watch")
    if catalog is not None and catalog.startswith("postgres"):
        with _pair(catalog, announce=False) as (server, other):
            figures["watch_polling"] = _watchers(server, other, versions, watchers, rounds, "cpu-watch-polling")
    return figures


@contextmanager
def _pair(catalog: str | None, *, announce: bool) -> Iterator[tuple[Any, Any]]:
    """Two server processes on one catalog (`catalog`, else the first one's SQLite) and one filesystem store."""
    from benchmarks._serve import serve_process

    args = ["--catalog", catalog] if catalog else []
    env = dict(os.environ, WEIGHTSYNC_ANNOUNCE=str(announce).lower())
    with tempfile.TemporaryDirectory(prefix="weightsync-server-cpu-") as tmp:
        with serve_process(Path(tmp), args=args, env=env) as server:
            other_dir = Path(tmp) / "other"  # the second process: its own log, the first one's data
            other_dir.mkdir()
            (other_dir / "data").symlink_to(Path(tmp) / "data")
            with serve_process(other_dir, args=args, env=env) as other:
                yield server, other


def _watchers(server: Any, other: Any, versions: list[Path], n: int, rounds: int, model: str) -> dict[str, Any]:
    """`n` followers long-polling at `other` while versions commit through `server`, a round each: `other`'s CPU
    while they wait (a share of one core) and the seconds from each commit's answer until all `n` answered."""
    import threading

    import httpx

    from weightsync.client import Publisher

    idle, answered, firsts = [], [], []
    with Publisher(server.url, model) as publisher:
        head = publisher.publish(versions[0]).version
        for r in range(rounds):
            ends: list[tuple[float, int]] = []

            def follow(after: int, ends: list[tuple[float, int]]) -> None:
                with httpx.Client(base_url=other.url, timeout=120) as c:
                    resp = c.get(f"/v1/models/{model}/watch", params={"after": after, "timeout": 60})
                    ends.append((time.monotonic(), resp.status_code))

            threads = [threading.Thread(target=follow, args=(head, ends)) for _ in range(n)]
            for t in threads:
                t.start()
            time.sleep(1.0)  # every one waiting
            cpu0 = process_cpu(other.proc.pid)
            time.sleep(2.0)
            idle.append((process_cpu(other.proc.pid) - cpu0) / 2.0)
            head = publisher.publish(versions[(r + 1) % 2]).version
            t0 = time.monotonic()
            for t in threads:
                t.join()
            if len(ends) != n or any(status != 200 for _, status in ends):
                raise AssertionError(f"followers' answers: {sorted({s for _, s in ends})}, {len(ends)} of {n}")
            answered.append(max(t for t, _ in ends) - t0)
            firsts.append(min(t for t, _ in ends) - t0)
    return {
        "followers": n,
        "idle_core_share": statistics.median(idle),
        "first_answered_ms": statistics.median(firsts) * 1e3,
        "answered_ms": statistics.median(answered) * 1e3,
        "rounds_answered_ms": [a * 1e3 for a in answered],
    }


def _measure(
    server: Any,
    other: Any,
    versions: list[Path],
    seeded: list[int],
    requests: int,
    publishes: int,
    rounds: int,
    rows: dict[str, list[tuple[float, float]]],
) -> dict[str, Any]:
    """`run`'s rounds, against `server` (which took the seeded versions' uploads) and `other` (which did not)."""
    import httpx

    from weightsync.client import Publisher

    with httpx.Client(base_url=server.url) as http, httpx.Client(base_url=other.url) as http_other:
        pid = server.proc.pid
        plan = {"have": seeded[1], "want": seeded[2], "holder": "follower", "inline": 1 << 26}
        http.get("/v1/models/cpu-plan/plan", params=plan).raise_for_status()  # takes the lease
        http_other.get("/v1/models/cpu-plan/plan", params=plan).raise_for_status()  # its first: not counted
        chains = made = 0
        ways: dict[str, bool] = {}
        content = contents(versions)

        def one_plan() -> None:
            http.get("/v1/models/cpu-plan/plan", params=plan).raise_for_status()

        def other_plan() -> None:
            http_other.get("/v1/models/cpu-plan/plan", params=plan).raise_for_status()

        def deltas(n: int) -> tuple[float, float]:
            """Server CPU per delta publish and the median wall, over `n` on fresh models (CHAIN a model)."""
            nonlocal chains, made
            cpu, walls = 0.0, []
            for first in range(0, n, CHAIN):
                chains += 1
                k = min(CHAIN, n - first)
                with Publisher(server.url, f"cpu-publish-{chains}") as publisher:
                    c, w = _delta_chain(pid, publisher, content, made, k, ways)
                made += k + 1  # no content twice in a run: each publish's objects new to the store
                cpu += c * k
                walls.append(w)
            return cpu / n, statistics.median(walls)

        for _ in range(rounds):
            rows["healthz"].append(per_request(pid, requests, lambda: http.get("/healthz").raise_for_status()))
            rows["plan"].append(per_request(pid, requests, one_plan))
            rows["plan_other"].append(per_request(other.proc.pid, requests, other_plan))
            rows["publish"].append(deltas(publishes))
    figures: dict[str, Any] = {
        kind: {
            "server_cpu_ms": statistics.median(c for c, _ in rs) * 1e3,
            "wall_ms": statistics.median(w for _, w in rs) * 1e3,
            "rounds_cpu_ms": [c * 1e3 for c, _ in rs],
        }
        for kind, rs in rows.items()
    }
    figures["publish"]["one_request"] = ways["one_request"]
    return figures


def contents(versions: list[Path]) -> Callable[[int], bytes]:
    """Publish k's content: the model file of ``versions[k % 2]`` (a directory holding one safetensors file)
    with the lowest bit of one byte of its tensors' data flipped, a byte k picks (another for each k below
    the data's length), so that no two publishes are alike (ValueError for a version of other files)."""
    files = []
    for v in versions[:2]:
        found = sorted(v.glob("*.safetensors"))
        if len(found) != 1:
            raise ValueError(f"{v}: the publishes need a version of one safetensors file, found {len(found)}")
        files.append(found[0].read_bytes())
    from weightsync.codec.safetensors import parse_file

    layouts = [parse_file(f) for f in files]  # checked; where each file's data starts
    if len(files) != 2 or layouts[0] != layouts[1] or len(files[0]) != len(files[1]):
        raise ValueError("the publishes need two versions of the same tensors")
    start = layouts[0].header_len
    size = len(files[0]) - start
    if size == 0:
        raise ValueError("the publishes need a version whose tensors hold data")
    step = 1_000_003  # spreads the bytes over the tensors; prime to `size`, so k below `size` picks its own
    while math.gcd(step, size) != 1:
        step += 2

    def content(k: int) -> bytes:
        data = bytearray(files[k % 2])
        data[start + (k * step) % size] ^= 1
        return bytes(data)

    return content


def _delta_chain(
    pid: int, publisher: Any, content: Callable[[int], bytes], first: int, n: int, ways: dict[str, bool]
) -> tuple[float, float]:
    """`per_request` over `n` delta publishes of `content` (:func:`contents`) ``first + 1`` on, after an
    uncounted keyframe of ``content(first)``; whether they went in one request each is set in `ways`
    ("one_request"), and must be the same for all."""
    publisher.publish(content(first))
    turn = iter(range(first + 1, first + n + 1))
    ready: list[bytes] = []

    def make() -> None:
        ready[:] = [content(next(turn))]

    def one_publish() -> None:
        result = publisher.publish(ready.pop())
        if result.kind != "delta":
            raise AssertionError(f"wanted a delta, got a {result.kind}")
        one_request = "upload_s" in result.timings and "commit_s" not in result.timings
        if ways.setdefault("one_request", one_request) != one_request:
            raise AssertionError("the delta publishes went both in one request and in several")

    return per_request(pid, n, one_publish, idle_s=0.05, before=make)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.server_cpu", description=__doc__.splitlines()[0])
    ap.add_argument("--case", default="bf16-lr1e-6", help="corpus case (benchmarks/corpus.py)")
    ap.add_argument("--requests", type=int, default=400, help="healthz and plan requests per round")
    ap.add_argument("--publishes", type=int, default=40, help="delta publishes per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--watchers", type=int, default=100, help="followers long-polling at the second process")
    ap.add_argument("--catalog", help="both processes' catalog URL (an empty database; default: SQLite in the data)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if min(args.requests, args.publishes, args.rounds, args.watchers) < 1:
        ap.error("--requests, --publishes, --rounds and --watchers must be at least 1")
    if not Path("/proc/self/stat").exists():
        ap.error("reads the server's CPU time from /proc: Linux only")
    sys.path.insert(0, str(ROOT))
    from benchmarks.codec_bench import machine
    from benchmarks.corpus import ensure_case

    versions = ensure_case(args.case, 2)[:2]
    figures = run(versions, args.requests, args.publishes, args.rounds, args.watchers, args.catalog)
    result: dict[str, Any] = {"figures": figures}
    result.update(
        machine=machine(),
        when=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        case=args.case,
        rounds=args.rounds,
        catalog="PostgreSQL" if (args.catalog or "").startswith("postgres") else "SQLite",
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "server_cpu.json").write_text(json.dumps(result, indent=1))
    lines = [
        f"Machine: {result['machine']}. Run: {result['when']}. Case {args.case}; {result['catalog']} catalog; "
        f"medians of {args.rounds} rounds.",
        "",
        "| request | server CPU per request (ms) | wall, client round trip (ms) | rounds (CPU ms) |",
        "|---|---:|---:|---|",
    ]
    labels = {
        "healthz": "`GET /healthz`",
        "plan": "a follower's plan + objects (holder, `inline`)",
        "plan_other": "the same at a second process on the same catalog and store (not the upload's)",
        "publish": "a delta publish in one request (publishVersion), its objects new, commit record included"
        if result["figures"]["publish"]["one_request"]
        else "a delta publish (begin, uploads, commit), its objects new, commit record included",
    }
    for kind in labels:
        f = figures[kind]
        rounds = ", ".join(f"{c:.2f}" for c in f["rounds_cpu_ms"])
        lines.append(f"| {labels[kind]} | {f['server_cpu_ms']:.2f} | {f['wall_ms']:.2f} | {rounds} |")
    watch = figures["watch"]
    lines += [
        "",
        f"{watch['followers']} followers long-polling at the second process; a commit through the first process:",
        "",
        "| second process | its CPU while they wait (% of a core) | first answered after (ms) | all answered after "
        "(ms) | rounds, all (ms) |",
        "|---|---:|---:|---:|---|",
    ]
    ways = [("watch", "announcing (PostgreSQL's NOTIFY)" if result["catalog"] == "PostgreSQL" else "polling")]
    if "watch_polling" in figures:
        ways.append(("watch_polling", "polling (`WEIGHTSYNC_ANNOUNCE=false`)"))
    for key, label in ways:
        w = figures[key]
        each = ", ".join(f"{a:.0f}" for a in w["rounds_answered_ms"])
        lines.append(
            f"| {label} | {w['idle_core_share'] * 100:.1f} | {w['first_answered_ms']:.1f} | {w['answered_ms']:.1f} "
            f"| {each} |"
        )
    md = "\n".join(lines) + "\n"
    (args.out / "server_cpu.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
