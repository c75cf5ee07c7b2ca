"""Result types of the client SDK (plain frozen dataclasses; `to_dict` gives the JSON the CLI prints)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Version:
    """A committed version as the server describes it (docs/API.md, Version)."""

    model: str
    number: int
    parent: int | None
    kind: str
    chain_base: int | None
    step: int | None
    metadata: dict[str, Any]
    raw_bytes: int
    stored_bytes: int
    manifest: str
    committed_at: str | None

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Version:
        return cls(model=d["model"], number=int(d["number"]), parent=d.get("parent"), kind=d.get("kind", ""),
                   chain_base=d.get("chain_base"), step=d.get("step"), metadata=d.get("metadata") or {},
                   raw_bytes=int(d.get("raw_bytes") or 0), stored_bytes=int(d.get("stored_bytes") or 0),
                   manifest=d.get("manifest", ""), committed_at=d.get("committed_at"))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class PublishResult:
    """What one publish did. `bytes_sent` counts object and manifest bytes uploaded by this call.

    `bytes_received` is what a publisher whose base was behind the head downloaded
    to catch up before diffing (``on_mismatch="download"``); usually 0.
    """

    model: str
    version: int
    kind: str
    parent: int | None
    bytes_sent: int
    raw_bytes: int
    stored_bytes: int
    objects_total: int
    objects_uploaded: int
    manifest: str
    step: int | None
    seconds: float
    bytes_received: int = 0
    timings: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["bytes"] = self.bytes_sent
        return d


@dataclass(frozen=True)
class PullResult:
    """What one pull did. `bytes_received` counts object and manifest bytes downloaded by this call.

    `mode` is "full" (rebuilt from a keyframe), "delta" (incremental from what the
    directory held) or "current" (already at the version). `repaired` is True when the
    directory no longer matched its state file and was rebuilt by a full pull.
    """

    model: str
    version: int
    previous: int | None
    mode: str
    steps: int
    bytes_received: int
    plan_bytes: int
    full_bytes: int
    raw_bytes: int
    files: int
    objects_fetched: int
    objects_cached: int
    repaired: bool
    seconds: float
    timings: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["bytes"] = self.bytes_received
        return d
