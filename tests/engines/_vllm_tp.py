"""Tensor-parallel workers of weightsync's vLLM worker extension, simulated rank by rank on vLLM's own loaders.

Run with the vLLM venv's interpreter (``tests/engines/test_vllm_tp.py`` does)::

    .venv-vllm/bin/python tests/engines/_vllm_tp.py SPEC.json

Tensor parallelism above 1 cannot run on vLLM's CPU executor here, so each rank
is simulated: its parameters are vLLM 0.32's parallel layers of the tiny Llama
(``_vllm_layouts.build``) made with the rank and size faked and loaded with
vLLM's own ``AutoWeightsLoader`` from the trainer's checkpoint, and a
:class:`FakeWorker` (weightsync's ``Worker`` extension on an object with vLLM's
``vllm_config`` and ``model_runner.get_model()``, its tensor-parallel rank given)
holds them. The workers of a scenario run their attach and prepare threads at
once, as vLLM's workers do; the workers of one host share a host directory and
talk to the weightsync server through that host's counting proxy.

SPEC: ``{"model", "trainer": {tag: dir}, "numbers": {tag: version}, "out",
"scenarios": [{"name", "size", "hosts": [{"url", "dir", "ranks"}], "path": [tags],
"corrupt": tag or null, "behind": tag or null}]}``. For each scenario it attaches every rank to
``path[0]``, switches through the rest, and records after every switch what each
rank's parameters hold against what vLLM's loaders make of the checkpoint on that
rank (the oracle), the elements each rank wrote against the elements that differ
between the oracle's two loads, and which worker made each version for its host.
With ``corrupt``, that version is then prepared by rank 0 alone, one changed value
landing only on rank 1's slice is flipped in the host store, and every rank
switches; then, as the adapter does after a failed switch, every rank is asked to
revert, and all prepare and switch again. With ``behind``, a slice of rank 1 is
zeroed behind its back before switching to that version (:func:`behind`). Writes
``out`` (JSON).
"""

from __future__ import annotations

import json
import sys
import time
import types
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent))
from _make_llama import config as tiny_config  # noqa: E402
from _tp_util import flip_one_of_rank  # noqa: E402
from _vllm_layouts import build, fake_tp, load, params  # noqa: E402
from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402

from weightsync.engines import layouts  # noqa: E402
from weightsync.engines.host_store import HostStore  # noqa: E402
from weightsync.engines.vllm_worker import Worker  # noqa: E402


class FakeWorker(Worker):
    """vLLM's worker as the extension sees it: its config and its model. The extension reads the rank from
    vLLM's ``get_tensor_model_parallel_rank()`` at attach, so each attach runs with that rank faked."""

    def __init__(self, root: torch.nn.Module, rank: int, size: int, hf_config: Any) -> None:
        self.vllm_config = types.SimpleNamespace(
            parallel_config=types.SimpleNamespace(tensor_parallel_size=size, pipeline_parallel_size=1),
            model_config=types.SimpleNamespace(hf_config=hf_config),
        )
        self.model_runner = types.SimpleNamespace(get_model=lambda: root)
        self.tp = (rank, size)


def checkpoint(directory: str) -> dict[str, torch.Tensor]:
    return load_file(str(Path(directory) / "model.safetensors"))


def oracle(cfg: Any, tensors: dict[str, torch.Tensor], rank: int, size: int) -> dict[str, torch.Tensor]:
    """Every parameter of ``rank`` of ``size`` as vLLM's loaders make it from ``tensors``."""
    fake_tp(rank, size)
    with set_current_vllm_config(VllmConfig()):
        root = build(cfg)
    del root.column  # _vllm_layouts' extra layer: not the Llama's
    for p in root.parameters():
        p.data.view(torch.uint8).fill_(0xA5)
    load(root, tensors)
    return params(root)


