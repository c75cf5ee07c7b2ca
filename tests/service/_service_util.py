"""Helpers of the service tests: tokens, an in-process uvicorn server, subprocess servers.

The in-process server is uvicorn in a background thread (its own event loop), reached
over real HTTP with httpx. Subprocess servers (``python -m weightsync.service serve``)
are started by :func:`spawn_service` for the multi-process and CLI tests.
"""

from __future__ import annotations

import hashlib
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import uvicorn
from _pg import fresh_database
from _serve import SERVICE_CLI, ServeProcess, clean_env, spawn_serve

from weightsync.service import Settings, create_app

# name -> (token, scopes, model patterns). "admin" is configured by hash, the others in clear.
TOKENS: dict[str, tuple[str, list[str], list[str]]] = {
    "admin": ("adm-" + uuid.uuid4().hex + uuid.uuid4().hex, ["admin"], ["**"]),
    "publisher": ("pub-" + uuid.uuid4().hex + uuid.uuid4().hex, ["publish"], ["policy-*"]),
    "reader": ("rd-" + uuid.uuid4().hex + uuid.uuid4().hex, ["read"], ["policy-*"]),
    "other": ("oth-" + uuid.uuid4().hex + uuid.uuid4().hex, ["publish"], ["other-*"]),
    "org": ("org-" + uuid.uuid4().hex + uuid.uuid4().hex, ["publish"], ["Acme/*"]),
}
UPLOAD_CAP = 1 << 20  # small, so the 413 paths are cheap to show
JSON_CAP = 64 << 10


def token_entries() -> list[dict]:
    out = []
    for name, (token, scopes, models) in TOKENS.items():
        entry: dict = {"name": name, "scopes": scopes, "models": models}
        if name == "admin":
            entry["token_sha256"] = hashlib.sha256(token.encode()).hexdigest()
        else:
            entry["token"] = token
        out.append(entry)
    return out


class ServerThread:
    """uvicorn serving ``app`` on a free loopback port in a daemon thread."""

    def __init__(self, app) -> None:
        config = uvicorn.Config(
            app, host="127.0.0.1", port=0, log_config=None, access_log=False, lifespan="on", timeout_graceful_shutdown=2
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)

    def start(self, timeout: float = 60.0) -> str:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("service did not start (see the captured log)")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@contextmanager
def running(settings: Settings) -> Iterator[str]:
    srv = ServerThread(create_app(settings))
    url = srv.start()
    try:
        yield url
    finally:
        srv.stop()


@dataclass
class Service:
    """A running service and how to talk to it."""

    url: str
    backend: str
    settings: Settings
    clients: list[httpx.Client] = field(default_factory=list)

    @property
    def s3(self) -> bool:
        return self.backend.endswith("s3")

    def client(self, who: str | None = "admin", *, token: str | None = None, timeout: float = 60.0) -> httpx.Client:
        """An httpx client with ``who``'s bearer token (None: no Authorization header)."""
        headers = {}
        tok = token if token is not None else (TOKENS[who][0] if who else None)
        if tok is not None:
            headers["Authorization"] = f"Bearer {tok}"
        c = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)
        self.clients.append(c)
        return c


BACKENDS = ["sqlite-fs", pytest.param("pg-s3", marks=[pytest.mark.postgres, pytest.mark.s3])]


def backend_settings(backend: str, tmp: Path, request, **extra) -> tuple[dict, list]:
    """Settings keywords for ``backend`` and the context managers to exit afterwards."""
    kw: dict = {"data": tmp}
    cleanups = []
    if backend.startswith("pg"):
        ctx = fresh_database("ws_svc")
        kw["catalog"] = ctx.__enter__()
        cleanups.append(ctx)
    if backend.endswith("s3"):
        server = request.getfixturevalue("seaweed")
        kw.update(
            store=f"s3://weightsync-service-tests/{uuid.uuid4().hex}",
            s3_endpoint=server.endpoint_url,
            s3_access_key_id=server.access_key,
            s3_secret_access_key=server.secret_key,
            s3_region=server.region,
        )
    kw.update(extra)
    return kw, cleanups


# --- subprocess services -------------------------------------------------------------------


#: A running ``python -m weightsync.service serve`` subprocess (the shared helper's type).
Spawned = ServeProcess


def service_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment without ``WEIGHTSYNC_*``/``AWS_*``/``PROMETHEUS_*`` variables, ``extra`` on top."""
    return clean_env(extra)


def run_cli(
    args: list[str], *, env: dict[str, str] | None = None, timeout: float = 60.0
) -> subprocess.CompletedProcess:
    """``python -m weightsync.service ARGS`` to completion."""
    return subprocess.run([*SERVICE_CLI, *args], env=service_env(env), capture_output=True, text=True, timeout=timeout)


def spawn_service(
    args: list[str], log_path: Path, *, env: dict[str, str] | None = None, wait: bool = True, timeout: float = 60.0
) -> Spawned:
    """Start ``python -m weightsync.service serve ARGS --port P``; with ``wait``, until /healthz answers."""
    return spawn_serve(args, log_path=log_path, command=SERVICE_CLI, env=service_env(env), wait=wait, timeout=timeout)
