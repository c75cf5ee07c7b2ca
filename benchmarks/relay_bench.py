"""Regional relays (issue 15): bytes across each WAN link and publish → last subscriber applied.

One origin (`weightsync serve`, the embedded default) on loopback; two "regions", each behind its
own emulated WAN link to the origin (tests/_wan.py: a TCP proxy capping the link's total bandwidth,
all connections together, adding a one-way delay, counting bytes itself); 4 subscriber processes per
region that hold the model's tensors in memory and follow it with `prepare` + `apply` in place
(`benchmarks.sync_bench`'s subscriber). Two layouts, same links, same versions:

- **relay**: one `weightsync relay` per region behind the link; the region's subscribers read from it.
- **direct**: the 8 subscribers read from the origin straight through their region's link.

The publisher (this process) publishes to the origin, outside the links. Per version: bytes that
crossed each link (origin → region), over the version's own bytes (its manifest and new objects as
uploaded), and the time from the publish call to the last subscriber applied. With ``--outage``, the
relay layout also cuts both links while the relays prefetch one version (restored ``--outage-s``
later), and kills one relay (SIGKILL) right after another version commits, restarting it.

    PYTHONPATH=src:. python -m benchmarks.relay_bench [--case bf16-lr1e-6] [--versions 4] \\
        [--mbit 200] [--delay-ms 40] [--outage] [--out benchmarks/results/relay.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from benchmarks._serve import _serve, free_port, serve
from benchmarks.sync_bench import read_lines, stop_all, wait_until

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from _wan import WanLink  # noqa: E402  (tests/_wan.py, by path as benchmarks/_serve.py does)

REGIONS = ("eu", "us")
PER_REGION = 4


class Relay:
    """A `weightsync relay` process on a free loopback port (restartable on the same port and data)."""

    def __init__(self, upstream: str, data: Path, site: str) -> None:
        self.upstream, self.data, self.site = upstream, data, site
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Relay:
        self.data.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "weightsync", "relay", "--upstream", self.upstream, "--data", str(self.data)]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--site", self.site, "--log-level", "warning"]
        log = open(self.data.parent / f"relay-{self.site}.log", "ab")  # noqa: SIM115 - the process writes it
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"relay {self.site} exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/healthz", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"relay {self.site} did not answer /healthz")

    def wait_for(self, model: str, number: int, timeout: float = 900) -> None:
        """Return once this relay's head of `model` is `number` or later."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = httpx.get(f"{self.url}/v1/models/{model}", timeout=10)
            if r.status_code == 200 and (r.json().get("head") or 0) >= number:
                return
            time.sleep(0.1)
        raise TimeoutError(f"relay {self.site} did not mirror {model} v{number}")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            _serve.stop_process(self.proc, 5)

    def stop(self) -> None:
        if self.proc is not None:
            _serve.stop_process(self.proc, 10)


