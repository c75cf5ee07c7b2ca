"""`benchmarks.codec_bench.machine`: the machine line every benchmark's results name."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the benchmarks package lives at the repo root

from benchmarks import codec_bench  # noqa: E402


def test_the_line_names_cores_and_python() -> None:
    line = codec_bench.machine()
    assert f"{os.cpu_count()} cores" in line
    assert f"Python {platform.python_version()}" in line


def test_vcpu_packing_is_named_where_the_kernel_has_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    knob = tmp_path / "sched_vcpu_pack"
    monkeypatch.setattr(codec_bench, "VCPU_PACK", knob)
    assert codec_bench.vcpu_pack() is None
    assert "vCPU packing" not in codec_bench.machine()
    knob.write_text("15\n")
    assert codec_bench.vcpu_pack() == "15"
    assert "vCPU packing 15" in codec_bench.machine()


def test_an_unreadable_packing_knob_is_named_as_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codec_bench, "VCPU_PACK", tmp_path)  # a directory: reading it fails, as without permission
    assert codec_bench.vcpu_pack() == "set"
