"""A loopback server that keeps SGLang 0.5.23's HTTP contract for weight updates, for the SGLang contract tests.

SGLang cannot run on this machine (CUDA-only wheels; its CPU backend needs AMX
Xeons), so ``weightsync.engines.sglang`` is tested against this server, which
implements the routes the adapter uses exactly as SGLang's source documents them.
Source read: the ``sglang==0.5.23`` wheel from PyPI (``sglang/_version.py``:
``0.5.23``):

- ``sglang/srt/entrypoints/http_server.py``: the routes, their status codes and
  bodies; a request that fails validation answers 400 with
  ``{"object": "error", "message", "type": "Bad Request", "param": null, "code": 400}``
  (``validation_exception_handler``, ``openai/protocol.py`` ``ErrorResponse``);
- ``sglang/srt/managers/io_struct.py``: the request fields and defaults
  (``PauseGenerationReqInput``, ``ContinueGenerationReqInput``,
  ``UpdateWeightFromDiskReqInput``, ``CheckWeightsReqInput``,
  ``UpdateWeightVersionReqInput``); unknown fields are ignored
  (``utils/msgspec_utils.py``: ``extra_behavior="ignore"``);
- ``sglang/srt/managers/tokenizer_manager.py``: pause/continue (``abort`` aborts
  every request until none runs; new requests wait while paused), an update
  while not paused waits for running requests, ``model_path`` and the weight
  version change only on success;
- ``sglang/srt/model_executor/model_runner_components/weight_updater.py`` and
  ``model_loader/weight_utils.py``: the update loads every ``*.safetensors`` of
  ``model_path`` into the parameters in place (a shape mismatch is an error, a
  tensor the checkpoint lacks keeps its bytes); on an error it answers
  ``"Failed to update weights: …\\nRolling back to original weights."`` after
  re-reading the same ``model_path`` (which fails again: the weights stay
  partly loaded here; SGLang's scheduler would raise);
- ``sglang/srt/managers/scheduler_components/weight_updater.py`` and
  ``scheduler.py``: with ``flush_cache`` the update fails ("Weights were updated,
  but the cache was not flushed …") while requests are in the running batch,
  which an ``in_place`` pause leaves there (``retract`` moves them back to the
  queue, which a paused engine ignores);
- ``sglang/srt/utils/weight_checker.py`` and ``managers/mm_utils.py``
  ``tensor_hash``: ``/weights_checker {"action": "checksum"}`` hashes every
  parameter: ``gpu_tensor_hash`` (``kernels/ops/memory/gpu_tensor_hash.py``) on
  a CUDA tensor, the first 8 bytes of SHA-256 elsewhere, as 16 hex digits; the
  hash here is written in torch from that kernel's source, independently of
  the adapter's numpy one (``--device cuda``, the default) or is the SHA-256 one
  (``--device cpu``).

The model is a Llama's parameter layout in SGLang: ``q_proj``, ``k_proj``,
``v_proj`` fused into ``qkv_proj`` and ``gate_proj``, ``up_proj`` into
``gate_up_proj`` (dim 0, in that order); every other checkpoint tensor is the
parameter of its name. Generation is simulated (``POST /generate``: one token
per step, ``step_s`` apart, each a function of the weights held when it is
made), enough to observe what a pause does to requests in flight.

Run: ``python _sglang_contract.py serve --model-path DIR --port P [--device cuda|cpu]`` (the shape
``_serve.ServeProcess`` starts).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import time
import uuid
from pathlib import Path
from typing import Any, Literal

import torch
import uvicorn
from fastapi import Body, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict
from safetensors import safe_open

VERSION = "0.5.23"
FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
M32 = 0xFFFFFFFF
M64 = (1 << 64) - 1


# --- request schemas (io_struct.py, 0.5.23) --------------------------------------------------


class _Req(BaseModel):
    model_config = ConfigDict(extra="ignore")
    rid: str | None = None
    http_worker_ipc: str | None = None


class PauseGenerationReqInput(_Req):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationReqInput(_Req):
    torch_empty_cache: bool = True


class UpdateWeightFromDiskReqInput(_Req):
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    flush_cache: bool = True
    manifest: dict[str, Any] | None = None


class CheckWeightsReqInput(_Req):
    action: str = "checksum"
    allow_quant_error: bool = False
    skip_tensor_list: list[str] | None = None
    selector: Literal["target", "draft", "all"] = "all"


class UpdateWeightVersionReqInput(_Req):
    new_version: str
    abort_all_requests: bool = True


class GenerateReqInput(BaseModel):
    model_config = ConfigDict(extra="ignore")
    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any] | None = None
    stream: bool = False


# --- SGLang's tensor_hash ----------------------------------------------------------------------


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x < 2**32 held in int64, without overflowing int64."""
    return ((x & 0xFFFF) * c + ((((x >> 16) * c) & 0xFFFF) << 16)) & M32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) & M32) | (x >> (32 - r))


