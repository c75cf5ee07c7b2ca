"""What the suite starts in process groups of its own dies with the test runner, however the runner ends.

The servers the suite starts (`weightsync serve`, SeaweedFS, vLLM) run in sessions of their own, so
a fixture can stop each one's whole group (uvicorn's workers, vLLM's engine). Their fixtures stop
them at teardown, and a SIGTERM runs the teardown (tests/_signals.py); a runner killed outright
(SIGKILL: an out-of-memory kill, a harness's hard timeout) runs nothing, and its servers outlived it,
holding ports and memory. So the runner starts a watchdog once (:func:`start`), a process in a
session of its own that polls the runner and, once the runner is gone, SIGKILLs every group
registered with :func:`register` that is still the one registered (the same leader, by its start
time: a group id reused since is left alone). At a normal end it finds those groups stopped already.

Linux only (it reads /proc); elsewhere nothing is started or registered.
`tests/test_suite_signals.py` shows it on a runner of its own.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ENV = "WEIGHTSYNC_TEST_REAPER"
"""The list file of this runner's watchdog: ``PID:path`` (PID the runner's, so a runner started by a test
starts a watchdog of its own)."""

POLL_S = 0.2


def started_at(pid: int) -> str | None:
    """The process's start time (clock ticks since boot, /proc/PID/stat field 22), or None if there is none."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def start() -> None:
    """Start this runner's watchdog (once per runner process; not without /proc)."""
    me = os.getpid()
    held = os.environ.get(ENV, "")
    if held.startswith(f"{me}:") or not Path("/proc/self/stat").exists():
        return
    mine = started_at(me)
    fd, path = tempfile.mkstemp(prefix="weightsync-test-groups-", suffix=".txt")
    os.close(fd)
    subprocess.Popen(
        [sys.executable, __file__, str(me), str(mine), path],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # a Ctrl-C or SIGTERM to the runner's group leaves it to finish the job
        close_fds=True,
    )
    os.environ[ENV] = f"{me}:{path}"


def register(pgid: int) -> None:
    """Kill the process group `pgid` (its leader started in a session of its own) once the runner is gone."""
    held = os.environ.get(ENV, "")
    _, sep, path = held.partition(":")
    when = started_at(pgid)
    if not sep or when is None:
        return
    with open(path, "a") as f:  # one short append: whole lines, whoever else appends
        f.write(f"{pgid} {when}\n")


def _watch(runner: int, runner_started: str, path: str) -> None:
    """Wait for the runner to go, then SIGKILL the registered groups that are still theirs; remove the list."""
    while started_at(runner) == runner_started:
        time.sleep(POLL_S)
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        pgid, _, when = line.partition(" ")
        if pgid.isdigit() and started_at(int(pgid)) == when:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(int(pgid), signal.SIGKILL)
    with contextlib.suppress(OSError):
        os.unlink(path)


if __name__ == "__main__":
    _watch(int(sys.argv[1]), sys.argv[2], sys.argv[3])
