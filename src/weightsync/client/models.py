"""Types of the client SDK: the API's JSON objects (docs/API.md "Shapes") and the results of push and pull.

The API types parse an answer with ``from_json``: every field this client knows is
checked strictly (a missing field or a wrong type raises :class:`weightsync.errors.BadResponse`),
fields it does not know are ignored, so a newer server never breaks an older client.
Their field names are the service's (``weightsync.service.schemas``), which a test holds
equal. ``to_dict`` gives the JSON form back (timestamps ISO 8601, ``Z`` for UTC), which
is what the CLI prints. All are frozen dataclasses.
"""

from __future__ import annotations

import dataclasses
import types
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any, ClassVar, TypeVar, Union, get_args, get_origin, get_type_hints

from weightsync import errors

_W = TypeVar("_W", bound="Wire")


class Wire:
    """Base of the API types: strict ``from_json`` for known fields, unknown fields ignored; ``to_dict``."""

    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]  # every subclass is a dataclass

    @classmethod
    def from_json(cls: type[_W], data: object) -> _W:
        """Parse one JSON object of this shape; BadResponse when a known field is missing or mistyped."""
        return _parse_object(cls, data, cls.__name__)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form of this object (what the server sent, less the fields this client ignores)."""
        out = _json_value(self)
        assert isinstance(out, dict)
        return out


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    """The resolved field annotations of ``cls`` (cached: resolving them is slow)."""
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = get_type_hints(cls)
    return hints


def _bad(where: str, expected: str, value: object) -> errors.BadResponse:
    got = "null" if value is None else type(value).__name__
    return errors.BadResponse(f"bad response from the server: {where}: expected {expected}, got {got}")


def _parse_object(cls: type[_W], data: object, where: str) -> _W:
    if not isinstance(data, dict):
        raise _bad(where, "an object", data)
    hints = _hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise errors.BadResponse(f"bad response from the server: {where}.{f.name} is missing")
            continue
        values[f.name] = _parse(hints[f.name], data[f.name], f"{where}.{f.name}")
    return cls(**values)


def _parse(tp: Any, value: object, where: str) -> Any:
    """``value`` checked against the annotation ``tp`` (the JSON subset the API uses)."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin is Union or origin is types.UnionType:
        options = [a for a in get_args(tp) if a is not type(None)]
        if value is None and len(options) < len(get_args(tp)):
            return None
        (only,) = options  # the API's unions are all "X or null"
        return _parse(only, value, where)
    if tp is bool:
        if not isinstance(value, bool):
            raise _bad(where, "a boolean", value)
        return value
    if tp is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise _bad(where, "an integer", value)
        return value
    if tp is float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise _bad(where, "a number", value)
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise _bad(where, "a string", value)
        return value
    if tp is datetime:
        if not isinstance(value, str):
            raise _bad(where, "an ISO 8601 timestamp", value)
        try:
            return datetime.fromisoformat(value.replace("Z", "+00:00", 1) if value.endswith("Z") else value)
        except ValueError:
            raise _bad(where, "an ISO 8601 timestamp", value) from None
    if origin is list:
        if not isinstance(value, list):
            raise _bad(where, "an array", value)
        (item,) = get_args(tp)
        return [_parse(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise _bad(where, "an object", value)
        _, item = get_args(tp)
        return {k: _parse(item, v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(tp, type) and issubclass(tp, Wire):
        return _parse_object(tp, value, where)
    raise TypeError(f"no JSON parser for {tp!r} ({where})")  # a programming error in this module


def timestamp(value: datetime) -> str:
    """A timestamp as the API writes it: ISO 8601, ``Z`` for UTC (what ``to_dict`` and the CLI print)."""
    return value.isoformat().replace("+00:00", "Z")


def _json_value(value: object) -> object:
    if isinstance(value, datetime):
        return timestamp(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _json_value(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, list):
        return [_json_value(v) for v in value]
    if isinstance(value, dict):
        return {k: _json_value(v) for k, v in value.items()}
    return value


# --- the API's objects (docs/API.md "Shapes"; service: weightsync.service.schemas) -------------


@dataclass(frozen=True)
class Health(Wire):
    """``GET /healthz``."""

    status: str


@dataclass(frozen=True)
class Model(Wire):
    """A model, its head, its chain and retention settings and its pin (docs/API.md, Model)."""

    name: str
    head: int | None
    created_at: datetime
    keyframe_interval: int
    max_chain_ratio: float
    keep_last: int | None
    pinned: int | None = None
    """The version followers hold instead of the head; None: the head (and from servers without pins)."""


@dataclass(frozen=True)
class DeletedModel(Wire):
    """``DELETE /v1/models/{model}``: what went; GC reclaims the objects after its grace period."""

    name: str
    versions_deleted: list[int]
    publishes_aborted: int
    deleted_at: datetime


@dataclass(frozen=True)
class Info(Wire):
    """``GET /v1/info``: the server's id (stable, shared by every service on one catalog), release, formats."""

    id: str
    version: str
    formats: list[int]


@dataclass(frozen=True)
class ModelList(Wire):
    """``GET /v1/models``: the models the caller may read."""

    models: list[Model]


@dataclass(frozen=True)
class Version(Wire):
    """A committed version as the server describes it (docs/API.md, Version); also what commit and watch return."""

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
    committed_at: datetime


@dataclass(frozen=True)
class VersionList(Wire):
    """``GET /v1/models/{model}/versions``: one page of committed versions, oldest first."""

    versions: list[Version]


@dataclass(frozen=True)
class PlanObject(Wire):
    """An object extent a plan step needs: ``size`` is the bytes its frames use (the extent to fetch)."""

    digest: str
    size: int


@dataclass(frozen=True)
class PlanStep(Wire):
    """One version of a plan: its manifest and the object extents its frames use."""

    number: int
    kind: str
    manifest: str
    manifest_bytes: int
    stored_bytes: int
    objects: list[PlanObject]


@dataclass(frozen=True)
class Plan(Wire):
    """What to fetch to go from ``have`` to ``target`` (docs/API.md, Plan)."""

    model: str
    have: int | None
    target: int
    bytes: int
    full_bytes: int
    lease_expires_at: datetime | None
    steps: list[PlanStep]


@dataclass(frozen=True)
class PublishBegin(Wire):
    """An open publish: encode a keyframe or a delta against ``parent`` (docs/API.md, Begin)."""

    model: str
    publish_id: str
    kind: str
    parent: int | None
    parent_manifest: str | None
    expires_at: datetime | None
    missing: list[str] | None = None
    """When the begin listed objects and they were checked: which to upload (as CheckObjects)."""
    formats: list[int] | None = None
    """The manifest formats the server reads (None: a server that predates format 2 reads format 1 only)."""
    uploads: dict[str, PresignedPut] | None = None

    def checked(self) -> CheckObjects | None:
        """The objects check that came with this answer, or None when there was none."""
        return None if self.missing is None else CheckObjects(missing=self.missing, uploads=self.uploads)


@dataclass(frozen=True)
class PresignedPut(Wire):
    """An upload straight to the object store: send exactly these headers."""

    method: str
    url: str
    headers: dict[str, str]


@dataclass(frozen=True)
class CheckObjects(Wire):
    """Which objects the store lacks; ``uploads`` (a request per missing digest) only when the store presigns."""

    missing: list[str]
    uploads: dict[str, PresignedPut] | None = None


@dataclass(frozen=True)
class Replica(Wire):
    """A replica-ledger entry: from ``applied_at`` on, ``subscriber`` holds ``version`` (docs/API.md, Replica).

    ``status``: ``serving`` (an engine serves the version, verified), ``applied`` (a subscriber
    wrote it), ``unhealthy`` (the engine holds no verified version: ``version`` and ``lag`` are
    None). ``lag``: the head, when the server answered, minus ``version``. A server that predates
    these fields is read as ``applied`` with no mode, engine or lag.
    """

    model: str
    subscriber: str
    version: int | None
    applied_at: datetime
    pause_ms: float | None
    bytes: int | None
    site: str | None
    host: str | None
    extra: dict[str, Any]
    status: str = "applied"
    mode: str | None = None
    engine: str | None = None
    lag: int | None = None


@dataclass(frozen=True)
class ReplicaList(Wire):
    """``GET /v1/models/{model}/replicas``: ledger entries, newest per subscriber unless ``all``."""

    replicas: list[Replica]


@dataclass(frozen=True)
class RelayModel(Wire):
    """What a relay holds of one model: the newest version it mirrored, and how long after its commit."""

    version: int
    prefetch_lag_s: float | None = None


@dataclass(frozen=True)
class Relay(Wire):
    """A relay's latest heartbeat (docs/API.md "Relays"): ``age_s`` since it, at read time."""

    name: str
    site: str | None
    upstream: str | None
    degraded: bool
    models: dict[str, RelayModel]
    first_seen: datetime
    last_seen: datetime
    age_s: float


@dataclass(frozen=True)
class RelayList(Wire):
    """``GET /v1/relays``: every relay that reported to the server, by name."""

    relays: list[Relay]


@dataclass(frozen=True)
class FsckProblem(Wire):
    """One finding of fsck, and whether ``repair`` fixed it."""

    code: str
    detail: str
    model: str | None
    number: int | None
    digest: str | None
    repaired: bool


@dataclass(frozen=True)
class FsckReport(Wire):
    """What fsck checked and found (docs/API.md, FsckReport); ``ok`` is False while problems remain."""

    ok: bool
    versions_checked: int
    objects_checked: int
    bytes_verified: int
    problems: list[FsckProblem]


@dataclass(frozen=True)
class GcReport(Wire):
    """What gc deleted, or with ``dry_run`` would delete (docs/API.md, GcReport)."""

    versions_deleted: dict[str, list[int]]
    pending_expired: int
    objects_deleted: int
    bytes_deleted: int
    objects_kept_in_grace: int
    leases_purged: int = 0  # absent from servers older than lease purging, which purged none


# --- results of push and pull ---------------------------------------------------------------


@dataclass(frozen=True)
class PublishResult:
    """What one publish did. `bytes_sent` counts object and manifest bytes uploaded by this call.

    `bytes_received` is what a publisher whose base was behind the head downloaded
    to catch up before diffing (``on_mismatch="download"``); usually 0.

    `timings` (seconds): ``begin_s``, ``encode_s`` (encode and pack), ``upload_s`` (the uploads; a
    version in one request: that request, its commit included), ``commit_s``, ``cache_s`` (keeping
    the next base), and the server's phases where it said them (``server_*``). A keyframe that
    uploads as it encodes counts the uploads made meanwhile in ``encode_s`` and those that outlast
    the encode in ``upload_s``.
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
    warnings: tuple[str, ...] = ()
    """What the publish left out of the version (pickle files beside safetensors weights), one line each."""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["bytes"] = self.bytes_sent
        return d


@dataclass(frozen=True)
class PullResult:
    """What one pull did. `bytes_received` counts object and manifest bytes downloaded by this call.

    `mode` is "full" (rebuilt from a keyframe), "delta" (incremental from what the
    directory held), "current" (already at the version) or "adopted" (a directory
    weightsync did not manage already held the version's files, taken over as they are). `adopted` counts
    the files kept as they were by ``pull --adopt``: all of them in mode "adopted"; some in mode "full",
    where only the other files' frames were downloaded. `repaired` is True when the
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
    adopted: int = 0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["bytes"] = self.bytes_received
        return d
