"""Fuzz targets and seed inputs for every decoder of hostile bytes (docs/FORMAT.md; DESIGN invariant 6).

Each target takes bytes and must either succeed or raise a :class:`WeightsyncError`;
anything else escaping is a bug. The same targets serve the hypothesis tests
(test_fuzz.py), the memory-bound subprocess (``python _sec_fuzz.py memory``) and the
optional coverage-guided atheris run (``python _sec_fuzz.py atheris``).

Targets go past the cheap outer checks on purpose: :func:`reseal_frame` recomputes a
mutated frame header's checksum and :func:`reseal_manifest` re-wraps mutated JSON in a
valid envelope, so mutations reach the section, plane and cross-reference checks.
"""

from __future__ import annotations

import json
import random
import struct
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
GOLDEN = HERE.parent / "golden"
for _p in (str(HERE.parent), str(HERE.parent.parent / "src")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import numpy as np  # noqa: E402
import xxhash  # noqa: E402
import zstandard  # noqa: E402

from weightsync.codec import frame as fr  # noqa: E402
from weightsync.codec import safetensors as stf  # noqa: E402
from weightsync.codec.checkpoint import Checkpoint  # noqa: E402
from weightsync.codec.container import read_container  # noqa: E402
from weightsync.codec.encoder import Decoder  # noqa: E402
from weightsync.codec.manifest import ENVELOPE_SIZE, Manifest  # noqa: E402
from weightsync.codec.manifest import MAGIC as MANIFEST_MAGIC  # noqa: E402
from weightsync.errors import WeightsyncError  # noqa: E402
from weightsync.ops.records import CommitRecord  # noqa: E402

# Decoding a fuzzed frame or container touches at most this many output bytes; a declared
# size beyond it is still parsed and checked, just not decoded into memory here.
MAX_DECODE = 8 << 20


# --- seeds ---------------------------------------------------------------------------------------------


def golden_frames() -> dict[str, tuple[bytes, bytes | None]]:
    """Golden frame name → (frame bytes, base bytes or None)."""
    index = json.loads((GOLDEN / "index.json").read_text())
    out = {}
    for e in index["frames"]:
        base = None if e["base"] is None else (GOLDEN / e["base"]).read_bytes()
        out[e["frame"]] = ((GOLDEN / e["frame"]).read_bytes(), base)
    return out


def golden_container() -> bytes:
    return (GOLDEN / "dir.wsd").read_bytes()


_BASE_CK: Checkpoint | None = None


def golden_base() -> Checkpoint:
    global _BASE_CK
    if _BASE_CK is None:
        base = GOLDEN / "dir.base"
        _BASE_CK = Checkpoint.from_bytes({p.name: p.read_bytes() for p in sorted(base.iterdir()) if p.is_file()})
    return _BASE_CK


def sample_manifests() -> list[Manifest]:
    """A delta manifest (of the golden container) and a keyframe manifest with store objects."""
    delta, _ = read_container(golden_container())
    from _ckpt import safetensors_file

    from weightsync.codec import Encoder

    rng = np.random.default_rng(3)
    data = safetensors_file(
        {
            "w": ("BF16", (64,), rng.integers(0, 256, 128, dtype=np.uint8)),
            "b": ("F32", (4,), rng.integers(0, 256, 16, dtype=np.uint8)),
        }
    )
    ck = Checkpoint.from_bytes({"m.safetensors": data, "config.json": b"{}"})
    key = Encoder().encode(ck, None).with_locations(lambda i, f: ("a" * 64, i * 100))
    key.model, key.number, key.parent, key.step = "policy-x", 1, None, 3
    return [delta, key]


def sample_safetensors_header() -> bytes:
    return stf.serialize_header(
        [("a", "BF16", (4, 4), 32), ("b", "F32", (3,), 12), ("c", "F4", (8,), 4)], {"format": "pt"}
    )


def sample_record() -> bytes:
    return CommitRecord(
        model="policy-x",
        number=3,
        parent=2,
        kind="delta",
        chain_base=1,
        manifest="b" * 64,
        step=1200,
        metadata={"run": "a"},
        committed_at=datetime(2026, 11, 22, 1, 2, 3, tzinfo=UTC),
    ).encode()


def seeds() -> dict[str, list[bytes]]:
    """Valid samples per target, to mutate."""
    frames = golden_frames()
    manifests = sample_manifests()
    header = sample_safetensors_header()
    return {
        "frame": [f for f, _ in frames.values()],
        "container": [golden_container()],
        "manifest": [m.encode() for m in manifests],
        "manifest_json": [m.to_json() for m in manifests],
        "safetensors": [header + bytes(48)],
        "record": [sample_record()],
    }


# --- resealing: mutations that get past the outer checksum ----------------------------------------------


def reseal_frame(data: bytes) -> bytes:
    """``data`` with its frame header checksum (bytes 56–63) recomputed, when it is long enough."""
    if len(data) < fr.HEADER_SIZE:
        return data
    head = bytes(data[: fr.HEADER_SIZE - 8])
    return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head)) + bytes(data[fr.HEADER_SIZE :])


