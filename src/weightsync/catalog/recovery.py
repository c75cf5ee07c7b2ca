"""Disaster recovery: importing committed versions from manifests, and the dump a rebuild must reproduce.

docs/CATALOG.md "Rebuilding". Manifests and commit records are objects, so the store alone can
restore every committed version; :func:`dump` is exactly what such a rebuild restores.
"""

from __future__ import annotations

import secrets
from datetime import datetime
from typing import Any

from sqlalchemy import and_, select, update
from sqlalchemy.orm import Session

from .. import errors
from . import objects
from .records import ImportedVersion, Version
from .rows import model_row, version_record
from .schema import ModelRow, ObjectRow, VersionObjectRow, VersionRow

__all__ = ["dump", "import_version"]


def import_version(
    s: Session,
    model: str,
    r: ImportedVersion,
    refs: dict[str, int],
    metadata: dict[str, Any],
    committed_at: datetime,
    now: datetime,
) -> Version:
    """Insert committed version ``r`` under its own number; idempotent for the same manifest, else Conflict."""
    m = model_row(s, model, lock=True)
    same = select(VersionRow).where(VersionRow.model_id == m.id, VersionRow.number == r.number)
    prior = s.scalars(same).one_or_none()
    if prior is not None:
        if prior.state == "committed" and prior.manifest_digest == r.manifest_digest:
            return version_record(prior, m.name)
        raise errors.Conflict(f"model {m.name!r} already has a version {r.number} ({prior.state})")
    row = VersionRow(
        model_id=m.id,
        number=r.number,
        parent=r.parent,
        kind=r.kind,
        chain_base=r.chain_base,
        state="committed",
        step=r.step,
        metadata_=metadata,
        raw_bytes=r.raw_bytes,
        stored_bytes=r.stored_bytes,
        manifest_digest=r.manifest_digest,
        publish_id="import-" + secrets.token_urlsafe(24),
        created_at=committed_at,
        committed_at=committed_at,
    )
    s.add(row)
    s.flush()
    pinned = objects.attach(s, row.id, refs, now)
    if pinned.deleting:
        raise errors.IncompletePublish(f"object {pinned.deleting[0]} is being deleted by GC: cannot import")
    s.execute(update(ObjectRow).where(ObjectRow.digest == r.manifest_digest).values(unreferenced_since=None))
    if m.head is None or r.number > m.head:
        m.head = r.number
    s.flush()
    return version_record(row, m.name)


def dump(s: Session, model: str | None) -> dict[str, Any]:
    """Committed versions and heads as plain JSON data (see Catalog.dump_committed)."""
    mstmt = select(ModelRow).where(ModelRow.deleted_at.is_(None)).order_by(ModelRow.name)
    if model is not None:
        mstmt = mstmt.where(ModelRow.id == model_row(s, model).id)
    out: dict[str, Any] = {"models": {}, "versions": []}
    for m in s.scalars(mstmt):
        out["models"][m.name] = {"head": m.head}
        vrows = list(
            s.scalars(
                select(VersionRow)
                .where(VersionRow.model_id == m.id, VersionRow.state == "committed")
                .order_by(VersionRow.number)
            )
        )
        refs: dict[int, list[list[Any]]] = {v.id: [] for v in vrows}
        for vid, d, size in s.execute(
            select(VersionObjectRow.version_id, VersionObjectRow.digest, VersionObjectRow.size)
            .join(VersionRow, VersionRow.id == VersionObjectRow.version_id)
            .where(and_(VersionRow.model_id == m.id, VersionRow.state == "committed"))
            .order_by(VersionObjectRow.version_id, VersionObjectRow.digest)
        ):
            refs[vid].append([d, size])
        for v in vrows:
            out["versions"].append(
                {
                    "model": m.name,
                    "number": v.number,
                    "parent": v.parent,
                    "kind": v.kind,
                    "chain_base": v.chain_base,
                    "step": v.step,
                    "metadata": v.metadata_,
                    "raw_bytes": v.raw_bytes,
                    "stored_bytes": v.stored_bytes,
                    "manifest_digest": v.manifest_digest,
                    "objects": refs[v.id],
                }
            )
    return out
