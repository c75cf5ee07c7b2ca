"""`ops` fixture: Ops over every catalog x store combination (SQLite/PostgreSQL x filesystem/SeaweedFS)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest
from _pg import fresh_database
from _versions import checkpoint, model_files, next_step

from weightsync.catalog import Catalog
from weightsync.ops import Ops, OpsSettings

COMBOS = [
    "sqlite-fs",
    pytest.param("sqlite-s3", marks=pytest.mark.s3),
    pytest.param("pg-fs", marks=pytest.mark.postgres),
    pytest.param("pg-s3", marks=[pytest.mark.postgres, pytest.mark.s3]),
]


class Clock:
    """A settable clock so grace periods and expiry are tested without sleeping."""

    def __init__(self) -> None:
        self.now = datetime.now(UTC)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, **kw) -> None:
        self.now += timedelta(**kw)


def make_store(kind: str, tmp_path, request):
    if kind == "fs":
        from weightsync.store.fs import FsStore

        return FsStore(tmp_path / "store")
    from weightsync.store.s3 import S3Store

    server = request.getfixturevalue("seaweed")
    return S3Store(
        "weightsync-ops-tests",
        f"t-{uuid.uuid4().hex}",
        endpoint_url=server.endpoint_url,
        access_key_id=server.access_key,
        secret_access_key=server.secret_key,
        region=server.region,
        create_bucket=True,
    )


@pytest.fixture(params=COMBOS)
def backends(request, tmp_path):
    """(catalog URL, store factory) for one combination; PostgreSQL databases are dropped afterwards."""
    cat_kind, store_kind = request.param.split("-")
    if cat_kind == "pg":
        try:
            ctx = fresh_database()
            url = ctx.__enter__()
        except Exception as exc:  # noqa: BLE001  # pragma: no cover - server absent
            pytest.skip(f"PostgreSQL unavailable: {exc}")
        request.addfinalizer(lambda: ctx.__exit__(None, None, None))
    else:
        url = f"sqlite:///{tmp_path / 'catalog.db'}"
    return url, (lambda: make_store(store_kind, tmp_path, request))


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
async def ops(backends, clock):
    url, make = backends
    catalog = Catalog.open(url)
    store = make()
    o = Ops(catalog, store, OpsSettings(gc_grace=timedelta(minutes=5)), clock=clock)
    try:
        yield o
    finally:
        await o.aclose()
        await store.close()
        catalog.close()


@pytest.fixture
def versions():
    """Five consecutive checkpoints (as in-memory directories) and their bytes."""
    t = model_files()
    out = []
    for i in range(5):
        out.append(checkpoint(t, i))
        t = next_step(t, i + 1)
    return out
