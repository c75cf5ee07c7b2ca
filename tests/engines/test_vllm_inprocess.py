"""vLLM in-process mode against a real vLLM 0.32 (CPU) server running weightsync's worker extension.

One server for the module, started with ``--worker-extension-cls weightsync.engines.vllm_worker.Worker``
on a checkout of version 1 of the tiny bf16 Llama (``_make_llama.py``: versions are real AdamW steps).
Each test brings the engine to the version it starts from, so the tests hold in any order.

What this CPU build of vLLM does to the parameters decides the layout (docs/ENGINES.md "vLLM
in-process mode"): when oneDNN accepts the Linear layers, each computes from a packed copy and its
``weight`` parameter is emptied (``vllm/model_executor/layers/utils.py``
``dispatch_cpu_unquantized_gemm``, ``remove_weight=True``; ``lm_head`` keeps its weight but computes
from a packed copy too). That happens on a CPU with AVX-512 BF16 (this machine); on one without it, or
with ``ONEDNN_MAX_CPU_ISA=AVX2`` (``_vllm.VllmServer`` sets it for disk mode), oneDNN refuses them
("Failed to create oneDNN linear, fallback to torch linear" in the server's log) and torch's linear
reads the parameters. This module's server is left uncapped so that here the reload path runs too;
the fixture tells the two apart from the engine's digests at start (both pass: the uncapped run and
one under ``ONEDNN_MAX_CPU_ISA=SSE41``). With oneDNN the
embedding and the norms are updated in place and the Linear modules through the layer-wise reload of
just the modules whose tensors changed; without it, every parameter in place. The tests assert that
split, that the elements written are the elements that changed between the trainer's checkpoints,
and that a version whose changes touch only parameters read directly is switched without any reload.
The oracle for the parameters vLLM can show is the SHA-256 of the trainer's own checkpoint bytes
(``_vllm.checkpoint_digests``) against ``/weight_checker``.
"""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import pytest
from _inprocess import InProcessServer, changed_elements, tensors
from _serve import clean_env, own_group, serving, stop_process
from _vllm import checkpoint_digests, engine_digests, generate, is_paused, make_versions, require_vllm

from weightsync import Publisher, Subscriber, errors
from weightsync.codec.dtypes import by_name
from weightsync.codec.manifest import Manifest
from weightsync.engines import EngineUnhealthy, follow
from weightsync.engines.vllm import VllmClient
from weightsync.engines.vllm_inprocess import VllmInProcess
from weightsync.engines.vllm_worker import Spec, as_changes, plan_layout

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MODEL = "tiny-llama"
EMPTY = hashlib.sha256(b"").hexdigest()
IN_PLACE = {  # with oneDNN
    "model.embed_tokens.weight",
    "model.norm.weight",
    *(f"model.layers.{i}.{n}.weight" for i in (0, 1) for n in ("input_layernorm", "post_attention_layernorm")),
}
"""The parameters this CPU build computes from directly when oneDNN packs the Linear layers."""
PACKED = {  # with oneDNN
    "lm_head",
    *(f"model.layers.{i}.{m}" for i in (0, 1) for m in ("self_attn.qkv_proj", "self_attn.o_proj")),
    *(f"model.layers.{i}.{m}" for i in (0, 1) for m in ("mlp.gate_up_proj", "mlp.down_proj")),
}


@dataclass
class Stack:
    ws_url: str
    vllm_url: str
    root: Path
    trainer: dict[str, Path]
    numbers: dict[str, int]
    in_place: set[str] = field(default_factory=set)
    """Engine parameters the forward pass reads directly, here (updated in place)."""
    packed: set[str] = field(default_factory=set)
    """Modules the forward pass computes from packed copies, here (reloaded)."""
    head: str = ""
    """The trainer version (tag) published last: what the next publish is a delta against."""
    adapters: list[VllmInProcess] = field(default_factory=list)

    def adapter(self, name: str = "inproc", **kwargs) -> VllmInProcess:  # type: ignore[no-untyped-def]
        client = kwargs.pop("client", self.vllm_url)
        engine = VllmInProcess(client, Subscriber(self.ws_url, MODEL, name=name, report=False), **kwargs)
        self.adapters.append(engine)
        return engine

    def bring_to(self, engine: VllmInProcess, tag: str) -> int:
        number = self.numbers[tag]
        if engine.held() != number:
            engine.switch(engine.prepare(number))
        assert_holds(self, tag)
        return number

    def publish(self, tag: str, step: int) -> int:
        with Publisher(self.ws_url, MODEL, cache_dir=self.root / "publisher") as pub:
            number = pub.publish(self.trainer[tag], step=step).version
        self.head = tag
        return number


