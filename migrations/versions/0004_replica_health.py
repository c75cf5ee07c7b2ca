"""Replica health as ledger columns: replicas.status, replicas.mode, replicas.engine; number nullable.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02

``status`` is ``serving`` | ``applied`` | ``unhealthy`` (a check constraint); an ``unhealthy`` entry
holds no version, so ``number`` becomes nullable, NULL exactly for those (a second check).
``mode`` and ``engine`` are free columns the catalog checks (docs/CATALOG.md "Replica ledger").

Existing rows were all reports of an applied version: they become ``applied``, or ``serving`` where
the sidecar wrote ``"status": "serving"`` into ``extra``; ``mode`` and ``engine`` come from ``extra``
where it holds a known value (a pull's ``full``/``delta``/``adopted`` is mode ``pull``), else NULL.
``extra`` itself is kept as written.

Nothing references ``replicas``, so SQLite's batch mode may rebuild it (copy, drop, rename): the only
way SQLite can make a column nullable.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copies of the sets and checks as of this revision.
STATUS_CHECK = "status IN ('serving', 'applied', 'unhealthy')"
NUMBER_CHECK = "(number IS NULL) = (status = 'unhealthy')"
ENGINES = ("vllm", "sglang", "torch")
MODES = ("disk", "in-place", "reload")
PULL_MODES = ("full", "delta", "adopted")  # what a pull wrote into extra["mode"] before this revision


def _quoted(values: Sequence[str]) -> str:
    return ", ".join(f"'{v}'" for v in values)


def _from_extra(dialect: str) -> None:
    """Fill the new columns from what older reports wrote into ``extra``."""
    key = "json_extract(extra, '$.{}')" if dialect == "sqlite" else "(extra ->> '{}')"
    status, mode, engine = key.format("status"), key.format("mode"), key.format("engine")
    op.execute(f"UPDATE replicas SET status = 'serving' WHERE {status} = 'serving'")
    op.execute(f"UPDATE replicas SET engine = {engine} WHERE {engine} IN ({_quoted(ENGINES)})")
    op.execute(f"UPDATE replicas SET mode = {mode} WHERE {mode} IN ({_quoted(MODES)})")
    op.execute(f"UPDATE replicas SET mode = 'pull' WHERE {mode} IN ({_quoted(PULL_MODES)})")


def upgrade() -> None:
    with op.batch_alter_table("replicas") as batch:
        batch.alter_column("number", existing_type=sa.Integer(), nullable=True)
        batch.add_column(sa.Column("status", sa.String(16), server_default="applied", nullable=False))
        batch.add_column(sa.Column("mode", sa.String(16), nullable=True))
        batch.add_column(sa.Column("engine", sa.String(32), nullable=True))
        batch.create_check_constraint(op.f("ck_replicas_status"), STATUS_CHECK)
        batch.create_check_constraint(op.f("ck_replicas_unhealthy_no_version"), NUMBER_CHECK)
    _from_extra(op.get_bind().dialect.name)


def downgrade() -> None:
    # 0003's ledger has no way to say "holds nothing": unhealthy entries go.
    op.execute("DELETE FROM replicas WHERE number IS NULL")
    with op.batch_alter_table("replicas") as batch:
        batch.drop_constraint(op.f("ck_replicas_unhealthy_no_version"), type_="check")
        batch.drop_constraint(op.f("ck_replicas_status"), type_="check")
        batch.drop_column("engine")
        batch.drop_column("mode")
        batch.drop_column("status")
        batch.alter_column("number", existing_type=sa.Integer(), nullable=False)
