"""A test runner stopped with SIGTERM runs its fixtures' teardown (tests/_signals.py), and one killed outright has
what it registered killed by its watchdog (tests/_reaper.py): what a fixture started in a session of its own
does not outlive it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

SIGTERM_CONFTEST = """
from _signals import stop_on_sigterm


def pytest_configure(config):
    stop_on_sigterm()
"""

REAPER_CONFTEST = """
from _reaper import start


def pytest_configure(config):
    start()
"""

CHILD_TEST = """
import os, subprocess, time
import pytest
from _serve import own_group


@pytest.fixture
def server():
    proc = subprocess.Popen(["sleep", "300"], start_new_session=True)  # as the suite's servers are started
    if os.environ.get("REGISTER") == "1":
        own_group(proc.pid)
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


@contextmanager
def child_suite(tmp_path: Path, conftest: str | None, *, register: bool) -> Iterator[tuple[subprocess.Popen, int]]:
    """A pytest runner of its own on CHILD_TEST (with `conftest`, and its fixture's group registered with the
    runner's watchdog when `register`), yielded with its fixture's process once that is running and the test
    waits; both killed after, whatever happened."""
    (tmp_path / "test_child.py").write_text(CHILD_TEST)
    if conftest is not None:
        (tmp_path / "conftest.py").write_text(conftest)
    pid_file = tmp_path / "pid"
    env = {k: v for k, v in os.environ.items() if k != "WEIGHTSYNC_TEST_REAPER"}  # its own watchdog, not ours
    env |= {"PID_FILE": str(pid_file), "PYTHONPATH": str(Path(__file__).parent), "REGISTER": "1" if register else "0"}
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
        time.sleep(0.5)  # inside the test's sleep
        yield runner, int(pid_file.read_text())
    finally:
        if runner.poll() is None:
            runner.kill()
        if pid_file.exists():
            try:
                os.killpg(int(pid_file.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.skipif(not Path("/proc").exists(), reason="reads /proc")
@pytest.mark.parametrize("handled", [True, False])
def test_a_runner_stopped_by_sigterm_stops_what_its_fixtures_started(tmp_path: Path, handled: bool) -> None:
    """With the handler, the fixture's process is gone once the runner has exited; without it (the default
    SIGTERM), it is still there: what the handler is for."""
    with child_suite(tmp_path, SIGTERM_CONFTEST if handled else None, register=False) as (runner, server):
        runner.send_signal(signal.SIGTERM)
        runner.wait(timeout=60)
        assert _alive(server) is not handled


@pytest.mark.skipif(not Path("/proc").exists(), reason="reads /proc")
@pytest.mark.parametrize("registered", [True, False])
def test_a_runner_killed_outright_takes_what_it_registered_with_it(tmp_path: Path, registered: bool) -> None:
    """SIGKILL runs no teardown: the runner's watchdog kills the group its fixture registered once the runner is
    gone; a group not registered (what the watchdog is for) is still there."""
    with child_suite(tmp_path, REAPER_CONFTEST, register=registered) as (runner, server):
        runner.kill()
        runner.wait(timeout=60)
        deadline = time.monotonic() + 10
        while _alive(server) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _alive(server) is not registered
        if not registered:
            time.sleep(1.0)  # well past the watchdog's poll: still there
            assert _alive(server)
