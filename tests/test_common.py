"""The shared primitives of weightsync.common: validation, exact reads, backoff, sizes."""

from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from weightsync import __version__, errors
from weightsync.common import (
    VERSION,
    Backoff,
    check_digest,
    check_model_name,
    human_bytes,
    is_digest,
    pread_exact,
)


def test_digests_are_64_lowercase_hex_digits() -> None:
    good = "ab" * 32
    assert is_digest(good) and check_digest(good) == good
    for bad in ["AB" * 32, "ab" * 31, "ab" * 32 + "a", "g" * 64, "", None, 7, good + "\n"]:
        assert not is_digest(bad)
        with pytest.raises(errors.InvalidDigest):
            check_digest(bad)


@pytest.mark.parametrize(
    "name", ["a", "policy-7b", "m.v1_2", "0" * 96, "Policy", "Org/Name", "meta-llama/Llama-3.1-8B"]
)
def test_valid_model_names_pass(name: str) -> None:
    assert check_model_name(name) == name


@pytest.mark.parametrize(
    "name",
    ["", "-a", ".a", "a/b/c", "/a", "a/", "a/-b", "a" * 97, "a b", "a--b", "a..b", "Org/versions", "é", None, 3],
)
def test_invalid_model_names_raise_invalid_name(name: object) -> None:
    with pytest.raises(errors.InvalidName):
        check_model_name(name)


def test_pread_exact_reads_everything_or_refuses(tmp_path) -> None:
    data = os.urandom(100_000)
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert pread_exact(fd, 1000, 5) == data[5:1005]
        assert pread_exact(fd, len(data), 0) == data
        assert pread_exact(fd, 0, len(data)) == b""
        with pytest.raises(errors.StoreError):
            pread_exact(fd, 10, len(data) - 5)
    finally:
        os.close(fd)


@given(st.integers(0, 200), st.floats(0, 5), st.floats(0, 60))
def test_backoff_waits_stay_within_the_jittered_ceiling(attempt: int, base: float, cap: float) -> None:
    b = Backoff(attempts=3, base=base, cap=cap)
    assert 0 <= b.delay(attempt) <= min(cap, base * 2.0 ** min(attempt, 62)) + 1e-9


def test_backoff_honours_retry_after_bounded() -> None:
    b = Backoff(base=0.1, cap=2.0)
    assert b.delay(0, "1.5") == 1.5
    assert b.delay(0, "3600") == 6.0
    assert 0 <= b.delay(0, "soon") <= 0.1  # unparsable: the jittered wait
    assert 0 <= b.delay(0, "-4") <= 0.1  # negative: the jittered wait, never a negative sleep


def test_backoff_refuses_nonsense() -> None:
    with pytest.raises(errors.InvalidArgument):
        Backoff(attempts=0)
    with pytest.raises(errors.InvalidArgument):
        Backoff(base=-1)


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (47_600_000, "45.4 MiB"),
        (3 * 1024**4, "3.0 TiB"),
        (5 * 1024**6, "5120.0 PiB"),
    ],
)
def test_human_bytes(n: int, text: str) -> None:
    assert human_bytes(n) == text


def test_the_version_has_one_source() -> None:
    assert __version__ == VERSION


def test_gc_paused_holds_the_collector_off_and_restores_it() -> None:
    import gc

    from weightsync.common import gc_paused

    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():  # nested: still off, and the inner exit does not turn it back on
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), gc_paused():
        raise RuntimeError("boom")
    assert gc.isenabled()  # an exception in the block restores it too


def test_gc_paused_leaves_a_collector_the_caller_turned_off_off() -> None:
    import gc

    from weightsync.common import gc_paused

    gc.disable()
    try:
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_gc_paused_comes_back_only_when_the_last_thread_leaves() -> None:
    import gc
    import threading

    from weightsync.common import gc_paused

    inside, leave = threading.Event(), threading.Event()

    def other() -> None:
        with gc_paused():
            inside.set()
            leave.wait(10)

    t = threading.Thread(target=other)
    with gc_paused():
        t.start()
        assert inside.wait(10)
    assert not gc.isenabled()  # this block ended, the other thread's has not
    leave.set()
    t.join(10)
    assert gc.isenabled()