def assert_holds(stack: Stack, tag: str) -> None:
    """The engine's parameters vLLM can show are the trainer's version ``tag``; the packed ones show nothing."""
    got = engine_digests(stack.vllm_url)
    want = checkpoint_digests(stack.trainer[tag])
    shown = {n for n, d in got.items() if d != EMPTY}
    assert {n.rsplit(".", 1)[0] for n in got.keys() - shown} <= stack.packed  # emptied by the CPU GEMM packing
    assert shown >= stack.in_place | {"lm_head.weight"}
    assert {n: got[n] for n in shown} == {n: want[n] for n in shown}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    python = require_vllm()
    root = tmp_path_factory.mktemp("vllm-inproc")
    dirs = make_versions(python, root / "trainer", 4)
    trainer = {f"v{i}": d for i, d in enumerate(dirs, 1)}
    # No memory of small objects in this server: a test flips stored bytes on disk and wants them served.
    env = clean_env({"WEIGHTSYNC_OBJECT_MEMORY": "0"})
    with serving(["--data", str(root / "ws")], log_path=root / "ws.log", env=env) as ws:
        s = Stack(ws.url, "", root, trainer, {})
        for step, tag in enumerate(["v1", "v2", "v3", "v4"], 1):
            s.numbers[tag] = s.publish(tag, step)
        checkout = root / "checkout"
        with Subscriber(ws.url, MODEL, name="setup", report=False) as sub:
            sub.pull(checkout, s.numbers["v1"])
        server = InProcessServer(python, checkout, root / "vllm.log")
        s.vllm_url = server.url
        try:
            server.wait_ready()
            start = engine_digests(server.url)
            if start["model.layers.0.self_attn.qkv_proj.weight"] == EMPTY:  # oneDNN packed the Linear layers
                s.in_place, s.packed = IN_PLACE, PACKED
            else:  # oneDNN refused (no AVX-512 BF16, or capped): torch's linear reads the parameters
                s.in_place, s.packed = set(start), set()
            yield s
        finally:
            for a in s.adapters:
                a.subscriber.close()
                a.close()
            server.stop()


def test_attach_proves_the_held_version_and_splits_the_layout(stack: Stack) -> None:
    engine = stack.adapter("attach")
    assert engine.held() == stack.numbers["v1"]  # the engine was started on v1: proven from its weights
    (status,) = engine.status()
    assert set(status["in_place"]) == stack.in_place
    assert set(status["reload"]) == stack.packed
    assert status["unmapped"] == []
    assert engine.confirm_views() == len(stack.in_place)  # /weight_checker sees the bytes the worker's views hold
    assert_holds(stack, "v1")


def test_each_switch_writes_exactly_the_changed_elements(stack: Stack) -> None:
    engine = stack.adapter("switches", confirm=True)
    stack.bring_to(engine, "v1")
    outputs = {"v1": generate(stack.vllm_url)}
    before = engine.counters()[0]
    for old, tag in [("v1", "v2"), ("v2", "v3"), ("v3", "v4")]:
        number = stack.numbers[tag]
        changed = changed_elements(stack.trainer[old], stack.trainer[tag])
        update = engine.prepare(number)
        report = engine.switch(update)
        assert (report.version, report.mode, engine.version) == (number, "in-place", number)
        assert report.elements == sum(changed.values())  # every changed element, and only those
        after = engine.counters()[0]
        in_place = [n for n in changed if _module(n) not in stack.packed]
        reloaded_modules = {_module(n) for n in changed if _module(n) in stack.packed}
        assert after["elements"] - before["elements"] == sum(changed.values())
        assert after["tensors_in_place"] - before["tensors_in_place"] == len(in_place)
        assert after["tensors_reloaded"] - before["tensors_reloaded"] == sum(
            len(_module_tensors(stack.trainer[tag], m)) for m in reloaded_modules
        )
        assert after["reloads"] - before["reloads"] == (1 if reloaded_modules else 0)  # one layer-wise reload
        (last,) = engine.last  # one worker: its own report of the switch
        assert (last["elements"], last["tensors_in_place"]) == (report.elements, len(in_place))
        assert last["modules_reloaded"] == len(reloaded_modules)
        assert report.checked == len(in_place) + after["tensors_reloaded"] - before["tensors_reloaded"]
        assert report.pause_s > 0 and "apply_s" in report.timings and "confirm_s" in report.timings
        assert_holds(stack, tag)
        assert httpx.get(stack.vllm_url + "/weight_info", timeout=30).json() == {"weight_version": str(number)}
        assert not is_paused(stack.vllm_url)
        outputs[tag] = generate(stack.vllm_url)
        assert generate(stack.vllm_url) == outputs[tag]  # greedy: deterministic per version
        before = after
    assert outputs["v1"] != outputs["v2"] != outputs["v3"] != outputs["v4"]


