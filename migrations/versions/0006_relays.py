"""Relays (issue 15): ``relays``, the heartbeat of every relay reporting here; ``fetch_claims``.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23

A relay (``weightsync relay``) reports itself every few seconds: its site, the URL it follows,
whether it is degraded, and per model the version it holds with its prefetch lag (``state``, JSON).
Reports of relays below a relay are forwarded, so the origin's table names every relay. A row is
replaced by each heartbeat (``last_seen`` says how fresh it is); nothing references the table.

``fetch_claims``: relay replicas sharing one catalog claim an object (its digest) before fetching it
from their upstream, so it crosses once; the row is deleted when the fetch ends and an expired one
may be taken over. Both tables start empty; no existing row changes.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TS = sa.DateTime(timezone=True)
JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    op.create_table(
        "relays",
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("site", sa.String(255), nullable=True),
        sa.Column("upstream", sa.String(1024), nullable=True),
        sa.Column("degraded", sa.Boolean(), nullable=False),
        sa.Column("state", JSON, nullable=False),
        sa.Column("first_seen", TS, nullable=False),
        sa.Column("last_seen", TS, nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_relays")),
    )
    op.create_index(op.f("ix_relays_last_seen"), "relays", ["last_seen"])
    op.create_table(
        "fetch_claims",
        sa.Column("digest", sa.String(64), nullable=False),
        sa.Column("holder", sa.String(255), nullable=False),
        sa.Column("expires_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("digest", name=op.f("pk_fetch_claims")),
    )


def downgrade() -> None:
    op.drop_table("fetch_claims")
    op.drop_index(op.f("ix_relays_last_seen"), table_name="relays")
    op.drop_table("relays")
