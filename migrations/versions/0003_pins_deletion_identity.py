"""Fleet admin: models.pinned, models.deleted_at, and the catalog's server identity.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01

``models.pinned`` is the version followers hold instead of the head (NULL: follow the head);
``models.deleted_at`` marks a deleted model (invisible, its name free, its versions deleted but
numbered, so a re-created model continues the numbering). ``server_identity`` holds one row, made
here: a uuid4 that every service on this catalog reports as its id (``GET /v1/info``); clients key
caches by it. Existing models are neither pinned nor deleted.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copy of the timestamp type as of this revision.
TS = sa.DateTime(timezone=True)

DELETED_CHECK = "deleted_at IS NULL OR (pinned IS NULL AND head IS NULL)"


def upgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name == "sqlite":
        # Not batch mode: rebuilding `models` would break the foreign keys of versions, replicas and
        # leases (see 0002). ADD COLUMN takes a column constraint, checked against existing rows.
        # A downgrade leaves the columns on SQLite (see downgrade): an upgrade after it keeps them.
        have = {c["name"] for c in sa.inspect(bind).get_columns("models")}
        if "pinned" not in have:
            op.execute("ALTER TABLE models ADD COLUMN pinned INTEGER")
        if "deleted_at" not in have:
            op.execute(
                "ALTER TABLE models ADD COLUMN deleted_at DATETIME"
                f" CONSTRAINT ck_models_deleted_is_empty CHECK ({DELETED_CHECK})"
            )
    else:
        op.add_column("models", sa.Column("pinned", sa.Integer(), nullable=True))
        op.add_column("models", sa.Column("deleted_at", TS, nullable=True))
        op.create_check_constraint(op.f("ck_models_deleted_is_empty"), "models", DELETED_CHECK)
    identity = op.create_table(
        "server_identity",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("server_id", sa.String(32), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.CheckConstraint("id = 1", name=op.f("ck_server_identity_single_row")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_server_identity")),
    )
    op.bulk_insert(identity, [{"id": 1, "server_id": uuid.uuid4().hex, "created_at": datetime.now(UTC)}])


def downgrade() -> None:
    op.drop_table("server_identity")
    if op.get_bind().dialect.name == "sqlite":
        # DROP COLUMN refuses a column a CHECK constraint names and a rebuild breaks the foreign keys
        # (see upgrade): the columns stay on SQLite, emptied as PostgreSQL's are dropped (a deleted
        # model is back, without versions; pins are gone), so that 0002's code may commit to any model.
        op.execute("UPDATE models SET pinned = NULL, deleted_at = NULL")
        return
    op.drop_constraint(op.f("ck_models_deleted_is_empty"), "models", type_="check")
    op.drop_column("models", "deleted_at")
    op.drop_column("models", "pinned")
