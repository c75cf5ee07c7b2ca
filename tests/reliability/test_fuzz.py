"""Fuzzing every decoder of hostile bytes: only named errors escape, memory stays bounded (DESIGN invariant 6).

Targets (tests/reliability/_sec_fuzz.py): frames, delta containers (parsed and decoded
against the golden base), stored manifests, manifest JSON, safetensors headers and
commit records. Inputs are hypothesis-driven mutations of valid samples — bit flips,
truncations, insertions, extreme integers written over length fields, structural edits
of the JSON documents — resealed where an outer checksum would stop them early, plus
random bytes. Any exception that is not a ``WeightsyncError`` fails the test.

Budgets: bounded by default (CI), larger with ``--long``. The seed is fixed
(``WEIGHTSYNC_FUZZ_SEED``, default below) so a run is reproducible; the figures
(executions, crashes) are printed by ``test_fuzz_summary`` (run with ``-s``).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from collections import Counter
from pathlib import Path

import _sec_fuzz as fz
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from weightsync.codec import frame as fr
from weightsync.errors import WeightsyncError

SEED = int(os.environ.get("WEIGHTSYNC_FUZZ_SEED", "20261122"))
HERE = Path(__file__).resolve().parent
EXECUTIONS: Counter[str] = Counter()
CRASHES: Counter[str] = Counter()
SEEDS = fz.seeds()


def examples(long_run: bool, default: int) -> int:
    return default * 20 if long_run else default


def _run(name: str, data: bytes) -> None:
    """One input: success or a WeightsyncError; anything else is counted as a crash and re-raised."""
    EXECUTIONS[name] += 1
    try:
        fz.run_target(name, data)
    except Exception:
        CRASHES[name] += 1
        raise


# --- byte-level mutation ------------------------------------------------------------------------------------

EXTREMES = [
    0,
    1,
    2,
    3,
    7,
    63,
    64,
    65,
    255,
    256,
    2**16,
    2**31 - 1,
    2**31,
    2**32 - 1,
    2**32,
    (1 << 30),
    (1 << 30) + 2,
    2**62,
    2**63,
    2**64 - 1,
]


@st.composite
def mutated(draw, target: str) -> bytes:
    """A valid sample of `target` with 1–4 byte-level mutations, resealed or not."""
    buf = bytearray(draw(st.sampled_from(SEEDS[target])))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "int", "cut", "insert", "delete", "splice"]))
        n = len(buf)
        if op == "flip" and n:
            i = draw(st.integers(0, n - 1))
            buf[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and n:
            buf[draw(st.integers(0, n - 1))] = draw(st.integers(0, 255))
        elif op == "int" and n >= 8:
            i = draw(st.integers(0, n - 8))
            buf[i : i + 8] = struct.pack("<Q", draw(st.sampled_from(EXTREMES)))
        elif op == "cut":
            del buf[draw(st.integers(0, n)) :]
        elif op == "insert":
            i = draw(st.integers(0, n))
            buf[i:i] = draw(st.binary(min_size=1, max_size=32))
        elif op == "delete" and n:
            i = draw(st.integers(0, n - 1))
            del buf[i : i + draw(st.integers(1, 16))]
        elif op == "splice" and n:
            i, j = sorted(draw(st.integers(0, n)) for _ in range(2))
            k = draw(st.integers(0, n))
            buf[k:k] = buf[i:j]
    out = bytes(buf)
    if target == "frame" and draw(st.booleans()):
        out = fz.reseal_frame(out)
    return out


@st.composite
def frame_fields(draw) -> bytes:
    """A frame whose header fields are drawn (then sealed) over a random or golden payload."""
    payload = draw(
        st.one_of(st.binary(max_size=512), st.sampled_from(SEEDS["frame"]).map(lambda f: f[fr.HEADER_SIZE :]))
    )
    head = struct.pack(
        "<4sBBBBQQ16s16s",
        b"WSFR",
        draw(st.sampled_from([1, 1, 1, 0, 2, 255])),
        draw(st.integers(0, 255)),
        draw(st.integers(0, 24)),
        draw(st.integers(0, 4)),
        draw(st.one_of(st.sampled_from(EXTREMES), st.integers(0, 4096))),
        draw(st.one_of(st.just(len(payload)), st.sampled_from(EXTREMES))),
        draw(st.one_of(st.just(bytes(16)), st.binary(min_size=16, max_size=16))),
        draw(st.binary(min_size=16, max_size=16)),
    )
    return fz.reseal_frame(head + bytes(8) + payload)


@pytest.mark.parametrize("target", sorted(fz.TARGETS))
def test_mutated_samples_raise_only_named_errors(target: str, long_run: bool):
    @seed(SEED)
    @settings(
        max_examples=examples(long_run, 150),
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(mutated(target))
    def run(data: bytes) -> None:
        _run(target, data)

    run()


@pytest.mark.parametrize("target", sorted(fz.TARGETS))
def test_random_bytes_raise_only_named_errors(target: str, long_run: bool):
    magic = {
        "frame": b"WSFR\x01",
        "container": b"WSYNCDLT\x01\x00",
        "manifest": b"WSMF\x01\x00\x00\x00",
        "manifest_json": b'{"format":"weightsync.manifest","version":1,',
        "safetensors": b"",
        "record": b"WSCR\x01",
    }[target]

    @seed(SEED)
    @settings(max_examples=examples(long_run, 60), deadline=None, database=None)
    @given(st.binary(max_size=2048), st.booleans())
    def run(data: bytes, with_magic: bool) -> None:
        _run(target, magic + data if with_magic else data)

    run()


def test_frame_header_fields_raise_only_named_errors(long_run: bool):
    @seed(SEED)
    @settings(max_examples=examples(long_run, 300), deadline=None, database=None)
    @given(frame_fields())
    def run(data: bytes) -> None:
        _run("frame", data)

    run()


# --- structural mutation of the JSON documents ----------------------------------------------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.sampled_from(EXTREMES + [-1])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.sampled_from(
        [
            "",
            "..",
            "../../etc/passwd",
            "/abs",
            "a\x00b",
            ".weightsync/x",
            "F4",
            "BF16",
            "U8",
            "a" * 64,
            "0" * 32,
            "header",
            "tensor",
            "blob",
            "delta",
            "keyframe",
        ]
    ),
    lambda ch: st.lists(ch, max_size=4) | st.dictionaries(st.text(max_size=8), ch, max_size=4),
    max_leaves=8,
)


def _slots(node, out: list) -> list:
    """Every (container, key) in a JSON document, depth first."""
    if isinstance(node, dict):
        for k in list(node):
            out.append((node, k))
            _slots(node[k], out)
    elif isinstance(node, list):
        for i in range(len(node)):
            out.append((node, i))
            _slots(node[i], out)
    return out


@st.composite
def edited_document(draw, doc):
    """`doc` (deep-copied) with 1–3 structural edits: replace a value, delete a member, duplicate an element."""
    doc = json.loads(json.dumps(doc))
    for _ in range(draw(st.integers(1, 3))):
        slots = _slots(doc, [])
        if not slots:
            break
        parent, key = draw(st.sampled_from(slots))
        op = draw(st.sampled_from(["replace", "replace", "delete", "duplicate", "nudge"]))
        if op == "replace":
            parent[key] = draw(json_values)
        elif op == "delete":
            del parent[key]
        elif op == "duplicate" and isinstance(parent, list):
            parent.insert(key, json.loads(json.dumps(parent[key])))
        elif op == "nudge" and type(parent[key]) is int:
            parent[key] += draw(st.sampled_from([-(2**40), -2, -1, 1, 2, 2**40]))
    return doc


def _dumps(doc) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def test_edited_manifest_documents_raise_only_named_errors(long_run: bool):
    docs = [json.loads(m) for m in SEEDS["manifest_json"]]

    @seed(SEED)
    @settings(
        max_examples=examples(long_run, 300), deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
    )
    @given(st.sampled_from(range(len(docs))).flatmap(lambda i: edited_document(docs[i])), st.booleans())
    def run(doc, stored: bool) -> None:
        body = _dumps(doc)
        if stored:
            _run("manifest", fz.reseal_manifest(body))
        else:
            _run("manifest_json", body)

    run()


def test_edited_container_manifests_raise_only_named_errors(long_run: bool):
    """A container whose manifest was edited (and resealed): parse, then decode against the golden base."""
    from weightsync.codec.container import read_container

    manifest, area = read_container(SEEDS["container"][0])
    doc = manifest.to_dict()

    @seed(SEED)
    @settings(
        max_examples=examples(long_run, 150), deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
    )
    @given(edited_document(doc))
    def run(edited) -> None:
        _run("container", fz.reseal_container(fz.reseal_manifest(_dumps(edited)), bytes(area)))

    run()


def test_edited_safetensors_headers_raise_only_named_errors(long_run: bool):
    header = SEEDS["safetensors"][0]
    (n,) = struct.unpack("<Q", header[:8])
    doc = json.loads(header[8 : 8 + n])

    @seed(SEED)
    @settings(max_examples=examples(long_run, 300), deadline=None, database=None)
    @given(edited_document(doc), st.integers(0, 64))
    def run(edited, data_len: int) -> None:
        body = json.dumps(edited).encode()
        _run("safetensors", struct.pack("<Q", len(body)) + body + bytes(data_len))

    run()


def test_edited_commit_records_raise_only_named_errors(long_run: bool):
    rec = SEEDS["record"][0]
    doc = json.loads(rec[5:])

    @seed(SEED)
    @settings(max_examples=examples(long_run, 200), deadline=None, database=None)
    @given(edited_document(doc))
    def run(edited) -> None:
        _run("record", rec[:5] + _dumps(edited))

    run()


# --- deep nesting (found by this suite) ------------------------------------------------------------------------


def _nested(depth: int) -> bytes:
    return b'{"a":' * depth + b"1" + b"}" * depth


@pytest.mark.parametrize("target", ["manifest_json", "manifest", "safetensors", "record"])
def test_deeply_nested_json_is_a_named_error(target: str):
    """A few hundred KB of nested objects overflow the JSON parser's stack: a named error, not RecursionError."""
    body = _nested(100_000)  # 600 KB: under every cap (commit records: 1 MiB)
    data = {
        "manifest_json": body,
        "manifest": fz.reseal_manifest(body),
        "safetensors": struct.pack("<Q", len(body)) + body,
        "record": b"WSCR\x01" + body,
    }[target]
    with pytest.raises(WeightsyncError):
        fz.TARGETS[target](data)


