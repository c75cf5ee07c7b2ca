"""Object tombstones: objects.state ('live' | 'deleting') and objects.deleting_since.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23

GC marks an object 'deleting' (in the transaction that re-checks it is unreferenced) before it
deletes the bytes, and removes the row after; a publisher never references a 'deleting' object
(docs/DESIGN.md invariant 7). Existing rows become 'live'.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copy of the timestamp type as of this revision.
TS = sa.DateTime(timezone=True)


STATE_CHECK = "state IN ('live', 'deleting')"
SINCE_CHECK = "(state = 'deleting') = (deleting_since IS NOT NULL)"


def upgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        # Not batch mode: rebuilding `objects` (copy, drop, rename) would break the foreign key
        # of version_objects, and SQLite cannot switch foreign keys off inside the migration's
        # transaction. ADD COLUMN takes column constraints, checked against existing rows.
        op.execute(
            "ALTER TABLE objects ADD COLUMN state VARCHAR(16) DEFAULT 'live' NOT NULL"
            f" CONSTRAINT ck_objects_state CHECK ({STATE_CHECK})"
        )
        op.execute(
            "ALTER TABLE objects ADD COLUMN deleting_since DATETIME"
            f" CONSTRAINT ck_objects_deleting_since CHECK ({SINCE_CHECK})"
        )
    else:
        op.add_column("objects", sa.Column("state", sa.String(16), server_default="live", nullable=False))
        op.add_column("objects", sa.Column("deleting_since", TS, nullable=True))
        op.create_check_constraint(op.f("ck_objects_state"), "objects", STATE_CHECK)
        op.create_check_constraint(op.f("ck_objects_deleting_since"), "objects", SINCE_CHECK)
    op.create_index(op.f("ix_objects_deleting_since"), "objects", ["deleting_since"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_objects_deleting_since"), table_name="objects")
    if op.get_bind().dialect.name == "sqlite":
        # DROP COLUMN refuses columns with CHECK constraints, and a rebuild breaks the foreign
        # key (see upgrade): tombstone columns stay on SQLite; 0001's code ignores them.
        return
    op.drop_constraint(op.f("ck_objects_deleting_since"), "objects", type_="check")
    op.drop_constraint(op.f("ck_objects_state"), "objects", type_="check")
    op.drop_column("objects", "deleting_since")
    op.drop_column("objects", "state")