def bits(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().view(-1).view(torch.uint8).numpy()


def differing(live: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    assert live.keys() == want.keys()
    return sorted(n for n in want if not np.array_equal(bits(live[n]), bits(want[n])))


def changed_counts(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> dict[str, int]:
    out = {}
    for n in new:
        a, b = old[n].contiguous().view(-1), new[n].contiguous().view(-1)
        w = a.element_size()
        ints = {2: torch.int16, 4: torch.int32, 1: torch.uint8, 8: torch.int64}[w]
        k = int((a.view(ints) != b.view(ints)).sum())
        if k:
            out[n] = k
    return out


def wait_all(workers: list[FakeWorker], call: str, done: Any, timeout: float = 300.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        answers = [getattr(w, call)() for w in workers]
        for a in answers:
            if "error" in a:
                raise RuntimeError(f"{call}: {a}")
        if all(done(a) for a in answers):
            return answers
        assert time.monotonic() < deadline, f"{call} timed out: {answers}"
        time.sleep(0.05)


def live(root: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.data for n, p in root.named_parameters()}


def run(spec: dict[str, Any], scenario: dict[str, Any]) -> dict[str, Any]:
    cfg = tiny_config()
    size = scenario["size"]
    path = scenario["path"]
    ckpts = {
        tag: checkpoint(spec["trainer"][tag]) for tag in {*path, scenario["corrupt"], scenario.get("behind")} if tag
    }
    host_of = {r: h for h in scenario["hosts"] for r in h["ranks"]}
    roots, workers = [], []
    for rank in range(size):
        fake_tp(rank, size)
        with set_current_vllm_config(VllmConfig()):
            root = build(cfg)
        del root.column
        load(root, ckpts[path[0]])  # the engine started on the first version, loaded by vLLM
        roots.append(root)
        workers.append(FakeWorker(root, rank, size, cfg))
    oracles = {path[0]: [oracle(cfg, ckpts[path[0]], r, size) for r in range(size)]}
    out: dict[str, Any] = {"attach": [], "switches": []}
    for rank, w in enumerate(workers):
        host = host_of[rank]
        fake_tp(rank, size)  # read by the extension before its attach thread starts
        answer = w.weightsync_attach(
            host["url"], spec["model"], [spec["numbers"][path[0]]], None, f"rank{rank}", None, host["dir"]
        )
        assert "error" not in answer, answer
    attached = wait_all(workers, "weightsync_attached", lambda a: not a.get("attaching"))
    out["attach"] = [
        {"held": a["held"], "made": a["counters"]["host_made"], "unmapped": a["unmapped"], "rank": a["rank"]}
        for a in attached
    ]
    for old, tag in zip(path, path[1:], strict=False):
        number = spec["numbers"][tag]
        oracles[tag] = [oracle(cfg, ckpts[tag], r, size) for r in range(size)]
        for w in workers:
            w.weightsync_prepare(number)
        ready = wait_all(workers, "weightsync_status", lambda a, n=number: a["ready"] and a["target"] == n)
        answers = [w.weightsync_switch(number) for w in workers]
        step = {"tag": tag, "version": number, "ranks": []}
        for rank, (a, s) in enumerate(zip(answers, ready, strict=True)):
            assert "error" not in a, a
            want = oracles[tag][rank]
            step["ranks"].append(
                {
                    "rank": rank,
                    "held": workers[rank].weightsync_status()["held"],
                    "made_here": s["made_here"],
                    "bytes": s["bytes"],
                    "differing": differing(live(roots[rank]), want),
                    "written": a["written"],
                    "compared": a["compared"],
                    "elements": a["elements"],
                    "apply_s": a["apply_s"],
                    "prepare_s": a["prepare_s"],
                    "changed": changed_counts(oracles[old][rank], want),
                }
            )
        out["switches"].append(step)
    if scenario.get("corrupt"):
        out["corrupt"] = corrupt(spec, scenario, workers, roots, oracles, ckpts, cfg)
    if scenario.get("behind"):
        out["behind"] = behind(spec, scenario, workers, roots, oracles, ckpts, cfg)
    for w in workers:
        w.weightsync_detach()
    return out


def corrupt(
    spec: dict[str, Any],
    scenario: dict[str, Any],
    workers: list[FakeWorker],
    roots: list[torch.nn.Module],
    oracles: dict[str, list[dict[str, torch.Tensor]]],
    ckpts: dict[str, dict[str, torch.Tensor]],
    cfg: Any,
) -> dict[str, Any]:
    """Rank 1's slice of the next version is corrupted in the host store: caught by its checksum, undone."""
    size, tag, held_tag = scenario["size"], scenario["corrupt"], scenario["path"][-1]
    number = spec["numbers"][tag]
    oracles[tag] = [oracle(cfg, ckpts[tag], r, size) for r in range(size)]
    host = scenario["hosts"][0]
    assert {0, 1} <= set(host["ranks"])
    workers[0].weightsync_prepare(number)  # rank 0 makes the version for the host
    wait_all(workers[:1], "weightsync_status", lambda a: a["ready"] and a["target"] == number)
    store = HostStore(host["dir"], spec["model"])
    config = layouts.ModelConfig.from_dict(cfg.to_dict())
    flipped = flip_one_of_rank(store.dir / f"v{number}", config, rank=1, size=size)
    for w in workers[1:]:
        w.weightsync_prepare(number)
    wait_all(workers, "weightsync_status", lambda a: a["ready"] and a["target"] == number)
    answers = [w.weightsync_switch(number) for w in workers]
    after = [
        {
            "rank": r,
            "error": a.get("error"),
            "held": workers[r].weightsync_status()["held"],
            "differing_old": differing(live(roots[r]), oracles[held_tag][r]),
            "differing_new": differing(live(roots[r]), oracles[tag][r]),
        }
        for r, a in enumerate(answers)
    ]
    store_dropped = not (store.dir / f"v{number}").exists()
    # What the adapter does next: every worker that switched puts its previous version back.
    reverted = [w.weightsync_revert(number) for w in workers]
    after_revert = [
        {"rank": r, "held": a["held"], "differing_old": differing(live(roots[r]), oracles[held_tag][r])}
        for r, a in enumerate(reverted)
    ]
    for w in workers:  # the next try: the store makes the version afresh
        w.weightsync_prepare(number)
    ready = wait_all(workers, "weightsync_status", lambda a: a["ready"] and a["target"] == number)
    retry = [w.weightsync_switch(number) for w in workers]
    return {
        "flipped": flipped,
        "after": after,
        "store_dropped": store_dropped,
        "after_revert": after_revert,
        "retry_made": [a["made_here"] for a in ready],
        "retry": [{k: a.get(k) for k in ("error", "version", "elements", "compared")} for a in retry],
        "retry_held": [w.weightsync_status()["held"] for w in workers],
        "retry_differing": [differing(live(roots[r]), oracles[tag][r]) for r in range(size)],
    }


def behind(
    spec: dict[str, Any],
    scenario: dict[str, Any],
    workers: list[FakeWorker],
    roots: list[torch.nn.Module],
    oracles: dict[str, list[dict[str, torch.Tensor]]],
    ckpts: dict[str, dict[str, torch.Tensor]],
    cfg: Any,
) -> dict[str, Any]:
    """Rank 1's qkv_proj slice is zeroed behind its back (as ``/weight_checker reset`` does): its next switch's
    base check refuses to write and it holds no version; the switch after that finds every element that
    differs from the version by comparing its slices with the host's copy, and reaches it."""
    size, tag = scenario["size"], scenario["behind"]
    number = spec["numbers"][tag]
    oracles[tag] = [oracle(cfg, ckpts[tag], r, size) for r in range(size)]
    dict(roots[1].named_parameters())["model.layers.0.self_attn.qkv_proj.weight"].data.zero_()
    for w in workers:
        w.weightsync_prepare(number)
    wait_all(workers, "weightsync_status", lambda a: a["ready"] and a["target"] == number)
    first = [w.weightsync_switch(number) for w in workers]
    held = [w.weightsync_status()["held"] for w in workers]
    workers[1].weightsync_prepare(number)
    (ready,) = wait_all(workers[1:2], "weightsync_status", lambda a: a["ready"] and a["target"] == number)
    again = workers[1].weightsync_switch(number)
    return {
        "first": [a.get("error") for a in first],
        "held": held,
        "made_here": ready["made_here"],
        "again": {k: again.get(k) for k in ("error", "version", "compared")},
        "params": sorted(n for n, _ in roots[1].named_parameters()),
        "held_after": [w.weightsync_status()["held"] for w in workers],
        "differing": [differing(live(roots[r]), oracles[tag][r]) for r in range(size)],
    }


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    torch.set_default_dtype(torch.bfloat16)  # vLLM's model dtype (--dtype bfloat16)
    torch.set_num_threads(1)
    results = {s["name"]: run(spec, s) for s in spec["scenarios"]}
    Path(spec["out"]).write_text(json.dumps(results))
    print(f"ran {len(results)} scenarios")


if __name__ == "__main__":
    main()