def reseal_manifest(body: bytes) -> bytes:
    """JSON bytes wrapped as a stored manifest (FORMAT §5.1) with a valid envelope and checksum."""
    packed = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(body)
    return struct.pack("<4sBBHQQ", MANIFEST_MAGIC, 1, 0, 0, len(body), xxhash.xxh3_64_intdigest(body)) + packed


def reseal_container(manifest_stored: bytes, area: bytes) -> bytes:
    return (
        struct.pack("<8sHHIQQ", b"WSYNCDLT", 1, 0, 0, len(manifest_stored), xxhash.xxh3_64_intdigest(manifest_stored))
        + manifest_stored
        + area
    )


# --- targets ---------------------------------------------------------------------------------------------


def target_frame(data: bytes) -> None:
    """parse_header, then decode into a zero or golden base of the declared length (bounded)."""
    head = fr.parse_header(data)
    if head.raw_len > MAX_DECODE:
        # Still exercised: a wrong-sized target must be refused before anything is decoded.
        try:
            fr.apply_frame(data, np.zeros(16, dtype=np.uint8))
        except WeightsyncError:
            return
        raise AssertionError("a frame was applied to a target of the wrong length")
    base = np.zeros(head.raw_len, dtype=np.uint8) if head.delta else None
    try:
        fr.decode_frame(data, base)
    except WeightsyncError:
        pass
    if head.delta:  # skip the base check: reach the payload decoding of every delta
        target = np.zeros(head.raw_len, dtype=np.uint8)
        before = target.copy()
        try:
            fr.apply_frame(data, target, verify_base=False)
        except WeightsyncError:
            # FORMAT §4.2: a failed apply leaves the target as it was.
            assert np.array_equal(target, before), "a failed delta apply modified its target"


def target_container(data: bytes) -> None:
    """read_container, then decode against the golden base in memory (bounded output sizes)."""
    manifest, area = read_container(data)
    if sum(f.size for f in manifest.files) > MAX_DECODE:
        return
    outputs = [np.zeros(f.size, dtype=np.uint8) for f in manifest.files]

    def read_frame(ref):
        return area[ref.offset : ref.offset + ref.length]

    Decoder(threads=1).decode(manifest, read_frame, outputs, golden_base(), verify_segments=True)


def target_manifest(data: bytes) -> None:
    m = Manifest.decode(data)
    again = Manifest.decode(m.encode())  # whatever parses must survive its own round trip
    assert again.to_json() == m.to_json()


def target_manifest_json(data: bytes) -> None:
    Manifest.parse(data)


def target_safetensors(data: bytes) -> None:
    """Both entry points: the length prefix alone, and the full header against a plausible file size."""
    for size in (len(data), len(data) + 64, 1 << 40):
        try:
            total = stf.header_length(data[:8], size)
        except WeightsyncError:
            continue
        stf.parse(data[:total], size)
    # A .safetensors file that fails validation is carried as a blob, never an error.
    Checkpoint.from_bytes({"x.safetensors": data})


def target_record(data: bytes) -> None:
    CommitRecord.decode(data)


TARGETS: dict[str, Callable[[bytes], None]] = {
    "frame": target_frame,
    "container": target_container,
    "manifest": target_manifest,
    "manifest_json": target_manifest_json,
    "safetensors": target_safetensors,
    "record": target_record,
}


