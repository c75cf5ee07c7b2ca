"""Ctrl-C (SIGINT to a real `weightsync` process) stops a push or pull mid-transfer; a re-run resumes (issue 12).

Each test caps the transfer at 1 MiB/s so that a ~10 MiB object is still in flight when the
signal arrives, then checks through the server that the transfer was cut off rather than
waited for, and that the pending publish was aborted. The time from the signal to the
process's exit is printed (``pytest -s``), never asserted.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pytest
from _client_util import tree_bytes
from _metrics import requests_seen
from _serve import clean_env

from weightsync.client.cli import EXIT_INTERRUPTED

pytestmark = pytest.mark.slow

HANG_S = 60.0
"""How long an interrupted process may take before the test calls it hung (it should take well under 1 s)."""
CHECK = "/v1/models/{model}/publishes/{publish_id}/objects"
ABORT = "/v1/models/{model}/publishes/{publish_id}"
OBJECT = "/v1/objects/{digest}"


def _checkpoint(root: Path, seed: int, elements: int = 2_600_000) -> Path:
    """A directory holding one ~10 MiB safetensors file of random floats (they barely compress)."""
    from safetensors.numpy import save_file

    root.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    save_file({"w": rng.standard_normal(elements).astype(np.float32)}, str(root / "model.safetensors"))
    return root


def _cli(*args: object) -> list[str]:
    return [sys.executable, "-m", "weightsync", *map(str, args)]


def _interrupt(cmd: list[str], env: dict[str, str], started: Callable[[], bool]) -> tuple[int, str, str, float]:
    """Run `cmd`, send SIGINT one second after `started()` turns true; (status, stdout, stderr, seconds to exit)."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + HANG_S
        while not started():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the transfer never started"
            time.sleep(0.05)
        time.sleep(1.0)  # mid-transfer: at 1 MiB/s about 9 s of it are left
        t = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=HANG_S)
        return proc.returncode, out, err, time.monotonic() - t
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _eventually(check: Callable[[], bool]) -> bool:
    """True once `check()` is (the server records a request just after answering it)."""
    deadline = time.monotonic() + 10
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_ctrl_c_stops_a_push_mid_upload_aborts_the_publish_and_a_rerun_resumes(server, model, tmp_path: Path) -> None:
    env = clean_env({"WEIGHTSYNC_SERVER": server.url, "WEIGHTSYNC_CACHE": str(tmp_path / "cache")})
    first = subprocess.run(
        _cli("push", model, _checkpoint(tmp_path / "v1", 1)), env=env, capture_output=True, timeout=HANG_S
    )
    assert first.returncode == 0, first.stderr
    v2 = _checkpoint(tmp_path / "v2", 2)
    checks = requests_seen(server.url, "POST", CHECK)
    aborts = requests_seen(server.url, "DELETE", ABORT, "204")
    cut = requests_seen(server.url, "PUT", OBJECT, "499")
    push = _cli("push", model, v2, "--keyframe", "--limit-rate", "1M", "--json")

    status, out, err, seconds = _interrupt(push, env, lambda: requests_seen(server.url, "POST", CHECK) > checks)
    print(f"\npush: SIGINT to exit {seconds:.3f} s")
    assert status == EXIT_INTERRUPTED and out == "" and err == "weightsync: error: interrupted\n"
    assert httpx.get(f"{server.url}/v1/models/{model}").json()["head"] == 1  # nothing committed
    assert _eventually(lambda: requests_seen(server.url, "DELETE", ABORT, "204") == aborts + 1)  # publish aborted
    assert _eventually(lambda: requests_seen(server.url, "PUT", OBJECT, "499") > cut)  # upload cut off mid-body

    rerun = subprocess.run(push, env=env, capture_output=True, text=True, timeout=HANG_S)
    assert rerun.returncode == 0, rerun.stderr
    result = json.loads(rerun.stdout)
    # The object cut off is uploaded again; what the first run finished (the manifest) is found by the check.
    assert result["version"] == 2 and 1 <= result["objects_uploaded"] < result["objects_total"]
    pulled = subprocess.run(_cli("pull", model, tmp_path / "replica"), env=env, capture_output=True, timeout=HANG_S)
    assert pulled.returncode == 0 and tree_bytes(tmp_path / "replica") == tree_bytes(v2)


def test_ctrl_c_stops_a_pull_mid_download_and_a_rerun_completes(server, model, tmp_path: Path) -> None:
    env = clean_env({"WEIGHTSYNC_SERVER": server.url, "WEIGHTSYNC_CACHE": str(tmp_path / "cache")})
    src = _checkpoint(tmp_path / "v1", 3)
    assert subprocess.run(_cli("push", model, src), env=env, capture_output=True, timeout=HANG_S).returncode == 0
    stored = httpx.get(f"{server.url}/v1/models/{model}/versions/1").json()["stored_bytes"]
    plans = requests_seen(server.url, "GET", "/v1/models/{model}/plan")
    dest = tmp_path / "replica"
    pull = _cli("pull", model, dest, "--limit-rate", "1M", "--json")

    status, out, err, seconds = _interrupt(
        pull, env, lambda: requests_seen(server.url, "GET", "/v1/models/{model}/plan") > plans
    )
    print(f"\npull: SIGINT to exit {seconds:.3f} s")
    assert status == EXIT_INTERRUPTED and out == "" and err == "weightsync: error: interrupted\n"
    assert not (dest / "model.safetensors").exists()  # no version half-installed

    rerun = subprocess.run(pull, env=env, capture_output=True, text=True, timeout=HANG_S)
    assert rerun.returncode == 0, rerun.stderr
    # The range in flight was dropped, not finished and kept: the re-run fetches it again.
    assert json.loads(rerun.stdout)["bytes"] > stored // 2
    assert tree_bytes(dest) == tree_bytes(src)
