"""vLLM in-process mode with tensor parallelism 2 and 4: each rank updates its own slices, one download per host.

Tensor parallelism above 1 cannot run on vLLM's CPU executor here (one CPU worker, no
process group of several ranks), so the ranks are simulated (``_vllm_tp.py``, run with
the vLLM venv's interpreter): each rank's parameters are vLLM 0.32's own parallel layers
of the tiny Llama, built with the tensor-parallel rank and size faked and loaded by
vLLM's own weight loaders on CPU tensors (as ``test_layouts.py`` does), held by
weightsync's worker extension (``engines/vllm_worker.py``) with its rank given. The
workers follow a real weightsync server through versions made by real AdamW steps
(``_make_llama.py``); the workers of one host share a host directory and reach the
server through that host's counting proxy (``_counting_proxy.py``).

After every switch, on every rank: the parameters equal what vLLM's loaders make of
the new checkpoint on that rank, bit for bit; the elements the rank wrote, parameter
by parameter, are the elements that differ between the loaders' two results (the
changed checkpoint elements landing in its slice); exactly one worker per host made the
version, and the server sent each object once per host. A value of rank 1's slice
corrupted in the host store is caught by rank 1's slice checksum: its writes are undone
and it stays on its version (bit for bit), the store drops the bad copy, rank 0 (which
switched) reverts to the same version when asked, and the next prepare makes the version
again (one more download, on that host only) and every rank switches.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from _counting_proxy import CountingProxy
from _serve import free_port, own_group, serving, stop_process
from _tp_util import flip_one_of_rank
from _vllm import make_versions, require_vllm

import weightsync
from weightsync import Publisher, Subscriber
from weightsync.codec.manifest import Manifest
from weightsync.engines import SwitchFailed
from weightsync.engines.host_store import HostStore
from weightsync.engines.layouts import ModelConfig
from weightsync.engines.vllm_inprocess import VllmInProcess

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SCRIPT = Path(__file__).with_name("_vllm_tp.py")
MODEL = "tiny-llama"
PATH = ["v1", "v2", "v3", "v4"]


@dataclass
class Stack:
    python: Path
    root: Path
    url: str
    trainer: dict[str, str]
    numbers: dict[str, int]
    objects: dict[str, set[str]]
    """Each version's objects: its frames' and its manifest."""
    env: dict[str, str]
    """For the vLLM venv's interpreter: this checkout's weightsync first, not the venv's install."""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A real weightsync server with v1..v4 (AdamW steps), v5 (v1's bytes again) and v6 (v2's), all deltas."""
    python = require_vllm()
    root = tmp_path_factory.mktemp("vllm-tp")
    dirs = make_versions(python, root / "trainer", 4)
    trainer = {f"v{i}": str(d) for i, d in enumerate(dirs, 1)}
    trainer["v5"] = trainer["v1"]  # v1's bytes again after v4: a delta that undoes three steps
    trainer["v6"] = trainer["v2"]
    with serving(["--data", str(root / "ws")], log_path=root / "ws.log") as server:
        numbers = {}
        with Publisher(server.url, MODEL, cache_dir=root / "publisher") as pub:
            for step, tag in enumerate(["v1", "v2", "v3", "v4", "v5", "v6"], 1):
                numbers[tag] = pub.publish(trainer[tag], step=step).version
                if tag == "v1":
                    with Subscriber(server.url, MODEL, report=False) as sub:
                        sub.api.update_model(MODEL, max_chain_ratio=1000.0)  # deltas all the way
        with Subscriber(server.url, MODEL, report=False) as sub:
            api = sub.api
            objects = {
                t: {*Manifest.decode(api.get_manifest(MODEL, n)).objects(), api.get_version(MODEL, n).manifest}
                for t, n in numbers.items()
            }
        src = str(Path(weightsync.__file__).parents[1])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
        yield Stack(python, root, server.url, trainer, numbers, objects, env)


@pytest.fixture(scope="module")
def run(stack: Stack):  # type: ignore[no-untyped-def]
    """``_vllm_tp.py``'s scenarios, each host's workers behind a counting proxy of their own."""
    root = stack.root
    proxies = {name: CountingProxy(stack.url) for name in ("tp2", "tp4", "tp4-a", "tp4-b")}
    try:

        def host(name: str, ranks: list[int]) -> dict[str, object]:
            return {"url": proxies[name].url, "dir": str(root / "hosts" / name), "ranks": ranks}

        scenarios = [
            {"name": "tp2", "size": 2, "hosts": [host("tp2", [0, 1])], "path": PATH, "corrupt": "v5", "behind": "v6"},
            {"name": "tp4", "size": 4, "hosts": [host("tp4", [0, 1, 2, 3])], "path": PATH, "corrupt": None},
            {
                "name": "tp4-two-hosts",
                "size": 4,
                "hosts": [host("tp4-a", [0, 1]), host("tp4-b", [2, 3])],
                "path": PATH,
                "corrupt": None,
            },
        ]
        spec = {
            "model": MODEL,
            "trainer": stack.trainer,
            "numbers": stack.numbers,
            "scenarios": scenarios,
            "out": str(root / "out.json"),
        }
        (root / "spec.json").write_text(json.dumps(spec))
        cmd = [str(stack.python), str(SCRIPT), str(root / "spec.json")]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=stack.env)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-6000:]
        yield json.loads((root / "out.json").read_text()), stack.numbers, stack.objects, proxies
    finally:
        for p in proxies.values():
            p.close()


