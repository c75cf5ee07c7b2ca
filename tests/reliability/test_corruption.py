"""Corruption at rest and in transit is always detected by a pull, never served as good (DESIGN invariants 1, 4).

A real ``weightsync serve`` holds two versions of a model (a keyframe and a delta, several
objects each). Each case damages one thing — a data object of v2 or v2's manifest — in one
way, either **at rest** (the store's file rewritten behind the store's back, as disk rot
would) or **in transit** (a loopback proxy between the SDK and the server damages the
answer), then pulls v2 with the SDK into a fresh directory (``full``) or into a directory
holding v1 (``incremental``).

Every case must end in one of two ways: a named ``WeightsyncError`` with the directory
exactly as it was (nothing, or v1 byte for byte), or — for transient damage, only the first
answer spoiled — a retry (the SDK's own, or the caller's next ``pull``) that ends with v2
byte for byte. The directory never holds anything else. Figures: "M/M detected" is printed
by ``test_corruption_summary`` (run with ``-s``); docs/reliability/corruption-fuzz-security.md.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from _sec_proxy import CorruptingProxy, Fault, object_path
from _sec_server import SecServer, publish_versions, read_tree, start_server, stop_server, version_files

from weightsync import errors
from weightsync.client import Retry, Subscriber

MODEL = "policy-corruption"
# Quick retries: the cases exercise the retry paths many times.
FAST = Retry(attempts=3, base=0.01, cap=0.05)

REST_KINDS = {
    "data": ["bitflip", "truncate", "empty", "swap"],
    "manifest": ["bitflip", "truncate", "empty", "swap", "wrong-manifest"],
}
TRANSIT_KINDS = {
    "data": ["bitflip", "truncate", "cut", "empty", "swap"],
    "manifest": ["bitflip", "truncate", "cut", "empty", "swap", "wrong-manifest"],
}
MODES = ["full", "incremental"]


@dataclass
class Env:
    server: SecServer
    root: Path
    versions: list[dict[str, bytes]]
    published: list[dict]
    proxy: CorruptingProxy | None = None
    outcomes: list[tuple[str, str]] = field(default_factory=list)
    recoveries: list[str] = field(default_factory=list)

    @property
    def v2_object(self) -> str:
        """A data object only v2's delta references (an incremental pull fetches it too)."""
        return sorted(set(self.published[1]["objects"]) - set(self.published[0]["objects"]))[0]

    @property
    def v1_object(self) -> str:
        return self.published[0]["objects"][0]

    def digest_of(self, target: str) -> str:
        return self.v2_object if target == "data" else self.published[1]["manifest"]


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> Iterator[Env]:
    root = tmp_path_factory.mktemp("corruption")
    server = start_server(root / "server", log_level="warning")
    e = None
    try:
        versions = version_files(2, seed=7)
        published = publish_versions(server, MODEL, versions, root / "src")
        assert [p["number"] for p in published] == [1, 2]
        e = Env(server, root, versions, published)
        assert e.v2_object not in published[0]["objects"]
        with CorruptingProxy(server.url) as proxy:
            e.proxy = proxy
            yield e
        by_where: dict[str, list[int]] = {}
        for c, o in e.outcomes:
            tally = by_where.setdefault(c.split("-", 1)[0], [0, 0])
            tally[0] += o == "detected"
            tally[1] += 1
        print(
            f"\nFIGURE corruption: {sum(o == 'detected' for _, o in e.outcomes)}/{len(e.outcomes)} detected "
            f"({', '.join(f'{w} {d}/{n}' for w, (d, n) in by_where.items())}); "
            f"needed a second pull after repair: {e.recoveries or 'none'}"
        )
    finally:
        stop_server(server)
        if e is not None and e.server is not server:  # restarted by the cold-cache case
            stop_server(e.server)


def _pull(url: str, env: Env, dest: Path) -> None:
    with Subscriber(
        url,
        MODEL,
        token=env.server.token("reader"),
        retry=FAST,
        report=False,
        concurrency=2,
        decode_threads=1,
        range_bytes=1 << 12,
    ) as sub:
        sub.pull(dest, version=2)


