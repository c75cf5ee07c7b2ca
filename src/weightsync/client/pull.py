"""The pull pipeline: plan, fetch, decode and switch a checkout to a version (docs/API.md "Pulling").

A pull asks the server for a plan from the version the checkout holds,
fetches the manifests and object extents it names (in parallel, large objects
as several ranges), checks every object's SHA-256, decodes each step onto the
previous one and switches the checkout to the result in one atomic step
(client/checkout.py). A pull killed at any point leaves the old version
readable; re-run, it finds the objects (and ranges) it already has in its
cache and fetches only the rest. Adopting a directory weightsync does not
manage (`adopt`) keeps the files already the version's and fetches only the
frames of the others (`fetch_needed`).

Used by :class:`~weightsync.client.Subscriber` (directories and, for the
fetch phase, in-place updates) and by :class:`~weightsync.client.Publisher`
(catching its base up with the head).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weightsync import errors
from weightsync.client import inplace
from weightsync.client._http import Api, checked
from weightsync.client._objects import DEFAULT_RANGE_BYTES, FetchStats, ObjectCache, object_reader
from weightsync.client.checkout import Checkout
from weightsync.client.decode import HeldFile, Tree, check_bases, decode_step, frames_for, map_file, needed_files
from weightsync.client.inplace import Prepared
from weightsync.client.models import Plan, PlanStep, PullResult
from weightsync.client.selection import file_selector
from weightsync.client.state import CheckoutState
from weightsync.codec import safetensors
from weightsync.codec.checkpoint import is_safetensors
from weightsync.codec.manifest import FrameRef, Manifest

log = logging.getLogger("weightsync.client")

DEFAULT_INLINE_BYTES = 32 << 20
"""Updates up to this size come with their plan (one round trip); larger ones are fetched in parallel ranges.
Measured on loopback (2-core box, interleaved): moe-bf16-x4's 11.5 MB update prepared in 57-64 ms with it
against 68-81 ms as a plan and then range reads."""

Progress = Callable[[int, int], None]
"""Called as progress(bytes_done, bytes_total) while objects move."""


class Meter:
    """Counts body bytes moved by one operation and forwards progress. Thread-safe."""

    def __init__(self, progress: Progress | None) -> None:
        self.bytes = 0
        self.total = 0
        self.progress = progress
        self._lock = threading.Lock()

    def __call__(self, n: int) -> None:
        with self._lock:
            self.bytes += n
            done, total = self.bytes, self.total
        if self.progress is not None:
            self.progress(done, max(total, done))


def step_objects(steps: list[PlanStep]) -> tuple[dict[str, int], dict[str, int]]:
    """(manifests, objects) of plan steps as digest → bytes to fetch (an object's largest extent)."""
    manifests: dict[str, int] = {}
    objects: dict[str, int] = {}
    for s in steps:
        manifests[s.manifest] = s.manifest_bytes
        for o in s.objects:
            objects[o.digest] = max(objects.get(o.digest, 0), o.size)
    return manifests, objects


@dataclass(frozen=True)
class FetchOptions:
    """How a subscriber fetches and decodes (see :class:`~weightsync.client.subscriber.Subscriber`)."""

    cache_dir: Path | None = None
    """Objects kept across pulls and directories; None: each checkout's own cache."""
    keep_objects: bool = False
    deep_verify: bool = True
    range_bytes: int = DEFAULT_RANGE_BYTES
    decode_threads: int | None = None
    """Threads that decode frames (None: the CPU pool; with a staging device, `inplace.DEVICE_DECODE_THREADS`)."""
    inline_bytes: int = DEFAULT_INLINE_BYTES
    """`prepare`: an update of at most this many bytes comes with its plan, in one request (0: never)."""

    def cache(self) -> ObjectCache | None:
        """The shared object cache, or None for each checkout's own."""
        return ObjectCache(self.cache_dir / "objects") if self.cache_dir is not None else None


def fetch_plan(
    api: Api, cache: ObjectCache, plan: Plan, pool: ThreadPoolExecutor, *, range_bytes: int, meter: Meter
) -> FetchStats:
    """Make every manifest and object extent of `plan`'s steps present and verified in `cache`."""
    manifests, objects = step_objects(plan.steps)
    meter.total = plan.bytes
    # Manifests and objects in one batch: every request of a small update in flight at once
    # (one round trip on the critical path, not two).
    wanted = dict(objects)
    for digest, size in manifests.items():
        wanted[digest] = max(size, wanted.get(digest, 0))
    return cache.fetch(api, wanted, pool, range_bytes=range_bytes)


def load_manifest(cache: ObjectCache, digest: str) -> Manifest:
    """A manifest the cache holds (fetched and verified by `fetch_plan`)."""
    return Manifest.decode(bytes(cache.read(digest)))


def fetch_update(
    api: Api,
    model: str,
    cache: ObjectCache,
    *,
    have: int | None,
    want: int | None,
    holder: str | None,
    pool: ThreadPoolExecutor,
    range_bytes: int,
    meter: Meter,
    select: Callable[[str], bool] | None = None,
    inline: int = 0,
) -> tuple[Plan, list[Manifest], list[str], dict[str, float]]:
    """The plan from `have` to `want` (None: head) and every manifest and object it needs, verified in `cache`.

    With `inline` (bytes; not with `select`), an update of at most that many bytes comes in the plan's
    own answer (docs/API.md "One request per update"): one round trip instead of two; ``plan_s`` then
    covers its objects too. Whatever did not come with it is fetched as usual.

    With `select`, only the byte ranges of the frames that change the tensors it takes
    (inplace.frames_needed), fetched as parts: those are not checked against their object's
    SHA-256 (that needs the whole object); the decode and the apply check every selected
    tensor's base and result instead.

    Every object that came with the plan, or was read whole, is checked against its SHA-256 before it is
    used, whatever the server says it checked: the apply's result checks do not cover every damaged frame
    (docs/FORMAT.md §10.3).

    Returns (plan, its steps' manifests in order, the objects read from ranges, timings: plan_s
    and download_s, and server_plan_s when the plan came with its objects from a server that says).
    """
    t0 = time.perf_counter()
    inlined: dict[str, tuple[memoryview, str | Future[str] | None]] = {}
    server: dict[str, float] = {}
    if select is None and inline:
        plan, inlined = api.get_plan_bundle(model, have=have, want=want, holder=holder, inline=inline, timings=server)
    else:
        plan = api.get_plan(model, have=have, want=want, holder=holder)
    timings = {"plan_s": time.perf_counter() - t0, **server}
    t = time.perf_counter()
    partial: list[str] = []
    if select is None:
        # The manifests come first in the plan's answer: they are decoded while its objects still hash.
        in_manifests, in_objects = step_objects(plan.steps)
        came = checked(inlined, in_manifests)
        early = {digest: Manifest.decode(bytes(data)) for digest, data in came.items()}
        objects = checked(inlined, in_objects)
        _keep_inlined(cache, came | objects)
        fetch_plan(api, cache, plan, pool, range_bytes=range_bytes, meter=meter)
        manifests = [early.get(s.manifest) or load_manifest(cache, s.manifest) for s in plan.steps]
    else:
        manifests, _ = _fetch_manifests(api, cache, plan, pool, range_bytes=range_bytes, meter=meter)
        refs = inplace.frames_needed(manifests, select)
        extents, _ = _fetch_frames(api, cache, refs, pool, range_bytes=range_bytes, meter=meter)
        partial = [d for d in extents if not cache.has(d)]
    timings["download_s"] = time.perf_counter() - t
    return plan, manifests, partial, timings


def _keep_inlined(cache: ObjectCache, objects: dict[str, memoryview]) -> None:
    """Put the objects that came with the plan, checked against their names (`_http.checked`), into `cache`."""
    for digest, data in objects.items():
        if not cache.has(digest):
            cache.put_checked(digest, data)


def prepare_update(
    api: Api,
    model: str,
    options: FetchOptions,
    *,
    have: int | None,
    want: int | None,
    holder: str | None,
    pool: ThreadPoolExecutor,
    meter: Meter,
    device: Any = None,
    select: Callable[[str], bool] | None = None,
) -> tuple[Prepared, dict[str, float]]:
    """Fetch and decode the update of `model` from `have` to `want` (None: head) for an in-place apply.

    Returns the :class:`~weightsync.client.inplace.Prepared` update (staged on `device` when
    given) and the timings (plan_s, download_s, decode_s); its ``seconds`` covers all of it.
    With `select`, the update of the selected tensors, from only the frames that change them.
    """
    t0 = time.perf_counter()
    cache = options.cache() or ObjectCache(None)
    plan, manifests, partial, timings = fetch_update(
        api,
        model,
        cache,
        have=have,
        want=want,
        holder=holder,
        pool=pool,
        range_bytes=options.range_bytes,
        meter=meter,
        select=select,
        inline=options.inline_bytes,
    )
    try:
        prepared = inplace.prepare(
            manifests,
            object_reader(cache),
            model=model,
            base=have,
            target=plan.target,
            threads=options.decode_threads,
            device=device,
            bytes_received=meter.bytes,
            select=select,
        )
    except errors.WeightsyncError:
        cache.drop_parts(partial)  # a range that does not decode is fetched again by the next prepare
        raise
    prepared.partial_objects = partial
    timings["decode_s"] = prepared.seconds
    prepared.seconds = time.perf_counter() - t0
    return prepared, timings


def check_installable(tree: Tree) -> None:
    """Every safetensors file of `tree` (a version decoded, about to be installed) parses completely.

    A replica does not depend on every publisher being correct: a file that would not load
    (InvalidCheckpoint naming it and the defect) is never installed; the version held stays.
    Only headers are read.
    """
    for path, held in tree.files.items():
        if not is_safetensors(path):
            continue
        try:
            safetensors.parse_file(map_file(held.location, held.size))
        except errors.SafetensorsError as exc:
            raise errors.InvalidCheckpoint(
                f"{path}: pulled file is not a valid safetensors file ({exc}): not installed"
            ) from None


@dataclass
class _Kept:
    """What pull --adopt found in a directory weightsync does not manage: the files already the target's."""

    state: CheckoutState
    """The target version, as the checkout's state once installed."""
    manifest: Manifest
    """The target version's manifest."""
    files: dict[str, Path]
    """Its files already there (size and every segment's digest), by path → where they are."""

    @property
    def whole(self) -> bool:
        return len(self.files) == len(self.state.files)


def _take_over(
    api: Api,
    model: str,
    checkout: Checkout,
    plan: Plan,
    objects: ObjectCache,
    pool: ThreadPoolExecutor,
    dpool: ThreadPoolExecutor,
    *,
    adopt: bool,
    include: tuple[str, ...] | None = None,
) -> _Kept | None:
    """A directory weightsync does not manage, about to get `plan`'s target: whose files are already there?
    (Of the files `include` takes, with pull --include.)

    None when none of the target's paths exist. Otherwise UnmanagedFiles, unless `adopt`:
    then each file there is checked against the target's (its size and every segment's
    digest, `Checkout.matching`) and those that are it are kept (the others get replaced).
    """
    digest = plan.steps[-1].manifest
    manifest = _target_manifest(api, plan, objects, pool)
    candidate = CheckoutState.of(model, plan.target, digest, manifest, api.server, include)
    there = [f.path for f in candidate.files if os.path.lexists(checkout.root / f.path)]
    if not there:
        return None
    if not adopt:
        names = ", ".join(there[:3]) + (f" and {len(there) - 3} more" if len(there) > 3 else "")
        raise errors.UnmanagedFiles(
            f"{checkout.root} already has files weightsync does not manage ({names}): pull into an empty "
            "directory, or adopt it (CLI --adopt) to take them over"
        )
    kept = _Kept(candidate, manifest, checkout.matching(candidate, dpool))
    if not kept.whole:
        log.warning(
            "%s: %d of the %d files of v%s are there already: fetching the other %d",
            checkout.root,
            len(kept.files),
            len(candidate.files),
            plan.target,
            len(candidate.files) - len(kept.files),
        )
    return kept


def _target_manifest(api: Api, plan: Plan, objects: ObjectCache, pool: ThreadPoolExecutor) -> Manifest:
    """The manifest of `plan`'s target (its last step), fetched into `objects` if not there."""
    step = plan.steps[-1]
    objects.fetch(api, {step.manifest: step.manifest_bytes}, pool, range_bytes=DEFAULT_RANGE_BYTES)
    return load_manifest(objects, step.manifest)


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Byte ranges sorted, overlapping and adjacent ones joined (frames stored back to back: one request)."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def fetch_needed(
    api: Api,
    cache: ObjectCache,
    plan: Plan,
    kept: Collection[str],
    pool: ThreadPoolExecutor,
    *,
    range_bytes: int,
    meter: Meter,
    chosen: Callable[[str], bool] | None = None,
) -> tuple[list[Manifest], list[set[str]], dict[str, list[tuple[int, int]]], FetchStats]:
    """Fetch what decoding `plan`'s target without the files `kept` needs: every manifest, then only the
    byte ranges of the frames the other files' chains read (a frame shared by several files counts for each).
    `chosen`: only the files it takes are wanted at all (pull --include).

    Returns (the steps' manifests, the paths each step decodes (`needed_files`), the object
    ranges fetched, the fetch's counts).
    """
    chain, stats = _fetch_manifests(api, cache, plan, pool, range_bytes=range_bytes, meter=meter)
    wanted = [f.path for f in chain[-1].files if f.path not in kept and (chosen is None or chosen(f.path))]
    needs = needed_files(chain, wanted)
    refs = [ref for manifest, paths in zip(chain, needs, strict=True) for ref in frames_for(manifest, paths)]
    extents, got = _fetch_frames(api, cache, refs, pool, range_bytes=range_bytes, meter=meter)
    return chain, needs, extents, FetchStats(stats.fetched + got.fetched, stats.cached + got.cached)


