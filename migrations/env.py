"""Alembic environment for the weightsync catalog (docs/CATALOG.md "Migrations").

Two ways in, one set of scripts:

* from code: :func:`weightsync.catalog.migrate.upgrade` passes an open connection in
  ``config.attributes["connection"]`` (already inside a locked transaction);
* from the command line: ``alembic upgrade head`` at the repository root, with the database
  URL from ``-x url=…``, else ``$WEIGHTSYNC_CATALOG``, else ``sqlalchemy.url`` in alembic.ini.
"""

from __future__ import annotations

import os
from logging.config import fileConfig

from alembic import context
from sqlalchemy import Connection
from sqlalchemy.pool import NullPool

from weightsync.catalog.engine import make_engine, normalize_url, writer
from weightsync.catalog.migrate import lock_for_migration, render_item
from weightsync.catalog.schema import metadata

config = context.config
target_metadata = metadata

if config.config_file_name is not None and config.attributes.get("connection") is None:
    fileConfig(config.config_file_name, disable_existing_loggers=False)


def _url() -> str:
    url = (
        context.get_x_argument(as_dictionary=True).get("url")
        or os.environ.get("WEIGHTSYNC_CATALOG")
        or config.get_main_option("sqlalchemy.url")
    )
    if not url:
        raise SystemExit("no catalog URL: pass -x url=…, set WEIGHTSYNC_CATALOG or sqlalchemy.url")
    return url


def _configure(conn: Connection) -> None:
    context.configure(
        connection=conn,
        target_metadata=target_metadata,
        # SQLite cannot ALTER most things; batch mode recreates the table instead.
        render_as_batch=conn.dialect.name == "sqlite",
        # The catalog's SQLite engine controls BEGIN itself, so DDL is transactional there
        # too: a failed upgrade leaves the previous schema, not half of the new one.
        transactional_ddl=True,
        compare_type=True,
        render_item=render_item,
    )


def run_migrations_offline() -> None:
    url = normalize_url(_url())
    context.configure(
        url=url,
        target_metadata=target_metadata,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
        render_as_batch=url.get_backend_name() == "sqlite",
        render_item=render_item,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    shared = config.attributes.get("connection")
    if shared is not None:
        _configure(shared)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = make_engine(_url(), poolclass=NullPool)
    try:
        with writer(engine).connect() as conn:
            _configure(conn)
            with context.begin_transaction():
                lock_for_migration(conn)
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