def test_republished_version_gives_its_answers_again(stack: Stack) -> None:
    """v1's bytes published again after v4: applied as a delta onto v4, the engine answers as it did on v1."""
    engine = stack.adapter("again")
    stack.bring_to(engine, "v1")
    first = generate(stack.vllm_url)
    stack.bring_to(engine, "v4")
    again = stack.publish("v1", 50)
    stack.trainer["v1-again"], stack.numbers["v1-again"] = stack.trainer["v1"], again
    report = engine.switch(engine.prepare(again))
    assert report.version == again
    assert_holds(stack, "v1")
    assert generate(stack.vllm_url) == first


def test_only_in_place_changes_need_no_reload(stack: Stack) -> None:
    """A version that changes only tensors the forward reads directly is switched by element updates alone."""
    engine = stack.adapter("no-reload")
    stack.bring_to(engine, "v2")
    mixed = stack.root / "trainer" / "v2-norms"
    direct = {n for n in tensors(stack.trainer["v2"]) if _module(n) not in stack.packed}
    _mix(stack.trainer["v2"], stack.trainer["v3"], direct, mixed)
    stack.trainer["v2-norms"] = mixed
    number = stack.numbers["v2-norms"] = stack.publish("v2-norms", 60)
    changed = changed_elements(stack.trainer["v2"], mixed)
    assert changed and set(changed) <= direct
    before = engine.counters()[0]
    report = engine.switch(engine.prepare(number))
    after = engine.counters()[0]
    assert report.elements == sum(changed.values())
    assert after["reloads"] == before["reloads"] and after["tensors_reloaded"] == before["tensors_reloaded"]
    assert after["tensors_in_place"] - before["tensors_in_place"] == len(changed)
    assert report.timings["reload_s"] == 0.0
    assert_holds(stack, "v2-norms")


def test_a_corrupted_delta_leaves_the_engine_on_its_version(stack: Stack) -> None:
    """A stored object of the new version has a byte flipped: the workers' download refuses it, the engine
    never pauses and keeps serving its version."""
    engine = stack.adapter("corrupt")
    tag = stack.head
    held = stack.bring_to(engine, tag)
    answer = generate(stack.vllm_url)
    small = stack.root / "trainer" / "small"
    _mix(stack.trainer[tag], stack.trainer["v1"], {"model.norm.weight"}, small)
    stack.trainer["small"] = small
    with Subscriber(stack.ws_url, MODEL, report=False) as sub:
        sub.api.update_model(MODEL, max_chain_ratio=1000.0)  # the AdamW steps fill a chain fast: a delta here
        bad = stack.publish("small", 70)  # a small delta from the version the engine holds, its parent
        manifest = Manifest.decode(sub.api.get_manifest(MODEL, bad))
    assert manifest.kind == "delta" and manifest.parent == held
    paths = [next((stack.root / "ws").rglob(digest)) for digest in manifest.objects()]
    for path in paths:
        _flip(path)
    with pytest.raises(errors.WeightsyncError):
        engine.switch(engine.prepare(bad))
    assert engine.held() == held and not is_paused(stack.vllm_url)
    assert engine.counters()[0]["failed"] == 0  # refused before any switch: nothing was written
    assert_holds(stack, tag)
    assert generate(stack.vllm_url) == answer
    for path in paths:
        _flip(path)  # the store repaired: the same version now switches
    assert engine.switch(engine.prepare(bad)).version == bad
    assert_holds(stack, "small")


