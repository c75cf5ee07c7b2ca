"""Initial catalog: models, versions, objects, version_objects, replicas, leases.

Revision ID: 0001
Revises:
Create Date: 2025-11-22

Review like a format change (docs/CATALOG.md "Reviewing a migration"): constraint names follow
the naming convention, schema.py changes in the same commit, and the schema test passes.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copies of the column types as of this revision: a migration must not change
# meaning when schema.py changes later.
TS = sa.DateTime(timezone=True)
JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def upgrade() -> None:
    op.create_table(
        "models",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("head", sa.Integer(), nullable=True),
        sa.Column("keyframe_interval", sa.Integer(), nullable=False),
        sa.Column("max_chain_ratio", sa.Float(), nullable=False),
        sa.Column("keep_last", sa.Integer(), nullable=True),
        sa.CheckConstraint("keyframe_interval >= 1", name=op.f("ck_models_keyframe_interval_positive")),
        sa.CheckConstraint("max_chain_ratio > 0", name=op.f("ck_models_max_chain_ratio_positive")),
        sa.CheckConstraint("keep_last IS NULL OR keep_last >= 1", name=op.f("ck_models_keep_last_positive")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_models")),
        sa.UniqueConstraint("name", name=op.f("uq_models_name")),
    )

    op.create_table(
        "versions",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column("number", sa.Integer(), nullable=True),
        sa.Column("parent", sa.Integer(), nullable=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("chain_base", sa.Integer(), nullable=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=True),
        sa.Column("metadata", JSON, nullable=False),
        sa.Column("raw_bytes", sa.BigInteger(), nullable=True),
        sa.Column("stored_bytes", sa.BigInteger(), nullable=True),
        sa.Column("manifest_digest", sa.String(64), nullable=True),
        sa.Column("publish_id", sa.String(128), nullable=False),
        sa.Column("idempotency_key", sa.String(128), nullable=True),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("committed_at", TS, nullable=True),
        sa.Column("expires_at", TS, nullable=True),
        sa.Column("deleted_at", TS, nullable=True),
        sa.CheckConstraint("kind IN ('keyframe', 'delta')", name=op.f("ck_versions_kind")),
        sa.CheckConstraint("state IN ('pending', 'committed', 'deleted')", name=op.f("ck_versions_state")),
        sa.CheckConstraint(
            "state <> 'committed' OR (number IS NOT NULL AND chain_base IS NOT NULL"
            " AND manifest_digest IS NOT NULL AND raw_bytes IS NOT NULL"
            " AND stored_bytes IS NOT NULL AND committed_at IS NOT NULL)",
            name=op.f("ck_versions_committed_complete"),
        ),
        sa.CheckConstraint("state <> 'pending' OR expires_at IS NOT NULL", name=op.f("ck_versions_pending_expires")),
        sa.CheckConstraint(
            "kind <> 'delta' OR state = 'pending' OR parent IS NOT NULL", name=op.f("ck_versions_delta_parent")
        ),
        sa.ForeignKeyConstraint(["model_id"], ["models.id"], name=op.f("fk_versions_model_id_models")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_versions")),
        sa.UniqueConstraint("model_id", "number", name=op.f("uq_versions_model_id_number")),
        sa.UniqueConstraint("model_id", "idempotency_key", name=op.f("uq_versions_model_id_idempotency_key")),
        sa.UniqueConstraint("publish_id", name=op.f("uq_versions_publish_id")),
    )
    op.create_index(op.f("ix_versions_state_expires_at"), "versions", ["state", "expires_at"])
    op.create_index(op.f("ix_versions_manifest_digest"), "versions", ["manifest_digest"])

    op.create_table(
        "objects",
        sa.Column("digest", sa.String(64), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.Column("first_seen", TS, nullable=False),
        sa.Column("unreferenced_since", TS, nullable=True),
        sa.CheckConstraint("size >= 0", name=op.f("ck_objects_size_nonnegative")),
        sa.PrimaryKeyConstraint("digest", name=op.f("pk_objects")),
    )
    op.create_index(op.f("ix_objects_unreferenced_since"), "objects", ["unreferenced_since"])

    op.create_table(
        "version_objects",
        sa.Column("version_id", sa.Integer(), nullable=False),
        sa.Column("digest", sa.String(64), nullable=False),
        sa.Column("size", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["version_id"], ["versions.id"], name=op.f("fk_version_objects_version_id_versions")),
        sa.ForeignKeyConstraint(["digest"], ["objects.digest"], name=op.f("fk_version_objects_digest_objects")),
        sa.PrimaryKeyConstraint("version_id", "digest", name=op.f("pk_version_objects")),
    )
    op.create_index(op.f("ix_version_objects_digest"), "version_objects", ["digest"])

    op.create_table(
        "replicas",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column("subscriber", sa.String(255), nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("applied_at", TS, nullable=False),
        sa.Column("pause_ms", sa.Float(), nullable=True),
        sa.Column("bytes_received", sa.BigInteger(), nullable=True),
        sa.Column("site", sa.String(255), nullable=True),
        sa.Column("host", sa.String(255), nullable=True),
        sa.Column("extra", JSON, nullable=False),
        sa.ForeignKeyConstraint(["model_id"], ["models.id"], name=op.f("fk_replicas_model_id_models")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_replicas")),
    )
    op.create_index(
        op.f("ix_replicas_model_id_subscriber_applied_at"), "replicas", ["model_id", "subscriber", "applied_at"]
    )

    op.create_table(
        "leases",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("holder", sa.String(255), nullable=False),
        sa.Column("acquired_at", TS, nullable=False),
        sa.Column("expires_at", TS, nullable=False),
        sa.ForeignKeyConstraint(["model_id"], ["models.id"], name=op.f("fk_leases_model_id_models")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_leases")),
        sa.UniqueConstraint("model_id", "number", "holder", name=op.f("uq_leases_model_id_number_holder")),
    )
    op.create_index(op.f("ix_leases_expires_at"), "leases", ["expires_at"])


def downgrade() -> None:
    op.drop_table("leases")
    op.drop_table("replicas")
    op.drop_table("version_objects")
    op.drop_table("objects")
    op.drop_table("versions")
    op.drop_table("models")
