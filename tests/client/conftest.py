"""Fixtures of the client suite: real `weightsync serve` subprocesses (anonymous and with tokens)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from _client_util import TOKENS, Server, start_server, stop_server


def _service_available() -> bool:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401

        import weightsync.service.cli  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One anonymous server for the session; tests keep apart by model name."""
    if not _service_available():
        pytest.skip("the service (weightsync[server]) is not installed")
    srv = start_server(tmp_path_factory.mktemp("server"))
    try:
        yield srv
    finally:
        stop_server(srv)


@pytest.fixture(scope="session")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server with tokens: an admin token and a read-only token."""
    if not _service_available():
        pytest.skip("the service (weightsync[server]) is not installed")
    tokens = [
        {"name": "admin", "token": TOKENS["admin"], "scopes": ["admin"]},
        {"name": "reader", "token": TOKENS["reader"], "scopes": ["read"]},
    ]
    srv = start_server(tmp_path_factory.mktemp("auth-server"), tokens=tokens)
    try:
        yield srv
    finally:
        stop_server(srv)


@pytest.fixture
def model(request: pytest.FixtureRequest) -> str:
    """A model name unique to the test."""
    name = re.sub(r"[^a-z0-9._-]", "-", request.node.name.lower()).strip("-.")
    return f"m-{name}"[:120]
