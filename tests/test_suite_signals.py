"""A test runner stopped with SIGTERM runs its fixtures' teardown (tests/_signals.py): what a fixture started
in a session of its own does not outlive it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

CHILD_CONFTEST = """
from _signals import stop_on_sigterm


def pytest_configure(config):
    stop_on_sigterm()
"""

CHILD_TEST = """
import os, subprocess, time
import pytest


@pytest.fixture
def server():
    proc = subprocess.Popen(["sleep", "300"], start_new_session=True)  # as the suite's servers are started
    with open(os.environ["PID_FILE"] + ".tmp", "w") as f:
        f.write(str(proc.pid))
    os.replace(os.environ["PID_FILE"] + ".tmp", os.environ["PID_FILE"])
    yield proc
    os.killpg(proc.pid, 9)
    proc.wait()


def test_waits(server):
    time.sleep(300)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]


@pytest.mark.skipif(not Path("/proc").exists(), reason="reads /proc")
@pytest.mark.parametrize("handled", [True, False])
def test_a_runner_stopped_by_sigterm_stops_what_its_fixtures_started(tmp_path: Path, handled: bool) -> None:
    """With the handler, the fixture's process is gone once the runner has exited; without it (the default
    SIGTERM), it is still there: what the handler is for."""
    (tmp_path / "test_child.py").write_text(CHILD_TEST)
    if handled:
        (tmp_path / "conftest.py").write_text(CHILD_CONFTEST)
    pid_file = tmp_path / "pid"
    env = {**os.environ, "PID_FILE": str(pid_file), "PYTHONPATH": str(Path(__file__).parent)}
    runner = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while not pid_file.exists():
            assert runner.poll() is None and time.monotonic() < deadline, "the child suite did not start its fixture"
            time.sleep(0.05)
        server = int(pid_file.read_text())
        time.sleep(0.5)  # inside the test's sleep
        runner.send_signal(signal.SIGTERM)
        runner.wait(timeout=60)
        assert _alive(server) is not handled
    finally:
        if runner.poll() is None:
            runner.kill()
        if pid_file.exists():
            try:
                os.killpg(int(pid_file.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
