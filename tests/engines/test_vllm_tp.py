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
from pathlib import Path

import pytest
from _counting_proxy import CountingProxy
from _serve import serving
from _vllm import make_versions, require_vllm

import weightsync
from weightsync import Publisher, Subscriber
from weightsync.codec.manifest import Manifest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SCRIPT = Path(__file__).with_name("_vllm_tp.py")
MODEL = "tiny-llama"
PATH = ["v1", "v2", "v3", "v4"]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    python = require_vllm()
    root = tmp_path_factory.mktemp("vllm-tp")
    dirs = make_versions(python, root / "trainer", 4)
    trainer = {f"v{i}": str(d) for i, d in enumerate(dirs, 1)}
    trainer["v5"] = trainer["v1"]  # v1's bytes again after v4: a delta that undoes three steps
    trainer["v6"] = trainer["v2"]
    proxies: dict[str, CountingProxy] = {}
    with serving(["--data", str(root / "ws")], log_path=root / "ws.log") as server:
        try:
            numbers = {}
            with Publisher(server.url, MODEL, cache_dir=root / "publisher") as pub:
                for step, tag in enumerate(["v1", "v2", "v3", "v4", "v5", "v6"], 1):
                    numbers[tag] = pub.publish(trainer[tag], step=step).version
                    if tag == "v1":
                        with Subscriber(server.url, MODEL, report=False) as sub:
                            sub.api.update_model(MODEL, max_chain_ratio=1000.0)  # deltas all the way
            with Subscriber(server.url, MODEL, report=False) as sub:
                api = sub.api
                objects = {  # each version's objects: its frames' and its manifest
                    t: {*Manifest.decode(api.get_manifest(MODEL, n)).objects(), api.get_version(MODEL, n).manifest}
                    for t, n in numbers.items()
                }
            for name in ("tp2", "tp4", "tp4-a", "tp4-b"):
                proxies[name] = CountingProxy(server.url)

            def host(name: str, ranks: list[int]) -> dict[str, object]:
                return {"url": proxies[name].url, "dir": str(root / "hosts" / name), "ranks": ranks}

            scenarios = [
                {
                    "name": "tp2",
                    "size": 2,
                    "hosts": [host("tp2", [0, 1])],
                    "path": PATH,
                    "corrupt": "v5",
                    "behind": "v6",
                },
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
                "trainer": trainer,
                "numbers": numbers,
                "scenarios": scenarios,
                "out": str(root / "out.json"),
            }
            (root / "spec.json").write_text(json.dumps(spec))
            src = str(Path(weightsync.__file__).parents[1])  # this checkout's weightsync, not the venv's install
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
            cmd = [str(python), str(SCRIPT), str(root / "spec.json")]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env)
            assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-6000:]
            yield json.loads((root / "out.json").read_text()), numbers, objects, proxies
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
