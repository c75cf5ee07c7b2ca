"""The fleet dashboard's read model (docs/UI.md): what its pages show, composed from ops' reads.

The pages under ``/ui`` (routes/ui.py) render these records; nothing here writes. Lag follows
docs/UI.md: a replica holding version ``n`` of a model whose head is ``h`` is ``h - n``
versions behind, and has been behind since the first version after ``n`` committed; past
``stale_after`` seconds of that it is *stale*. An unhealthy replica holds no version: it has no
lag and is shown as unhealthy instead.
"""

from __future__ import annotations

import asyncio
import math
import shlex
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime

from weightsync import errors
from weightsync.catalog import Model, RelayInfo, Replica, Version, VersionTotals
from weightsync.codec import Manifest
from weightsync.common import model_path_name
from weightsync.ops import Ops
from weightsync.service.auth import Principal

__all__ = [
    "PAGE_SIZE",
    "ChangeWatcher",
    "Chart",
    "ModelPage",
    "ModelSummary",
    "ReplicaView",
    "VersionPage",
    "model_page",
    "models_overview",
    "version_page",
]

PAGE_SIZE = 100
"""Versions per page of a model's timeline (keyset pages: ``before``/``after`` a number)."""


def ratio(raw: int | None, stored: int | None) -> float | None:
    """Raw bytes over stored bytes (the compression ratio), None when either is unknown or stored is 0."""
    if not raw or not stored:
        return None
    return raw / stored


@dataclass(frozen=True)
class ReplicaView:
    """One replica's latest ledger entry with its lag: versions behind the head, and for how long."""

    replica: Replica
    lag_versions: int | None
    behind_since: datetime | None  # when the first version newer than the one held committed
    lag_s: float | None  # seconds since behind_since (0 when current; None when unhealthy)
    stale: bool
    report_age_s: float

    @property
    def site(self) -> str:
        return self.replica.site or "(no site)"

    @property
    def current(self) -> bool:
        return self.replica.status != "unhealthy" and self.lag_versions == 0


@dataclass(frozen=True)
class SiteGroup:
    """The replicas of one site, by subscriber."""

    site: str
    replicas: list[ReplicaView]

    @property
    def current(self) -> int:
        return sum(r.current for r in self.replicas)


@dataclass(frozen=True)
class ModelSummary:
    """A row of the Models page."""

    model: Model
    head: Version | None
    head_age_s: float | None
    totals: VersionTotals
    replicas: int
    current: int
    stale: int
    unhealthy: int

    @property
    def ratio(self) -> float | None:
        return ratio(self.totals.raw_bytes, self.totals.stored_bytes)


@dataclass(frozen=True)
class Bar:
    """One version in the delta-size chart (SVG user units; the template draws them)."""

    version: Version
    x: float
    width: float
    y: float
    height: float
    ratio_y: float | None
    chain_index: int  # which chain of the page it is in (alternating bands)


@dataclass(frozen=True)
class Chart:
    """The stored-bytes-per-version chart of a page of versions: log-scale bars, ratio dots, chain bands."""

    width: int
    height: int
    plot_top: float
    plot_bottom: float
    bars: list[Bar]
    y_ticks: list[tuple[float, int]]  # (y, bytes) on the log axis
    ratio_ticks: list[tuple[float, float]]  # (y, ratio) on the right axis
    band_y: float
    band_height: float
    chains: int


@dataclass(frozen=True)
class ModelPage:
    """The Model page: the model, its totals, one page of its timeline, its replicas by site."""

    model: Model
    head: Version | None
    totals: VersionTotals
    versions: list[Version]  # newest first
    chart: Chart | None
    newer: int | None  # ``after`` of the next newer page (None: this is the newest)
    older: int | None  # ``before`` of the next older page (None: this is the oldest)
    sites: list[SiteGroup]
    stale_after_s: float

    @property
    def replicas(self) -> list[ReplicaView]:
        return [r for g in self.sites for r in g.replicas]


@dataclass(frozen=True)
class FileSummary:
    path: str
    size: int
    tensors: int
    changed: int | None