def run_target(name: str, data: bytes) -> bool:
    """Run one input; True if it was accepted, False if refused by name; anything else propagates."""
    try:
        TARGETS[name](data)
        return True
    except WeightsyncError:
        return False


# --- a plain mutator (memory run and atheris seeds) --------------------------------------------------


def mutate(rng: random.Random, data: bytes, target: str) -> bytes:
    """One random structural or byte-level mutation of ``data``, resealed where the target has an outer check."""
    buf = bytearray(data)
    op = rng.randrange(7)
    if op == 0 and buf:  # bit flips
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(buf))
            buf[i] ^= 1 << rng.randrange(8)
    elif op == 1 and buf:  # truncate
        del buf[rng.randrange(len(buf)) :]
    elif op == 2:  # insert random bytes
        i = rng.randrange(len(buf) + 1)
        buf[i:i] = rng.randbytes(rng.randint(1, 16))
    elif op == 3 and len(buf) >= 8:  # overwrite a little-endian integer with an extreme value
        i = rng.randrange(len(buf) - 7)
        buf[i : i + 8] = struct.pack(
            "<Q", rng.choice([0, 1, 2**31, 2**32 - 1, 2**32, 2**62, 2**64 - 1, 1 << 30, (1 << 30) + 1])
        )
    elif op == 4:
        buf = bytearray(rng.randbytes(rng.randint(0, 256)))
    elif op == 5 and buf:  # splice with itself
        i, j = sorted(rng.randrange(len(buf) + 1) for _ in range(2))
        buf[i:i] = buf[i:j]
    elif buf:
        i = rng.randrange(len(buf))
        buf[i] = rng.choice([0, 0xFF, 0x7F, 0x80, ord("-"), ord("9"), ord('"'), ord("[")])
    out = bytes(buf)
    if target == "frame" and rng.random() < 0.7:
        out = reseal_frame(out)
    elif target == "manifest" and rng.random() < 0.5:
        out = reseal_manifest(out[ENVELOPE_SIZE:] if len(out) > ENVELOPE_SIZE else out)
    return out


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def memory_run(seed: int, n: int) -> dict:
    """Run ``n`` mutated inputs per target in this process; return peak-memory figures in bytes
    (Linux: peak RSS over the resident size at the start, and tracemalloc's peak)."""
    import tracemalloc

    rng = random.Random(seed)
    corpus = seeds()
    # Reset the peak first: ru_maxrss would still hold the forking parent's size (it survives exec).
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    rss0 = _status_kib("VmRSS")
    tracemalloc.start()
    executed = accepted = 0
    biggest = 0
    for name, samples in corpus.items():
        for _ in range(n):
            data = mutate(rng, rng.choice(samples), name)
            if len(data) >= 1 << 20:
                continue
            biggest = max(biggest, len(data))
            accepted += run_target(name, data)
            executed += 1
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    rss1 = _status_kib("VmHWM")
    return {
        "seed": seed,
        "executions": executed,
        "accepted": accepted,
        "largest_input": biggest,
        "tracemalloc_peak": peak,
        "rss_growth": max(0, rss1 - rss0) * 1024,
    }


# --- atheris ----------------------------------------------------------------------------------------------


def atheris_main(argv: list[str]) -> None:
    """Coverage-guided run over every target; the first input byte picks the target."""
    import atheris

    names = sorted(TARGETS)

    def one(data: bytes) -> None:
        if not data:
            return
        run_target(names[data[0] % len(names)], data[1:])

    atheris.Setup(argv, one)
    atheris.Fuzz()


def write_atheris_corpus(directory: Path) -> int:
    names = sorted(TARGETS)
    directory.mkdir(parents=True, exist_ok=True)
    n = 0
    for name, samples in seeds().items():
        for i, s in enumerate(samples):
            (directory / f"{name}-{i}").write_bytes(bytes([names.index(name)]) + s)
            n += 1
    return n


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "memory":
        print(json.dumps(memory_run(int(sys.argv[2]), int(sys.argv[3]))))
    else:
        raise SystemExit("usage: _sec_fuzz.py memory SEED N  (the atheris run is _sec_atheris.py)")
