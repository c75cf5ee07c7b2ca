"""`weightsync follow` without an engine: usage errors, an engine that cannot be reached, Ctrl-C, the layering.

The command against a real vLLM is in test_vllm.py (it shares that module's one server).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _serve import ServeProcess, clean_env, free_port, serving
from typer.testing import CliRunner

from weightsync import Publisher, Subscriber
from weightsync.cli import app
from weightsync.client.cli import EXIT_INTERRUPTED, EXIT_UNAVAILABLE, EXIT_USAGE, _print_switch
from weightsync.engines import SwitchReport, follow
from weightsync.engines.torch import TorchModule

WEIGHTSYNC = Path(sys.executable).with_name("weightsync")  # the console script an operator runs


def _cli(*args: object) -> object:
    return CliRunner().invoke(app, ["follow", *map(str, args)], env=clean_env(), catch_exceptions=False)


def _usage_error(result) -> str:  # type: ignore[no-untyped-def]
    assert result.exit_code == EXIT_USAGE, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("weightsync: error: ") and result.stdout == "", result.stderr
    assert lines[0].endswith("(see weightsync follow --help)"), lines[0]
    return lines[0]


def test_usage_mistakes_are_one_line_before_anything_is_reached(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    ok = ["--engine-url", dead, "--dir", tmp_path / "d"]
    assert "TorchModule (SDK)" in _usage_error(_cli("m", "--engine", "torch", *ok))
    assert "'tgi' is not an engine" in _usage_error(_cli("m", "--engine", "tgi", *ok))
    assert "Missing option '--engine'" in _usage_error(_cli("m", *ok))
    assert "disk mode needs the checkout" in _usage_error(_cli("m", "--engine", "vllm", "--engine-url", dead))
    assert "'--mode'" in _usage_error(_cli("m", "--engine", "vllm", *ok, "--mode", "hot"))
    assert "vllm only" in _usage_error(_cli("m", "--engine", "sglang", *ok, "--mode", "in-process"))
    line = _usage_error(_cli("m", "--engine", "vllm", "--engine-url", dead.removeprefix("http://"), "--dir", "d"))
    assert f"needs a scheme: {dead}" in line
    line = _usage_error(_cli("m", "--engine", "vllm", "--engine-url", dead + "/v1/", "--dir", "d"))
    assert f"OpenAI base URL: use the server's root, {dead}" in line
    assert "not one of keep, wait, abort" in _usage_error(_cli("m", "--engine", "vllm", *ok, "--pause", "never"))
    assert "'--engine-wait'" in _usage_error(_cli("m", "--engine", "vllm", *ok, "--engine-wait", "-1"))
    assert "'--server'" in _usage_error(_cli("m", "--engine", "vllm", *ok, "--server", "127.0.0.1:8400"))
    assert not (tmp_path / "d").exists()


def test_an_engine_that_cannot_be_reached_is_exit_5_in_one_line(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    args = ["m", "--engine", "vllm", "--engine-url", dead, "--dir", tmp_path / "d"]
    r = _cli(*args, "--engine-wait", "0")
    assert r.exit_code == EXIT_UNAVAILABLE and r.stdout == ""  # type: ignore[attr-defined]
    assert r.stderr == f"weightsync: error: vLLM at {dead} cannot be reached (waited 0s for /health)\n"  # type: ignore[attr-defined]
    r = _cli(*args, "--engine-wait", "1")
    assert r.exit_code == EXIT_UNAVAILABLE  # type: ignore[attr-defined]
    assert r.stderr.splitlines() == [  # type: ignore[attr-defined]
        f"weightsync: waiting for vllm at {dead}",
        f"weightsync: error: vLLM at {dead} cannot be reached (waited 1s for /health)",
    ]


def test_ctrl_c_while_waiting_for_the_engine_exits_130(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    cmd = [WEIGHTSYNC, "follow", "m", "--engine", "vllm", "--engine-url", dead, "--dir", tmp_path / "d"]
    proc = subprocess.Popen(cmd, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        assert proc.stderr.readline() == f"weightsync: waiting for vllm at {dead}\n"  # it is in the wait now
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == EXIT_INTERRUPTED and out == "" and err == "weightsync: error: interrupted\n"


def test_help_names_the_modes_and_says_the_torch_adapter_is_sdk_only() -> None:
    r = CliRunner().invoke(app, ["follow", "--help"], env={"COLUMNS": "100"})
    assert r.exit_code == 0
    text = " ".join(r.stdout.split())
    assert (
        "vllm (disk or in-process mode: --mode)" in text and "SDK only (weightsync.engines.torch.TorchModule)" in text
    )
    assert "VLLM_SERVER_DEV_MODE=1" in text and "╭" not in r.stdout


def test_the_cli_does_not_import_the_engines() -> None:
    """Layering: weightsync.engines builds on the client SDK, so the CLI imports it only inside `follow`."""
    code = "import sys, weightsync.cli; print(sorted(m for m in sys.modules if m.startswith('weightsync.engines')))"
    out = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_switch_prints_one_line_or_one_json_object(capsys: pytest.CaptureFixture[str]) -> None:
    report = SwitchReport(7, 6, 0.0834, "disk", 15, 700 << 10, 0.21, {"reload_s": 0.035, "verify_s": 0.012})
    _print_switch("tiny", "vllm", report, as_json=False)
    assert capsys.readouterr().out == (
        "tiny v7: vllm switched from v6, paused 83 ms (reload 35 ms, verify 12 ms), 15 parameters checked; "
        "prepared in 0.21s, 700.0 KiB received\n"
    )
    _print_switch("tiny", "vllm", SwitchReport(1, None, 0.05, "disk", 15), as_json=True)
    line = capsys.readouterr().out
    assert line.count("\n") == 1 and '"previous": null' in line and '"pause_ms": 50.0' in line


# --- Ctrl-C during a switch (what `weightsync follow` relies on), with the real torch adapter -------------


torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    root = tmp_path_factory.mktemp("follow-interrupt")
    with serving(["--data", str(root / "data")], log_path=root / "serve.log") as srv:
        yield srv


class _CtrlCInSwitch(TorchModule):
    """The real adapter; ``signals`` real SIGINTs reach this process as its switch starts."""

    signals = 0

    def switch(self, update):  # type: ignore[no-untyped-def]
        for _ in range(self.signals):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # the handler runs in the main thread at its next instruction
        return super().switch(update)


def _versions(n: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [{"w": torch.randn(64, 64, generator=gen).to(torch.bfloat16)} for _ in range(n)]


@pytest.mark.parametrize("signals", [1, 2])
def test_ctrl_c_during_a_switch_finishes_it_first_and_twice_abandons_it(
    server: ServeProcess, tmp_path: Path, signals: int
) -> None:
    model = f"follow-interrupt-{signals}"
    v1, v2 = _versions(2)
    with Publisher(server.url, model, cache_dir=tmp_path / "pub") as pub:
        n1, n2 = (pub.publish(v, step=i).version for i, v in enumerate((v1, v2)))
    module = torch.nn.Module()
    module.w = torch.nn.Parameter(v1["w"].clone(), requires_grad=False)
    handler = signal.getsignal(signal.SIGINT)
    with Subscriber(server.url, model, name="interrupted") as sub:
        engine = _CtrlCInSwitch(module, sub)
        engine.load(n1)  # a switch too: no signal yet
        engine.signals = signals
        with pytest.raises(KeyboardInterrupt):
            follow(engine, sub, watch_timeout=2)
    assert signal.getsignal(signal.SIGINT) is handler  # put back
    if signals == 1:  # the switch ran to its end and was reported, then the interrupt came through
        assert engine.version == n2 and torch.equal(module.w, v2["w"])
    else:  # the second one raised at once: the switch never started
        assert engine.version == n1 and torch.equal(module.w, v1["w"])
