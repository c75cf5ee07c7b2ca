"""GC's fence (issue 11): ``gc_fence``, one row holding when GC last forgot tombstones whose bytes it deleted.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01

GC raises ``deleted_at`` to its time in the transaction that forgets tombstones after deleting their
bytes; a publishVersion whose objects were all written by itself after that fence (less a margin
for clocks) references and commits them in one transaction instead of two (DESIGN invariant 7).
The row is made here with ``deleted_at`` NULL: a GC that deleted bytes before the upgrade did so
before any publish that reads the fence wrote its objects. No existing row changes.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copy of the timestamp type as of this revision.
TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    fence = op.create_table(
        "gc_fence",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("deleted_at", TS, nullable=True),
        sa.CheckConstraint("id = 1", name=op.f("ck_gc_fence_single_row")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_gc_fence")),
    )
    op.bulk_insert(fence, [{"id": 1, "deleted_at": None}])


def downgrade() -> None:
    op.drop_table("gc_fence")