def gpu_tensor_hash(t: torch.Tensor, *, tile: int = 8192, seed: int = 0x243F6A88) -> int:
    """gpu_tensor_hash.py's value for ``t``'s bytes, computed in int64 torch on the CPU."""
    b = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if b.numel() % 4:
        b = torch.cat([b, torch.zeros(4 - b.numel() % 4, dtype=torch.uint8)])
    n = b.numel() // 4
    if n == 0:
        return 0
    w = b.view(torch.int32).to(torch.int64) & M32
    i = torch.arange(n, dtype=torch.int64)
    s1, s2 = seed & M32, ((seed * 0x9E3779B1) ^ 0xDEADBEEF) & M32
    k1 = _fmix32(w ^ ((_mul32(i, 0x27D4EB2D) + s1) & M32 ^ _rotl32(i, 15)))
    k2 = _fmix32(w ^ ((_mul32(i, 0x165667B1) + s2) & M32 ^ _rotl32(i, 13)))
    pad = (-n) % tile
    k1 = torch.cat([k1, torch.zeros(pad, dtype=torch.int64)]).view(-1, tile).sum(1) & M32
    k2 = torch.cat([k2, torch.zeros(pad, dtype=torch.int64)]).view(-1, tile).sum(1) & M32
    nbytes = (n * 4) & M32
    h1, h2 = _fmix32(k1 ^ nbytes), _fmix32(k2 ^ nbytes)
    x = sum((int(a) << 32) | int(c) for a, c in zip(h1.tolist(), h2.tolist(), strict=True)) & M64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def tensor_hash(t: torch.Tensor, device: str) -> str:
    """weight_checker.py ``_hash_tensor``: 16 hex digits of mm_utils ``tensor_hash`` on ``device``."""
    if device == "cuda":
        return f"{gpu_tensor_hash(t):016x}"
    return hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()[:16]


# --- the engine ----------------------------------------------------------------------------------