def _fetch_manifests(
    api: Api, cache: ObjectCache, plan: Plan, pool: ThreadPoolExecutor, *, range_bytes: int, meter: Meter
) -> tuple[list[Manifest], FetchStats]:
    """The manifests of `plan`'s steps, in order, fetched whole and verified (`meter.total` starts with them)."""
    wanted, _ = step_objects(plan.steps)
    meter.total = sum(wanted.values())
    stats = cache.fetch(api, wanted, pool, range_bytes=range_bytes)
    return [load_manifest(cache, s.manifest) for s in plan.steps], stats


def _fetch_frames(
    api: Api,
    cache: ObjectCache,
    refs: Iterable[FrameRef],
    pool: ThreadPoolExecutor,
    *,
    range_bytes: int,
    meter: Meter,
) -> tuple[dict[str, list[tuple[int, int]]], FetchStats]:
    """The byte ranges of the frames `refs` made readable in `cache` (frames back to back: one range), by object."""
    ranges: dict[str, list[tuple[int, int]]] = {}
    for ref in refs:
        if ref.object is None:
            raise errors.FormatError("a stored manifest's frame names no object")
        ranges.setdefault(ref.object, []).append((ref.offset, ref.offset + ref.length))
    extents = {digest: _merged(r) for digest, r in ranges.items()}
    meter.total += sum(b - a for r in extents.values() for a, b in r)
    return extents, cache.fetch_extents(api, extents, pool, range_bytes=range_bytes)


