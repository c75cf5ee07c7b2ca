"""Plain, immutable records the catalog returns (never ORM objects bound to a session)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any


@dataclass(frozen=True, slots=True)
class Model:
    """A model: its head, its chain and retention settings, and the version it is pinned to (None: the head)."""

    name: str
    created_at: datetime
    head: int | None
    keyframe_interval: int
    max_chain_ratio: float
    keep_last: int | None
    pinned: int | None


@dataclass(frozen=True, slots=True)
class Version:
    """A version row. ``number`` is None while the version is pending (numbers are given at commit)."""

    model: str
    number: int | None
    parent: int | None
    kind: str
    chain_base: int | None
    state: str
    step: int | None
    metadata: dict[str, Any]
    raw_bytes: int | None
    stored_bytes: int | None
    manifest_digest: str | None
    publish_id: str
    idempotency_key: str | None
    created_at: datetime
    committed_at: datetime | None
    expires_at: datetime | None
    deleted_at: datetime | None


@dataclass(frozen=True, slots=True)
class VersionTotals:
    """A model's committed versions in sum: how many (keyframes among them), their raw and stored bytes."""

    versions: int
    keyframes: int
    raw_bytes: int
    stored_bytes: int


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """An object the catalog knows of; ``state`` "deleting" means GC is deleting its bytes (never reference it)."""

    digest: str
    size: int
    first_seen: datetime
    unreferenced_since: datetime | None
    state: str = "live"
    deleting_since: datetime | None = None


@dataclass(frozen=True, slots=True)
class RelayInfo:
    """A relay's latest heartbeat: who and where it is, what it follows, whether degraded, what it holds."""

    name: str
    site: str | None
    upstream: str | None
    degraded: bool
    state: dict[str, Any]
    first_seen: datetime
    last_seen: datetime


@dataclass(frozen=True, slots=True)
class Lease:
    """A reader's hold on the chain ending at ``number``."""

    model: str
    number: int
    holder: str
    acquired_at: datetime
    expires_at: datetime


@dataclass(frozen=True, slots=True)
class Replica:
    """One replica-ledger entry: from ``applied_at`` on, ``subscriber`` holds version ``number``.

    ``status`` is one of ``schema.REPLICA_STATUSES``; ``number`` is None exactly when it is
    "unhealthy" (the engine holds no verified version). ``lag`` is computed when the entry is
    read: the model's head then minus ``number`` (None for an unhealthy entry).
    """

    model: str
    subscriber: str
    number: int | None
    applied_at: datetime
    pause_ms: float | None
    bytes_received: int | None
    site: str | None
    host: str | None
    extra: dict[str, Any]
    status: str = "applied"
    mode: str | None = None
    engine: str | None = None
    lag: int | None = None


@dataclass(frozen=True, slots=True)
class ChainInfo:
    """The chain a version belongs to, as the publisher's keyframe policy needs it."""

    base: int
    length: int  # versions in the chain up to and including the asked one, keyframe included
    keyframe_bytes: int  # stored bytes of the keyframe
    delta_bytes: int  # stored bytes of the deltas after the keyframe, cumulative


@dataclass(frozen=True, slots=True)
class ImportedVersion:
    """A committed version as recorded in its manifest, for rebuilding a lost catalog."""

    number: int
    parent: int | None
    kind: str
    chain_base: int
    manifest_digest: str
    raw_bytes: int
    stored_bytes: int
    objects: list[tuple[str, int]] = field(default_factory=list)
    step: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    committed_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class Pinned:
    """What :meth:`Catalog.reference_objects` did: references it added, and objects it refused.

    ``deleting`` objects are being deleted by GC: they were not referenced, and the publisher
    must upload them again once GC is done (the store may still hold their bytes meanwhile).
    """

    added: tuple[str, ...]
    deleting: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Target:
    """What followers of a model hold: the pinned version, or the head (None before the first commit)."""

    version: Version | None
    pinned: bool

    def news_for(self, after: int | None) -> bool:
        """Whether a follower holding ``after`` (None: nothing) must move: to a pin other than it, or a newer head."""
        if self.version is None or self.version.number is None:
            return False
        if after is None:
            return True
        return self.version.number != after if self.pinned else self.version.number > after


@dataclass(frozen=True, slots=True)
class DeletedModel:
    """What :meth:`Catalog.delete_model` did: the committed versions it deleted and the publishes it aborted."""

    name: str
    versions: tuple[Version, ...]
    aborted: tuple[Version, ...]
    deleted_at: datetime
