"""A real ``weightsync serve`` subprocess with a token file, for the corruption, API-fuzz and security suites.

Tokens are fresh random secrets per process, so a test can grep the server's log for
them. The principals cover every authorization case of docs/API.md "Auth":

- ``admin``: admin scope, every model;
- ``publisher``: publish scope on ``policy-*``;
- ``reader``: read scope on ``policy-*``;
- ``other``: publish scope on ``other-*`` only (the wrong-model-pattern principal).
"""

from __future__ import annotations

import hashlib
import json
import secrets
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from _serve import SERVICE_CLI, clean_env, spawn_serve, stop_process

PRINCIPALS: dict[str, tuple[list[str], list[str]]] = {
    "admin": (["admin"], ["*"]),
    "publisher": (["publish"], ["policy-*"]),
    "reader": (["read"], ["policy-*"]),
    "other": (["publish"], ["other-*"]),
}


def new_tokens() -> dict[str, str]:
    """A fresh secret per principal, plus ``bad``: well-formed but unknown to the server."""
    out = {name: f"ws-{name}-{secrets.token_hex(24)}" for name in PRINCIPALS}
    out["bad"] = f"ws-bad-{secrets.token_hex(24)}"
    return out


@dataclass
class SecServer:
    """A running server subprocess and what a test needs to reach and inspect it."""

    url: str
    proc: subprocess.Popen
    root: Path
    tokens: dict[str, str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def store_root(self) -> Path:
        return self.data / "store"

    def headers(self, who: str | None) -> dict[str, str]:
        """The Authorization header of principal ``who`` (None: no header)."""
        return {} if who is None else {"Authorization": f"Bearer {self.tokens[who]}"}

    def token(self, who: str) -> str:
        return self.tokens[who]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def object_path(self, digest: str) -> Path:
        """Where the filesystem store keeps ``digest`` (store/fs.py layout)."""
        return self.store_root / "objects" / digest[:2] / digest[2:4] / digest


def start_server(
    root: Path,
    *,
    env: dict[str, str] | None = None,
    log_level: str = "info",
    tokens: dict[str, str] | None = None,
    timeout: float = 60.0,
) -> SecServer:
    """``python -m weightsync.service serve`` on a free loopback port, tokens from a JSON file (clear tokens
    for publisher/reader/other, a hash for admin); waits for /healthz."""
    root.mkdir(parents=True, exist_ok=True)
    tokens = tokens or new_tokens()
    entries = []
    for name, (scopes, models) in PRINCIPALS.items():
        entry: dict = {"name": name, "scopes": scopes, "models": models}
        if name == "admin":
            entry["token_sha256"] = hashlib.sha256(tokens[name].encode()).hexdigest()
        else:
            entry["token"] = tokens[name]
        entries.append(entry)
    token_file = root / "tokens.json"
    token_file.write_text(json.dumps(entries))
    environ = clean_env(
        {
            "WEIGHTSYNC_WATCH_POLL_S": "0.05",
            "WEIGHTSYNC_SSE_KEEPALIVE_S": "0.5",
            "WEIGHTSYNC_SHUTDOWN_GRACE_S": "1",
            **(env or {}),
        }
    )
    log_path = root / "server.log"
    spawned = spawn_serve(
        ["--data", str(root / "data"), "--host", "127.0.0.1", "--tokens", str(token_file), "--log-level", log_level],
        log_path=log_path,
        command=SERVICE_CLI,
        env=environ,
        timeout=timeout,
    )
    return SecServer(spawned.url, spawned.proc, root, tokens, log_path, env or {})


def stop_server(server: SecServer) -> None:
    """SIGTERM, then SIGKILL (its process group) after 15 s."""
    stop_process(server.proc, 15)


@contextmanager
def serving(root: Path, **kwargs) -> Iterator[SecServer]:
    server = start_server(root, **kwargs)
    try:
        yield server
    finally:
        stop_server(server)


# --- test versions ---------------------------------------------------------------------------


def version_files(n: int, seed: int = 0) -> list[dict[str, bytes]]:
    """``n`` consecutive small versions (a safetensors file of mixed dtypes plus a config), as path → bytes."""
    from _ckpt import safetensors_file
    from _versions import model_files, next_step

    tensors = model_files(seed)
    out = []
    for i in range(n):
        out.append(
            {
                "model.safetensors": safetensors_file(tensors, {"step": str(i)}),
                "config.json": json.dumps({"hidden": 96, "step": i}).encode(),
            }
        )
        tensors = next_step(tensors, seed * 1000 + i + 1)
    return out


def write_tree(root: Path, files: dict[str, bytes]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for path, data in files.items():
        p = root / path
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return root


def read_tree(root: Path) -> dict[str, bytes]:
    """Every regular file under ``root`` except client state (``.weightsync/``), as path → bytes."""
    out = {}
    if not root.exists():
        return out
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if rel == ".weightsync" or rel.startswith(".weightsync/"):
            continue
        if p.is_file() or p.is_symlink():
            out[rel] = p.read_bytes() if p.is_file() else b"<symlink>"
    return out


def publish_versions(
    server: SecServer,
    model: str,
    versions: list[dict[str, bytes]],
    work: Path,
    *,
    who: str = "publisher",
    url: str | None = None,
) -> list[dict]:
    """Publish ``versions`` in order with the SDK (small chunks and objects: several objects per version).

    ``url`` sends the SDK's requests elsewhere (a proxy). Returns, per version,
    ``{"number", "manifest", "objects"}`` where ``objects`` are the data
    objects that version's own manifest references.
    """
    from weightsync.client import Publisher
    from weightsync.codec.manifest import Manifest

    out = []
    with Publisher(
        url or server.url,
        model,
        token=server.token(who),
        chunk_bytes=1 << 13,
        object_bytes=1 << 14,
        concurrency=2,
        encoder_threads=1,
    ) as pub:
        for i, files in enumerate(versions):
            src = write_tree(work / f"{model}-v{i}", files)
            res = pub.publish(src, step=i)
            out.append({"number": res.version, "manifest": res.manifest})
    with httpx.Client(base_url=server.url, headers=server.headers("admin"), timeout=30) as c:
        for info in out:
            r = c.get(f"/v1/objects/{info['manifest']}")
            r.raise_for_status()
            info["objects"] = sorted(Manifest.decode(r.content).objects())
    return out


# --- raw HTTP: exact request targets (httpx would normalize "..") ------------------------------------------


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes


def raw_request(
    url: str,
    method: str,
    target: str | bytes,
    *,
    headers: dict[str, str] | None = None,
    body: bytes = b"",
    send_body: int | None = None,
    timeout: float = 30.0,
) -> RawResponse:
    """Send one HTTP/1.1 request with ``target`` byte for byte; ``send_body`` sends only that many body bytes
    (the declared Content-Length stays whatever ``headers`` say). The connection is closed afterwards."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    target_b = target if isinstance(target, bytes) else target.encode("latin-1")
    lines = [method.encode() + b" " + target_b + b" HTTP/1.1", f"Host: {host}:{port}".encode(), b"Connection: close"]
    hdrs = dict(headers or {})
    if body and not any(k.lower() in ("content-length", "transfer-encoding") for k in hdrs):
        hdrs["Content-Length"] = str(len(body))
    lines += [f"{k}: {v}".encode("latin-1") for k, v in hdrs.items()]
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(b"\r\n".join(lines) + b"\r\n\r\n")
        chunk = body if send_body is None else body[:send_body]
        try:
            if chunk:
                s.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed before taking the rest: read its answer
        data = b""
        while True:
            try:
                part = s.recv(1 << 16)
            except (TimeoutError, ConnectionResetError):
                break
            if not part:
                break
            data += part
            head, sep, rest = data.partition(b"\r\n\r\n")
            if sep:
                length = next(
                    (
                        int(line.split(b":", 1)[1])
                        for line in head.split(b"\r\n")[1:]
                        if line.lower().startswith(b"content-length:")
                    ),
                    None,
                )
                if length is not None and len(rest) >= length:
                    break
    head, _, rest = data.partition(b"\r\n\r\n")
    if not head:
        return RawResponse(0, {}, b"")
    status_line, *header_lines = head.split(b"\r\n")
    parsed = {}
    for line in header_lines:
        k, _, v = line.decode("latin-1").partition(":")
        parsed[k.strip().lower()] = v.strip()
    return RawResponse(int(status_line.split()[1]), parsed, rest)
