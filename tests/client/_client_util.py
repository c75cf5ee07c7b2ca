"""Helpers for the client tests: a real server subprocess, a tiny trainer, fault-injecting transports."""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from _serve import SERVICE_CLI, clean_env, spawn_serve, stop_process
from _serve import free_port as free_port  # re-exported: the CLI tests' dead-server URLs


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    data: Path
    log: Path


TOKENS = {
    "admin": "admin-token-0123456789abcdef",
    "reader": "reader-token-0123456789abcdef",
}


def start_server(
    root: Path,
    *,
    tokens: list[dict] | None = None,
    args: list[str] | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 60.0,
) -> Server:
    """`python -m weightsync.service serve` on a free loopback port with its own data dir; waits for /healthz."""
    root.mkdir(parents=True, exist_ok=True)
    cmd = ["--data", str(root / "data"), "--host", "127.0.0.1", "--log-level", "warning", *(args or [])]
    if tokens is not None:
        token_file = root / "tokens.json"
        token_file.write_text(json.dumps(tokens))
        cmd += ["--tokens", str(token_file)]
    log = root / "server.log"
    spawned = spawn_serve(cmd, log_path=log, command=SERVICE_CLI, env=clean_env(env), timeout=timeout)
    return Server(spawned.url, spawned.proc, root / "data", log)


def stop_server(server: Server) -> None:
    """SIGTERM, then SIGKILL (its process group) after 15 s."""
    stop_process(server.proc, 15)


@contextmanager
def server_on(catalog: str, root: Path) -> Iterator[Server]:
    """A server on the ``sqlite`` catalog (the default) or on a fresh ``postgres`` database, stopped after."""
    from _pg import fresh_database

    with ExitStack() as stack:
        args = []
        if catalog == "postgres":
            args = ["--catalog", stack.enter_context(fresh_database()).replace("+psycopg", "")]
        srv = start_server(root, args=args)
        try:
            yield srv
        finally:
            stop_server(srv)


class Killed(Exception):
    """The injected crash: not an httpx error, so no retry absorbs it."""


class FaultyTransport(httpx.BaseTransport):
    """Passes requests through, but raises Killed on the (limit+1)-th request matching (method, path prefix).

    `limit` None disables the fault. Counts every matching request.
    """

    def __init__(self, method: str, prefix: str, limit: int | None = None) -> None:
        self.inner = httpx.HTTPTransport()
        self.method = method
        self.prefix = prefix
        self.limit = limit
        self.count = 0
        self._lock = threading.Lock()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == self.method and request.url.path.startswith(self.prefix):
            with self._lock:
                self.count += 1
                crash = self.limit is not None and self.count > self.limit
            if crash:
                raise Killed(f"injected crash at {request.method} {request.url.path}")
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


class TinyTrainer:
    """A small MLP trained with AdamW on synthetic regression data, exporting a mixed-dtype state_dict.

    lr is RL-like small, so between steps only a few % of the bf16 elements change.
    Exports bf16 weights, an fp32 bias, an fp8 (F8_E4M3) and a U8-quantized copy of a
    weight, a BOOL mask and an int64 step counter.
    """

    def __init__(self, seed: int = 0, width: int = 128, hidden: int = 256, lr: float = 2e-6) -> None:
        import torch
        from torch import nn

        self.torch = torch
        g = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(width, hidden), nn.LayerNorm(hidden), nn.GELU(), nn.Linear(hidden, width))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.x = torch.randn(256, width, generator=g)
        self.y = torch.randn(256, width, generator=g)
        self.steps = 0

    def step(self) -> None:
        loss = ((self.model(self.x) - self.y) ** 2).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        self.steps += 1

    def export(self) -> dict:
        torch = self.torch
        sd = {k: v.detach() for k, v in self.model.state_dict().items()}
        w3 = sd["3.weight"]
        scale = w3.abs().max() / 127
        return {
            "0.weight": sd["0.weight"].to(torch.bfloat16),
            "0.bias": sd["0.bias"].clone(),  # fp32: every element changes every step (dense frames)
            "1.weight": sd["1.weight"].to(torch.bfloat16),  # small bf16 tensors share a frame
            "1.bias": sd["1.bias"].to(torch.bfloat16),
            "3.weight": w3.to(torch.bfloat16),
            "3.bias": sd["3.bias"].to(torch.bfloat16),
            "3.weight_fp8": (w3 * 16).to(torch.float8_e4m3fn),
            "3.weight_u8": ((w3 / scale).round().clamp(-127, 127) + 128).to(torch.uint8),
            "3.mask": w3 > 0.01,  # BOOL: XOR-coded deltas
            "step": torch.tensor([self.steps], dtype=torch.int64),
        }


def publish_steps(url: str, model: str, trainer, n: int, **options) -> list[dict]:
    """Publish `n` optimizer steps of `trainer` (step i as ``step=i``); a copy of each exported state_dict."""
    from weightsync.client import Publisher

    out = []
    with Publisher(url, model, **options) as pub:
        for i in range(1, n + 1):
            trainer.step()
            sd = trainer.export()
            pub.publish(sd, step=i)
            out.append({k: v.clone() for k, v in sd.items()})
    return out


def tensor_bits(t):
    """A torch tensor's bytes, as a uint8 tensor: compare with torch.equal for bit identity."""
    import torch

    return t.detach().contiguous().view(-1).view(torch.uint8)


def follow(url: str, model: str, want: dict, *, name: str = "follow-check") -> None:
    """A fresh subscriber (named `name`) pulls the head into zeroed tensors: bit-identical to `want`."""
    import torch

    from weightsync.client import Subscriber

    got = {k: torch.zeros_like(v) for k, v in want.items()}
    with Subscriber(url, model, name=name, report=False) as sub:
        sub.apply(got, sub.prepare())
    for key, t in want.items():
        assert torch.equal(tensor_bits(got[key]), tensor_bits(t)), key


def write_version(root: Path, state_dict: dict, *, config: bytes = b'{"hidden": 256}\n') -> Path:
    """A checkpoint directory: model.safetensors plus a config file."""
    from weightsync.client.tensors import serialize_state_dict

    root.mkdir(parents=True, exist_ok=True)
    serialize_state_dict(state_dict).tofile(root / "model.safetensors")
    (root / "config.json").write_bytes(config)
    return root


def tree_bytes(root: Path) -> dict[str, bytes]:
    """Every file under `root` except client state, by relative path."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if p.is_file() and rel.parts[0] != ".weightsync":
            out[rel.as_posix()] = p.read_bytes()
    return out


def dir_size(root: Path) -> int:
    return sum(len(b) for b in tree_bytes(root).values())
