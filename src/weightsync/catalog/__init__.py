"""The SQL catalog: models, versions and their lineage, object references, leases, replica ledger.

SQLite by default, PostgreSQL at scale; schema changes only through the Alembic migrations in
the top-level ``migrations/`` directory (docs/CATALOG.md). Imports nothing of codec, store or ops.

>>> cat = Catalog.open("sqlite:///weightsync-data/catalog.db")   # runs `alembic upgrade head`
"""

from __future__ import annotations

from .core import DEFAULT_PENDING_TTL, DEFAULT_SETTINGS, Catalog, validate_model_name
from .engine import make_engine, normalize_url
from .publishes import PARTS_PREFIX
from .records import (
    ChainInfo,
    DeletedModel,
    ImportedVersion,
    Lease,
    Model,
    ObjectInfo,
    Pinned,
    RelayInfo,
    Replica,
    Target,
    Version,
    VersionTotals,
)

__all__ = [
    "PARTS_PREFIX",
    "DEFAULT_PENDING_TTL",
    "DEFAULT_SETTINGS",
    "Catalog",
    "ChainInfo",
    "DeletedModel",
    "ImportedVersion",
    "Lease",
    "Model",
    "ObjectInfo",
    "Pinned",
    "RelayInfo",
    "Replica",
    "Target",
    "Version",
    "VersionTotals",
    "make_engine",
    "normalize_url",
    "validate_model_name",
]
