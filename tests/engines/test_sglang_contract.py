"""SGLang disk mode: contract tests against a loopback server keeping SGLang 0.5.23's HTTP contract.

These are contract tests, not engine tests: SGLang cannot run here (CUDA-only
wheels; its CPU backend needs AMX Xeons). ``_sglang_contract.py`` serves the
routes the adapter uses as SGLang's own source documents them (source read: the
``sglang==0.5.23`` wheel from PyPI: ``sglang/srt/entrypoints/http_server.py``,
``sglang/srt/managers/io_struct.py``, ``sglang/srt/managers/tokenizer_manager.py``,
``sglang/srt/managers/scheduler_components/weight_updater.py``,
``sglang/srt/model_executor/model_runner_components/weight_updater.py``,
``sglang/srt/utils/weight_checker.py``, ``sglang/kernels/ops/memory/gpu_tensor_hash.py``;
details in that module's docstring and docs/ENGINES.md "SGLang facts"), loading
real safetensors files into a Llama's fused parameter layout.

One contract server for the module, started on a checkout of version 1; a real
``weightsync serve`` and a real Publisher publishing versions made by AdamW
steps on a tiny Llama-shaped model. The oracle for "the engine holds version N"
is the hash of the trainer's own tensors, fused by hand, computed by the
contract server's torch hash (written apart from the adapter's numpy one).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import pytest
from _serve import ServeProcess, clean_env, serving, stop_process
from _vllm import flip_bit

torch = pytest.importorskip("torch")

from _sglang_contract import gpu_tensor_hash, tensor_hash  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from weightsync import Publisher, Subscriber  # noqa: E402
from weightsync.engines import EngineUnhealthy, SwitchFailed, follow  # noqa: E402
from weightsync.engines.sglang import SglangClient, SglangDisk, cuda_tensor_hash, expected  # noqa: E402

CONTRACT = Path(__file__).with_name("_sglang_contract.py")
WEIGHTSYNC = Path(sys.executable).with_name("weightsync")
MODEL = "tiny-sglang"
QKV0 = "model.layers.0.self_attn.qkv_proj.weight"
HIDDEN, KV, FFN, VOCAB, LAYERS = 64, 32, 128, 256, 2


# --- versions: a tiny Llama-shaped model and AdamW steps ---------------------------------------


def _shapes() -> dict[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out |= {
            p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN),
            p + "self_attn.k_proj.weight": (KV, HIDDEN),
            p + "self_attn.v_proj.weight": (KV, HIDDEN),
            p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
            p + "mlp.gate_proj.weight": (FFN, HIDDEN),
            p + "mlp.up_proj.weight": (FFN, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, FFN),
            p + "input_layernorm.weight": (HIDDEN,),
            p + "post_attention_layernorm.weight": (HIDDEN,),
        }
    return out | {"model.norm.weight": (HIDDEN,), "lm_head.weight": (VOCAB, HIDDEN)}


def make_versions(root: Path, n: int) -> list[Path]:
    """``n`` checkpoint directories: bf16 casts of fp32 master weights after AdamW steps on a random objective."""
    gen = torch.Generator().manual_seed(13)
    master = {k: torch.nn.Parameter(torch.randn(s, generator=gen) * 0.05) for k, s in _shapes().items()}
    opt = torch.optim.AdamW(master.values(), lr=3e-3)
    dirs = []
    for v in range(1, n + 1):
        if v > 1:
            for _ in range(2):
                opt.zero_grad()
                loss = sum((p * torch.randn(p.shape, generator=gen)).sum() for p in master.values())
                loss.backward()  # type: ignore[union-attr]
                opt.step()
        d = root / f"v{v}"
        d.mkdir(parents=True)
        save_file({k: p.detach().to(torch.bfloat16).contiguous() for k, p in master.items()}, d / "model.safetensors")
        (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": HIDDEN}))
        dirs.append(d)
    return dirs


def oracle(directory: Path, device: str = "cuda") -> dict[str, str]:
    """The hash of each SGLang parameter when it holds the checkpoint ``directory``: fused by hand, hashed
    by the contract server's torch code."""
    t = load_file(directory / "model.safetensors")
    fused: dict[str, torch.Tensor] = {}
    for name, tensor in t.items():
        for part, (whole, _) in {"q_proj": ("qkv_proj", 0), "gate_proj": ("gate_up_proj", 0)}.items():
            if f".{part}." in name:
                rest = ("k_proj", "v_proj") if part == "q_proj" else ("up_proj",)
                parts = [tensor] + [t[name.replace(part, r)] for r in rest]
                fused[name.replace(part, whole)] = torch.cat(parts)
        if not re.search(r"\.(q|k|v|gate|up)_proj\.", name):
            fused[name] = tensor
    return {name: tensor_hash(x, device) for name, x in fused.items()}


