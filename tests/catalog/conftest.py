"""Fixtures for the catalog suite: every test runs on SQLite and, marked ``postgres``, on PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from _pg import fresh_database  # tests/ is on sys.path (pyproject: pythonpath)

from weightsync.catalog import Catalog

BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


@pytest.fixture(params=BACKENDS)
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """URL of an empty database: a temp SQLite file, or a fresh PostgreSQL database."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'catalog.db'}"
    else:
        with fresh_database() as url:
            yield url


@pytest.fixture
def catalog(db_url: str) -> Iterator[Catalog]:
    """A migrated catalog on ``db_url``, closed after the test."""
    cat = Catalog.open(db_url, migrate=True)
    try:
        yield cat
    finally:
        cat.close()
