"""The follow loop's waits: an engine that cannot be reached is asked again, and a stop ends the loop."""

from __future__ import annotations

import threading
from pathlib import Path

from _serve import free_port

from weightsync import Subscriber
from weightsync.common import Backoff
from weightsync.engines import EngineUnavailable, follow
from weightsync.engines.vllm import VllmClient, VllmDisk


def test_an_unreachable_engine_is_asked_again_until_stopped(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    errors: list[Exception] = []
    stop = threading.Event()

    def on_error(exc: Exception) -> None:
        errors.append(exc)
        if len(errors) == 3:
            stop.set()

    with Subscriber(dead, "m", report=False) as sub:  # the weightsync server is not reached before the engine
        engine = VllmDisk(VllmClient(dead, timeout=2), sub, tmp_path / "checkout")
        held = follow(engine, sub, stop=stop, on_error=on_error, retry=Backoff(attempts=1, base=0.01, cap=0.02))
        engine.close()
    assert held is None
    assert len(errors) == 3 and all(isinstance(e, EngineUnavailable) for e in errors)