def engine_hashes(url: str) -> dict[str, str]:
    body = httpx.post(url + "/weights_checker", json={"action": "checksum"}, timeout=60).json()
    return dict(body["ranks"][0]["checksums"])


def model_info(url: str) -> dict[str, object]:
    return dict(httpx.get(url + "/model_info", timeout=30).json())


def is_paused(url: str) -> bool:
    """Paused: a new request does not start (the contract server makes it wait, as SGLang's tokenizer does)."""
    try:
        httpx.post(url + "/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 1}}, timeout=3.0)
    except httpx.TimeoutException:
        return True
    return False


def contract_server(model_path: Path, log: Path, *, device: str = "cuda") -> ServeProcess:
    args = ["--model-path", str(model_path), "--device", device]
    return ServeProcess(args, log_path=log, command=[sys.executable, str(CONTRACT)]).wait_ready(60, path="/health")


@dataclass
class Stack:
    ws_url: str
    engine: ServeProcess
    checkout: Path
    trainer: dict[str, Path]
    numbers: dict[str, int]
    root: Path
    adapters: list[SglangDisk] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.engine.url

    def adapter(self, name: str, *, pause: str = "retract") -> SglangDisk:
        sub = Subscriber(self.ws_url, MODEL, name=name, report=False)
        engine = SglangDisk(SglangClient(self.url), sub, self.checkout, pause=pause)  # type: ignore[arg-type]
        self.adapters.append(engine)
        return engine

    def bring_to(self, engine: SglangDisk, tag: str) -> int:
        number = self.numbers[tag]
        if engine.held() != number:
            engine.switch(engine.prepare(number))
        assert engine_hashes(self.url) == oracle(self.trainer[tag])
        return number


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("sglang")
    dirs = make_versions(root / "trainer", 4)
    trainer = {f"v{i}": d for i, d in enumerate(dirs, 1)} | {"v1-again": dirs[0]}
    with serving(["--data", str(root / "ws")], log_path=root / "ws.log") as ws:
        numbers = {}
        with Publisher(ws.url, MODEL, cache_dir=root / "publisher") as pub:
            for step, tag in enumerate(["v1", "v2", "v3", "v4", "v1-again"], 1):
                numbers[tag] = pub.publish(trainer[tag], step=step).version
        checkout = root / "checkout"
        with Subscriber(ws.url, MODEL, name="setup", report=False) as sub:
            sub.pull(checkout, numbers["v1"])  # as a deployment does: pull, then start SGLang on the directory
        s = Stack(ws.url, contract_server(checkout, root / "sglang.log"), checkout, trainer, numbers, root)
        try:
            yield s
        finally:
            for a in s.adapters:
                a.subscriber.close()
                a.close()
            s.engine.stop()


# --- the contract itself ---------------------------------------------------------------------------


def test_the_contract_server_answers_as_sglang_0_5_23(stack: Stack) -> None:
    """Schemas and errors the adapter relies on, as http_server.py and io_struct.py (0.5.23) define them."""
    url = stack.url
    r = httpx.post(url + "/update_weights_from_disk", json={"weight_version": "1"}, timeout=30)
    assert r.status_code == 400 and r.json()["object"] == "error" and r.json()["code"] == 400
    assert "model_path" in r.json()["message"]
    r = httpx.post(url + "/pause_generation", json={"mode": "keep"}, timeout=30)  # vLLM's mode is no SGLang mode
    assert r.status_code == 400 and "in_place" in r.json()["message"]
    r = httpx.post(url + "/update_weights_from_disk", json={"model_path": str(stack.root / "none")}, timeout=30)
    assert r.status_code == 400 and r.json()["success"] is False and "Cannot find any model weights" in r.text
    info = model_info(url)
    assert {"model_path", "weight_version", "load_format"} <= set(info)
    body = httpx.post(url + "/weights_checker", json={"action": "checksum"}, timeout=60).json()
    assert set(body) == {"success", "message", "ranks", "per_engine_checksum"}
    sums = body["ranks"][0]["checksums"]
    assert QKV0 in sums and "model.layers.0.mlp.gate_up_proj.weight" in sums and len(sums) == 3 + 6 * LAYERS
    assert all(re.fullmatch(r"[0-9a-f]{16}", h) for h in sums.values())


def test_the_adapter_hash_is_sglang_tensor_hash() -> None:
    """The adapter's numpy hash equals the contract server's torch one and a word-by-word reading of the
    kernel, across tile edges and unaligned sizes; off CUDA it is the SHA-256 prefix."""

    def by_word(data: bytes) -> int:
        data += bytes(-len(data) % 4)
        words = np.frombuffer(data, "<u4").tolist()
        m, tiles = 0xFFFFFFFF, {}

        def mix(x: int) -> int:
            x ^= x >> 16
            x = (x * 0x85EBCA6B) & m
            x ^= x >> 13
            x = (x * 0xC2B2AE35) & m
            return x ^ (x >> 16)

        def rotl(x: int, r: int) -> int:
            return ((x << r) & m) | (x >> (32 - r))

        s1, s2 = 0x243F6A88, ((0x243F6A88 * 0x9E3779B1) ^ 0xDEADBEEF) & m
        for i, v in enumerate(words):
            a, b = tiles.get(i // 8192, (0, 0))
            k1 = mix(v ^ (((i * 0x27D4EB2D + s1) & m) ^ rotl(i, 15)))
            k2 = mix(v ^ (((i * 0x165667B1 + s2) & m) ^ rotl(i, 13)))
            tiles[i // 8192] = ((a + k1) & m, (b + k2) & m)
        n4 = (len(words) * 4) & m
        x = sum((mix(a ^ n4) << 32) | mix(b ^ n4) for a, b in tiles.values()) & ((1 << 64) - 1)
        for shift, mult in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
            x = ((x ^ (x >> shift)) * mult) & ((1 << 64) - 1)
        return x ^ (x >> 31) if words else 0

    rng = np.random.default_rng(5)
    for size in (0, 1, 6, 4 * 8192, 4 * 8192 + 3, 3 * 4 * 8192 + 10):
        data = rng.integers(0, 256, size, dtype=np.uint8)
        want = by_word(data.tobytes())
        assert cuda_tensor_hash(data, chunk_tiles=1) == want == gpu_tensor_hash(torch.from_numpy(data.copy()))
    x = torch.randn(8, 9).to(torch.bfloat16)
    assert tensor_hash(x, "cuda") != tensor_hash(x, "cpu")


def test_expected_hashes_follow_the_device(stack: Stack) -> None:
    names = sorted(oracle(stack.trainer["v2"]))
    assert expected(stack.trainer["v2"], names, device="cuda") == oracle(stack.trainer["v2"], "cuda")
    assert expected(stack.trainer["v2"], names, device="cpu") == oracle(stack.trainer["v2"], "cpu")


# --- switches --------------------------------------------------------------------------------------


def test_each_switch_leaves_the_engine_on_the_version(stack: Stack) -> None:
    engine = stack.adapter("switches")
    stack.bring_to(engine, "v1")
    for tag in ["v2", "v3", "v4", "v1-again"]:
        number = stack.numbers[tag]
        update = engine.prepare(number)
        report = engine.switch(update)
        assert (report.version, report.mode, engine.version, report.checked) == (number, "disk", number, 15)
        assert engine_hashes(stack.url) == oracle(stack.trainer[tag])
        info = model_info(stack.url)
        assert info["weight_version"] == str(number) and info["model_path"] == str(update.stage)
        assert not is_paused(stack.url)
    assert oracle(stack.trainer["v1"]) != oracle(stack.trainer["v2"]) != oracle(stack.trainer["v3"])


def test_a_bit_flipped_after_prepare_puts_the_engine_back_on_its_version(stack: Stack) -> None:
    engine = stack.adapter("flip")
    held = stack.bring_to(engine, "v2")
    update = engine.prepare(stack.numbers["v3"])
    flip_bit(update.stage / "model.safetensors", "model.layers.0.self_attn.k_proj.weight", byte=7)
    with pytest.raises(SwitchFailed) as caught:
        engine.switch(update)
    assert (caught.value.target, caught.value.held, caught.value.mismatched) == (stack.numbers["v3"], held, (QKV0,))
    assert engine.version == held and not is_paused(stack.url)
    assert engine_hashes(stack.url) == oracle(stack.trainer["v2"])
    assert model_info(stack.url)["weight_version"] == str(held)
    # The flipped file is the checkout's too: the next prepare finds it changed, pulls it again, and switches.
    assert engine.switch(engine.prepare(stack.numbers["v3"])).version == stack.numbers["v3"]
    assert engine_hashes(stack.url) == oracle(stack.trainer["v3"])


class _Observed(SglangClient):
    """The real client, noting the engine's hashes right after each update SGLang refuses."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.after_refusal: list[dict[str, str]] = []

    def update_from_disk(self, directory, **kwargs):  # type: ignore[no-untyped-def]
        ok, message = super().update_from_disk(directory, **kwargs)
        if not ok:
            self.after_refusal.append(engine_hashes(self.url))
        return ok, message


@pytest.mark.parametrize("damage", ["cut-short", "wrong-shape"])
def test_an_update_sglang_refuses_is_undone(stack: Stack, damage: str) -> None:
    """SGLang answers success false: a checkpoint cut short loads nothing; one whose last tensor has the
    wrong shape leaves the tensors before it loaded. Either way the adapter updates from the verified stage
    again and serves it."""
    client = _Observed(stack.url)
    sub = Subscriber(stack.ws_url, MODEL, name=f"refused-{damage}", report=False)
    engine = SglangDisk(client, sub, stack.checkout)
    stack.adapters.append(engine)
    held = stack.bring_to(engine, "v3")
    update = engine.prepare(stack.numbers["v4"])
    path = update.stage / "model.safetensors"
    if damage == "cut-short":
        data = path.read_bytes()
        path.unlink()  # the stage's link: the checkout's file stays whole
        path.write_bytes(data[: len(data) // 2])
    else:
        tensors = load_file(path)
        tensors["model.norm.weight"] = tensors["model.norm.weight"][: HIDDEN // 2].clone()
        path.unlink()
        save_file(tensors, path)
    with pytest.raises(SwitchFailed, match="SGLang refused the update") as caught:
        engine.switch(update)
    assert caught.value.held == held and caught.value.mismatched == ()
    (partial,) = client.after_refusal
    if damage == "wrong-shape":  # the v4 tensors before model.norm.weight were loaded when SGLang gave up
        assert partial[QKV0] == oracle(stack.trainer["v4"])[QKV0] != oracle(stack.trainer["v3"])[QKV0]
    assert engine_hashes(stack.url) == oracle(stack.trainer["v3"]) and not is_paused(stack.url)
    assert model_info(stack.url)["weight_version"] == str(held)


def test_a_failed_switch_without_a_verified_version_leaves_the_engine_paused(stack: Stack) -> None:
    before = stack.adapter("before-unhealthy")
    stack.bring_to(before, "v2")
    assert before._good is not None
    v2_stage = before._good.stage
    engine = stack.adapter("unhealthy")  # never asked what the engine holds: nothing verified to go back to
    update = engine.prepare(stack.numbers["v4"])
    flip_bit(update.stage / "model.safetensors", "model.norm.weight")
    with pytest.raises(EngineUnhealthy):
        engine.switch(update)
    assert is_paused(stack.url) and engine.version is None
    assert model_info(stack.url)["weight_version"] == "unverified"
    assert engine.held() is None  # the engine's hashes are neither v2 nor the checkout's v4
    assert is_paused(stack.url)  # weights that are no version: it stays paused
    # An operator loads v2's verified stage back: the adapter that verified it proves it and continues.
    r = httpx.post(stack.url + "/update_weights_from_disk", json={"model_path": str(v2_stage)}, timeout=60)
    assert r.status_code == 200 and r.json()["success"], r.text
    assert is_paused(stack.url)
    assert before.held() == stack.numbers["v2"]
    assert not is_paused(stack.url) and model_info(stack.url)["weight_version"] == str(stack.numbers["v2"])
    # An engine paused by someone else (not tagged unverified) is left paused by held().
    httpx.post(stack.url + "/pause_generation", json={"mode": "retract"}, timeout=30).raise_for_status()
    assert before.held() == stack.numbers["v2"] and is_paused(stack.url)
    httpx.post(stack.url + "/continue_generation", json={}, timeout=30).raise_for_status()
    report = engine.switch(engine.prepare(stack.numbers["v4"]))  # repaired checkout: verified, continued
    assert report.version == stack.numbers["v4"] and not is_paused(stack.url)
    assert engine_hashes(stack.url) == oracle(stack.trainer["v4"])


def test_held_is_learned_from_the_engine_after_a_restart(stack: Stack) -> None:
    number = stack.bring_to(stack.adapter("first"), "v4")
    assert stack.adapter("fresh").held() == number
    stage = Path(str(model_info(stack.url)["model_path"]))
    stack.engine.stop()  # the engine restarts on the stage it was last updated from
    stack.engine = contract_server(stage, stack.root / "sglang-restarted.log")
    assert model_info(stack.url)["weight_version"] == "default"  # a restarted SGLang forgot the tag
    assert stack.adapter("after-restart").held() == number  # the path and the hashes say v4
    httpx.post(stack.url + "/update_weight_version", json={"new_version": "999"}, timeout=30).raise_for_status()
    assert stack.adapter("wrong-tag").held() == number  # the tag is a hint; the hashes decide
    r = httpx.post(stack.url + "/weights_checker", json={"action": "reset_tensors"}, timeout=60)
    assert r.status_code == 200
    assert stack.adapter("scrambled").held() is None  # random weights are no version
    stack.bring_to(stack.adapter("repair"), "v4")


def _stream(url: str, tokens: int, out: dict[str, object], started: threading.Event) -> None:
    body = {"text": "hello", "sampling_params": {"max_new_tokens": tokens}, "stream": True}
    with httpx.stream("POST", url + "/generate", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            out["tokens"] = len(chunk["output_ids"])
            out["finish"] = chunk["meta_info"]["finish_reason"]
            started.set()


@pytest.mark.parametrize("mode", ["retract", "in_place", "abort"])
def test_requests_in_flight_behave_as_the_pause_mode_says(stack: Stack, mode: str) -> None:
    """A long request is streaming when the switch pauses: ``abort`` ends it, ``retract`` and ``in_place`` let
    it finish after the switch (``in_place`` only because the adapter does not ask SGLang to flush its cache,
    which SGLang refuses while requests sit in the running batch)."""
    engine = stack.adapter(f"pause-{mode}", pause=mode)
    stack.bring_to(engine, "v2")
    update = engine.prepare(stack.numbers["v3"])
    out: dict[str, object] = {}
    started = threading.Event()
    worker = threading.Thread(target=_stream, args=(stack.url, 150, out, started))
    worker.start()
    assert started.wait(60)
    report = engine.switch(update)
    worker.join(120)
    assert report.version == stack.numbers["v3"] and engine_hashes(stack.url) == oracle(stack.trainer["v3"])
    if mode == "abort":
        assert isinstance(out["finish"], dict) and out["finish"]["type"] == "abort" and out["tokens"] < 150
    else:
        assert isinstance(out["finish"], dict) and out["finish"]["type"] == "length" and out["tokens"] == 150


def test_in_place_with_a_cache_flush_is_refused_by_sglang(stack: Stack) -> None:
    """Why ``in_place`` updates go without ``flush_cache``: SGLang fails such an update while a request runs."""
    engine = stack.adapter("flush-check")
    stack.bring_to(engine, "v2")
    out: dict[str, object] = {}
    started = threading.Event()
    worker = threading.Thread(target=_stream, args=(stack.url, 100, out, started))
    worker.start()
    assert started.wait(60)
    client = SglangClient(stack.url)
    client.pause("in_place")
    ok, message = client.update_from_disk(stack.trainer["v2"], weight_version="x", flush_cache=True)
    client.resume()
    worker.join(120)
    client.close()
    assert not ok and "cache was not flushed" in message
    stack.bring_to(engine, "v2")


# --- the loop and the command -----------------------------------------------------------------------


def test_follow_keeps_the_engine_on_the_head(stack: Stack) -> None:
    engine = stack.adapter("follow-loop")
    stack.bring_to(engine, "v2")
    reports = []
    stop = threading.Event()
    held = follow(engine, engine.subscriber, stop=stop, count=1, on_switch=reports.append, watch_timeout=2)
    head = stack.numbers["v1-again"]
    assert held == head and [r.version for r in reports] == [head]
    assert engine_hashes(stack.url) == oracle(stack.trainer["v1-again"])


def _wait(predicate: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_the_follow_command_keeps_the_engine_on_the_head(stack: Stack) -> None:
    """`weightsync follow MODEL --engine sglang` as a process: it switches to the head, then to each new one."""
    stack.bring_to(stack.adapter("before-command"), "v3")
    cmd = [WEIGHTSYNC, "follow", MODEL, "--engine", "sglang", "--engine-url", stack.url, "--dir", stack.checkout]
    cmd += ["--server", stack.ws_url, "--json", "--count", "3", "--pause", "in_place", "--name", "cli"]
    proc = subprocess.Popen(
        [str(c) for c in cmd], env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        first = json.loads(proc.stdout.readline())
        assert first["engine"] == "sglang" and first["version"] == stack.numbers["v1-again"]
        assert first["previous"] == stack.numbers["v3"] and first["mode"] == "disk" and first["checked"] == 15
        new = make_versions(stack.root / "trainer-more", 6)[-2:]  # two more AdamW versions, past the first four
        with Publisher(stack.ws_url, MODEL, cache_dir=stack.root / "publisher") as pub:
            numbers = [pub.publish(d, step=10 + i).version for i, d in enumerate(new)]
        lines = [json.loads(proc.stdout.readline()) for _ in numbers]
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            stop_process(proc)  # type: ignore[arg-type]
    assert proc.returncode == 0, err
    assert [line["version"] for line in lines] == numbers
    assert engine_hashes(stack.url) == oracle(new[-1]) and model_info(stack.url)["weight_version"] == str(numbers[-1])
    ledger = httpx.get(f"{stack.ws_url}/v1/models/{MODEL}/replicas", params={"subscriber": "cli"}, timeout=30)
    (entry,) = ledger.json()["replicas"]
    assert entry["version"] == numbers[-1] and entry["engine"] == "sglang" and entry["status"] == "serving"
