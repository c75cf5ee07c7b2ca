"""Small builders shared by the catalog tests."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime

from weightsync.catalog import Catalog, Version

#: A fixed clock start, so expiry and grace tests never depend on the wall clock.
T0 = datetime(2030, 1, 1, tzinfo=UTC)


def digest(label: str) -> str:
    """A deterministic, valid object digest for ``label``."""
    return hashlib.sha256(label.encode()).hexdigest()


def publish(
    cat: Catalog,
    model: str,
    *,
    parent: int | None,
    kind: str | None = None,
    tag: str = "",
    objects: list[tuple[str, int]] | None = None,
    stored_bytes: int = 100,
    now: datetime | None = None,
    **begin: object,
) -> Version:
    """Begin and commit one version on top of ``parent``; return the committed version."""
    kind = kind or ("keyframe" if parent is None else "delta")
    tag = tag or f"{model}-{parent}-{kind}"
    p = cat.begin_version(model, parent=parent, kind=kind, now=now, **begin)  # type: ignore[arg-type]
    return cat.commit_version(
        model,
        p.publish_id,
        parent=parent,
        manifest_digest=digest("manifest:" + tag),
        objects=objects if objects is not None else [(digest("pack:" + tag), stored_bytes)],
        raw_bytes=1000,
        stored_bytes=stored_bytes,
        kind=kind,
        now=now,
    )
