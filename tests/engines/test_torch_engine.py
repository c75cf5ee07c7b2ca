"""The plain PyTorch adapter and the follow loop, against a real weightsync server: an nn.Module kept in place."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _serve import ServeProcess, serving

from weightsync import Publisher, Subscriber, errors
from weightsync.engines import SwitchReport, follow
from weightsync.engines.torch import TorchModule

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    root = tmp_path_factory.mktemp("torch-engine")
    with serving(["--data", str(root / "data")], log_path=root / "serve.log") as srv:
        yield srv


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))


def _trainer_versions(n: int) -> list[dict[str, torch.Tensor]]:
    """bf16 casts of fp32 masters after real AdamW steps: what a trainer publishes."""
    master = _net()
    opt = torch.optim.AdamW(master.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        out.append({k: v.detach().to(torch.bfloat16).clone() for k, v in master.state_dict().items()})
        x = torch.randn(16, 32, generator=gen)
        master(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return out


def _equal(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(v, state[k]) for k, v in module.state_dict().items())


def test_a_module_is_kept_on_each_version_in_place(server: ServeProcess, tmp_path: Path) -> None:
    model = "torch-inplace"
    versions = _trainer_versions(3)
    with Publisher(server.url, model, cache_dir=tmp_path / "pub") as pub:
        numbers = [pub.publish(v, step=i).version for i, v in enumerate(versions)]
    module = _net().to(torch.bfloat16)
    storage = {k: v.data_ptr() for k, v in module.state_dict().items()}
    with Subscriber(server.url, model, name="torch-replica") as sub:
        engine = TorchModule(module, sub)
        assert engine.held() is None
        first = engine.load(numbers[0])
        assert first.version == numbers[0] and _equal(module, versions[0])
        for number, state in zip(numbers[1:], versions[1:], strict=True):
            report = engine.switch(engine.prepare(number))
            assert (report.version, report.mode, engine.held()) == (number, "in-place", number)
            assert report.elements and report.elements > 0 and report.checked > 0
            assert _equal(module, state)
        assert {k: v.data_ptr() for k, v in module.state_dict().items()} == storage  # the module's own tensors
        x = torch.randn(2, 32).to(torch.bfloat16)
        reference = _net().to(torch.bfloat16)
        reference.load_state_dict(versions[-1])
        assert torch.equal(module(x), reference(x))
    with Subscriber(server.url, model, report=False) as reader:  # the replica's reports are sent by now
        ledger = reader.api.list_replicas(model, subscriber="torch-replica")
    assert ledger[0].version == numbers[-1] and (ledger[0].status, ledger[0].mode) == ("applied", "in-place")
    assert ledger[0].engine == "torch"


def test_a_version_that_adds_a_tensor_is_loaded_whole_or_refused(server: ServeProcess, tmp_path: Path) -> None:
    model = "torch-reload"
    v1, v2 = _trainer_versions(2)
    v2 = {**v2, "extra.bias": torch.zeros(8, dtype=torch.bfloat16)}
    with Publisher(server.url, model, cache_dir=tmp_path / "pub") as pub:
        n1 = pub.publish(v1).version
        n2 = pub.publish(v2).version
    with Subscriber(server.url, model, report=False) as sub:
        refusing = TorchModule(_net().to(torch.bfloat16), sub)
        refusing.load(n1)
        with pytest.raises(errors.ReloadRequired):
            refusing.switch(refusing.prepare(n2))
    with Subscriber(server.url, model, report=False) as sub:
        engine = TorchModule(_net().to(torch.bfloat16), sub, directory=tmp_path / "checkout")
        engine.load(n1)
        report = engine.switch(engine.prepare(n2))
        assert (report.mode, report.version, engine.version) == ("reload", n2, n2)
        assert torch.equal(engine.tensors["extra.bias"], v2["extra.bias"])
        assert torch.equal(engine.tensors["2.weight"], v2["2.weight"])


def test_follow_switches_to_each_new_head_until_count(server: ServeProcess, tmp_path: Path) -> None:
    model = "torch-follow"
    versions = _trainer_versions(3)
    with Publisher(server.url, model, cache_dir=tmp_path / "pub") as pub:
        pub.publish(versions[0])
        module = _net().to(torch.bfloat16)
        reports: list[SwitchReport] = []
        with Subscriber(server.url, model, name="follower") as sub:
            engine = TorchModule(module, sub)
            result: list[int | None] = []
            loop = threading.Thread(
                target=lambda: result.append(
                    follow(engine, sub, count=3, on_switch=reports.append, watch_timeout=2, stop=threading.Event())
                )
            )
            loop.start()
            _wait(lambda: len(reports) == 1)  # the head at start, loaded from nothing
            for state in versions[1:]:
                n = len(reports)
                pub.publish(state)
                _wait(lambda n=n: len(reports) > n)
            loop.join(60)
    assert not loop.is_alive() and result == [reports[-1].version]
    assert [r.mode for r in reports] == ["in-place"] * 3
    assert _equal(module, versions[-1])


def _wait(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