def _flip(path: Path) -> None:
    path.chmod(0o644)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def test_weights_changed_behind_the_workers_back_are_never_served(stack: Stack) -> None:
    """vLLM's own ``/weight_checker`` reset zeroes the weights under a worker that proved them: the next switch's
    base check refuses to write, the engine is left paused holding no version, and the switch after that
    rebuilds every tensor from the version (whole, each result checked) and resumes."""
    engine = stack.adapter("behind")
    stack.bring_to(engine, "v2")
    httpx.post(stack.vllm_url + "/weight_checker", json={"action": "reset"}, timeout=300).raise_for_status()
    update = engine.prepare(stack.numbers["v3"])
    with pytest.raises(EngineUnhealthy):
        engine.switch(update)
    assert is_paused(stack.vllm_url) and engine.version is None
    assert engine.held() is None
    counters = engine.counters()[0]
    report = engine.switch(engine.prepare(stack.numbers["v3"]))
    assert report.version == stack.numbers["v3"] and not is_paused(stack.vllm_url)
    assert engine.counters()[0]["reloads"] == counters["reloads"] + (1 if stack.packed else 0)  # packed: rebuilt
    assert_holds(stack, "v3")


def test_a_new_adapter_learns_what_the_workers_hold(stack: Stack) -> None:
    number = stack.bring_to(stack.adapter("first"), "v2")
    fresh = stack.adapter("second")
    assert fresh.held() == number
    fresh.detach()  # the workers forget; asked again, they prove it again from the weights
    assert stack.adapter("third", client=VllmClient(stack.vllm_url)).held() == number


def test_follow_reports_the_in_place_pause_to_the_ledger(stack: Stack) -> None:
    engine = stack.adapter("follower")
    stack.bring_to(engine, "v2")
    reports = []
    stop = threading.Event()
    loop = threading.Thread(
        target=follow,
        args=(engine, engine.subscriber),
        kwargs={"stop": stop, "on_switch": reports.append, "watch_timeout": 2},
    )
    loop.start()
    try:
        new = stack.publish("v3", 100)
        _wait(lambda: any(r.version == new for r in reports))
    finally:
        stop.set()
        loop.join(60)
    assert not loop.is_alive() and engine.version == new
    assert_holds(stack, "v3")
    assert not engine.reports_itself  # the loop reports: the workers' subscribers do not
    _wait(lambda: _ledger(stack, "follower") is not None and _ledger(stack, "follower").version == new)
    entry = _ledger(stack, "follower")
    assert entry is not None and entry.pause_ms is not None and entry.pause_ms > 0
    assert (entry.mode or entry.extra.get("mode")) == "in-place"
    assert entry.extra["elements"] == reports[-1].elements > 0


def test_the_follow_command_runs_the_in_process_mode(stack: Stack) -> None:
    """`weightsync follow --mode in-process` in its own process: each switch an element update, reported."""
    cmd = [
        str(Path(sys.executable).with_name("weightsync")),
        "follow",
        MODEL,
        "--engine",
        "vllm",
        "--mode",
        "in-process",
    ]
    cmd += ["--engine-url", stack.vllm_url, "--server", stack.ws_url, "--name", "cli-inproc", "--json"]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=clean_env(), start_new_session=True
    )
    own_group(proc.pid)
    lines: list[dict[str, object]] = []
    reader = threading.Thread(target=lambda: lines.extend(json.loads(line) for line in proc.stdout), daemon=True)  # type: ignore[union-attr]
    reader.start()
    try:
        _wait(lambda: _ledger(stack, "cli-inproc") is not None)  # attached, on the head
        tag = "v1" if stack.head != "v1" else "v2"
        new = stack.publish(tag, 300)
        _wait(lambda: any(line["version"] == new for line in lines))
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 130
    finally:
        stop_process(proc)  # type: ignore[arg-type]
    (last,) = [line for line in lines if line["version"] == new]
    assert last["mode"] == "in-place" and isinstance(last["pause_ms"], float) and last["pause_ms"] > 0
    assert_holds(stack, tag)
    entry = _ledger(stack, "cli-inproc")
    assert entry is not None and entry.version == new and entry.mode == "in-place" and entry.status == "serving"
    assert not is_paused(stack.vllm_url)


def _ledger(stack: Stack, name: str):  # type: ignore[no-untyped-def]
    with Subscriber(stack.ws_url, MODEL, report=False) as sub:
        entries = sub.api.list_replicas(MODEL, subscriber=name)
    return entries[0] if entries else None


