"""Fixtures of the store suite: one ``store`` fixture per backend, SeaweedFS for S3.

Every test that takes ``store`` runs once per backend (restic's
internal/backend/test style). S3 tests share the session's SeaweedFS
server (tests/conftest.py) and one bucket; each store gets its own random
key prefix, so tests never see each other's objects.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from _seaweed import SeaweedServer  # tests/ is on pythonpath (pyproject.toml)

from weightsync.store.base import ObjectStore

# `seaweed` (one server per session) and `anyio_backend` come from tests/conftest.py.

S3_BUCKET = "weightsync-store-tests"


def s3_store_factory(server: SeaweedServer, **options: Any) -> Callable[..., ObjectStore]:
    """Return a function making S3Stores on ``server`` that share one fresh prefix."""
    from weightsync.store.s3 import MIN_PART_SIZE, S3Store

    prefix = f"t-{uuid.uuid4().hex}"
    defaults: dict[str, Any] = {
        "endpoint_url": server.endpoint_url,
        "access_key_id": server.access_key,
        "secret_access_key": server.secret_key,
        "region": server.region,
        "create_bucket": True,
        # The smallest part S3 (and SeaweedFS) accept, so a few MB exercise multipart.
        "part_size": MIN_PART_SIZE,
        "max_concurrency": 4,
    }

    def make(**overrides: Any) -> ObjectStore:
        return S3Store(S3_BUCKET, prefix, **{**defaults, **options, **overrides})

    return make


@pytest.fixture
def s3_factory(seaweed: SeaweedServer) -> Callable[..., ObjectStore]:
    """A function making S3Stores on the session's SeaweedFS under one fresh prefix (options override)."""
    return s3_store_factory(seaweed)


# The S3 runs are `slow` (a SeaweedFS round trip per call): `make test-fast` keeps the filesystem runs.
@pytest.fixture(params=["fs", pytest.param("s3", marks=[pytest.mark.s3, pytest.mark.slow])])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, Callable[..., ObjectStore]]:
    """(name, factory): the factory opens a store on the same backing storage each call."""
    if request.param == "fs":
        from weightsync.store.fs import FsStore

        root = tmp_path / "store"
        return "fs", lambda **kw: FsStore(root, **kw)
    server: SeaweedServer = request.getfixturevalue("seaweed")
    return "s3", s3_store_factory(server)


@pytest.fixture
async def store(backend: tuple[str, Callable[..., ObjectStore]]) -> AsyncIterator[ObjectStore]:
    """An empty store of each backend, closed after the test."""
    _, make = backend
    async with make() as st:
        yield st


async def _leftovers(st: ObjectStore) -> list[str]:
    from weightsync.store.base import ForwardingStore
    from weightsync.store.fs import FsStore
    from weightsync.store.s3 import S3Store

    while isinstance(st, ForwardingStore):
        st = st.inner
    found: list[str] = []
    if isinstance(st, FsStore):
        found += [f"tmp/{p.name}" for p in (st.root / "tmp").iterdir()]
    elif isinstance(st, S3Store):
        client = await st._s3()
        resp = await client.list_multipart_uploads(Bucket=st.bucket, Prefix=st.prefix)
        found += [f"upload {u['Key']}" for u in resp.get("Uploads", [])]
    return found


@pytest.fixture
def leftovers() -> Callable[[ObjectStore], Any]:
    """``await leftovers(store)`` lists what a failed write left besides objects (temp files, pending uploads)."""
    return _leftovers
