"""``weightsync serve`` as a subprocess on a free loopback port, and small helpers around it.

The reliability tests run the service the way an operator does (the CLI, settings from
flags and ``WEIGHTSYNC_*``), so start-up checks and the real uvicorn stack are part of
what they exercise.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from _serve import ServeProcess, clean_env, spawn_serve

__all__ = ["Serve", "file_digests", "log_records", "serve"]

#: A running ``weightsync serve`` subprocess (the shared helper's type).
Serve = ServeProcess


def serve(
    args: list[str], log_path: Path, *, env: dict[str, str] | None = None, wait: bool = True, timeout: float = 60.0
) -> Serve:
    """Start ``python -m weightsync serve ARGS --port P``; with ``wait``, until /healthz answers 200.

    RuntimeError (with the log's tail) if the process exits first or time runs out.
    """
    return spawn_serve(args, log_path=log_path, env=clean_env(env), wait=wait, timeout=timeout)


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