def _with_kept(tree: Tree, kept: _Kept) -> Tree:
    """`tree` (the target's other files, decoded) plus the files kept where they are, in the manifest's order."""
    files: dict[str, HeldFile] = {}
    for f in kept.manifest.files:
        where = kept.files.get(f.path)
        if where is None:
            if f.path in tree.files:  # else a file the checkout does not hold (pull --include)
                files[f.path] = tree.files[f.path]
            continue
        decoded = tree.files.get(f.path)
        if decoded is not None and decoded.owned:  # a version 1 frame shared with another file decoded it too
            decoded.location.unlink(missing_ok=True)
        files[f.path] = HeldFile(where, f.size, False, f.spans())
    return Tree(tree.single_file, files, tree.digest_kind)


@contextmanager
def _left_as_it_was_if_refused(checkout: Checkout) -> Iterator[None]:
    """On UnmanagedFiles, remove the ``.weightsync`` the refused pull made (after its lock is released)."""
    fresh = not os.path.lexists(checkout.meta)
    try:
        yield
    except errors.UnmanagedFiles:
        if fresh:
            shutil.rmtree(checkout.meta, ignore_errors=True)
        raise


class _Restart(Exception):
    """The checkout's version is not the server's under that number: start over with a full pull."""


def pull(
    api: Api,
    model: str,
    checkout: Checkout,
    *,
    version: int | None = None,
    holder: str | None = None,
    options: FetchOptions = FetchOptions(),
    pool: ThreadPoolExecutor,
    meter: Meter | None = None,
    adopt: bool = False,
    include: Sequence[str] | None = None,
) -> PullResult:
    """Bring `checkout` to `version` (None: head) of `model`; see :meth:`Subscriber.pull`.

    `include` (file globs, client/selection.py): the checkout holds only the version's files
    they take, each byte-identical, decoded from only the frames with a piece in them (and
    in their bases along the plan); its state records the globs, and later pulls keep them
    (None: the checkout's, or every file). A changed selection keeps the files held that it
    still takes when the checkout is at the target already (fetching only the new ones'
    frames), else rebuilds the selection from the target's chain.

    `options.cache_dir` None: the checkout's own object cache, emptied after a successful
    pull unless `keep_objects`. Conflict when the checkout holds another model
    or another process is updating it; UnmanagedFiles when a directory weightsync does
    not manage already has files where the version puts its own, unless `adopt`: then
    each file there that already is the version's (size and every segment's digest) is
    kept as it is (the version takes its inode), and only the frames of the other files
    are fetched (byte ranges of the plan's objects, `fetch_needed`) and decoded; files
    of the directory that are not the version's stay untouched. The result's mode is
    "adopted" when every file was there (nothing but the target's manifest fetched),
    else "full" (built from the keyframe chain) with ``bytes_received`` the frames of
    the files that were not there (``plan_bytes``: what a full pull fetches). A refused
    directory is left as it was (no ``.weightsync`` either).
    """
    t0 = time.perf_counter()
    meter = meter or Meter(None)
    timings: dict[str, float] = {}
    checkout.root.mkdir(parents=True, exist_ok=True)
    with _left_as_it_was_if_refused(checkout), checkout.locked():
        checkout.sweep()  # the lock says no pull is running: what is not the current version is a leftover
        state = checkout.state()
        if state is not None and state.model != model:
            raise errors.Conflict(
                f"{checkout.root} holds model {state.model!r}, not {model!r}: pull into another directory"
            )
        held_include = state.include if state is not None else None
        if include is None:
            include = held_include  # a slice checkout keeps its slice
        include = None if include is None else tuple(include)
        chosen = file_selector(include)
        reselect = state is not None and include != held_include
        cache = options.cache()
        own_cache = cache is None
        objects = checkout.objects() if cache is None else cache
        if own_cache:
            objects.sweep()
        repaired = adopted = False
        have = None
        with ThreadPoolExecutor(options.decode_threads or os.cpu_count() or 1) as dpool:
            if state is not None:
                t = time.perf_counter()
                if checkout.verify(state, dpool, deep=options.deep_verify):
                    checkout.adopt(state)  # a checkout of plain files (older weightsync) becomes a version
                    have = state.number
                else:
                    log.warning(
                        "%s no longer matches its state file (v%s): pulling in full", checkout.root, state.number
                    )
                    repaired = True
                timings["verify_s"] = time.perf_counter() - t
            for attempt in range(2):
                t = time.perf_counter()
                # A changed selection is built from the target's whole chain (the files it keeps aside).
                plan = api.get_plan(model, have=None if reselect else have, want=version, holder=holder)
                timings["plan_s"] = time.perf_counter() - t
                steps, target = plan.steps, plan.target
                kept = None
                if reselect:
                    assert state is not None
                    target_manifest = _target_manifest(api, plan, objects, pool)
                    candidate = CheckoutState.of(
                        model, target, plan.steps[-1].manifest, target_manifest, api.server, include
                    )
                    # At the target already: the files held that the selection still takes stay as they are.
                    where = checkout.locate(state) if have == target else None
                    keep = {p: loc for p, loc in (where or {}).items() if chosen is None or chosen(p)}
                    kept, have = _Kept(candidate, target_manifest, keep), None
                elif state is None and steps:
                    t = time.perf_counter()
                    kept = _take_over(api, model, checkout, plan, objects, pool, dpool, adopt=adopt, include=include)
                    timings["verify_s"] = time.perf_counter() - t
                    if kept is not None and kept.whole:  # the files there are the version: nothing to fetch
                        checkout.adopt(kept.state)
                        steps, state, have, adopted = [], kept.state, target, True
                    elif kept is not None and not kept.files:
                        kept = None  # none of them is the version's: a full pull replaces them
                if not steps and have == target:
                    assert state is not None
                    if not options.keep_objects and own_cache:
                        objects.clear()  # what a pull that crashed after its switch left behind
                    return PullResult(
                        model=model,
                        version=target,
                        previous=None if adopted else have,
                        mode="adopted" if adopted else "current",
                        steps=0,
                        bytes_received=meter.bytes,
                        plan_bytes=0,
                        full_bytes=plan.full_bytes,
                        raw_bytes=sum(f.size for f in state.files),
                        files=len(state.files),
                        objects_fetched=0,
                        objects_cached=0,
                        repaired=repaired,
                        seconds=time.perf_counter() - t0,
                        timings=timings,
                        adopted=len(state.files) if adopted else 0,
                    )
                t = time.perf_counter()
                chain: list[Manifest] | None = None
                needs: list[set[str]] | None = None
                extents: dict[str, list[tuple[int, int]]] = {}
                if kept is None and chosen is None:
                    stats = fetch_plan(api, objects, plan, pool, range_bytes=options.range_bytes, meter=meter)
                else:  # only the frames of the (selected) files that are not there yet
                    chain, needs, extents, stats = fetch_needed(
                        api,
                        objects,
                        plan,
                        kept.files if kept is not None else (),
                        pool,
                        range_bytes=options.range_bytes,
                        meter=meter,
                        chosen=chosen,
                    )
                timings["download_s"] = time.perf_counter() - t
                t = time.perf_counter()
                work = checkout.workspace()
                try:
                    tree = checkout.tree(state) if state is not None and have is not None else Tree(False)
                    manifest = None
                    for i, s in enumerate(steps):
                        manifest = chain[i] if chain is not None else load_manifest(objects, s.manifest)
                        only = needs[i] if needs is not None else None
                        try:
                            check_bases(manifest, tree, only)
                        except errors.BaseMismatch:
                            if i == 0 and have is not None and attempt == 0:
                                raise _Restart() from None
                            raise
                        try:
                            tree = decode_step(manifest, object_reader(objects), tree, work, dpool, only)
                        except errors.FormatError:
                            # Ranges are checked only as their frames decode: a damaged one is fetched again next time.
                            objects.drop_parts(list(extents))
                            raise
                    if kept is not None:
                        tree = _with_kept(tree, kept)
                    timings["decode_s"] = time.perf_counter() - t
                    t = time.perf_counter()
                    assert manifest is not None
                    check_installable(tree)
                    installed = CheckoutState.of(model, target, steps[-1].manifest, manifest, api.server, include)
                    checkout.install(tree, installed, work)
                    timings["install_s"] = time.perf_counter() - t
                except _Restart:
                    log.warning(
                        "%s: v%s here differs from the server's v%s: pulling in full", checkout.root, have, have
                    )
                    have, repaired = None, True
                    continue
                finally:
                    work.clear()
                if not options.keep_objects and own_cache:
                    manifests, fetched = step_objects(steps)
                    objects.discard(list(fetched) + list(manifests))
                incremental = have is not None and steps[0].kind != "keyframe"
                return PullResult(
                    model=model,
                    version=target,
                    previous=state.number if state is not None and have is not None else None,
                    mode="delta" if incremental else "full",
                    steps=len(steps),
                    bytes_received=meter.bytes,
                    plan_bytes=plan.bytes,
                    full_bytes=plan.full_bytes,
                    raw_bytes=sum(f.size for f in installed.files),
                    files=len(installed.files),
                    objects_fetched=stats.fetched,
                    objects_cached=stats.cached,
                    repaired=repaired,
                    seconds=time.perf_counter() - t0,
                    timings=timings,
                    adopted=len(kept.files) if kept is not None else 0,
                )
    raise AssertionError("unreachable")  # pragma: no cover