# --- memory ---------------------------------------------------------------------------------------------------

MEMORY_BOUND = 256 << 20


def test_fuzzing_memory_is_bounded(long_run: bool):
    """A subprocess decodes thousands of mutated inputs (< 1 MiB each); its peak RSS grows by less than 256 MiB."""
    n = 2000 if long_run else 300
    out = subprocess.run(
        [sys.executable, str(HERE / "_sec_fuzz.py"), "memory", str(SEED), str(n)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=HERE,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"\nFIGURE fuzz-memory: {figures}")
    assert figures["largest_input"] < 1 << 20
    assert figures["rss_growth"] < MEMORY_BOUND, figures
    assert figures["tracemalloc_peak"] < MEMORY_BOUND, figures
    EXECUTIONS["memory-run"] += figures["executions"]


# --- atheris (optional) ----------------------------------------------------------------------------------------


def test_atheris_coverage_guided(tmp_path: Path, long_run: bool):
    """Coverage-guided libFuzzer run over every target (skipped without atheris); a crash fails the test."""
    pytest.importorskip("atheris")
    corpus = tmp_path / "corpus"
    subprocess.run(
        [sys.executable, str(HERE / "_sec_atheris.py"), "--write-corpus", str(corpus)],
        check=True,
        capture_output=True,
        timeout=120,
        cwd=HERE,
    )
    budget = ["-max_total_time=600"] if long_run else ["-runs=30000"]
    # Through a shell that forks it: a process started straight from pytest inherits pytest's peak RSS as
    # its own (Linux keeps the high-water mark across fork and exec), and libFuzzer's -rss_limit_mb reads
    # that peak: a test run whose pytest had grown past 1 GiB failed here with no input using the memory.
    out = subprocess.run(
        [
            "sh",
            "-c",
            '"$@"; exit $?',
            "sh",
            sys.executable,
            str(HERE / "_sec_atheris.py"),
            *budget,
            f"-seed={SEED % 2**31}",
            "-rss_limit_mb=1024",
            "-max_len=65536",
            f"-artifact_prefix={tmp_path}/",
            str(corpus),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=HERE,
    )
    log = out.stdout + out.stderr
    done = [line for line in log.splitlines() if line.startswith("Done ")]
    if out.returncode != 0:
        crashes = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(("crash-", "oom-", "leak-")))
        keep = HERE.parent.parent / ".fuzz-artifacts"
        for name in crashes:
            keep.mkdir(exist_ok=True)
            shutil.copy(tmp_path / name, keep / name)
        pytest.fail(f"atheris found a crash ({crashes}, copied to {keep}):\n{log[-4000:]}")
    assert done, log[-2000:]
    runs = int(done[-1].split()[1])
    EXECUTIONS["atheris"] += runs
    print(f"\nFIGURE fuzz-atheris: {done[-1]} (seed {SEED % 2**31})")


def test_fuzz_summary():
    """The figures: executions per target and crashes (every crash has already failed its test)."""
    total = sum(EXECUTIONS.values())
    print(
        f"\nFIGURE fuzz: {total} executions, {sum(CRASHES.values())} crashes, seed {SEED}; "
        + ", ".join(f"{k} {v}" for k, v in sorted(EXECUTIONS.items()))
    )
    assert not CRASHES, dict(CRASHES)
