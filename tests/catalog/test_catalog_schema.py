"""Migrations: `upgrade head` builds exactly the models' schema; unknown revisions are refused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text

from weightsync import errors
from weightsync.catalog import Catalog, make_engine, normalize_url
from weightsync.catalog import migrate as migrations
from weightsync.catalog.schema import NAMING_CONVENTION, metadata

REPO = Path(__file__).resolve().parents[2]


def _diffs(url: str) -> list:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True})
            return compare_metadata(ctx, metadata)
    finally:
        engine.dispose()


def test_upgrade_head_matches_models(db_url: str) -> None:
    Catalog.open(db_url, migrate=True).close()
    assert _diffs(db_url) == []
    engine = make_engine(db_url)
    try:
        insp = inspect(engine)
        assert set(insp.get_table_names()) == set(metadata.tables) | {"alembic_version"}
        # Constraint names come from the naming convention, so later migrations can address them.
        for table in metadata.tables:
            for uq in insp.get_unique_constraints(table):
                assert uq["name"].startswith(f"uq_{table}_")
            for fk in insp.get_foreign_keys(table):
                assert fk["name"].startswith(f"fk_{table}_")
            for ix in insp.get_indexes(table):
                if ix.get("duplicates_constraint"):  # PostgreSQL lists a unique constraint's index too
                    continue
                assert ix["name"].startswith(f"ix_{table}_")
            checks = {c["name"] for c in insp.get_check_constraints(table)}
            expected = {c.name for c in metadata.tables[table].constraints if c.__class__.__name__ == "CheckConstraint"}
            assert checks == expected
    finally:
        engine.dispose()


def test_naming_convention_covers_every_kind() -> None:
    assert set(NAMING_CONVENTION) == {"ix", "uq", "ck", "fk", "pk"}


def test_open_is_idempotent_and_at_head(db_url: str) -> None:
    Catalog.open(db_url).close()
    Catalog.open(db_url).close()
    cat = Catalog.open(db_url, migrate=False)  # already at head: no error
    try:
        with cat.engine.connect() as conn:
            assert migrations.current_revision(conn) == migrations.head_revision()
    finally:
        cat.close()


def test_unmigrated_database_refused_without_migrate(db_url: str) -> None:
    with pytest.raises(errors.SchemaVersionError, match="upgrade head"):
        Catalog.open(db_url, migrate=False)


def test_newer_revision_is_refused(db_url: str) -> None:
    Catalog.open(db_url).close()
    engine = make_engine(db_url)
    with engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = 'ffff_from_the_future'"))
    engine.dispose()
    for migrate in (True, False):
        with pytest.raises(errors.SchemaVersionError, match="ffff_from_the_future.*newer"):
            Catalog.open(db_url, migrate=migrate)


def test_alembic_command_line_upgrade(db_url: str) -> None:
    # `-x url=` wins over $WEIGHTSYNC_CATALOG, which wins over alembic.ini.
    env = {**os.environ, "WEIGHTSYNC_CATALOG": "postgresql://nobody@127.0.0.1:1/never"}
    subprocess.run(
        [sys.executable, "-m", "alembic", "-x", f"url={db_url}", "upgrade", "head"],
        cwd=REPO,
        env=env,
        check=True,
        capture_output=True,
    )
    Catalog.open(db_url, migrate=False).close()  # at head, by the command line's hand


def test_migrations_have_one_head() -> None:
    assert migrations.head_revision() == "0007"


def test_url_normalization() -> None:
    assert normalize_url("postgresql://u@h/db").drivername == "postgresql+psycopg"
    assert normalize_url("postgres://u@h/db").drivername == "postgresql+psycopg"
    assert normalize_url("postgresql+psycopg://u@h/db").drivername == "postgresql+psycopg"
    assert normalize_url("sqlite:///x.db").drivername == "sqlite"
    with pytest.raises(errors.CatalogError, match="unsupported"):
        normalize_url("mysql://u@h/db")


def test_sqlite_pragmas(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'sub' / 'c.db'}")
    try:
        with engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
            assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() > 0
    finally:
        engine.dispose()


def test_unreachable_postgres_is_catalog_unavailable() -> None:
    # Port 1 on localhost: nothing listens, the connection is refused at once.
    with pytest.raises(errors.CatalogUnavailable):
        Catalog.open("postgresql://postgres@127.0.0.1:1/nope", connect_args={"connect_timeout": 2})
