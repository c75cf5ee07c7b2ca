"""Running the Alembic migrations from code (service start) with the same scripts the CLI uses.

The scripts' source is the top-level ``migrations/`` directory; ``alembic.ini`` at the repository
root points there too, so ``alembic upgrade head`` and :func:`upgrade` run the same code. The wheel
ships the same files as ``weightsync/catalog/migrations/`` (pyproject.toml maps the directory into
the package), so an installed weightsync migrates its catalog without a source tree.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util.exc import CommandError
from sqlalchemy import Connection, Engine, text

from ..errors import CatalogError, SchemaVersionError
from .engine import writer
from .schema import UTCDateTime

#: Environment variable naming the migrations directory (for installs without the source tree).
MIGRATIONS_ENV = "WEIGHTSYNC_MIGRATIONS"

# Any constant works; it only has to be the same for every process migrating one database.
_PG_MIGRATION_LOCK = 0x77_73_79_6E_63  # "wsync"


def render_item(type_: str, obj: Any, autogen_context: Any) -> str | Literal[False]:
    """Alembic autogenerate hook: write the catalog's custom types as plain SQLAlchemy types.

    A migration must not import weightsync code for its column types: it would change meaning
    when that code changes. UTC handling is an ORM concern; the column is ``timestamptz``.
    """
    if type_ == "type" and isinstance(obj, UTCDateTime):
        return "sa.DateTime(timezone=True)"
    return False


def migrations_dir() -> Path:
    """Return the directory holding ``env.py`` and ``versions/`` (:class:`CatalogError` if absent).

    In order: ``$WEIGHTSYNC_MIGRATIONS`` (only it, when set); the copy inside the installed
    package (a wheel install); the top-level ``migrations/`` of the source tree this module is
    imported from (an editable install or ``PYTHONPATH=src``, where the package has no copy).
    """
    override = os.environ.get(MIGRATIONS_ENV)
    here = Path(__file__).resolve()
    # src/weightsync/catalog/migrate.py -> the repository root is three levels above the package.
    candidates = [Path(override)] if override else [here.parent / "migrations", here.parents[3] / "migrations"]
    for path in candidates:
        if (path / "env.py").is_file():
            return path
    tried = ", ".join(str(p) for p in candidates)
    raise CatalogError(f"catalog migrations not found (looked in {tried}; set {MIGRATIONS_ENV})")


def alembic_config(connection: Connection | None = None) -> Config:
    """Return an Alembic config for the catalog's scripts, optionally bound to ``connection``."""
    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    cfg.attributes["connection"] = connection
    return cfg


def head_revision() -> str:
    """Return the newest schema revision this code knows."""
    heads = ScriptDirectory.from_config(alembic_config()).get_heads()
    if len(heads) != 1:  # a merge was forgotten: refuse rather than pick one
        raise CatalogError(f"catalog migrations have {len(heads)} heads: {heads}")
    return heads[0]


def lock_for_migration(conn: Connection) -> None:
    """Serialize migrations of one PostgreSQL database across processes (transaction-scoped).

    Two services starting together would otherwise both try to create the tables. On SQLite
    the ``BEGIN IMMEDIATE`` of the migrating transaction already does this.
    """
    if conn.dialect.name == "postgresql":
        conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_MIGRATION_LOCK})


def current_revision(conn: Connection) -> str | None:
    """Return the database's schema revision (None if never migrated).

    Raises :class:`SchemaVersionError` if it is a revision this code does not know, which
    means a newer weightsync migrated the database.
    """
    heads = MigrationContext.configure(conn).get_current_heads()
    script = ScriptDirectory.from_config(alembic_config())
    for rev in heads:
        try:
            known = script.get_revision(rev)
        except CommandError:
            known = None
        if known is None:
            raise SchemaVersionError(
                f"catalog database is at schema revision {rev!r}, which this weightsync does not know"
                f" (its newest is {head_revision()!r}); it was migrated by a newer release:"
                " upgrade weightsync, or use another catalog"
            )
    if len(heads) > 1:
        raise SchemaVersionError(f"catalog database has several schema revisions {heads}")
    return heads[0] if heads else None


def upgrade(engine: Engine) -> None:
    """Bring the database to the newest schema revision (``alembic upgrade head``), in one transaction.

    Refuses (:class:`SchemaVersionError`) a database at a revision newer than the code knows.
    """
    with writer(engine).begin() as conn:
        lock_for_migration(conn)
        if current_revision(conn) == head_revision():
            return
        command.upgrade(alembic_config(conn), "head")


def check(engine: Engine) -> None:
    """Raise :class:`SchemaVersionError` unless the database is at exactly the newest revision."""
    with engine.connect() as conn:
        current = current_revision(conn)
    head = head_revision()
    if current != head:
        raise SchemaVersionError(
            f"catalog database is at schema revision {current!r}, this weightsync needs {head!r}:"
            " run `alembic upgrade head` (or open the catalog with migrate=True)"
        )
