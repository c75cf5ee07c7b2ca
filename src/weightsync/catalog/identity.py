"""The catalog's server identity: one row, made by migration 0003, that names this catalog for clients.

Every service on one catalog reports the same id (``GET /v1/info``), and it survives restarts:
clients key what they cache per server by it, never by host and port (docs/CATALOG.md "Server identity").
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from .. import errors
from .schema import ServerIdentityRow

__all__ = ["server_id"]


def server_id(s: Session) -> str:
    """The catalog's server id (32 hex digits); CatalogError if its row is missing (a damaged catalog)."""
    row = s.get(ServerIdentityRow, 1)
    if row is None:
        raise errors.CatalogError("the catalog has no server identity row (made by schema revision 0003)")
    return row.server_id