@dataclass(frozen=True)
class VersionPage:
    """The Version page: the version, its manifest in summary, its lineage and how to pull it."""

    model: Model
    version: Version
    lineage: list[Version]  # keyframe first
    files: list[FileSummary]
    tensors: int
    tensor_bytes: int
    dtypes: list[tuple[str, int, int]]  # (dtype, tensors, bytes), most bytes first
    changed_tensors: int | None  # None for a keyframe
    manifest_format: int | None  # None when the manifest could not be read (manifest_problem says why)
    manifest_problem: str | None = None
    holders: list[ReplicaView] = field(default_factory=list)
    pull_command: str = ""


# --- reads ---------------------------------------------------------------------------------


def _seconds(now: datetime, then: datetime | None) -> float | None:
    return None if then is None else max(0.0, (now - then).total_seconds())


async def replica_views(ops: Ops, model: str, now: datetime, stale_after_s: float) -> list[ReplicaView]:
    """Each subscriber's latest entry with its lag in versions and seconds (one catalog read per version held)."""
    found = await ops.list_replicas(model)
    first_newer: dict[int, datetime | None] = {}
    for number in {r.number for r in found if r.number is not None and r.lag}:
        newer = await ops.list_versions(model, after=number, limit=1)
        first_newer[number] = newer[0].committed_at if newer else None
    out = []
    for r in found:
        since = first_newer.get(r.number) if r.number is not None and r.lag else None
        lag_s = None if r.number is None else (_seconds(now, since) or 0.0)
        out.append(
            ReplicaView(
                replica=r,
                lag_versions=r.lag,
                behind_since=since,
                lag_s=lag_s,
                stale=lag_s is not None and lag_s > stale_after_s,
                report_age_s=_seconds(now, r.applied_at) or 0.0,
            )
        )
    return out


def by_site(views: list[ReplicaView]) -> list[SiteGroup]:
    """Replicas grouped by site (sites by name, the unnamed one last), each group by subscriber."""
    groups: dict[str, list[ReplicaView]] = {}
    for v in sorted(views, key=lambda v: (v.replica.site is None, v.site, v.replica.subscriber)):
        groups.setdefault(v.site, []).append(v)
    return [SiteGroup(site, rows) for site, rows in groups.items()]


async def models_overview(ops: Ops, who: Principal, now: datetime, stale_after_s: float) -> list[ModelSummary]:
    """Every model ``who`` may read, with its head, totals and how many replicas are current."""
    out = []
    for m in await ops.list_models():
        if not who.may_use(m.name):
            continue
        try:
            totals = await ops.version_totals(m.name)
            head = await ops.get_version(m.name) if m.head is not None else None
            views = await replica_views(ops, m.name, now, stale_after_s)
        except errors.NotFound:  # deleted while we looked
            continue
        out.append(
            ModelSummary(
                model=m,
                head=head,
                head_age_s=_seconds(now, head.committed_at) if head else None,
                totals=totals,
                replicas=len(views),
                current=sum(v.current for v in views),
                stale=sum(v.stale for v in views),
                unhealthy=sum(v.replica.status == "unhealthy" for v in views),
            )
        )
    return out


@dataclass(frozen=True)
class RelayModel:
    """What a relay holds of one model, against the head here."""

    name: str
    version: int | None
    behind: int | None
    prefetch_lag_s: float | None


@dataclass(frozen=True)
class RelayView:
    """A relay's last heartbeat as the Models page shows it (only the models the reader may read)."""

    relay: RelayInfo
    heartbeat_age_s: float
    stale: bool
    models: list[RelayModel]


async def relay_views(ops: Ops, who: Principal, now: datetime, stale_after_s: float) -> list[RelayView]:
    """Every relay that heartbeats here (and those below it), with the models ``who`` may read."""
    heads = {m.name: m.pinned if m.pinned is not None else m.head for m in await ops.list_models()}
    out = []
    for r in sorted(await ops.list_relays(), key=lambda r: (r.site or "", r.name)):
        held = []
        for name, state in sorted((r.state.get("models") or {}).items()):
            if not who.may_use(name) or not isinstance(state, dict):
                continue
            version = state.get("version")
            head = heads.get(name)
            behind = head - version if isinstance(version, int) and head is not None else None
            held.append(RelayModel(name, version, behind, state.get("prefetch_lag_s")))
        age = _seconds(now, r.last_seen) or 0.0
        out.append(RelayView(r, age, age > stale_after_s, held))
    return out


