"""The test runner stopped with SIGTERM (a CI timeout, `kill`) ends as after Ctrl-C.

By default SIGTERM ends Python at once, without the fixtures' teardown, and the servers the suite
starts in sessions of their own (SeaweedFS, `weightsync serve`, vLLM: each killed as a process group
by its fixture) outlived it. Raised as KeyboardInterrupt, pytest stops the session and runs the
teardown, which stops them. `tests/test_suite_signals.py` shows it on a runner of its own.
"""

from __future__ import annotations

import signal


def stop_on_sigterm() -> None:
    """SIGTERM raises KeyboardInterrupt in the main thread, unless something else handles it already."""
    if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _terminated)


def _terminated(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"stopped by signal {signum}")
