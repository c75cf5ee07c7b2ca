"""Free loopback ports and ``weightsync serve`` subprocesses: the one helper every suite and the benchmarks use.

``spawn_serve(args, log_path=…)`` starts ``python -m weightsync serve ARGS --port P`` on a free
port in its own process group, waits until ``/healthz`` (or another path) answers 200 and returns
a :class:`ServeProcess`; :func:`serving` is the same as a context manager that stops it on exit.
Suites keep thin presets of their own (tokens, data layout) on top of these.

The benchmarks import this file by path (``benchmarks/_serve.py``): ``tests/`` is not a package and
is on ``sys.path`` only under pytest, and nothing here ships in the wheel.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx

__all__ = [
    "SERVE_CLI",
    "SERVICE_CLI",
    "STRIPPED_ENV",
    "ServeProcess",
    "clean_env",
    "free_port",
    "free_ports",
    "serving",
    "spawn_serve",
    "stop_process",
]

#: The top-level CLI (``weightsync serve``), run with this interpreter.
SERVE_CLI: tuple[str, ...] = (sys.executable, "-m", "weightsync")
#: The service's own entry point (``python -m weightsync.service serve``).
SERVICE_CLI: tuple[str, ...] = (sys.executable, "-m", "weightsync.service")
#: Variables a test server must not inherit from the developer's shell: they would configure it.
STRIPPED_ENV: tuple[str, ...] = ("WEIGHTSYNC_", "AWS_", "PROMETHEUS_")


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port free on ``host`` right now (the OS picks it; it is released before returning)."""
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """Return ``n`` distinct TCP ports free on ``host`` right now (all held open at once, then released)."""
    with ExitStack() as stack:
        ports = []
        for _ in range(n):
            s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind((host, 0))
            ports.append(s.getsockname()[1])
        return ports


def clean_env(extra: Mapping[str, str] | None = None, *, strip: Sequence[str] = STRIPPED_ENV) -> dict[str, str]:
    """Return this process's environment without variables starting with ``strip``, then ``extra`` on top."""
    prefixes = tuple(strip)
    env = {k: v for k, v in os.environ.items() if not (prefixes and k.startswith(prefixes))}
    env.update(extra or {})
    return env


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 20.0) -> int:
    """Stop a server started in its own process group; return its exit status.

    SIGTERM to the server alone (a graceful shutdown, as an operator's ``kill`` does), SIGKILL to
    its whole group after ``timeout``; any process left in the group afterwards (uvicorn workers
    of a server that was SIGKILLed) is killed too, so no test leaks a listener.
    """
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid)
            proc.wait()
    _kill_group(proc.pid)
    return proc.returncode


def own_group(pgid: int) -> None:
    """A process group the suite started (its leader in a session of its own) dies with the test runner even when
    the runner is killed outright: registered with the runner's watchdog (tests/_reaper.py), where there is one
    (not in a benchmark, which loads this file without pytest's conftest)."""
    reaper = sys.modules.get("_reaper")
    if reaper is not None:
        reaper.register(pgid)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is already gone
        os.killpg(pgid, signal.SIGKILL)


class ServeProcess:
    """A ``weightsync serve`` subprocess on ``127.0.0.1:port``, its output in ``log_path``.

    The constructor starts it and returns at once; :meth:`wait_ready` waits for it to answer.
    """

    def __init__(
        self,
        args: Sequence[str],
        *,
        log_path: Path,
        command: Sequence[str] = SERVE_CLI,
        port: int | None = None,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        subcommand: str = "serve",
    ) -> None:
        """Run ``COMMAND SUBCOMMAND ARGS --port P`` (``serve`` or ``relay``; ``env``: the whole environment,
        default :func:`clean_env`)."""
        self.port = port if port is not None else free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [*command, subcommand, *args, "--port", str(self.port)]
        with open(log_path, "wb") as log:
            self.proc: subprocess.Popen[bytes] = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=dict(env) if env is not None else clean_env(),
                cwd=cwd,
                start_new_session=True,
            )  # its own process group: stop() can end workers too
        own_group(self.proc.pid)

    def log(self) -> str:
        """Return what the server has written so far (stdout and stderr)."""
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 60.0, *, path: str = "/healthz", poll_s: float = 0.1) -> ServeProcess:
        """Return once ``GET path`` answers 200.

        RuntimeError with the log's tail if the process exits first or ``timeout`` passes (the
        server is then stopped).
        """
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                if httpx.get(self.url + path, timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"serve did not answer {path} in {timeout}s:\n{self.log()[-3000:]}")
            time.sleep(poll_s)

    def stop(self, timeout: float = 20.0) -> int:
        """Stop the server (:func:`stop_process`) and return its exit status."""
        return stop_process(self.proc, timeout)


def spawn_serve(
    args: Sequence[str],
    *,
    log_path: Path,
    command: Sequence[str] = SERVE_CLI,
    port: int | None = None,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    wait: bool = True,
    timeout: float = 60.0,
    ready_path: str = "/healthz",
    subcommand: str = "serve",
) -> ServeProcess:
    """Start ``COMMAND SUBCOMMAND ARGS --port P``; with ``wait``, return once ``ready_path`` answers 200."""
    server = ServeProcess(args, log_path=log_path, command=command, port=port, env=env, cwd=cwd, subcommand=subcommand)
    return server.wait_ready(timeout, path=ready_path) if wait else server


@contextmanager
def serving(
    args: Sequence[str],
    *,
    log_path: Path,
    command: Sequence[str] = SERVE_CLI,
    port: int | None = None,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    timeout: float = 60.0,
    ready_path: str = "/healthz",
    stop_timeout: float = 20.0,
) -> Iterator[ServeProcess]:
    """:func:`spawn_serve` as a context manager: yield the ready server, stop it (and its group) on exit."""
    server = ServeProcess(args, log_path=log_path, command=command, port=port, env=env, cwd=cwd)
    try:
        server.wait_ready(timeout, path=ready_path)
        yield server
    finally:
        server.stop(stop_timeout)