def _wait(condition, timeout: float = 180.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def _module(tensor: str) -> str:
    """The vLLM module a checkpoint tensor feeds (fused names mapped)."""
    owner = tensor.rpartition(".")[0]
    for part, fused in ((".q_proj", ".qkv_proj"), (".k_proj", ".qkv_proj"), (".v_proj", ".qkv_proj")):
        owner = owner.replace(part, fused)
    return owner.replace(".gate_proj", ".gate_up_proj").replace(".up_proj", ".gate_up_proj")


def _module_tensors(directory: Path, module: str) -> list[str]:
    return [n for n in tensors(directory) if _module(n) == module]


def _mix(base: Path, other: Path, names: set[str], out: Path) -> None:
    """A checkpoint directory: ``base`` with the tensors ``names`` taken from ``other`` (same header)."""
    import shutil

    shutil.copytree(base, out)
    raw = bytearray((base / "model.safetensors").read_bytes())
    src = (other / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    import json

    header = json.loads(raw[8 : 8 + n])
    for name in names:
        start, end = header[name]["data_offsets"]
        raw[8 + n + start : 8 + n + end] = src[8 + n + start : 8 + n + end]
    (out / "model.safetensors").write_bytes(bytes(raw))


# --- the layout and the keyframe conversion, on plain torch modules named as vLLM names them --------------


def _specs(**shapes: tuple[int, ...]) -> dict[str, Spec]:
    return {name.replace("__", "."): Spec(by_name("BF16"), shape, "") for name, shape in shapes.items()}


def test_layout_maps_plain_and_fused_parameters_to_views_and_the_rest_to_reload() -> None:
    import torch

    class Attn(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv_proj = torch.nn.Module()
            self.qkv_proj.weight = torch.nn.Parameter(torch.zeros(8, 4, dtype=torch.bfloat16), requires_grad=False)
            self.o_proj = torch.nn.Module()
            self.o_proj.weight = torch.nn.Parameter(torch.zeros(0, dtype=torch.bfloat16), requires_grad=False)
            self.norm = torch.nn.Module()
            self.norm.weight = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16), requires_grad=False)

    net = Attn()
    specs = _specs(
        q_proj__weight=(4, 4),
        k_proj__weight=(2, 4),
        v_proj__weight=(2, 4),
        o_proj__weight=(4, 4),
        norm__weight=(4,),
        rotary__inv_freq=(2,),
    )
    specs = {f"a.{k}": v for k, v in specs.items()}
    root = torch.nn.Module()
    root.a = net
    layout = plan_layout(root, specs)
    assert layout.in_place == ["a.qkv_proj.weight", "a.norm.weight"]
    assert layout.reload == {"a.o_proj": ["a.o_proj.weight"]}  # emptied by packing: reloaded
    assert layout.unmapped == ["a.rotary.inv_freq"]
    k = layout.views["a.k_proj.weight"]
    k.fill_(1.0)  # a view: the fused parameter's rows 4..5 change, nothing else
    rows = net.qkv_proj.weight.float().sum(dim=1).tolist()
    assert rows == [0, 0, 0, 0, 4, 4, 0, 0]
    wrong = dict(specs, **{"a.v_proj.weight": Spec(by_name("BF16"), (3, 4), "")})  # rows do not add up
    assert "a.qkv_proj" in plan_layout(root, wrong).reload


def test_a_whole_replacement_becomes_the_xor_of_the_elements_that_differ() -> None:
    import torch

    from weightsync.client.inplace import Prepared, TensorUpdate

    live = torch.arange(6, dtype=torch.int16).view(torch.bfloat16)
    new = np.arange(6, dtype=np.int16)
    new[[1, 4]] = [100, -7]
    u = TensorUpdate("w", by_name("BF16"), (6,), None, replace=new.view(np.uint8).copy())
    prepared = Prepared("m", None, 2, {"w": u}, {"w": (by_name("BF16"), (6,), "r")}, 1, 0, 0.0)
    as_changes(prepared, {"w": live}, {"w": "base-digest"}, "sum64x16")
    assert u.replace is None and u.base_digest == "base-digest" and u.base_kind == "sum64x16"
    (op,) = u.ops
    assert op.positions.tolist() == [1, 4] and not op.add
    assert prepared.changed_elements == 2
    op.apply(live.view(torch.int16).numpy())
    assert live.view(torch.int16).tolist() == new.tolist()