def _prepare_dir(env: Env, mode: str, name: str) -> tuple[Path, dict[str, bytes]]:
    """A fresh directory, or one holding v1 (pulled cleanly, straight from the server)."""
    dest = env.root / "pulls" / name
    shutil.rmtree(dest, ignore_errors=True)
    if mode == "incremental":
        with Subscriber(env.server.url, MODEL, token=env.server.token("reader"), report=False) as sub:
            sub.pull(dest, version=1)
        assert read_tree(dest) == env.versions[0]
        return dest, dict(env.versions[0])
    return dest, {}


def _expect_detected(env: Env, case: str, url: str, dest: Path, before: dict[str, bytes]) -> BaseException:
    """The pull must raise a named error and leave `dest` exactly as it was."""
    try:
        _pull(url, env, dest)
    except errors.WeightsyncError as exc:
        got = read_tree(dest)
        assert got == before, f"{case}: a failed pull changed the directory: {sorted(got)}"
        return exc
    got = read_tree(dest)
    env.outcomes.append((case, "SERVED"))
    assert got == env.versions[1], f"{case}: damaged data served as good"
    pytest.fail(f"{case}: the pull succeeded on damaged data (bytes happened to be right)")


def _recover(env: Env, case: str, url: str, dest: Path) -> int:
    """Pull again after the damage is gone; returns the pulls it took (2: a damaged range was kept, see
    test_a_short_range_answer_is_not_kept_for_the_next_pull)."""
    for attempt in (1, 2):
        try:
            _pull(url, env, dest)
            break
        except errors.DigestMismatch:
            if attempt == 2:
                raise
            env.recoveries.append(case)
    _expect_v2(env, case, dest)
    return attempt


def _expect_v2(env: Env, case: str, dest: Path) -> None:
    assert read_tree(dest) == env.versions[1], f"{case}: the pulled directory differs from v2"


# --- at rest -----------------------------------------------------------------------------------------------


