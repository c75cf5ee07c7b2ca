"""The relay's route table, in process: every service operation once, every write refused, nothing else."""

from __future__ import annotations

import subprocess
import sys

from fastapi.routing import APIRoute

from weightsync.relay.app import relay_routers
from weightsync.relay.routes import READ_ONLY_OPERATIONS
from weightsync.service.deps import Require
from weightsync.service.routes import ROUTERS


def _operations(routers) -> dict[tuple[str, str], str]:
    out: dict[tuple[str, str], str] = {}
    for router in routers:
        for r in router.routes:
            if isinstance(r, APIRoute):
                for m in r.methods:
                    assert (r.path, m) not in out, f"{m} {r.path} twice"
                    out[(r.path, m)] = r.operation_id
    return out


def _scope(route: APIRoute) -> set[str]:
    """The scopes a service route's dependencies require (service/deps.py ``Require(scope)``)."""
    found = set()
    stack = [route.dependant]
    while stack:
        d = stack.pop()
        if isinstance(d.call, Require):
            found.add(d.call.scope)
        stack.extend(d.dependencies)
    return found


def test_the_relay_answers_every_operation_of_the_service_once() -> None:
    service = _operations(ROUTERS)
    relay = _operations(relay_routers())
    assert relay == service  # same paths, methods and operation ids: the SDK cannot tell them apart


def test_every_operation_that_changes_something_is_refused_and_no_read() -> None:
    writes = set()
    for router in ROUTERS:
        for r in router.routes:
            if isinstance(r, APIRoute) and (_scope(r) & {"publish", "admin"}) and r.operation_id not in ("fsck", "gc"):
                writes.add(r.operation_id)
    assert writes == READ_ONLY_OPERATIONS  # a new write route must be listed (fsck and gc are the relay's own)


def test_registering_the_relay_command_imports_no_server_dependency() -> None:
    code = (
        "import sys, typer; from weightsync.relay.cli import register; app = typer.Typer(); register(app); "
        "heavy = [m for m in ('fastapi', 'uvicorn', 'sqlalchemy', 'starlette', 'aioboto3', 'pydantic', 'httpx') "
        "if m in sys.modules]; print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
