"""Helpers of the relay tests: origins and relays as real processes, versions to publish, waiting."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from _ckpt import safetensors_file
from _client_util import Server
from _serve import SERVE_CLI, clean_env, spawn_serve
from _versions import model_files, next_step

from weightsync.client import Publisher


def start_relay(
    root: Path,
    upstream: str,
    *,
    tokens: list[dict] | None = None,
    args: list[str] | None = None,
    env: dict[str, str] | None = None,
    port: int | None = None,
    wait: bool = True,
) -> Server:
    """``weightsync relay --upstream UPSTREAM`` on a loopback port with its own data dir (reads the upstream's
    model list and heartbeats every 0.5 s); waits for /healthz unless not ``wait``."""
    root.mkdir(parents=True, exist_ok=True)
    cmd = ["--upstream", upstream, "--data", str(root / "data"), "--host", "127.0.0.1", "--log-level", "info"]
    if tokens is not None:
        (root / "tokens.json").write_text(json.dumps(tokens))
        cmd += ["--tokens", str(root / "tokens.json")]
    log = root / "relay.log"
    spawned = spawn_serve(
        [*cmd, *(args or [])],
        log_path=log,
        command=SERVE_CLI,
        subcommand="relay",
        port=port,
        env=clean_env({"WEIGHTSYNC_RELAY_POLL_S": "0.5", "WEIGHTSYNC_HEARTBEAT_S": "0.5", **(env or {})}),
        wait=wait,
    )
    return Server(spawned.url, spawned.proc, root / "data", log)


def restart_origin(old: Server, root: Path) -> Server:
    """A server on ``old``'s port and data directory (after ``old`` stopped)."""
    port = int(old.url.rsplit(":", 1)[1])
    cmd = ["--data", str(old.data), "--host", "127.0.0.1", "--log-level", "warning"]
    spawned = spawn_serve(cmd, log_path=root / "server-2.log", port=port, env=clean_env())
    return Server(spawned.url, spawned.proc, old.data, root / "server-2.log")


class Versions:
    """Consecutive small versions of one model, published to a server from files on disk."""

    def __init__(
        self, server: str, model: str, root: Path, *, token: str | None = None, seed: int = 0, tensors: int = 6
    ) -> None:
        self.tensors = model_files(seed, tensors)
        self.step = 0
        self.dir = root / f"src-{model}"
        self.publisher = Publisher(server, model, token=token, cache_dir=root / f"pubcache-{model}")

    def publish(self, *, keyframe: bool = False) -> int:
        if self.step:
            self.tensors = next_step(self.tensors, seed=self.step)
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "model.safetensors").write_bytes(safetensors_file(self.tensors, {"step": str(self.step)}))
        (self.dir / "config.json").write_bytes(b'{"hidden": 96}')
        self.step += 1
        return self.publisher.publish(self.dir, step=self.step, keyframe=keyframe).version


def wait_for(what: str, check: Callable[[], Any], timeout: float = 60.0, poll: float = 0.1) -> Any:
    """``check()``'s first truthy answer; AssertionError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = check()
        except (httpx.TransportError, httpx.HTTPStatusError):
            got = None
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(poll)


def head(url: str, model: str, token: str | None = None) -> int | None:
    """The model's head number at ``url`` (None: no version, or no such model)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    r = httpx.get(f"{url}/v1/models/{model}/versions/latest", headers=headers, timeout=10)
    return r.json()["number"] if r.status_code == 200 else None


def wait_head(url: str, model: str, number: int, token: str | None = None, timeout: float = 60.0) -> None:
    wait_for(f"{model} v{number} at {url}", lambda: (head(url, model, token) or 0) >= number, timeout)


def versions(url: str, model: str, token: str | None = None) -> list[dict]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.get(f"{url}/v1/models/{model}/versions", headers=headers, timeout=10).json()["versions"]


def tree(d: Path) -> dict[str, str]:
    """Every file under ``d`` (outside .weightsync) by relative path: its SHA-256."""
    return {
        str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(d.rglob("*"))
        if p.is_file() and ".weightsync" not in p.relative_to(d).parts
    }


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` at ``url``'s /metrics whose labels include ``labels``."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("#") or not (line.startswith(name + "{") or line.startswith(name + " ")):
            continue
        series, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in series for k, v in labels.items()):
            total += float(value)
    return total


def object_gets(url: str) -> float:
    """How many object GETs the server at ``url`` answered with bytes (200 or 206)."""
    return metric(url, "weightsync_http_requests_total", method="GET", route="/v1/objects/{digest}", status="200") + (
        metric(url, "weightsync_http_requests_total", method="GET", route="/v1/objects/{digest}", status="206")
    )


def store_objects(data: Path) -> dict[str, bytes]:
    """Every object file of a filesystem store under ``data`` (``DATA/store/objects``) by name."""
    return {p.name: p.read_bytes() for p in (data / "store" / "objects").rglob("*") if p.is_file()}
