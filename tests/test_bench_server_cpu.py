"""`benchmarks/server_cpu.py`: the server's CPU per request kind, read from /proc, over a real server."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
from _ckpt import safetensors_file
from _pg import fresh_database
from _versions import model_files, next_step

from weightsync.codec.safetensors import parse_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the benchmarks package lives at the repo root

from benchmarks import server_cpu  # noqa: E402

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads CPU time from /proc")


def _versions(root: Path) -> list[Path]:
    tensors = model_files(seed=3)
    out = []
    for i in range(2):
        d = root / f"v{i}"
        d.mkdir()
        (d / "model.safetensors").write_bytes(safetensors_file(tensors))
        out.append(d)
        tensors = next_step(tensors, seed=i)
    return out


def test_process_cpu_counts_the_cpu_a_process_burns() -> None:
    before = server_cpu.process_cpu(os.getpid())
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
    assert server_cpu.process_cpu(os.getpid()) - before >= 0.2  # clock ticks of 10 ms: a margin
    with pytest.raises(FileNotFoundError):
        server_cpu.process_cpu(2**22 + 1)  # above the kernel's pid_max default: no such process


def test_each_publish_content_is_its_version_with_one_byte_of_tensor_data_changed(tmp_path: Path) -> None:
    versions = _versions(tmp_path)
    files = [(v / "model.safetensors").read_bytes() for v in versions]
    start = parse_file(files[0]).header_len
    content = server_cpu.contents(versions)
    made = [content(k) for k in range(40)]
    assert len(set(made)) == len(made)  # no two publishes alike: their objects are new to the store
    for k, data in enumerate(made):
        base = files[k % 2]
        assert len(data) == len(base) and data[:start] == base[:start]  # the header (and so the tensors) kept
        changed = [i for i in range(start, len(base)) if data[i] != base[i]]
        assert len(changed) == 1 and data[changed[0]] ^ base[changed[0]] == 1
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.safetensors", "b.safetensors"):
        (two / name).write_bytes(files[0])
    with pytest.raises(ValueError, match="one safetensors file"):
        server_cpu.contents([two, versions[1]])


def test_every_request_kind_is_measured_on_a_real_server(tmp_path: Path) -> None:
    got = server_cpu.run(_versions(tmp_path), requests=4, publishes=3, rounds=2, watchers=3)
    assert list(got) == ["healthz", "plan", "plan_other", "publish", "watch"]
    watch = got.pop("watch")  # every follower answered 200 with the new version in each round (else it raises)
    assert watch["followers"] == 3 and len(watch["rounds_answered_ms"]) == 2
    assert all(a > 0 for a in watch["rounds_answered_ms"]) and watch["idle_core_share"] >= 0
    for kind, f in got.items():
        assert len(f["rounds_cpu_ms"]) == 2, kind
        assert f["wall_ms"] > 0 and all(c >= 0 for c in f["rounds_cpu_ms"]), kind
    # A publish does work on the server (hashing, fsync'd writes, three transactions): some CPU shows.
    assert max(got["publish"]["rounds_cpu_ms"]) > 0
    assert got["publish"]["one_request"] is True  # a small delta goes as one publishVersion


@pytest.mark.postgres
def test_on_postgresql_followers_are_measured_announcing_and_polling(tmp_path: Path) -> None:
    with fresh_database() as url:
        got = server_cpu.run(_versions(tmp_path), requests=1, publishes=1, rounds=1, watchers=2, catalog=url)
    assert {"watch", "watch_polling"} <= set(got)  # each raises unless every follower had the new version
    for key in ("watch", "watch_polling"):
        assert got[key]["followers"] == 2 and len(got[key]["rounds_answered_ms"]) == 1


def test_a_delta_too_large_for_one_request_is_measured_as_it_goes(tmp_path: Path, monkeypatch) -> None:
    """A delta the publisher sends as begin, uploads and commit (here: no part may go in one request) is
    timed all the same, and said to have gone that way."""
    from weightsync.client import Publisher

    real = Publisher.__init__

    def several_requests(self, *args, **kw):
        real(self, *args, **{**kw, "inline_bytes": 0})

    monkeypatch.setattr(Publisher, "__init__", several_requests)
    got = server_cpu.run(_versions(tmp_path), requests=1, publishes=2, rounds=1, watchers=1)
    assert got["publish"]["one_request"] is False and got["publish"]["wall_ms"] > 0


def test_a_publish_that_is_not_a_delta_in_one_request_fails_the_probe(tmp_path: Path, monkeypatch) -> None:
    """The probe checks what it measures: a publisher that sends keyframes is refused, not timed."""
    from weightsync.client import Publisher

    real = Publisher.publish

    def keyframes(self, source, **kw):
        return real(self, source, **{**kw, "keyframe": True})

    monkeypatch.setattr(Publisher, "publish", keyframes)
    with pytest.raises(AssertionError, match="wanted a delta, got a keyframe"):
        server_cpu.run(_versions(tmp_path), requests=1, publishes=1, rounds=1, watchers=1)


def test_counts_below_one_are_refused() -> None:
    with pytest.raises(SystemExit) as exc:
        server_cpu.main(["--rounds", "0"])
    assert exc.value.code == 2