def _damage_at_rest(env: Env, target: str, kind: str) -> tuple[Path, bytes]:
    """Rewrite the store's file of the target behind the store's back; return (path, original bytes)."""
    digest = env.digest_of(target)
    path = env.server.object_path(digest)
    original = path.read_bytes()
    if kind == "bitflip":
        damaged = bytearray(original)
        damaged[len(damaged) // 2] ^= 0x10
        new = bytes(damaged)
    elif kind == "truncate":
        new = original[: len(original) // 2]
    elif kind == "empty":
        new = b""
    elif kind == "swap":  # another object's bytes stored under this name
        other = env.v1_object if target == "data" else env.v2_object
        new = env.server.object_path(other).read_bytes()
    elif kind == "wrong-manifest":  # a valid manifest, of v1, under v2's manifest digest
        new = env.server.object_path(env.published[0]["manifest"]).read_bytes()
    else:
        raise AssertionError(kind)
    assert new != original
    path.chmod(0o644)
    path.write_bytes(new)
    return path, original


REST_CASES = [(t, k, m) for t, ks in REST_KINDS.items() for k in ks for m in MODES]


@pytest.mark.parametrize("target, kind, mode", REST_CASES, ids=[f"rest-{t}-{k}-{m}" for t, k, m in REST_CASES])
def test_corruption_at_rest_is_detected(env: Env, target: str, kind: str, mode: str):
    case = f"rest-{target}-{kind}-{mode}"
    dest, before = _prepare_dir(env, mode, case)
    path, original = _damage_at_rest(env, target, kind)
    try:
        exc = _expect_detected(env, case, env.server.url, dest, before)
    finally:
        path.write_bytes(original)
    env.outcomes.append((case, "detected"))
    assert isinstance(exc, (errors.DigestMismatch, errors.StoreError, errors.FormatError)), repr(exc)
    # Repaired store: the same directory now pulls v2 byte for byte.
    _recover(env, case, env.server.url, dest)


def test_wrong_manifest_at_rest_with_a_cold_server_cache(env: Env):
    """The server itself checks a manifest's digest when it loads one for a plan (cache emptied by a restart)."""
    case = "rest-manifest-wrong-manifest-cold-server"
    dest, before = _prepare_dir(env, "full", case)
    path, original = _damage_at_rest(env, "manifest", "wrong-manifest")
    old = env.server
    stop_server(old)
    env.server = start_server(old.root, log_level="warning", tokens=old.tokens)
    env.proxy.state.upstream = ("127.0.0.1", int(env.server.url.rsplit(":", 1)[1]))
    try:
        exc = _expect_detected(env, case, env.server.url, dest, before)
    finally:
        path.write_bytes(original)
    env.outcomes.append((case, "detected"))
    assert isinstance(exc, errors.DigestMismatch), repr(exc)
    _recover(env, case, env.server.url, dest)


# --- in transit --------------------------------------------------------------------------------------------


def _fault(env: Env, target: str, kind: str, times: int | None) -> Fault:
    digest = env.digest_of(target)
    if kind == "wrong-manifest":
        return Fault("swap", object_path(digest), times, swap_path=f"/v1/objects/{env.published[0]['manifest']}")
    if kind == "swap":
        other = env.v1_object if target == "data" else env.v2_object
        return Fault("swap", object_path(digest), times, swap_path=f"/v1/objects/{other}")
    return Fault(kind, object_path(digest), times)


TRANSIT_CASES = [(t, k, m) for t, ks in TRANSIT_KINDS.items() for k in ks for m in MODES]


@pytest.mark.parametrize("target, kind, mode", TRANSIT_CASES, ids=[f"transit-{t}-{k}-{m}" for t, k, m in TRANSIT_CASES])
def test_corruption_in_transit_is_detected(env: Env, target: str, kind: str, mode: str):
    case = f"transit-{target}-{kind}-{mode}"
    dest, before = _prepare_dir(env, mode, case)
    fault = _fault(env, target, kind, None)
    env.proxy.set_faults(fault)
    try:
        exc = _expect_detected(env, case, env.proxy.url, dest, before)
    finally:
        env.proxy.set_faults()
    assert fault.applied >= 1, f"{case}: the fault never fired"
    env.outcomes.append((case, "detected"))
    if kind == "cut":  # every attempt dropped: the SDK's retries give up by name
        assert isinstance(exc, errors.ServerUnavailable), repr(exc)
    elif kind == "swap":  # another object whole: its bytes, or (for a range from byte N) a 200 where a 206 must be
        assert isinstance(exc, (errors.DigestMismatch, errors.StoreError, errors.FormatError, errors.BadResponse)), (
            repr(exc)
        )
    else:
        assert isinstance(exc, (errors.DigestMismatch, errors.StoreError, errors.FormatError)), repr(exc)
    _recover(env, case, env.proxy.url, dest)


TRANSIENT_CASES = [(t, k, n) for t, ks in TRANSIT_KINDS.items() for k in ks for n in (1, 2)]


@pytest.mark.parametrize(
    "target, kind, times", TRANSIENT_CASES, ids=[f"transient-{t}-{k}-x{n}" for t, k, n in TRANSIENT_CASES]
)
def test_transient_corruption_is_recovered_by_retry(env: Env, target: str, kind: str, times: int):
    """Only the first `times` answers are damaged: the SDK's retry or the caller's next pull recovers."""
    case = f"transient-{target}-{kind}-x{times}"
    dest, before = _prepare_dir(env, "incremental", case)
    fault = _fault(env, target, kind, times)
    env.proxy.set_faults(fault)
    failures = []
    try:
        for _ in range(times + 1):  # at most one failed pull per damaged answer
            try:
                _pull(env.proxy.url, env, dest)
                break
            except errors.WeightsyncError as exc:
                failures.append(type(exc).__name__)
                assert read_tree(dest) == before, f"{case}: a failed pull changed the directory"
        else:
            pytest.fail(f"{case}: not recovered after {times + 1} pulls: {failures}")
    finally:
        env.proxy.set_faults()
    assert fault.applied == times, (case, fault.applied)
    _expect_v2(env, case, dest)
    env.outcomes.append((case, "detected"))
    if kind == "cut":
        assert not failures, f"{case}: a dropped connection should be retried inside the pull: {failures}"


def test_a_short_range_answer_is_not_kept_for_the_next_pull(env: Env):
    """An object truncated at rest, then repaired: the very next pull must succeed."""
    case = "short-range-kept"
    dest, before = _prepare_dir(env, "full", case)
    path, original = _damage_at_rest(env, "data", "truncate")
    try:
        _expect_detected(env, case, env.server.url, dest, before)
    finally:
        path.write_bytes(original)
    _pull(env.server.url, env, dest)
    _expect_v2(env, case, dest)


def test_corruption_summary(env: Env):
    """Every case ran so far was detected (named error or recovered); none served damaged bytes as good."""
    served = [c for c, o in env.outcomes if o != "detected"]
    assert not served, served
