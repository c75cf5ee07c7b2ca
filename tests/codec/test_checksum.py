"""The FORMAT v2 tensor checksum (FORMAT §10): its guarantees, its piecewise rule, and three equal implementations.

numpy (the definition), the C kernel and torch (weightsync.devsum, on the CPU here; the
same code runs on CUDA) must give the same value, and the committed test vectors.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightsync.codec.checksum import (
    CONSTANT,
    MAX_ELEMENTS,
    TensorSum,
    combine,
    lanes_of,
    reference_sum,
    tensor_sum,
)
from weightsync.errors import InvalidArgument

torch = pytest.importorskip("torch")
from weightsync import devsum  # noqa: E402  (needs torch)

GOLDEN = Path(__file__).resolve().parent.parent / "golden"
VECTORS = json.loads((GOLDEN / "checksum_vectors.json").read_text())
SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NUMPY_DTYPE = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


def vector_bytes(v: dict) -> bytes:
    if "data" in v:
        return bytes.fromhex(v["data"])
    return bytes((i * 131 + 7) % 256 for i in range(v["elements"] * v["width"]))


def all_sums(data: np.ndarray, width: int, start: int = 0) -> list[TensorSum]:
    """The checksum by every implementation: numpy, C (1 and 3 threads), torch."""
    t = torch.from_numpy(data.copy().view(NUMPY_DTYPE[width]))
    return [
        reference_sum(data, width, start=start),
        tensor_sum(data, width, start=start),
        tensor_sum(data, width, start=start, threads=3),
        devsum.tensor_sum(t, start=start, chunk=777),
    ]


def test_the_constant_is_the_specified_one():
    assert VECTORS["constant"] == f"0x{CONSTANT:016X}"


@pytest.mark.parametrize("v", VECTORS["vectors"], ids=lambda v: f"w{v['width']}-n{v['elements']}-s{v['start']}")
def test_vectors(v):
    data = np.frombuffer(vector_bytes(v), dtype=np.uint8)
    for s in all_sums(data, v["width"], v["start"]):
        assert s.hex() == v["checksum"]
        assert [f"{x:016x}" for x in s.lanes] == v["lanes"]
    assert TensorSum.from_digest(v["width"], bytes.fromhex(v["checksum"])).hex() == v["checksum"]


@st.composite
def tensor(draw, min_elements=0):
    width = draw(st.sampled_from([1, 2, 4, 8]))
    n = draw(st.integers(min_elements, 5000))
    seed = draw(st.integers(0, 2**32 - 1))
    data = np.random.default_rng(seed).integers(0, 256, n * width, dtype=np.uint8)
    if draw(st.booleans()):
        data[: len(data) // 2] = 0  # runs of zeros: C must still weigh them
    return width, data


@SETTINGS
@given(tensor(), st.integers(0, 2**64 - 1))
def test_every_implementation_agrees(t, start):
    width, data = t
    start = min(start, 2**64 - 1 - len(data) // width)
    sums = all_sums(data, width, start)
    assert all(s == sums[0] for s in sums)
    assert len(sums[0].lanes) == lanes_of(width) and sums[0].count == len(data) // width


@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("word", [0x0000, 0xFFFF, 0x8000, 0x7FFF, 0x00FF, 0xFF00])
def test_words_at_the_ends_of_their_range_sum_alike(width, word):
    """Every word the same extreme value, over several 4 KiB blocks and a tail: the C loop for
    2-byte elements sums sign-flipped pairs and recovers the odd words mod 2^32 (_kernels_sum.h)."""
    n = 5 * 4096 // width + 3
    data = np.full(n * width // 2 if width > 1 else n, word, dtype="<u2" if width > 1 else np.uint16)
    data = data.view(np.uint8)[: n * width] if width > 1 else (data & 0xFF).astype(np.uint8)
    for start in (0, (1 << 40) + 1):
        sums = all_sums(data, width, start)
        assert all(x == sums[0] for x in sums)


@SETTINGS
@given(tensor(min_elements=1), st.data())
def test_a_change_of_any_one_element_is_detected(t, data):
    width, arr = t
    n = len(arr) // width
    i = data.draw(st.integers(0, n - 1))
    before = tensor_sum(arr, width)
    changed = arr.copy()
    j = data.draw(st.integers(0, width - 1))  # any byte of the element: every word feeds a lane
    changed[i * width + j] ^= data.draw(st.integers(1, 255))
    assert tensor_sum(changed, width) != before
    assert reference_sum(changed, width) != before


@SETTINGS
@given(tensor(min_elements=2), st.data())
def test_a_swap_of_two_different_elements_is_detected(t, data):
    width, arr = t
    n = len(arr) // width
    i, j = data.draw(st.lists(st.integers(0, n - 1), min_size=2, max_size=2, unique=True))
    a, b = arr[i * width : (i + 1) * width].copy(), arr[j * width : (j + 1) * width].copy()
    if np.array_equal(a, b):
        arr[i * width] ^= 1
        a = arr[i * width : (i + 1) * width].copy()
    before = tensor_sum(arr, width)
    swapped = arr.copy()
    swapped[i * width : (i + 1) * width], swapped[j * width : (j + 1) * width] = b, a
    assert tensor_sum(swapped, width) != before


@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_swaps_far_apart_and_of_the_hardest_values_are_detected(width):
    # Worst case of the proof (FORMAT §10.3): values differing by 2^15 in one 16-bit word
    # (2^7 for bytes) at positions 2^47 apart still change the sum; pieces at their starts
    # stand for the two ends of a tensor of 2^48 elements.
    a = np.zeros(width, dtype=np.uint8)
    b = a.copy()
    b[-1] = 0x80  # top bit of the element's last word
    far = MAX_ELEMENTS // 2 - 1
    original = tensor_sum(a, width, start=0) + tensor_sum(b, width, start=far)
    swapped = tensor_sum(b, width, start=0) + tensor_sum(a, width, start=far)
    assert original != swapped


def test_the_swap_guarantee_ends_where_the_format_says():
    # At distance 2^48 the weights differ by 2^49: times 2^15 that is 0 mod 2^64. Documented, not hidden.
    a = np.zeros(2, dtype=np.uint8)
    b = np.array([0, 0x80], dtype=np.uint8)
    original = tensor_sum(a, 2, start=0) + tensor_sum(b, 2, start=MAX_ELEMENTS)
    swapped = tensor_sum(b, 2, start=0) + tensor_sum(a, 2, start=MAX_ELEMENTS)
    assert original == swapped


@SETTINGS
@given(tensor(min_elements=1), st.integers(1, 50))
def test_truncation_and_extension_are_detected(t, cut):
    width, arr = t
    n = len(arr) // width
    whole = tensor_sum(arr, width)
    shorter = tensor_sum(arr[: max(0, n - cut) * width], width)
    assert shorter != whole
    longer = tensor_sum(np.concatenate([arr, np.zeros(cut * width, np.uint8)]), width)
    assert longer != whole


@SETTINGS
@given(tensor(), st.lists(st.integers(0, 5000), max_size=6))
def test_parts_at_their_positions_sum_to_the_whole(t, cuts):
    width, arr = t
    n = len(arr) // width
    bounds = sorted({0, n, *(min(c, n) for c in cuts)})
    parts = [tensor_sum(arr[a * width : b * width], width, start=a) for a, b in zip(bounds, bounds[1:], strict=False)]
    whole = tensor_sum(arr, width)
    assert combine(parts or [TensorSum.empty(width)]) == whole
    # torch computes parts of a tensor the same way (tensor-parallel slices, chunks)
    tt = torch.from_numpy(arr.copy().view(NUMPY_DTYPE[width]))
    tparts = [devsum.tensor_sum(tt[a:b], start=a) for a, b in zip(bounds, bounds[1:], strict=False)]
    assert combine(tparts or [TensorSum.empty(width)]) == whole


def test_a_part_at_the_wrong_position_is_detected():
    arr = np.zeros(64, dtype=np.uint8)  # zeros: only the constant makes position matter
    right = tensor_sum(arr[:32], 2, start=0) + tensor_sum(arr[32:], 2, start=16)
    wrong = tensor_sum(arr[:32], 2, start=0) + tensor_sum(arr[32:], 2, start=17)
    assert right == tensor_sum(arr, 2) and wrong != right


def test_torch_sums_any_dtype_from_its_bytes():
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.bool, torch.float8_e4m3fn):
        t = (torch.randn(37, 11) * 10).to(dtype)
        raw = t.contiguous().view(-1).view(torch.uint8).numpy()
        assert devsum.tensor_sum(t) == tensor_sum(raw, t.element_size())
        assert devsum.tensor_sum(t.t()) == tensor_sum(
            t.t().contiguous().view(-1).view(torch.uint8).numpy(), t.element_size()
        )


def test_bad_arguments_are_named_errors():
    with pytest.raises(InvalidArgument):
        tensor_sum(np.zeros(3, np.uint8), 2)
    with pytest.raises(InvalidArgument):
        tensor_sum(np.zeros(4, np.uint8), 3)
    with pytest.raises(InvalidArgument):
        tensor_sum(np.zeros(4, np.uint8), 2, start=-1)
    with pytest.raises(InvalidArgument):
        TensorSum.from_digest(4, bytes(16))
    with pytest.raises(InvalidArgument):
        TensorSum.empty(2) + TensorSum.empty(4)
    with pytest.raises(InvalidArgument):
        combine([])


_TRITON_DIFFERENTIAL = """
import sys, torch
from weightsync import devsum, devsum_triton
from weightsync.codec.checksum import lanes_of, tensor_sum
gen = torch.Generator().manual_seed(int(sys.argv[1]))
B = devsum_triton.BLOCK
for dtype in (torch.uint8, torch.bfloat16, torch.int16, torch.float32, torch.float64):
    width = torch.tensor([], dtype=dtype).element_size()
    for n in (1, 7, B - 1, B, B + 1, 3 * B + 77):
        t = torch.randint(0, 256, (n * width,), generator=gen, dtype=torch.uint8).view(dtype)
        got = devsum_triton.moments(t, lanes_of(width))
        want = devsum._torch_moments(t, devsum.DEFAULT_CHUNK)
        assert torch.equal(got, want), (dtype, n, got.tolist(), want.tolist())
