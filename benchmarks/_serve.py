"""Start `weightsync serve` as a subprocess on a free loopback port, for the demo and the benchmarks.

A preset of the test suites' one serve helper, ``tests/_serve.py``; the servers die with the process that
started them, however it ends (the suites' watchdog, ``tests/_reaper.py``). That file is imported by path
under the name the suites use (``_serve``): ``tests/`` is not a package, is on ``sys.path`` only under
pytest, and must not ship in the wheel; benchmarks always run from a source checkout.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

_HELPER = Path(__file__).resolve().parents[1] / "tests" / "_serve.py"


def _helper(name: str = "_serve") -> ModuleType:
    """Return ``tests/<name>.py`` as module `name` (the one pytest or ``_seaweed`` imported, if any)."""
    path = _HELPER.with_name(f"{name}.py")
    loaded = sys.modules.get(name)
    if loaded is not None and Path(loaded.__file__ or "").resolve() == path:
        return loaded
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the helper {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as import does: a later `import _serve` (tests/_seaweed.py) gets this one
    spec.loader.exec_module(module)
    return module


# A benchmark killed outright (or stopped by a plain SIGTERM, which runs no cleanup) takes its servers with it:
# the watchdog the test runner has (tests/_reaper.py; a no-op under pytest, whose runner started one already).
_helper("_reaper").start()
_serve = _helper()
free_port = _serve.free_port
free_ports = _serve.free_ports


@contextmanager
def serve(
    workdir: Path, *, args: Sequence[str] = (), env: dict[str, str] | None = None, timeout: float = 60.0
) -> Iterator[str]:
    """Run the server with data under `workdir/data` until /healthz answers; yield its URL; stop it after."""
    with serve_process(workdir, args=args, env=env, timeout=timeout) as server:
        yield server.url


@contextmanager
def serve_process(
    workdir: Path, *, args: Sequence[str] = (), env: dict[str, str] | None = None, timeout: float = 60.0
) -> Iterator[_serve.ServeProcess]:
    """:func:`serve`, yielding the running server (its ``url``, and ``proc`` for its pid)."""
    with _serve.serving(
        ["--data", str(workdir / "data"), *args],
        log_path=workdir / "server.log",
        env=env or dict(os.environ),
        timeout=timeout,
        stop_timeout=10,
    ) as server:
        yield server