def engine_name(name: str) -> tuple[str, int | None]:
    """The SGLang parameter a checkpoint tensor loads into, and its shard (None: the whole parameter)."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in FUSED:
        fused, shard = FUSED[parts[-2]]
        return ".".join([*parts[:-2], fused, parts[-1]]), shard
    return name, None


def checkpoint_files(model_path: str) -> list[Path]:
    root = Path(model_path)
    files = sorted(root.glob("*.safetensors")) if root.is_dir() else []
    if not files:
        raise RuntimeError(f"Cannot find any model weights with `{model_path}`")
    return files


def read_layout(model_path: str) -> tuple[dict[str, torch.Tensor], dict[str, list[int]]]:
    """The parameters (zeros) a model of the checkpoint at ``model_path`` has, fused as SGLang fuses them,
    and the first row of each shard of the fused ones."""
    shards: dict[str, dict[int | None, torch.Tensor]] = {}
    for path in checkpoint_files(model_path):
        with safe_open(path, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not iterable
                name, shard = engine_name(key)
                shards.setdefault(name, {})[shard] = f.get_slice(key)
    params, starts = {}, {}
    for name, parts in shards.items():
        if None in parts:
            s = parts[None]
            params[name] = torch.zeros(s.get_shape(), dtype=_dtype(s.get_dtype()))
        else:
            slices = [parts[i] for i in sorted(parts)]
            rows = [s.get_shape()[0] for s in slices]
            starts[name] = [sum(rows[:i]) for i in range(len(rows))]
            params[name] = torch.zeros([sum(rows), *slices[0].get_shape()[1:]], dtype=_dtype(slices[0].get_dtype()))
    return params, starts


def _dtype(name: str) -> torch.dtype:
    return {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}[name]


class Engine:
    """The scheduler's state: parameters, model path, weight version, pause, the requests."""

    def __init__(self, model_path: str, device: str, step_s: float) -> None:
        self.device, self.step_s = device, step_s
        self.params, self.shard_starts = read_layout(model_path)
        self.load(model_path)
        self.model_path, self.weight_version, self.load_format = model_path, "default", "auto"
        self.paused = False
        self.pause_mode: str | None = None
        self.running: dict[str, dict[str, Any]] = {}  # rid -> request state
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.idle = asyncio.Event()
        self.idle.set()
        self.updates = 0

    def load(self, model_path: str) -> None:
        """Load every tensor of the checkpoint into its parameter in place (a failure leaves the rest as it was)."""
        for path in checkpoint_files(model_path):
            with safe_open(path, framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open is not iterable
                    name, shard = engine_name(key)
                    if name not in self.params:
                        raise KeyError(name)
                    weight = f.get_tensor(key)
                    param = self.params[name]
                    if shard is None:
                        target = param
                    else:
                        start = self.shard_starts[name][shard]
                        target = param[start : start + weight.shape[0]]
                    if target.size() != weight.size():
                        raise AssertionError(
                            f"Attempted to load weight ({weight.size()}) into parameter ({target.size()})"
                        )
                    target.copy_(weight)

    def checksums(self) -> dict[str, str]:
        return {name: tensor_hash(p, self.device) for name, p in self.params.items()}

    def fingerprint(self) -> int:
        h = hashlib.sha256()
        for name in sorted(self.params):
            h.update(self.params[name].view(-1).view(torch.uint8).numpy().tobytes())
        return int.from_bytes(h.digest()[:4], "big")


def create_app(engine: Engine) -> FastAPI:
    app = FastAPI()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message = f"{exc} {exc.errors()}"
        body = {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}
        return JSONResponse(body, status_code=400)

    @app.get("/health")
    @app.get("/health_generate")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/model_info")
    async def model_info() -> dict[str, Any]:
        return {
            "model_path": engine.model_path,
            "served_model_name": engine.model_path,
            "tokenizer_path": engine.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": engine.weight_version,
            "load_format": engine.load_format,
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
        }

    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        return {
            "model_path": engine.model_path,
            "device": engine.device,
            "tp_size": 1,
            "pp_size": 1,
            "dp_size": 1,
            "version": VERSION,
            "internal_states": [{}],
        }

    @app.post("/pause_generation")
    async def pause_generation(obj: PauseGenerationReqInput = Body()) -> JSONResponse:  # noqa: B008
        engine.paused, engine.pause_mode = True, obj.mode
        engine.resumed.clear()
        if obj.mode == "abort":
            while engine.running:  # tokenizer_manager: abort all until no request holds the reader lock
                for state in engine.running.values():
                    state["abort"] = True
                await asyncio.sleep(0.01)
        elif obj.mode == "retract":
            for state in engine.running.values():
                state["retracted"] = True  # back to the waiting queue: its KV cache is recomputed on continue
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    @app.post("/continue_generation")
    async def continue_generation(obj: ContinueGenerationReqInput = Body()) -> JSONResponse:  # noqa: B008
        engine.paused, engine.pause_mode = False, None
        engine.resumed.set()
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(obj: UpdateWeightFromDiskReqInput = Body()) -> JSONResponse:  # noqa: B008
        if not engine.paused:
            await engine.idle.wait()  # the model-update writer lock: running requests finish first
        success, message = True, "Succeeded to update model weights."
        try:
            checkpoint_files(obj.model_path)
        except RuntimeError as exc:
            success, message = False, f"Failed to get weights iterator: {exc}."
        else:
            try:
                engine.load(obj.model_path)
            except Exception as exc:  # noqa: BLE001 - SGLang answers any loader error so
                success, message = False, f"Failed to update weights: {exc}.\nRolling back to original weights."
                try:
                    engine.load(obj.model_path)  # SGLang's rollback rereads the path it was given
                except Exception:  # noqa: BLE001, S110 - fails the same way: the weights stay partly loaded
                    pass
        if success:
            engine.updates += 1
            if obj.flush_cache and engine.pause_mode == "in_place" and engine.running:
                success = False
                message = (
                    "Weights were updated, but the cache was not flushed because requests are still running "
                    "or queued. Retract or finish them, then call /flush_cache."
                )
        if success:
            engine.model_path = obj.model_path
            engine.load_format = obj.load_format or engine.load_format
            if obj.weight_version is not None:
                engine.weight_version = obj.weight_version
                message += f" Weight version updated to {obj.weight_version}."
        body = {"success": success, "message": message, "num_paused_requests": 0}
        return JSONResponse(body, status_code=200 if success else 400)

    @app.api_route("/weights_checker", methods=["GET", "POST"])
    async def weights_checker(obj: CheckWeightsReqInput | None = Body(None)) -> JSONResponse:  # noqa: B008
        obj = obj or CheckWeightsReqInput()
        if obj.action == "reset_tensors":
            for p in engine.params.values():
                p.copy_(torch.rand(p.shape, dtype=torch.float32).to(p.dtype))
            return JSONResponse({"success": True, "message": "Success."})
        if obj.action != "checksum":
            return JSONResponse({"success": False, "message": f"Unsupported action={obj.action!r}"}, status_code=400)
        sums = engine.checksums()
        h = hashlib.sha256()
        for name in sorted(sums):
            h.update(name.encode())
            h.update(sums[name].encode())
        per_gpu = h.hexdigest()
        info = {"role": "target", "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1, "pp_rank": 0}
        info |= {"pp_size": 1, "rank": 0, "size": 1}
        ranks = [{"checksums": sums, "per_gpu_checksum": per_gpu, "parallelism_info": [info]}]
        per_engine = hashlib.sha256(per_gpu.encode()).hexdigest()
        body = {"success": True, "message": "Success.", "ranks": ranks, "per_engine_checksum": per_engine}
        return JSONResponse(body)

    @app.post("/update_weight_version")
    async def update_weight_version(obj: UpdateWeightVersionReqInput = Body()) -> JSONResponse:  # noqa: B008
        if obj.abort_all_requests:
            for state in engine.running.values():
                state["abort"] = True
        engine.weight_version = obj.new_version
        body = {"success": True, "message": f"Weight version updated to {obj.new_version}"}
        return JSONResponse(body | {"new_version": obj.new_version})

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        ok = not engine.running or engine.pause_mode == "retract"
        text = "Cache flushed.\n" if ok else "Flush cache failed.\n"
        return Response(content=text, status_code=200 if ok else 400)

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(obj: GenerateReqInput) -> Any:
        await engine.resumed.wait()  # tokenizer_manager: new requests wait while paused
        rid = uuid.uuid4().hex
        steps = int((obj.sampling_params or {}).get("max_new_tokens", 16))
        state: dict[str, Any] = {"abort": False, "retracted": False, "tokens": [], "versions": []}
        engine.running[rid] = state
        engine.idle.clear()

        def meta(reason: dict[str, Any] | None) -> dict[str, Any]:
            return {"id": rid, "finish_reason": reason, "completion_tokens": len(state["tokens"])}

        async def run() -> Any:
            try:
                while len(state["tokens"]) < steps:
                    if state["abort"]:
                        return {"type": "abort", "message": "Abort before update weights."}
                    if engine.paused and engine.pause_mode in ("in_place", "retract"):
                        await engine.resumed.wait()
                        continue
                    await asyncio.sleep(engine.step_s)
                    if state["abort"] or engine.paused:
                        continue
                    state["tokens"].append(engine.fingerprint() % 1000)
                    state["versions"].append(engine.weight_version)
                    yield_point.set()
                return {"type": "length", "length": steps}
            finally:
                engine.running.pop(rid, None)
                if not engine.running:
                    engine.idle.set()

        yield_point = asyncio.Event()
        if not obj.stream:
            reason = await run()
            return {"text": " ".join(map(str, state["tokens"])), "output_ids": state["tokens"]} | {
                "meta_info": meta(reason) | {"weight_versions": state["versions"]}
            }

        async def stream() -> Any:
            task = asyncio.ensure_future(run())
            sent = 0
            while True:
                yield_point.clear()
                done = task.done()
                if len(state["tokens"]) > sent or done:
                    sent = len(state["tokens"])
                    reason = task.result() if done else None
                    out = {"output_ids": state["tokens"], "meta_info": meta(reason)}
                    yield b"data: " + json.dumps(out).encode() + b"\n\n"
                if done:
                    break
                waiter = asyncio.ensure_future(yield_point.wait())
                await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--step-s", type=float, default=0.02, help="seconds per generated token")
    args = parser.parse_args()
    started = time.monotonic()

    async def serve() -> None:
        engine = Engine(args.model_path, args.device, args.step_s)
        config = uvicorn.Config(create_app(engine), host=args.host, port=args.port, log_level="warning")
        print(f"contract server on {args.host}:{args.port} ({time.monotonic() - started:.1f}s)", flush=True)
        await uvicorn.Server(config).serve()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