def run_layout(layout: str, versions: list[Path], args: argparse.Namespace, work: Path) -> list[dict]:
    from weightsync.client import Publisher

    model = f"relay-bench-{layout}"
    rows: list[dict] = []
    relays: dict[str, Relay] = {}
    procs: list[subprocess.Popen[bytes]] = []
    with serve(work / "origin") as origin:
        port = int(origin.rsplit(":", 1)[1])
        shape = {"mbit_s": args.mbit, "delay_s": args.delay_ms / 1e3}
        links = {r: WanLink(("127.0.0.1", port), **shape).start() for r in REGIONS}
        try:
            pub = Publisher(origin, model)
            first = pub.publish(versions[0], step=0, keyframe=True)
            for r in REGIONS:
                upstream = f"http://127.0.0.1:{links[r].port}"
                if layout == "relay":
                    relays[r] = Relay(upstream, work / f"relay-{r}" / "data", r).start()
            outs: list[Path] = []
            t0 = time.time()
            for relay in relays.values():  # a relay shows a model once it holds a version of it
                relay.wait_for(model, first.version)
            for r in REGIONS:
                url = relays[r].url if layout == "relay" else f"http://127.0.0.1:{links[r].port}"
                for i in range(PER_REGION):
                    out = work / f"{r}-sub{i}.jsonl"
                    outs.append(out)
                    cmd = [sys.executable, "-m", "benchmarks.sync_bench", "_subscriber", "--server", url]
                    cmd += ["--model", model, "--name", f"{r}-{i}", "--bandwidth", "1e12"]
                    cmd += ["--dir", str(work / f"{r}-sub{i}"), "--versions", str(len(versions) - 1), "--out", str(out)]
                    procs.append(subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "WEIGHTSYNC_SITE": r}))
            wait_until(lambda: all(any("ready" in x for x in read_lines(o)) for o in outs), procs, 900)
            rows.append(
                {
                    "layout": layout,
                    "version": first.version,
                    "kind": "keyframe (8 late joiners pull it)",
                    "version_bytes": first.bytes_sent,
                    "link_bytes": {r: links[r].down_bytes for r in REGIONS},
                    "latency_s": time.time() - t0,
                }
            )
            for i, vdir in enumerate(versions[1:], start=1):
                before = {r: links[r].down_bytes for r in REGIONS}
                event = None
                if args.outage and layout == "relay" and i == 2:
                    event = f"links cut during the prefetch, restored after {args.outage_s:.1f} s"
                    threading.Timer(args.outage_at_s, lambda: [links[r].sever() for r in REGIONS]).start()
                    threading.Timer(
                        args.outage_at_s + args.outage_s, lambda: [links[r].restore() for r in REGIONS]
                    ).start()
                t_call = time.time()
                res = pub.publish(vdir, step=i)
                if args.outage and layout == "relay" and i == 3:
                    event = "relay eu killed (SIGKILL) after the commit, restarted"
                    relays["eu"].kill()
                    relays["eu"].start()
                wait_until(
                    lambda v=res.version: all(any(x.get("version") == v for x in read_lines(o)) for o in outs),
                    procs,
                    900,
                )
                subs = [next(x for x in read_lines(o) if x.get("version") == res.version) for o in outs]
                rows.append(
                    {
                        "layout": layout,
                        "version": res.version,
                        "kind": res.kind,
                        "event": event,
                        "version_bytes": res.bytes_sent,
                        "link_bytes": {r: links[r].down_bytes - before[r] for r in REGIONS},
                        "latency_s": max(s["applied_at"] for s in subs) - t_call,
                        "pause_s_median": statistics.median(s["pause_s"] for s in subs),
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
            pub.close()
        finally:
            stop_all(procs)
            for relay in relays.values():
                relay.stop()
            for link in links.values():
                link.stop()
    return rows


def plot(rows: list[dict], out: Path) -> Path:
    """Per case: bytes across one WAN link per version, and publish → last applied, relay vs direct."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = sorted({r["case"] for r in rows})
    fig, axes = plt.subplots(2, len(cases), figsize=(4.6 * len(cases), 6.4), squeeze=False)
    for col, case in enumerate(cases):
        for layout, marker in (("relay", "o"), ("direct", "s")):
            mine = sorted((r for r in rows if r["case"] == case and r["layout"] == layout), key=lambda r: r["version"])
            xs = [r["version"] for r in mine]
            axes[0][col].plot(xs, [max(r["link_bytes"].values()) / 1e6 for r in mine], marker=marker, label=layout)
            axes[1][col].plot(xs, [r["latency_s"] for r in mine], marker=marker, label=layout)
            for r in mine:
                if r.get("event"):
                    what = "outage" if "cut" in r["event"] else "restart"
                    axes[1][col].annotate(what, (r["version"], r["latency_s"]))
        axes[0][col].plot(xs, [r["version_bytes"] / 1e6 for r in mine], linestyle="--", label="version's bytes")
        axes[0][col].set_title(f"{case}: MB across one WAN link")
        axes[1][col].set_title(f"{case}: publish → last of 8 applied (s)")
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xlabel("version (1: keyframe, late joiners)")
            ax.set_yscale("log")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.relay_bench", description=__doc__.split("\n")[0])
    ap.add_argument("--case", default="bf16-lr1e-6")
    ap.add_argument("--versions", type=int, default=4, help="timed versions after the first")
    ap.add_argument("--mbit", type=float, default=200.0, help="each WAN link's bandwidth, per direction")
    ap.add_argument("--delay-ms", type=float, default=40.0, help="one-way delay of each WAN link")
    ap.add_argument("--layouts", nargs="*", default=["relay", "direct"], choices=["relay", "direct"])
    ap.add_argument("--outage", action="store_true", help="relay layout: cut the links (v3), kill a relay (v4)")
    ap.add_argument("--outage-at-s", type=float, default=0.3)
    ap.add_argument("--outage-s", type=float, default=3.0)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "relay.jsonl")
    ap.add_argument("--plot", type=Path, default=None, help="only draw the plot of --out's results into this PNG")
    args = ap.parse_args(argv)
    if args.plot is not None:
        rows = [json.loads(line) for line in args.out.read_text().splitlines() if line.strip()]
        print(plot(rows, args.plot))
        return 0
    from benchmarks.corpus import ensure_case

    versions = ensure_case(args.case, args.versions)[: args.versions + 1]
    machine = f"{platform.machine()} {os.cpu_count()} cores"
    results = []
    for layout in args.layouts:
        work = Path(tempfile.mkdtemp(prefix=f"relay-bench-{layout}-"))
        (work / "origin").mkdir()
        try:
            rows = run_layout(layout, versions, args, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        for r in rows:
            r |= {"case": args.case, "mbit": args.mbit, "delay_ms": args.delay_ms, "machine": machine}
        results.extend(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as f:
        for r in results:
            f.write(json.dumps(r) + "\n")
    for layout in args.layouts:
        mine = [r for r in results if r["layout"] == layout and r["kind"] in ("delta", "keyframe")]
        quiet = [r for r in mine if not r.get("event")]
        if not quiet:
            continue
        over = [max(r["link_bytes"].values()) / r["version_bytes"] for r in quiet]
        print(
            f"{args.case} {layout}: link bytes / version bytes {min(over):.3f}-{max(over):.3f}, "
            f"publish -> last applied median {statistics.median(r['latency_s'] for r in quiet):.2f} s",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