async def model_page(
    ops: Ops,
    model: str,
    now: datetime,
    stale_after_s: float,
    *,
    before: int | None = None,
    after: int | None = None,
    page_size: int = PAGE_SIZE,
) -> ModelPage:
    """One page of ``model``'s timeline (the newest, or keyset ``before``/``after`` a number) and its replicas."""
    m = await ops.get_model(model)
    totals = await ops.version_totals(model)
    head = await ops.get_version(model) if m.head is not None else None
    if after is not None:
        page = (await ops.list_versions(model, after=after, limit=page_size))[::-1]
    else:
        page = await ops.list_versions(model, before=before, limit=page_size, descending=True)
    newer = older = None
    if page:
        hi, lo = page[0].number or 0, page[-1].number or 0
        if head is not None and head.number != hi:
            newer = hi
        if await ops.list_versions(model, before=lo, limit=1, descending=True):
            older = lo
    views = await replica_views(ops, model, now, stale_after_s)
    return ModelPage(
        model=m,
        head=head,
        totals=totals,
        versions=page,
        chart=chart(page[::-1]) if page else None,
        newer=newer,
        older=older,
        sites=by_site(views),
        stale_after_s=stale_after_s,
    )


def pull_command(server: str, model: str, number: int) -> str:
    """The exact command that brings a directory to this version."""
    return shlex.join(
        ["weightsync", "pull", model, f"./{model_path_name(model)}", "--version", str(number), "--server", server]
    )


async def version_page(
    ops: Ops, model: str, number: int, server: str, now: datetime, stale_after_s: float
) -> VersionPage:
    """Version ``number`` of ``model``: its manifest summarized, its lineage, the replicas holding it."""
    m = await ops.get_model(model)
    v = await ops.get_version(model, number)
    lineage = await ops.lineage(model, number)
    problem: str | None = None
    try:
        manifest: Manifest | None = await ops.load_manifest(v.manifest_digest or "")
    except errors.WeightsyncError as exc:  # the page still shows what the catalog knows
        manifest, problem = None, f"{exc.title}: {exc}"
    files, dtype_count, dtype_bytes = [], Counter[str](), Counter[str]()
    changed_total = 0
    delta = v.kind == "delta"
    for f in manifest.files if manifest is not None else ():
        tensors = [e for e in f.segments if e.segment.kind == "tensor"]
        changed = sum(not e.unchanged and e.digest != e.base_digest for e in tensors) if delta else None
        changed_total += changed or 0
        for e in tensors:
            dtype_count[e.segment.dtype.name] += 1
            dtype_bytes[e.segment.dtype.name] += e.segment.length
        files.append(FileSummary(f.path, f.size, len(tensors), changed))
    views = [r for r in await replica_views(ops, model, now, stale_after_s) if r.replica.number == number]
    return VersionPage(
        model=m,
        version=v,
        lineage=lineage,
        files=files,
        tensors=sum(dtype_count.values()),
        tensor_bytes=sum(dtype_bytes.values()),
        dtypes=sorted(((d, dtype_count[d], dtype_bytes[d]) for d in dtype_count), key=lambda t: (-t[2], t[0])),
        changed_tensors=changed_total if delta else None,
        manifest_format=None if manifest is None else manifest.version,
        manifest_problem=problem,
        holders=views,
        pull_command=pull_command(server, model, number),
    )


# --- changes, for the live stream ------------------------------------------------------------


