"""Fixtures: a real service on a loopback port per backend (SQLite + filesystem; PostgreSQL + SeaweedFS).

The in-process server is uvicorn in a background thread (its own event loop), reached
over real HTTP with httpx; see _service_util.py.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import pytest
from _service_util import BACKENDS, JSON_CAP, UPLOAD_CAP, Service, backend_settings, running, token_entries
from _versions import checkpoint, model_files, next_step

from weightsync.service import Settings


@pytest.fixture(scope="session", params=BACKENDS)
def service(request, tmp_path_factory) -> Iterator[Service]:
    """The service with tokens, on one backend, shared by the session's API tests."""
    kw, cleanups = backend_settings(request.param, tmp_path_factory.mktemp("service"), request)
    settings = Settings(
        **kw,
        tokens=json.dumps(token_entries()),
        max_upload_body=UPLOAD_CAP,
        max_json_body=JSON_CAP,
        watch_poll_s=0.05,
        sse_keepalive_s=0.5,
        gc_grace_s=0,
    )
    try:
        with running(settings) as url:
            svc = Service(url, request.param, settings)
            yield svc
            for c in svc.clients:
                c.close()
    finally:
        for ctx in cleanups:
            ctx.__exit__(None, None, None)


@pytest.fixture
def model() -> str:
    """A fresh model name the publisher and reader tokens may use."""
    return f"policy-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session")
def versions():
    """Four consecutive small checkpoints (a safetensors file and a config)."""
    t = model_files()
    out = []
    for i in range(4):
        out.append(checkpoint(t, i))
        t = next_step(t, i + 1)
    return out
