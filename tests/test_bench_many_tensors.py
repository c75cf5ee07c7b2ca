"""`benchmarks/many_tensors.py`: every stage runs and the decoded version is the published one, byte for byte."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the benchmarks package lives at the repo root

from benchmarks import many_tensors  # noqa: E402


def test_every_stage_is_timed_and_the_decode_is_exact(capsys) -> None:
    got = many_tensors.run(300)
    assert list(got) == ["open", "encode", "pack", "manifest encode", "manifest parse", "decode"]
    assert all(v >= 0 for v in got.values())
    assert many_tensors.main(["--counts", "10", "20"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 1") or line.startswith("| 2")]
    assert [r.split("|")[1].strip() for r in rows] == ["10", "20"]


def test_a_decode_that_differs_is_an_error(monkeypatch) -> None:
    """The bench checks what it measures: a decoder that writes other bytes fails it."""
    from weightsync.codec.decoder import Decoder

    real = Decoder.decode

    def wrong(self, manifest, read_frame, outputs, base=None, **kw):
        real(self, manifest, read_frame, outputs, base, **kw)
        outputs[0][-1] ^= 1

    monkeypatch.setattr(Decoder, "decode", wrong)
    with pytest.raises(AssertionError, match="differs"):
        many_tensors.run(40)


def test_the_sdk_probe_times_every_stage_and_checks_the_live_tensors(capsys) -> None:
    got = many_tensors.sdk_run(30, elements=64, versions=3)
    assert list(got) == ["publish", "prepare", "apply", "pause", "prepare + apply", "reload"]
    assert all(v >= 0 for v in got.values())
    assert got["pause"] <= got["apply"]
    assert many_tensors.main(["--sdk", "--counts", "12", "--elements", "32", "--versions", "3"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 12 ")]
    assert len(rows) == 1 and rows[0].endswith("x |")


def test_the_sdk_probe_fails_when_the_live_tensors_miss_an_update(monkeypatch) -> None:
    from weightsync.client import Subscriber

    real = Subscriber.apply
    calls = []

    def skip_the_last(self, tensors, prepared, **kw):
        calls.append(prepared.target)
        if len(calls) == 2:  # the second update never lands: the tensors stay a version behind
            self.version = prepared.target
            return 0.0
        return real(self, tensors, prepared, **kw)

    monkeypatch.setattr(Subscriber, "apply", skip_the_last)
    with pytest.raises(AssertionError, match="differs from the last version"):
        many_tensors.sdk_run(20, elements=64, versions=3)
