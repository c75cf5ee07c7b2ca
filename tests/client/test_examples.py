"""examples/: the trainer publishes in the background while the inference loop applies updates in place."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_trainer_and_inference_examples(server, model, tmp_path: Path) -> None:
    env = {**os.environ, "WEIGHTSYNC_SERVER": server.url}
    env.pop("WEIGHTSYNC_TOKEN", None)
    inference = subprocess.Popen(
        [
            sys.executable,
            str(EXAMPLES / "inference_loop.py"),
            "--model",
            model,
            "--dir",
            str(tmp_path / "w"),
            "--updates",
            "2",
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    trainer = None
    try:
        assert inference.stdout is not None
        first = inference.stdout.readline()
        assert "waiting for the first version" in first, first
        trainer = subprocess.Popen(
            [
                sys.executable,
                str(EXAMPLES / "trainer_loop.py"),
                "--model",
                model,
                "--steps",
                "60",
                "--step-seconds",
                "0.3",
                "--hidden",
                "256",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        out, _ = inference.communicate(timeout=90)
        assert inference.returncode == 0, out
        lines = [first, *out.splitlines()]
        assert any(line.startswith("loaded v") for line in lines), out
        assert sum("paused" in line for line in lines) == 2, out
    finally:
        for proc in (inference, trainer):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
    assert trainer is not None
    out, _ = trainer.communicate(timeout=30)
    assert "published v1 (keyframe" in out and "(delta" in out, out
