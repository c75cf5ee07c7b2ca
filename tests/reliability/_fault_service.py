"""``weightsync serve`` as a subprocess on a free loopback port, and small helpers around it.

The reliability tests run the service the way an operator does (the CLI, settings from
flags and ``WEIGHTSYNC_*``), so start-up checks and the real uvicorn stack are part of
what they exercise.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

__all__ = ["Serve", "file_digests", "free_port", "log_records", "serve"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Serve:
    """A running ``weightsync serve`` subprocess."""

    proc: subprocess.Popen
    url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def serve(args: list[str], log_path: Path, *, env: dict[str, str] | None = None, wait: bool = True,
          timeout: float = 60.0) -> Serve:
    """Start ``python -m weightsync serve ARGS --port P``; with ``wait``, until /healthz answers 200.

    RuntimeError (with the log's tail) if the process exits first or time runs out.
    """
    port = free_port()
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("WEIGHTSYNC_", "AWS_", "PROMETHEUS_"))}
    clean.update(env or {})
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "weightsync", "serve", *args, "--port", str(port)],
                                env=clean, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    srv = Serve(proc, f"http://127.0.0.1:{port}", log_path)
    if not wait:
        return srv
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited with {proc.returncode}:\n{srv.log()[-3000:]}")
        try:
            if httpx.get(srv.url + "/healthz", timeout=2).status_code == 200:
                return srv
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            srv.stop()
            raise RuntimeError(f"serve did not answer /healthz in {timeout}s:\n{srv.log()[-3000:]}")
        time.sleep(0.1)


def log_records(text: str) -> list[dict]:
    """The JSON log lines of a serve log (other lines are skipped)."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def file_digests(root: Path, names: list[str] | None = None) -> dict[str, str]:
    """SHA-256 of the files under ``root`` (relative path → digest), the checkout's own state excluded."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_file() and not rel.startswith(".weightsync") and (names is None or rel in names):
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out