class ChangeWatcher:
    """What changes when a version commits, a pin moves or a replica reports, read at most once a ``poll``.

    Every open dashboard stream of the process asks the same one, so N streams on M models cost
    M reads a poll, not N x M. Fingerprints are compared, never trusted for content: a page that
    sees one change fetches itself.
    """

    def __init__(self, ops: Ops, poll: float) -> None:
        self.ops = ops
        self.poll = poll
        self._models: tuple[float, list[str]] | None = None
        self._prints: dict[str, tuple[float, tuple[object, ...] | None]] = {}

    def _fresh(self, at: float) -> bool:
        return asyncio.get_running_loop().time() - at < self.poll

    async def models(self) -> list[str]:
        """Every model's name (any reader's filter applies after)."""
        if self._models is None or not self._fresh(self._models[0]):
            self._models = (asyncio.get_running_loop().time(), [m.name for m in await self.ops.list_models()])
        return self._models[1]

    async def fingerprint(self, model: str) -> tuple[object, ...] | None:
        """(head, pin) and (replicas, newest report) of ``model``; None when there is no such model."""
        cached = self._prints.get(model)
        if cached is not None and self._fresh(cached[0]):
            return cached[1]
        now = asyncio.get_running_loop().time()
        try:
            m = await self.ops.get_model(model)
            replicas = await self.ops.list_replicas(model)
        except errors.NotFound:
            found: tuple[object, ...] | None = None
        else:
            found = ((m.head, m.pinned), (len(replicas), max((r.applied_at for r in replicas), default=None)))
        if len(self._prints) > 10_000:  # names asked for that never existed: keep the cache bounded
            self._prints.clear()
        self._prints[model] = (now, found)
        return found


# --- the chart -----------------------------------------------------------------------------

_W, _H = 960, 260
_LEFT, _RIGHT, _TOP, _BOTTOM = 64, 48, 12, 200
_BAND_Y, _BAND_H = 212, 14


def chart(versions: list[Version]) -> Chart:
    """Geometry of the stored-bytes chart for ``versions`` (oldest first): bars on a log axis, ratio dots.

    Keyframes are ~20-200x their deltas, so a linear axis would flatten every delta: the bytes
    axis is logarithmic, ticked at powers of two.
    """
    sizes = [max(1, v.stored_bytes or 1) for v in versions]
    lo = math.log2(max(1, min(sizes) // 2))
    hi = math.log2(max(sizes)) + 0.25
    span = max(hi - lo, 1.0)
    plot_h = _BOTTOM - _TOP
    step = (_W - _LEFT - _RIGHT) / max(1, len(versions))
    ratios = [ratio(v.raw_bytes, v.stored_bytes) for v in versions]
    top_ratio = max([r for r in ratios if r] or [1.0])
    top_ratio = _nice_ceiling(top_ratio)

    def y_of(n: float) -> float:
        return _BOTTOM - (math.log2(n) - lo) / span * plot_h

    bars, chain_index, last_base = [], -1, object()
    for i, (v, r) in enumerate(zip(versions, ratios, strict=True)):
        if v.chain_base != last_base:
            chain_index, last_base = chain_index + 1, v.chain_base
        y = y_of(sizes[i])
        bars.append(
            Bar(
                version=v,
                x=_LEFT + i * step + step * 0.1,
                width=max(step * 0.8, 1.0),
                y=y,
                height=_BOTTOM - y,
                ratio_y=None if r is None else _BOTTOM - r / top_ratio * plot_h,
                chain_index=chain_index,
            )
        )
    # Ticks at powers of two, every 1, 2, 5 or 10 of them: at most five on the axis.
    every = next(e for e in (1, 2, 5, 10, 20) if (hi - lo) / e <= 5)
    y_ticks = [(y_of(2.0**p), 2**p) for p in range(math.ceil(lo / every) * every, math.floor(hi) + 1, every)]
    if not y_ticks:  # a range within one power of two: label its ends
        y_ticks = [(y_of(min(sizes)), min(sizes)), (y_of(max(sizes)), max(sizes))]
    ratio_ticks = [(_BOTTOM - f * plot_h, top_ratio * f) for f in (0.0, 0.5, 1.0)]
    return Chart(_W, _H, _TOP, _BOTTOM, bars, y_ticks, ratio_ticks, _BAND_Y, _BAND_H, chain_index + 1)


def _nice_ceiling(x: float) -> float:
    """The smallest of 1, 2, 5 × 10^k at or above ``x``."""
    k = 10 ** math.floor(math.log10(x))
    for f in (1, 2, 5, 10):
        if f * k >= x:
            return float(f * k)
    return 10.0 * k