print("agree")
"""


@pytest.mark.parametrize("seed", [0, 1])
def test_the_triton_kernel_gives_the_torch_paths_moments(seed: int) -> None:
    """devsum_triton.py against the torch path (the reference), through Triton's interpreter on the CPU (a GPU
    box runs the same kernel compiled: benchmarks/device_probe.py checks it against the CPU kernels there)."""
    import importlib.util
    import os
    import subprocess
    import sys

    if importlib.util.find_spec("triton") is None:  # not imported here: it would grow every later test's process
        pytest.skip("needs triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run(
        [sys.executable, "-c", _TRITON_DIFFERENTIAL, str(seed)], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and out.stdout.strip() == "agree", out.stderr[-2000:]


def test_a_triton_kernel_that_disagrees_or_cannot_run_leaves_the_torch_path(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """devsum._check_triton: the kernel is used only where it gives the torch path's moments."""
    from weightsync import devsum_triton

    monkeypatch.setattr(devsum_triton, "available", lambda: True)
    cpu = torch.device("cpu")
    monkeypatch.setattr(devsum_triton, "moments", lambda t, lanes: devsum._torch_moments(t, devsum.DEFAULT_CHUNK))
    assert devsum._check_triton(cpu, 2) is True
    monkeypatch.setattr(devsum_triton, "moments", lambda t, lanes: devsum._torch_moments(t, devsum.DEFAULT_CHUNK) + 1)
    with caplog.at_level("WARNING", logger="weightsync.devsum"):
        assert devsum._check_triton(cpu, 2) is False
    assert "disagrees" in caplog.text

    def broken(t: torch.Tensor, lanes: int) -> torch.Tensor:
        raise RuntimeError("no GPU here")

    monkeypatch.setattr(devsum_triton, "moments", broken)
    assert devsum._check_triton(cpu, 2) is False
    monkeypatch.setattr(devsum_triton, "available", lambda: False)
    assert devsum._check_triton(cpu, 2) is False
