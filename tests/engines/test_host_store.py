"""The host store (engines/host_store.py) against a real weightsync server: one worker per host makes each version.

No engine needed: workers are threads with their own Subscriber, the host a temporary directory.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from _serve import ServeProcess, serving

from weightsync import Publisher, Subscriber
from weightsync.engines.host_store import KEEP, HostStore, HostVersion

torch = pytest.importorskip("torch")
MODEL = "host-store"


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServeProcess, list[int], list[dict]]]:
    """Five versions of bf16 tensors made by AdamW steps, published (deltas after the first)."""
    root = tmp_path_factory.mktemp("host-store")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 16))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    states = []
    for _ in range(5):
        states.append({k: v.detach().to(torch.bfloat16).clone() for k, v in net.state_dict().items()})
        net(torch.randn(8, 64)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    with serving(["--data", str(root / "data")], log_path=root / "serve.log") as srv:
        with Publisher(srv.url, MODEL, cache_dir=root / "pub") as pub:
            numbers = [pub.publish(s, step=i).version for i, s in enumerate(states)]
        yield srv, numbers, states


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def _get_all(store_dir: Path, url: str, version: int, workers: int) -> list[tuple[HostVersion, bool]]:
    """``workers`` threads, each with its own subscriber, get ``version`` from one host store at once."""
    results: list[tuple[HostVersion, bool] | None] = [None] * workers
    start = threading.Barrier(workers)

    def run(i: int) -> None:
        with Subscriber(url, MODEL, name=f"w{i}", report=False) as sub:
            start.wait()
            results[i] = HostStore(store_dir, MODEL).get(sub, version)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r is not None for r in results)
    return [r for r in results if r is not None]


def test_one_worker_makes_each_version_and_records_its_changed_elements(published, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    srv, numbers, states = published
    previous = None
    for number, state in zip(numbers, states, strict=True):
        got = _get_all(tmp_path, srv.url, number, 4)
        assert sum(made for _, made in got) == 1  # exactly one of the four made it; the others read it
        version = got[0][0]
        assert version.base == previous and (version.bytes > 0)
        for name, t in state.items():
            assert np.array_equal(version.array(name), _bits(t)), name  # the version's bytes
            changes = version.changes(name)
            if previous is None:
                assert changes is None  # made from nothing: no base to differ from
                continue
            assert changes is not None
            old = _bits(states[numbers.index(previous)][name]).reshape(-1)
            new = _bits(t).reshape(-1)
            positions, values = changes
            assert np.array_equal(positions, np.flatnonzero(old != new))  # exactly the changed elements
            assert np.array_equal(values, new[positions])
        previous = number
    assert HostStore(tmp_path, MODEL).versions() == sorted(numbers, reverse=True)[:KEEP]  # older ones removed


def test_a_dropped_version_is_made_again_by_the_next_worker(published, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    srv, numbers, _ = published
    store = HostStore(tmp_path, MODEL)
    _get_all(tmp_path, srv.url, numbers[0], 2)
    ((first, made),) = _get_all(tmp_path, srv.url, numbers[1], 1)
    assert made and first.base == numbers[0]
    recorded = (first.path / "changes.bin").read_bytes()
    store.drop(numbers[1])
    assert store.versions() == [numbers[0]]
    ((again, made),) = _get_all(tmp_path, srv.url, numbers[1], 1)
    assert made and again.base == numbers[0]
    assert (again.path / "changes.bin").read_bytes() == recorded