SCENARIOS = {"tp2": 2, "tp4": 4, "tp4-two-hosts": 4}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_every_rank_holds_what_vllms_loaders_make_of_each_version(run, scenario: str) -> None:  # type: ignore[no-untyped-def]
    out, numbers, _, _ = run
    got = out[scenario]
    size = SCENARIOS[scenario]
    assert [a["held"] for a in got["attach"]] == [numbers["v1"]] * size  # proven from the loaded slices
    assert [a["rank"] for a in got["attach"]] == list(range(size))  # as vLLM's parallel state says
    assert all(a["unmapped"] == [] for a in got["attach"])
    assert [s["tag"] for s in got["switches"]] == PATH[1:]
    for step in got["switches"]:
        assert len(step["ranks"]) == size
        for r in step["ranks"]:
            where = (scenario, step["tag"], r["rank"])
            assert r["held"] == numbers[step["tag"]], where
            assert r["differing"] == [], where  # bit for bit what vLLM's loaders make on that rank
            # Written: exactly the elements that differ between the loaders' two results, per parameter.
            assert r["written"] == r["changed"], where
            assert r["compared"] == [], where  # every slice's changes mapped from the host's record, none searched
            assert r["elements"] == sum(r["changed"].values()) > 0, where


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_one_worker_per_host_makes_each_version(run, scenario: str) -> None:  # type: ignore[no-untyped-def]
    out, _, _, _ = run
    got = out[scenario]
    hosts = 2 if scenario == "tp4-two-hosts" else 1
    assert sum(a["made"] for a in got["attach"]) == hosts
    for step in got["switches"]:
        made = [r for r in step["ranks"] if r["made_here"]]
        assert len(made) == hosts, (scenario, step["tag"])
        assert all(r["bytes"] > 0 for r in made) and all(r["bytes"] == 0 for r in step["ranks"] if not r["made_here"])
        if hosts == 2:
            assert {r["rank"] // 2 for r in made} == {0, 1}  # one per host


def test_the_server_sends_each_object_once_per_host(run) -> None:  # type: ignore[no-untyped-def]
    _, _, objects, proxies = run
    for name in ("tp4", "tp4-a", "tp4-b"):
        assert proxies[name].downloads, name
        assert set(proxies[name].downloads.values()) == {1}, name  # no object byte range sent twice to a host
    # The two hosts of one engine each fetched the same objects, once each.
    assert proxies["tp4-a"].downloads == proxies["tp4-b"].downloads == proxies["tp4"].downloads
    # The host whose copy of v5 was found corrupt fetched v5's objects once more, and nothing else twice but
    # v6's (v2's bytes after v1's: the same delta frames as v2, stored once, fetched again for that version).
    v5 = objects["v5"]
    twice = {d for d, n in proxies["tp2"].objects().items() if n == 2}
    assert twice and v5 <= twice <= v5 | (objects["v6"] & objects["v2"])
    assert set(proxies["tp2"].objects().values()) == {1, 2}
    # v1..v4 as the other engine, then v5 and v6
    assert set(proxies["tp2"].objects()) == set(proxies["tp4"].objects()) | v5 | objects["v6"]


def test_a_corrupted_slice_is_caught_and_leaves_the_rank_on_its_version(run) -> None:  # type: ignore[no-untyped-def]
    out, numbers, _, _ = run
    got = out["tp2"]["corrupt"]
    assert ".q_proj." in got["flipped"]
    rank0, rank1 = got["after"]
    assert rank0["error"] is None and rank0["held"] == numbers["v5"] and rank0["differing_new"] == []
    assert rank1["error"] == "ChecksumMismatch"
    assert rank1["held"] == numbers["v4"] and rank1["differing_old"] == []  # every write undone, bit for bit
    assert got["store_dropped"]
    # Rank 0, which had switched, puts v4 back when asked (the adapter asks after any worker failed).
    assert [(a["held"], a["differing_old"]) for a in got["after_revert"]] == [(numbers["v4"], [])] * 2
    assert got["retry_made"].count(True) == 1  # made afresh for the host, once
    assert all(r["error"] is None and r["version"] == numbers["v5"] and r["compared"] == [] for r in got["retry"])
    assert got["retry_held"] == [numbers["v5"]] * 2 and got["retry_differing"] == [[], []]


def test_a_slice_changed_behind_the_ranks_back_is_never_written_over_then_rebuilt(run) -> None:  # type: ignore[no-untyped-def]
    out, numbers, _, _ = run
    got = out["tp2"]["behind"]
    assert got["first"] == [None, "BaseMismatch"]  # rank 1's base check refused before any write
    assert got["held"] == [numbers["v6"], None]
    assert not got["made_here"]  # read from the host's copy: no second download
    assert got["again"]["error"] is None and got["again"]["version"] == numbers["v6"]
    assert got["again"]["compared"] == got["params"]  # holding no version: every slice compared with v6's
    assert got["held_after"] == [numbers["v6"]] * 2 and got["differing"] == [[], []]


# --- the adapter, against simulated ranks behind vLLM's dev routes ----------------------------------------------

ENGINE = Path(__file__).with_name("_vllm_tp_engine.py")
TP = 2


@dataclass
class TpEngine:
    url: str
    host_dir: Path
    proxy: CountingProxy

    def differing(self, tag: str) -> list[list[str]]:
        """Each rank's parameters that are not what vLLM's loaders make of checkpoint ``tag`` on that rank."""
        r = httpx.post(self.url + "/_test/differing", json={"tag": tag}, timeout=300)
        r.raise_for_status()
        return r.json()["differing"]


@pytest.fixture(scope="module")
def tp_engine(stack: Stack) -> Iterator[TpEngine]:
    """``_vllm_tp_engine.py``: 2 ranks started on v1 (tagged with its number), answering vLLM's dev routes."""
    port = free_port()
    tag = str(stack.numbers["v1"])
    spec = {"trainer": stack.trainer, "start": "v1", "size": TP, "port": port, "weight_version": tag}
    (stack.root / "engine.json").write_text(json.dumps(spec))
    log = open(stack.root / "engine.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [str(stack.python), str(ENGINE), str(stack.root / "engine.json")],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=stack.env,
        start_new_session=True,
    )
    own_group(proc.pid)
    proxy = CountingProxy(stack.url)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, (stack.root / "engine.log").read_text()[-4000:]
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the simulated engine did not start"
            time.sleep(0.5)
        yield TpEngine(url, stack.root / "hosts" / "adapter", proxy)
    finally:
        proxy.close()
        stop_process(proc)
        log.close()


def test_the_adapter_keeps_a_tensor_parallel_engine_on_each_version(stack: Stack, tp_engine: TpEngine) -> None:
    """``VllmInProcess`` drives both ranks through vLLM's routes: attach proves v1 rank by rank (and confirms it
    with ``/weight_checker``'s per-rank digests), each switch leaves every rank on the version bit for bit, one
    worker downloads each version for the host, and ``/weight_checker`` agrees after every switch."""
    numbers = stack.numbers
    sub = Subscriber(tp_engine.proxy.url, MODEL, name="tp-adapter", report=False)
    engine = VllmInProcess(tp_engine.url, sub, host_dir=str(tp_engine.host_dir), confirm=True)
    try:
        assert engine.held() == numbers["v1"]
        (status, _) = engine.status()
        assert [a["rank"] for a in engine.status()] == [0, 1] and status["unmapped"] == []
        for tag in PATH[1:]:
            before = dict(tp_engine.proxy.downloads)
            update = engine.prepare(numbers[tag])
            fetched = sum(1 for k in tp_engine.proxy.downloads if k not in before)
            assert fetched > 0 and all(tp_engine.proxy.downloads[k] == 1 for k in tp_engine.proxy.downloads)
            assert update.bytes_received > 0  # the one worker that made it for the host; the other read it
            assert [a["made_here"] for a in engine.status()].count(True) == 1
            report = engine.switch(update)
            assert (report.version, report.mode) == (numbers[tag], "in-place")
            assert report.timings["confirm_s"] >= 0  # /weight_checker's per-rank digests equal the workers'
            assert tp_engine.differing(tag) == [[], []]
            assert [a["elements"] for a in engine.last] == [sum(a["written"].values()) for a in engine.last]
            assert engine.client.weight_version() == str(numbers[tag]) and not engine.client.is_paused()
    finally:
        engine.detach()
        engine.close()
        sub.close()


def test_a_rank_that_fails_its_switch_has_the_other_put_back_and_the_engine_resumes(
    stack: Stack, tp_engine: TpEngine
) -> None:
    """The host's copy of v5 has one value of rank 1's slice corrupted (made by another worker of the host, then
    damaged): rank 1's result check fails and undoes its writes, rank 0 (which switched) is asked to revert, and
    the engine resumes on v4 (SwitchFailed); the next prepare makes v5 afresh and the switch succeeds."""
    numbers = stack.numbers
    sub = Subscriber(tp_engine.proxy.url, MODEL, name="tp-adapter-2", report=False)
    engine = VllmInProcess(tp_engine.url, sub, host_dir=str(tp_engine.host_dir))
    try:
        if engine.held() != numbers["v4"]:
            engine.switch(engine.prepare(numbers["v4"]))
        with Subscriber(tp_engine.proxy.url, MODEL, name="another-worker", report=False) as maker:
            HostStore(tp_engine.host_dir, MODEL).get(maker, numbers["v5"])
        config = ModelConfig.read(stack.trainer["v5"])
        flip_one_of_rank(tp_engine.host_dir / MODEL / f"v{numbers['v5']}", config, rank=1, size=TP)
        update = engine.prepare(numbers["v5"])
        with pytest.raises(SwitchFailed):
            engine.switch(update)
        assert engine.version == numbers["v4"] and not engine.client.is_paused()
        assert [a["held"] for a in engine.status()] == [numbers["v4"]] * TP
        assert [a["counters"]["reverted"] for a in engine.status()] == [1, 0]  # rank 0 put v4 back
        assert tp_engine.differing("v4") == [[], []]
        assert engine.client.weight_version() == str(numbers["v4"])
        report = engine.switch(engine.prepare(numbers["v5"]))  # the bad copy was dropped: made afresh
        assert report.version == numbers["v5"]
        assert tp_engine.differing("v5") == [[], []]
    finally:
        engine.detach()
        engine.close()
        sub.close()
