"""Multi-part publish: version_parts, one row per part recorded against its pending version (issue 14).

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23

A part is (version, rank) with the group's world size, the part's manifest digest and its removal
choice; ``rank`` lies in ``[0, world)`` (a check). Rows are never changed, only added; the rows of a
committed or expired version stay as its record. Existing data is untouched (no version had parts).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "version_parts",
        sa.Column(
            "version_id",
            sa.Integer(),
            sa.ForeignKey("versions.id", name=op.f("fk_version_parts_version_id_versions")),
            nullable=False,
        ),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("world", sa.Integer(), nullable=False),
        sa.Column("manifest_digest", sa.String(64), nullable=False),
        sa.Column("allow_removals", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("version_id", "rank", name=op.f("pk_version_parts")),
        sa.CheckConstraint("rank >= 0 AND rank < world", name=op.f("ck_version_parts_rank_in_world")),
    )


def downgrade() -> None:
    op.drop_table("version_parts")
