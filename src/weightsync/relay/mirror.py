"""The relay's background work: follow the upstream, mirror versions, fetch objects once, forward reports.

Order of a mirrored version (the relay's form of DESIGN invariant 2): the manifest (hashed
against the version's digest, stored), then every object the version's chain needs (fetched
from the upstream, hashed by the store while it writes a temporary file, renamed only when the
SHA-256 is its name), then the catalog row under the upstream's number, lineage and commit time
(``Ops.import_version``), which is what wakes local watchers. A relay killed anywhere leaves at
most whole objects without a row; the next sync finds them held and goes on.

Object fetches are single-flight: one task per digest, which every local request for the
object (and the prefetch) shares. A request streams the bytes as they arrive (its range of
them; the last byte only once the store verified the object: weightsync/relay/inflight.py), or,
for an object too large to hold in memory, waits and reads it from the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import secrets
from collections.abc import AsyncIterator, Coroutine
from datetime import UTC, datetime, timedelta
from typing import Any

from weightsync import errors
from weightsync.catalog import ImportedVersion
from weightsync.client import models
from weightsync.codec import Manifest
from weightsync.common import Backoff
from weightsync.ops import Ops
from weightsync.ops.admin import delete_model, pin_model
from weightsync.relay.inflight import InFlight
from weightsync.relay.metrics import RelayMetrics
from weightsync.relay.settings import RelaySettings
from weightsync.relay.upstream import Upstream
from weightsync.service.auth import model_pattern
from weightsync.store import PutResult

__all__ = ["Mirror"]

log = logging.getLogger("weightsync.relay")

PAGE = 1000
_RETRY = Backoff(attempts=1, base=0.5, cap=10.0)
_FORWARD_QUEUE = 10_000
_HEADS = 8  # sizes of history objects asked at once (HEAD)
STORE_PIECE = 1 << 20  # bytes handed to the store at a time while fetching
# Replicas sharing a catalog claim a fetch for this long (renewed while it runs), and poll this often
# for an object another replica is fetching.
CLAIM_TTL = timedelta(seconds=60)
CLAIM_POLL_S = 0.25


class Mirror:
    """One relay's mirror of its upstream: the follower tasks, the single-flight fetches, the report queue.

    All methods run on the app's event loop; :meth:`start` and :meth:`stop` bracket the app's life.
    """

    def __init__(self, ops: Ops, upstream: Upstream, settings: RelaySettings, metrics: RelayMetrics) -> None:
        self.ops = ops
        self.upstream = upstream
        self.settings = settings
        self.metrics = metrics
        self.patterns = [model_pattern(p) for p in settings.model_patterns()]
        self.site = settings.site_name()
        # This process among the replicas that may share the catalog (fetch claims).
        self.holder = f"relay@{self.site}/{secrets.token_hex(6)}"
        self.upstream_ok: bool | None = None  # None: not asked yet
        self.last_error: str | None = None
        self._fetches: dict[str, asyncio.Future[int]] = {}
        self._inflight: dict[str, InFlight] = {}  # the bytes of each running fetch, for readers to stream
        self._fetch_slots = asyncio.Semaphore(settings.prefetch_concurrency)
        self._head_slots = asyncio.Semaphore(_HEADS)
        self._locks: dict[str, asyncio.Lock] = {}
        self._followers: dict[str, asyncio.Task[None]] = {}
        self._upstream_models: dict[str, models.Model] = {}  # the upstream's record of each model, as last read
        self._tasks: set[asyncio.Task[Any]] = set()
        self._reports: asyncio.Queue[tuple[str, dict[str, Any]]] = asyncio.Queue(_FORWARD_QUEUE)
        self._below: dict[str, dict[str, Any]] = {}  # relays below this one: their latest heartbeat
        self._last_mirrored: dict[str, tuple[int, float]] = {}  # model -> (number, prefetch lag) of the newest
        self._upstream_leases: dict[tuple[str, int], tuple[datetime, datetime]] = {}  # -> (taken, expires)

    # --- life -------------------------------------------------------------------------

    def start(self) -> None:
        """Start following the upstream (its model list, then each mirrored model's events) and forwarding."""
        self._spawn(self._discover())
        self._spawn(self._forward())
        self._spawn(self._heartbeats())
        if self.settings.evict_keep is not None:
            self._spawn(self._evict_periodically())

    async def stop(self) -> None:
        """Cancel every task (fetches included) and wait for them; nothing half-written is left (the store)."""
        tasks = [*self._tasks, *self._followers.values(), *self._fetches.values()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.upstream.close()

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    @property
    def degraded(self) -> bool:
        """Whether the upstream failed the last time it was asked (the relay serves what it holds)."""
        return self.upstream_ok is False

    def _reached(self) -> None:
        if self.upstream_ok is not True:
            log.info("upstream %s reachable", self.upstream.url)
        self.upstream_ok = True
        self.last_error = None
        self.metrics.upstream_up.set(1)

    def _failed(self, exc: BaseException) -> None:
        """Note an upstream failure: unreachable or refusing this relay's token (degraded), or another (logged)."""
        if isinstance(exc, (errors.ServerUnavailable, errors.AuthError)):
            if self.upstream_ok is not False:
                log.warning("upstream %s unreachable, serving what this relay holds: %s", self.upstream.url, exc)
            self.upstream_ok = False
            self.metrics.upstream_up.set(0)
        else:
            log.warning("upstream %s: %s: %s", self.upstream.url, type(exc).__name__, exc)
        self.last_error = str(exc)

    def mirrors(self, model: str) -> bool:
        """Whether ``model`` is one this relay mirrors (``--models`` patterns)."""
        return any(p.fullmatch(model) for p in self.patterns)

    # --- following ----------------------------------------------------------------------

    async def _discover(self) -> None:
        """Read the upstream's model list every ``relay_poll_s``: follow new models, catch up missed changes."""
        while True:
            try:
                found = await self.upstream.list_models()
                self._reached()
                for m in found:
                    if not self.mirrors(m.name):
                        continue
                    self._upstream_models[m.name] = m
                    follower = self._followers.get(m.name)
                    if follower is None or follower.done():
                        self._followers[m.name] = asyncio.ensure_future(self._follow(m.name))
                    elif await self._behind(m) and not self._lock(m.name).locked():
                        self.spawn_logged(self.sync(m.name))
                listed = {m.name for m in found}
                for local in await self.ops.list_models():
                    if local.name not in listed and self.mirrors(local.name):
                        await self._forget_if_gone(local.name)
                await self._renew_leases()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the loop must outlive any failure; logged
                self._failed(exc)
            await asyncio.sleep(self.settings.relay_poll_s)

    async def _follow(self, model: str) -> None:
        """Sync ``model``, then once per upstream event; reconnect with backoff. Ends when the upstream deletes it."""
        attempt = 0
        while True:
            try:
                await self.sync(model)
                after = (await self._local_head(model))[0]
                async for version in self.upstream.events(model, after=after):
                    self._reached()
                    if not await self._next(model, version):
                        await self.sync(model)
                    attempt = 0
                log.info("upstream ended the event stream of %s (deleted there)", model)
                await self._forget_if_gone(model)
                return
            except asyncio.CancelledError:
                raise
            except errors.ModelNotFound:
                # Deleted upstream between the list and the sync: the list brings it back if it returns.
                await self._forget_if_gone(model)
                return
            except Exception as exc:  # noqa: BLE001 - logged; retried with backoff
                self._failed(exc)
            await asyncio.sleep(_RETRY.delay(attempt))
            attempt += 1

    async def _forget_if_gone(self, model: str) -> None:
        """Delete the mirror of ``model`` once the upstream itself answers that it has no such model.

        Only a ModelNotFound from the upstream counts (an unreachable upstream proves nothing): a model
        deleted there, even while this relay was down, stops being served here. Its objects go to GC.
        """
        try:
            await self.upstream.get_model(model)
            return
        except errors.ModelNotFound:
            pass
        async with self._lock(model):
            try:
                await delete_model(self.ops, model)
            except errors.ModelNotFound:
                return
        self._upstream_models.pop(model, None)
        self._last_mirrored.pop(model, None)
        log.info("model %s was deleted upstream: deleted here too", model)

    def spawn_logged(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` in the background (cancelled at :meth:`stop`); a failure is noted as the upstream's."""

        async def run() -> None:
            try:
                await coro
            except Exception as exc:  # noqa: BLE001 - background work: logged, retried by the next tick
                self._failed(exc)

        self._spawn(run())

    def _lock(self, model: str) -> asyncio.Lock:
        return self._locks.setdefault(model, asyncio.Lock())

    async def _local_head(self, model: str) -> tuple[int | None, int | None]:
        """The local (head, pinned) of ``model``; (None, None) when it does not exist here."""
        try:
            m = await self.ops.get_model(model)
        except errors.ModelNotFound:
            return None, None
        return m.head, m.pinned

    async def _behind(self, up: models.Model) -> bool:
        head, pinned = await self._local_head(up.name)
        return (up.head is not None and (head is None or up.head > head)) or pinned != up.pinned

    async def _next(self, model: str, v: models.Version) -> bool:
        """Mirror ``v`` straight from its event when it is the version after the local head: the usual case.

        Its manifest and objects are fetched at once, without asking the upstream for the model, the
        lineage and the versions after the head first (three WAN round trips before the first byte). The
        model's settings are those of the last :meth:`sync`. False (nothing done) when ``v`` is not next,
        the model is pinned here or upstream, or no sync has read the model yet: :meth:`sync` then runs.
        """
        up = self._upstream_models.get(model)
        if up is None or up.pinned is not None:
            return False
        async with self._lock(model):
            head, pinned = await self._local_head(model)
            if head is None or pinned is not None or v.parent != head or v.number <= head:
                return False
            await self._mirror_version(up, v, prefetch=True)
            self._announce(model)
            return True

    async def sync(self, model: str) -> int:
        """Mirror every upstream version of ``model`` above the local head, in order, and its pin; how many."""
        async with self._lock(model):
            up = await self.upstream.get_model(model)
            self._upstream_models[model] = up
            self._reached()
            head, pinned = await self._local_head(model)
            count = 0
            if up.head is not None and (head is None or up.head > head):
                target = up.pinned if up.pinned is not None else up.head
                chain = {v.number for v in await self.upstream.lineage(model, target)}
                after = head or 0
                while True:
                    page = await self.upstream.list_versions(model, after=after, limit=PAGE)
                    for v in page:
                        await self._mirror_version(up, v, prefetch=v.number in chain or v.number >= target)
                        after = v.number
                        count += 1
                    if len(page) < PAGE:
                        break
            if up.pinned != pinned and (head is not None or count):
                await pin_model(self.ops, model, up.pinned)
            if count:
                self._announce(model)
            return count

    async def _mirror_version(self, up: models.Model, v: models.Version, *, prefetch: bool) -> None:
        """Store ``v``'s manifest, its objects (``prefetch``; else their sizes only), then its catalog row."""
        data = await self.upstream.manifest(up.name, v.number)
        if hashlib.sha256(data).hexdigest() != v.manifest:
            raise errors.DigestMismatch(f"upstream manifest of {up.name} v{v.number} does not hash to {v.manifest}")
        self.metrics.upstream_bytes.inc(len(data))
        await self.ops.put_bytes(data, expected_digest=v.manifest)
        manifest = await asyncio.to_thread(Manifest.decode, data)
        digests = sorted(manifest.objects())
        sizes = await asyncio.gather(*(self._size(d, fetch=prefetch) for d in digests))
        record = ImportedVersion(
            number=v.number,
            parent=v.parent,
            kind=v.kind,
            chain_base=v.chain_base if v.chain_base is not None else v.number,
            manifest_digest=v.manifest,
            raw_bytes=v.raw_bytes,
            stored_bytes=v.stored_bytes,
            objects=list(zip(digests, sizes, strict=True)),
            step=v.step,
            metadata=v.metadata,
            committed_at=v.committed_at,
        )
        await self.ops.import_version(
            up.name,
            record,
            keyframe_interval=up.keyframe_interval,
            max_chain_ratio=up.max_chain_ratio,
            keep_last=None,  # every row is mirrored; what a relay evicts is bytes
        )
        lag = max(0.0, (datetime.now(UTC) - v.committed_at).total_seconds())
        self.metrics.versions_mirrored.inc()
        self.metrics.prefetch_lag.observe(lag)
        self.metrics.last_lag.labels(up.name).set(lag)
        self._last_mirrored[up.name] = (v.number, lag)
        log.info(
            "mirrored %s v%d (%s, %s objects%s)",
            up.name,
            v.number,
            v.kind,
            len(digests),
            "" if prefetch else ", sizes only",
        )

    async def _size(self, digest: str, *, fetch: bool) -> int:
        """The object's size: held here, else fetched (``fetch``), else asked of the upstream."""
        with contextlib.suppress(errors.ObjectNotFound):
            return (await self.ops.store.stat(digest)).size
        if fetch:
            return await self.fetch(digest)
        async with self._head_slots:
            return await self.upstream.object_size(digest)

    # --- leases upstream ---------------------------------------------------------------------

    async def hold_upstream(self, model: str, number: int) -> None:
        """Hold version ``number``'s chain at the upstream while a local reader holds it here.

        A local plan with a ``holder`` leases the chain in this relay's catalog; the same chain
        leased upstream (holder ``relay@<site>``) keeps the upstream's retention and gc off the
        objects this relay may still have to fetch for that reader. Renewed at half its life while
        a local lease on it lasts (:meth:`_renew_leases`).
        """
        now = datetime.now(UTC)
        held = self._upstream_leases.get((model, number))
        if held is not None and now < held[0] + (held[1] - held[0]) / 2:
            return
        expires = await self.upstream.hold(model, number, self.name)
        if expires is not None:
            self._upstream_leases[(model, number)] = (now, expires)
            self.metrics.upstream_leases.set(len(self._upstream_leases))

    async def _renew_leases(self) -> None:
        """Renew the upstream leases of the chains local readers still hold; forget the others."""
        local = {(lease.model, lease.number) for lease in await self.ops.active_leases()}
        for key in list(self._upstream_leases):
            if key not in local:
                del self._upstream_leases[key]  # left to expire upstream
        self.metrics.upstream_leases.set(len(self._upstream_leases))
        for model, number in sorted(local):
            if self.mirrors(model):
                await self.hold_upstream(model, number)

    # --- eviction ---------------------------------------------------------------------------

    async def _evict_periodically(self) -> None:
        while True:
            await asyncio.sleep(self.settings.evict_interval_s)
            try:
                await self.evict()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - retried at the next interval
                log.warning("eviction failed: %s: %s", type(exc).__name__, exc)

    async def evict(self) -> int:
        """Delete the bytes of objects no kept chain needs; the bytes evicted. Catalog rows stay.

        Kept, over every model here (objects are shared between models): each chain (versions with one
        chain base) holding one of the model's newest ``evict_keep`` versions, the pinned version or a
        leased one. Safe against readers by construction: a request for an evicted object is a miss,
        fetched again from the upstream (single-flight), so a race costs WAN bytes, never an answer.
        """
        keep_n = self.settings.evict_keep
        if keep_n is None:
            return 0
        leased: dict[str, set[int]] = {}
        for lease in await self.ops.active_leases():
            leased.setdefault(lease.model, set()).add(lease.number)
        kept: set[str] = set()
        dropped: set[str] = set()
        for m in await self.ops.list_models():
            found = await self.ops.list_versions(m.name, limit=None)
            base_of = {v.number: v.chain_base for v in found}
            wanted = {v.number for v in found[-keep_n:]} | leased.get(m.name, set())
            if m.pinned is not None:
                wanted.add(m.pinned)
            bases = {base_of[n] for n in wanted if n in base_of}
            for v in found:
                if v.manifest_digest is None:
                    continue
                manifest = await self.ops.load_manifest(v.manifest_digest)
                (kept if v.chain_base in bases else dropped).update(manifest.objects())
        evicted = 0
        for digest in sorted(dropped - kept):
            if digest in self._fetches:
                continue  # being fetched for a reader right now
            try:
                size = (await self.ops.store.stat(digest)).size
            except errors.ObjectNotFound:
                continue
            await self.ops.delete_object(digest)
            evicted += size
        if evicted:
            self.metrics.evicted_bytes.inc(evicted)
            log.info("evicted %d bytes of objects no kept chain needs", evicted)
        return evicted

    # --- objects --------------------------------------------------------------------------

    def _start(self, digest: str) -> tuple[asyncio.Future[int], InFlight]:
        """The one fetch of ``digest`` (started now unless running) and its bytes so far."""
        running = self._fetches.get(digest)
        if running is not None:
            return running, self._inflight[digest]
        inflight = InFlight(digest)
        task = asyncio.ensure_future(self._download(digest, inflight))
        self._fetches[digest] = task
        self._inflight[digest] = inflight

        def done(t: asyncio.Future[int], digest: str = digest) -> None:
            if self._fetches.get(digest) is t:
                del self._fetches[digest]
                del self._inflight[digest]
            if not t.cancelled():
                t.exception()  # retrieved: every waiter got it

        task.add_done_callback(done)
        return task, inflight

    async def fetch(self, digest: str) -> int:
        """Bring object ``digest`` here from the upstream, once however many ask at the same time; its size."""
        task, _ = self._start(digest)
        return await asyncio.shield(task)

    async def _download(self, digest: str, inflight: InFlight) -> int:
        """Fetch ``digest`` into the store unless it is there, or another replica on this catalog fetches it
        (then wait for it to appear: one fetch per object per region)."""
        deferred = False
        try:
            while True:
                async with self._fetch_slots:
                    with contextlib.suppress(errors.ObjectNotFound):
                        size = (await self.ops.store.stat(digest)).size  # fetched meanwhile (another replica)
                        inflight.finish(None)
                        return size
                    if await self.ops.claim_fetch(digest, self.holder, CLAIM_TTL):
                        try:
                            stored = await self._fetch_claimed(digest, inflight)
                        finally:
                            await self.ops.release_fetch(digest, self.holder)
                        break
                if not deferred:
                    deferred = True
                    self.metrics.fetches_deferred.inc()
                await asyncio.sleep(CLAIM_POLL_S)  # another replica fetches it into the shared store
        except BaseException as exc:
            inflight.finish(exc)
            raise
        inflight.finish(None)  # stored under its verified digest: readers get the last byte now
        self._reached()
        self.metrics.upstream_fetches.inc()
        return stored.size

    async def _fetch_claimed(self, digest: str, inflight: InFlight) -> PutResult:
        """The upstream fetch itself, the claim renewed while it runs."""

        async def renew() -> None:
            while True:
                await asyncio.sleep(CLAIM_TTL.total_seconds() / 3)
                await self.ops.claim_fetch(digest, self.holder, CLAIM_TTL)

        renewing = asyncio.ensure_future(renew())
        try:
            async with self.upstream.open_object(digest) as (length, chunks):
                inflight.begin(length)
                # The declared length: an object larger than the memory keeps is not held while it streams.
                return await self.ops.put_object(self._counted(chunks, inflight), expected_digest=digest, size=length)
        except errors.ServerUnavailable as exc:
            self._failed(exc)
            raise
        except errors.DigestMismatch:
            # Damaged on the way (the store kept nothing): a local reader retries (503), as after an outage.
            log.warning("object %s arrived from the upstream with other bytes: not kept", digest)
            raise errors.StoreUnavailable(
                f"object {digest} arrived from the upstream with other bytes; retry"
            ) from None
        finally:
            renewing.cancel()
            with contextlib.suppress(asyncio.CancelledError, errors.WeightsyncError):
                await renewing

    async def _counted(self, chunks: AsyncIterator[bytes], inflight: InFlight) -> AsyncIterator[bytes]:
        """The upstream's chunks, each handed to the readers at once and to the store in pieces of
        about STORE_PIECE (fewer, larger writes than the network's pieces)."""
        pending: list[bytes] = []
        size = 0
        async for chunk in chunks:
            self.metrics.upstream_bytes.inc(len(chunk))
            inflight.add(chunk)
            pending.append(chunk)
            size += len(chunk)
            if size >= STORE_PIECE:
                yield b"".join(pending)
                pending, size = [], 0
        if pending:
            yield b"".join(pending)

    async def _check_known(self, digest: str) -> None:
        """ObjectNotFound unless a version this relay mirrors names ``digest`` (only those are fetched)."""
        info = (await self.ops.object_records([digest])).get(digest)
        if info is None or info.state == "deleting":
            raise errors.ObjectNotFound(f"object {digest} is not in any version this relay mirrors")

    async def open_miss(self, digest: str) -> InFlight | None:
        """For a local read of ``digest``: None when the store holds it (a hit, or a miss waited for), or
        the running fetch to stream from (a miss of an object small enough to stream).

        Only objects a mirrored version names are fetched (ObjectNotFound otherwise); an unreachable
        upstream is ServerUnavailable (503: the client retries).
        """
        if await self.ops.store.exists(digest):
            self.metrics.object_requests.labels("hit").inc()
            return None
        await self._check_known(digest)
        self.metrics.object_requests.labels("miss").inc()
        task, inflight = self._start(digest)
        if await inflight.decided() and not inflight.done:
            return inflight
        await asyncio.shield(task)
        return None

    async def ensure_held(self, digest: str) -> None:
        """Make sure the store holds ``digest`` before a local read: a hit, or one (shared) upstream fetch."""
        if await self.ops.store.exists(digest):
            self.metrics.object_requests.labels("hit").inc()
            return
        await self._check_known(digest)
        self.metrics.object_requests.labels("miss").inc()
        await self.fetch(digest)

    # --- heartbeats -----------------------------------------------------------------------

    def forward_heartbeat(self, name: str, body: dict[str, Any]) -> None:
        """Keep the latest heartbeat of a relay below this one, for the next heartbeat sent upstream."""
        self._below[name] = body

    async def state(self) -> dict[str, Any]:
        """This relay's heartbeat: site, upstream, degraded, and per model the version held and its lag."""
        held: dict[str, Any] = {}
        for m in await self.ops.list_models():
            if m.head is None:
                continue
            last = self._last_mirrored.get(m.name)
            lag = round(last[1], 3) if last is not None and last[0] == m.head else None
            held[m.name] = {"version": m.head, "prefetch_lag_s": lag}
        return {"site": self.site, "upstream": self.upstream.url, "degraded": self.degraded, "models": held}

    async def _heartbeats(self) -> None:
        """Every ``heartbeat_s``: this relay's heartbeat upstream, then those of the relays below it.

        An upstream without the relays API (an older server answers 404) is told nothing, said once."""
        while True:
            try:
                await self.upstream.heartbeat(self.name, await self.state())
                for name, body in list(self._below.items()):
                    await self.upstream.heartbeat(name, body)
                    if self._below.get(name) is body:
                        del self._below[name]
            except asyncio.CancelledError:
                raise
            except errors.NotFound:
                log.info("upstream %s takes no relay heartbeats (an older server): none sent", self.upstream.url)
                return
            except Exception as exc:  # noqa: BLE001 - the next beat tries again
                self._failed(exc)
            await asyncio.sleep(self.settings.heartbeat_s)

    # --- replica reports ------------------------------------------------------------------

    @property
    def name(self) -> str:
        """This relay's name in the upstream's ledger."""
        return f"relay@{self.site}"

    def _announce(self, model: str) -> None:
        """Tell the upstream's ledger which version of ``model`` this relay now holds (after each sync that
        mirrored some): the origin lists its relays, with their site and prefetch lag, among the replicas."""
        head = self._last_mirrored.get(model)
        if head is None:
            return
        number, lag = head
        extra = {"role": "relay", "prefetch_lag_s": round(lag, 3)}
        self._queue(model, {"subscriber": self.name, "version": number, "site": self.site, "extra": extra})

    def forward_report(self, model: str, body: dict[str, Any]) -> None:
        """Queue a replica report for the upstream's ledger (the relay's site when the report names none)."""
        forwarded = dict(body)
        if not forwarded.get("site"):
            forwarded["site"] = self.site
        forwarded["extra"] = {**(forwarded.get("extra") or {}), "relay": self.site}
        self._queue(model, forwarded)

    def _queue(self, model: str, forwarded: dict[str, Any]) -> None:
        try:
            self._reports.put_nowait((model, forwarded))
        except asyncio.QueueFull:
            self.metrics.reports_dropped.inc()
            log.warning("replica report queue full: a report of %s is not forwarded", model)

    async def _forward(self) -> None:
        """Send queued reports in order; an unreachable upstream keeps them (retried with backoff)."""
        while True:
            model, body = await self._reports.get()
            attempt = 0
            while True:
                try:
                    await self.upstream.report_replica(model, body)
                    self.metrics.reports_forwarded.inc()
                    break
                except asyncio.CancelledError:
                    raise
                except errors.ServerUnavailable as exc:
                    self._failed(exc)
                    await asyncio.sleep(_RETRY.delay(attempt))
                    attempt += 1
                except Exception as exc:  # noqa: BLE001 - refused upstream: dropped, logged
                    self.metrics.reports_dropped.inc()
                    log.warning("replica report of %s not forwarded: %s", model, exc)
                    break
