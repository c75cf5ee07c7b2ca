"""Subscribing: pull versions into directories, or prepare and apply them in place into tensors.

A pull (docs/API.md "Pulling") asks the server for a plan from the version the
directory holds, fetches the manifests and object extents it names (in
parallel, large objects as several ranges), checks every object's SHA-256,
decodes each step onto the previous one and renames the new files into place.
A pull killed half way leaves the old version intact; re-run, it finds the
objects (and ranges) it already has in its cache and fetches only the rest.

`prepare` does the network and decode work of an update off the critical
path; `apply` is the only part that pauses serving: it changes just the
elements that differ, in place, with torch ops on the tensors' own device.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from weightsync import errors
from weightsync.client._checkout import (
    CheckoutState,
    Tree,
    Workspace,
    check_bases,
    decode_step,
    install,
    locked,
    state_dir,
    verify,
)
from weightsync.client._http import Api, Retry, TokenBucket
from weightsync.client._pool import run_all
from weightsync.client._objects import DEFAULT_RANGE_BYTES, ObjectCache, object_reader
from weightsync.client.models import PullResult, Version
from weightsync.codec.dtypes import DType, by_name
from weightsync.codec.frame import unzigzag
from weightsync.codec.manifest import Manifest
from weightsync.codec.values import DeltaValues, apply_values, decode_values, keyframe_bytes

log = logging.getLogger("weightsync.client")

Progress = Callable[[int, int], None]
"""Called as progress(bytes_done, bytes_total) while objects move."""


class _Meter:
    """Counts body bytes moved by one operation and forwards progress."""

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


def _step_objects(steps: list[dict]) -> tuple[dict[str, int], dict[str, int]]:
    """(manifests, objects) of plan steps as digest → bytes to fetch."""
    manifests: dict[str, int] = {}
    objects: dict[str, int] = {}
    for s in steps:
        manifests[s["manifest"]] = int(s.get("manifest_bytes") or 0)
        for o in s.get("objects") or []:
            d, n = o["digest"], int(o["size"])
            objects[d] = max(objects.get(d, 0), n)
    return manifests, objects


def _load_manifest(cache: ObjectCache, digest: str) -> Manifest:
    return Manifest.decode(bytes(cache.read(digest)))


def pull_into(api: Api, model: str, root: Path, *, version: int | None = None, holder: str | None = None,
              cache_root: Path | None = None, keep_objects: bool = False, pool: ThreadPoolExecutor,
              decode_threads: int | None = None, deep_verify: bool = True,
              range_bytes: int = DEFAULT_RANGE_BYTES, meter: _Meter | None = None) -> PullResult:
    """Bring checkout `root` to `version` (None: head) of `model`; see :meth:`Subscriber.pull`."""
    t0 = time.perf_counter()
    meter = meter or _Meter(None)
    timings: dict[str, float] = {}
    root.mkdir(parents=True, exist_ok=True)
    with locked(root):
        state = CheckoutState.load(root)
        if state is not None and state.model != model:
            raise errors.Conflict(f"{root} holds model {state.model!r}, not {model!r}: pull into another directory")
        cache = ObjectCache(cache_root if cache_root is not None else state_dir(root) / "objects")
        if cache_root is None:
            cache.sweep()  # the checkout's own cache: the lock says no one else is writing it
            for stale in state_dir(root).glob(".state.json.*.tmp"):  # a crash inside write_atomic
                stale.unlink(missing_ok=True)
        repaired = False
        have = None
        with ThreadPoolExecutor(decode_threads or os.cpu_count() or 1) as dpool:
            if state is not None:
                t = time.perf_counter()
                if verify(root, state, dpool, deep=deep_verify):
                    have = state.number
                else:
                    log.warning("%s no longer matches its state file (v%s): pulling in full", root, state.number)
                    repaired = True
                timings["verify_s"] = time.perf_counter() - t
            for attempt in range(2):
                t = time.perf_counter()
                plan = api.get_plan(model, have=have, want=version, holder=holder)
                timings["plan_s"] = time.perf_counter() - t
                steps = plan.get("steps") or []
                target = int(plan["target"])
                if not steps and have == target:
                    if not keep_objects and cache_root is None:
                        cache.clear()  # what a pull that crashed after installing left behind
                    return PullResult(model, target, have, "current", 0, meter.bytes, 0,
                                      int(plan.get("full_bytes") or 0), sum(f.size for f in state.files),
                                      len(state.files), 0, 0, repaired, time.perf_counter() - t0, timings)
                manifests, objects = _step_objects(steps)
                meter.total = int(plan.get("bytes") or 0)
                t = time.perf_counter()
                ms = cache.fetch(api, manifests, pool, range_bytes=range_bytes)
                os_ = cache.fetch(api, objects, pool, range_bytes=range_bytes)
                timings["download_s"] = time.perf_counter() - t
                t = time.perf_counter()
                work = Workspace(root)
                try:
                    tree = Tree.of_state(root, state) if have is not None else Tree(False)
                    manifest = None
                    for i, s in enumerate(steps):
                        manifest = _load_manifest(cache, s["manifest"])
                        try:
                            check_bases(manifest, tree)
                        except errors.BaseMismatch:
                            if i == 0 and have is not None and attempt == 0:
                                raise _Restart() from None
                            raise
                        tree = decode_step(manifest, object_reader(cache), tree, work, dpool)
                    timings["decode_s"] = time.perf_counter() - t
                    t = time.perf_counter()
                    install(root, tree, state)
                    assert manifest is not None
                    CheckoutState.of(model, target, steps[-1]["manifest"], manifest, api.server).save(root)
                    timings["install_s"] = time.perf_counter() - t
                except _Restart:
                    log.warning("%s: v%s here differs from the server's v%s: pulling in full", root, have, have)
                    have, repaired = None, True
                    continue
                finally:
                    work.clear()
                if not keep_objects and cache_root is None:
                    cache.discard(list(objects) + list(manifests))
                incremental = have is not None and steps[0].get("kind") != "keyframe"
                return PullResult(model, target, state.number if state and have is not None else None,
                                  "delta" if incremental else "full", len(steps), meter.bytes,
                                  int(plan.get("bytes") or 0), int(plan.get("full_bytes") or 0),
                                  manifest.raw_bytes, len(manifest.files), ms.fetched + os_.fetched,
                                  ms.cached + os_.cached, repaired, time.perf_counter() - t0, timings)
    raise AssertionError("unreachable")  # pragma: no cover


class _Restart(Exception):
    pass


# --- prepare / apply -------------------------------------------------------------------


@dataclass
class _Op:
    """Elements to change in one tensor: positions (element indices) and operands (add or XOR)."""

    add: bool
    positions: np.ndarray  # int64
    operands: np.ndarray  # unsigned, W bytes: wrapping differences (add) or XOR masks
    staged: tuple[Any, Any] | None = None  # (positions, operands) as torch tensors on the target device


@dataclass
class TensorUpdate:
    """What `apply` does to one tensor: replace it whole, or change some elements."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    base_xxh3: str | None
    """xxh3 the tensor must have before (None when it is replaced whole)."""
    result_xxh3: str = ""
    replace: np.ndarray | None = None
    staged_replace: Any = None
    ops: list[_Op] = field(default_factory=list)

    @property
    def changed_elements(self) -> int:
        if self.replace is not None:
            return len(self.replace) // self.dtype.width
        return sum(len(op.positions) for op in self.ops)


@dataclass
class Prepared:
    """An update from version `base` (what the tensors hold; None: nothing) to `target`, decoded and ready."""

    model: str
    base: int | None
    target: int
    updates: dict[str, TensorUpdate]
    specs: dict[str, tuple[DType, tuple[int, ...], str]]
    """Every tensor of the target version: dtype, shape, xxh3."""
    steps: int
    bytes_received: int
    seconds: float
    device: Any = None

    @property
    def changed_elements(self) -> int:
        return sum(u.changed_elements for u in self.updates.values())


def _combine(a: _Op, positions: np.ndarray, operands: np.ndarray) -> _Op:
    """Compose two consecutive changes of one kind into one (differences add, XOR masks xor)."""
    pos = np.concatenate([a.positions, positions])
    vals = np.concatenate([a.operands, operands])
    order = np.argsort(pos, kind="stable")
    pos, vals = pos[order], vals[order]
    uniq, starts = np.unique(pos, return_index=True)
    reduce = np.add if a.add else np.bitwise_xor
    merged = reduce.reduceat(vals, starts) if len(vals) else vals
    keep = merged != 0
    return _Op(a.add, uniq[keep], merged[keep].astype(vals.dtype, copy=False))


def _decode_prepared(model: str, have: int | None, target: int, manifests: list[Manifest],
                     read_frame: Callable, pool: ThreadPoolExecutor) -> tuple[dict[str, TensorUpdate], dict]:
    updates: dict[str, TensorUpdate] = {}
    for manifest in manifests:
        names: dict[tuple[int, int], str] = {}
        touched: set[str] = set()
        for fi, f in enumerate(manifest.files):
            for si, e in enumerate(f.segments):
                seg = e.segment
                if seg.kind != "tensor":
                    continue
                names[(fi, si)] = seg.name
                if e.base_offset is None:
                    updates[seg.name] = TensorUpdate(seg.name, seg.dtype, seg.shape, None,
                                                     replace=np.empty(seg.length, dtype=np.uint8))
                    touched.add(seg.name)
                elif e.xxh3 != e.base_xxh3:
                    u = updates.get(seg.name)
                    if u is None or u.dtype is not seg.dtype or u.shape != seg.shape:
                        updates[seg.name] = TensorUpdate(seg.name, seg.dtype, seg.shape, e.base_xxh3)
                    touched.add(seg.name)
        pending: dict[str, list[tuple[bool, np.ndarray, np.ndarray]]] = {}
        lock = threading.Lock()

        def run(ref, names=names, touched=touched, pending=pending, lock=lock) -> None:
            if not any(names.get((p.file, p.seg)) in touched for p in ref.pieces):
                return
            blob = read_frame(ref)
            change: DeltaValues | None = None
            data = None
            if ref.delta:
                change = decode_values(blob)
                if change.header.dtype.name != ref.dtype or change.header.raw_len != ref.raw_len:
                    raise errors.FormatError("frame header disagrees with its manifest entry")
            else:
                data = keyframe_bytes(blob)
            width = by_name(ref.dtype).width
            pos = 0
            for p in ref.pieces:
                name = names.get((p.file, p.seg))
                start, count = pos // width, p.length // width
                pos += p.length
                if name not in touched:
                    continue
                u = updates[name]
                if data is not None:
                    u.replace[p.offset : p.offset + p.length] = data[start * width : (start + count) * width]
                    continue
                assert change is not None
                if u.replace is not None:  # replaced earlier in this plan: compose on the host copy
                    apply_values(u.replace, change, start=start, count=count, offset=p.offset // width)
                    continue
                if change.positions is None:
                    vals = change.values[start : start + count]
                    where = np.flatnonzero(vals)
                    vals = vals[where]
                else:
                    lo, hi = np.searchsorted(change.positions, [start, start + count])
                    where = change.positions[lo:hi] - start
                    vals = change.values[lo:hi]
                if change.header.add:
                    vals = unzigzag(vals)
                with lock:
                    pending.setdefault(name, []).append((change.header.add, where + p.offset // width, vals))

        run_all(pool, run, manifest.frames)
        for name, parts in pending.items():
            u = updates[name]
            # Pieces of one step never overlap: concatenate them, then compose with earlier steps.
            by_kind: dict[bool, list] = {}
            for add, where, vals in parts:
                by_kind.setdefault(add, []).append((where, vals))
            for add, items in by_kind.items():
                where = np.concatenate([w for w, _ in items])
                vals = np.concatenate([v for _, v in items])
                if u.ops and u.ops[-1].add == add:
                    u.ops[-1] = _combine(u.ops[-1], where, vals)
                else:
                    u.ops.append(_Op(add, where.astype(np.int64, copy=False), vals))
    final = manifests[-1]
    specs = {e.segment.name: (e.segment.dtype, e.segment.shape, e.xxh3)
             for f in final.files for e in f.segments if e.segment.kind == "tensor"}
    for name in list(updates):
        if name not in specs:
            del updates[name]  # removed by the update: nothing to apply
            continue
        u = updates[name]
        u.result_xxh3 = specs[name][2]
        if u.replace is None and not any(len(op.positions) for op in u.ops):
            del updates[name]  # changes that cancelled out over several steps
    return updates, specs


class Subscriber:
    """Pulls versions of one model into directories, or applies them in place into tensors.

    ``name`` identifies this subscriber in the replica ledger and holds a lease
    on the chain it reads (default: the host name). ``cache_dir`` keeps
    downloaded objects across pulls and directories (default: each checkout's
    own ``.weightsync/objects``, emptied after a successful pull). ``bandwidth``
    caps downloads in bytes/s. ``version`` tells the subscriber which version
    the caller's tensors hold (`pull` and `apply` keep it up to date).

    One operation at a time per instance (calls are serialized by a lock);
    `prepare` may run in a background thread while the caller serves.
    """

    def __init__(self, server: str, model: str, *, token: str | None = None,
                 name: str | None = None, cache_dir: str | os.PathLike | None = None, concurrency: int = 8,
                 bandwidth: float | None = None, version: int | None = None, site: str | None = None,
                 keep_objects: bool = False, deep_verify: bool = True, range_bytes: int = DEFAULT_RANGE_BYTES,
                 decode_threads: int | None = None, timeout: float = 60.0, retry: Retry | None = None,
                 transport: Any = None, progress: Progress | None = None, report: bool = True) -> None:
        self.model = model
        self.name = name or socket.gethostname()
        self.site = site
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.concurrency = max(1, concurrency)
        self.version = version
        self.keep_objects = keep_objects
        self.deep_verify = deep_verify
        self.range_bytes = range_bytes
        self.decode_threads = decode_threads
        self.progress = progress
        self.report = report
        limiter = TokenBucket(bandwidth) if bandwidth else None
        self.api = Api(server, token, timeout=timeout, concurrency=self.concurrency, retry=retry,
                       limiter=limiter, transport=transport)
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="weightsync-fetch")
        self._reporter = ThreadPoolExecutor(1, thread_name_prefix="weightsync-report")

    def close(self) -> None:
        self._reporter.shutdown(wait=True)
        self._pool.shutdown(wait=True)
        self.api.close()

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _report(self, version: int, *, bytes_: int, pause_ms: float | None = None, extra: dict | None = None,
                wait: bool = True) -> None:
        if not self.report:
            return
        body: dict[str, Any] = {"subscriber": self.name, "version": version, "bytes": bytes_,
                                "host": socket.gethostname(), "extra": extra or {}}
        if pause_ms is not None:
            body["pause_ms"] = pause_ms
        if self.site:
            body["site"] = self.site

        def send() -> None:
            try:
                self.api.report_replica(self.model, body)
            except errors.WeightsyncError as exc:  # the ledger is informative: never fail an update for it
                log.warning("replica report for %s v%s failed: %s", self.model, version, exc)

        fut = self._reporter.submit(send)
        if wait:
            fut.result()

    # --- directories --------------------------------------------------------------------

    def pull(self, dir: str | os.PathLike, version: int | None = None) -> PullResult:
        """Make `dir` hold `version` (default: the head) byte for byte, incrementally from what it holds.

        Before an incremental pull the directory is checked against its state
        file (sizes and every segment's xxh3); a directory changed behind its
        back is pulled in full (``repaired`` in the result). Files not part of
        the model are left alone. Sets :attr:`version`. Raises ModelNotFound,
        VersionNotFound, AuthError, ServerUnavailable, DigestMismatch, ...
        """
        with self._lock:
            meter = _Meter(self.progress)
            self.api.on_bytes = meter
            try:
                result = pull_into(self.api, self.model, Path(dir), version=version, holder=self.name,
                                   cache_root=self.cache_dir / "objects" if self.cache_dir else None,
                                   keep_objects=self.keep_objects, pool=self._pool,
                                   decode_threads=self.decode_threads, deep_verify=self.deep_verify,
                                   range_bytes=self.range_bytes, meter=meter)
            finally:
                self.api.on_bytes = None
            self.version = result.version
            if result.mode != "current":
                self._report(result.version, bytes_=result.bytes_received,
                             extra={"mode": result.mode, "dir": str(Path(dir).resolve()),
                                    "steps": result.steps, "repaired": result.repaired,
                                    **{k: round(v, 4) for k, v in result.timings.items()}})
            return result

    # --- tensors ------------------------------------------------------------------------

    def prepare(self, version: int | None = None, *, device: Any = None) -> Prepared:
        """Download and decode the update from :attr:`version` to `version` (default: head), off the critical path.

        Nothing is applied. With `device`, the changes are staged on that device
        too (e.g. "cuda:0") so `apply` moves nothing. A plan that starts a new
        chain (keyframe) yields whole-tensor replacements.
        """
        with self._lock:
            t0 = time.perf_counter()
            have = self.version
            meter = _Meter(self.progress)
            self.api.on_bytes = meter
            try:
                plan = self.api.get_plan(self.model, have=have, want=version, holder=self.name)
                target = int(plan["target"])
                steps = plan.get("steps") or []
                cache = ObjectCache(self.cache_dir / "objects" if self.cache_dir else None)
                manifests, objects = _step_objects(steps)
                meter.total = int(plan.get("bytes") or 0)
                cache.fetch(self.api, manifests, self._pool, range_bytes=self.range_bytes)
                cache.fetch(self.api, objects, self._pool, range_bytes=self.range_bytes)
            finally:
                self.api.on_bytes = None
            decoded = [_load_manifest(cache, s["manifest"]) for s in steps]
            if not decoded:
                return Prepared(self.model, have, target, {}, {}, 0, meter.bytes, time.perf_counter() - t0)
            with ThreadPoolExecutor(self.decode_threads or os.cpu_count() or 1) as dpool:
                updates, specs = _decode_prepared(self.model, have, target, decoded, object_reader(cache), dpool)
            prepared = Prepared(self.model, have, target, updates, specs, len(steps), meter.bytes,
                                time.perf_counter() - t0)
            if device is not None:
                _stage(prepared, device)
            return prepared

    def apply(self, tensors: Mapping[str, Any], prepared: Prepared, *, verify: bool = True,
              strict: bool = True) -> float:
        """Apply `prepared` in place into `tensors` (name → torch tensor); return the pause in seconds.

        Refuses (BaseMismatch, nothing changed) an update whose base is not
        :attr:`version`. Every tensor of the new version must be in `tensors`
        with its dtype and shape (else ReloadRequired, nothing changed) unless
        ``strict=False``, which skips tensors the caller does not hold. With
        `verify`, the xxh3 of every tensor about to change is checked against the
        base before any tensor changes, and the result after (ChecksumMismatch:
        reload). Hashing runs on the host, so CUDA tensors are copied there
        for verification; the update itself runs on the tensors' device.

        The returned pause covers only the mutation (verification only reads,
        before and after it). Tensors must be contiguous.
        """
        with self._lock:
            return _apply(self, tensors, prepared, verify=verify, strict=strict)

    def watch(self, after: int | None = None, *, timeout: float = 30.0,
              stop: threading.Event | None = None) -> Iterator[Version]:
        """Yield each new head as it commits (long-poll `watchModel`), reconnecting on errors.

        Starts after `after`, else after :attr:`version`, else after the current
        head. When several versions commit between two polls only the newest is
        yielded. Ends when `stop` is set (checked between polls).
        """
        if after is None:
            after = self.version
        if after is None:
            head = self.api.head(self.model)
            after = int(head["number"]) if head else 0
        backoff = 0.5
        while stop is None or not stop.is_set():
            try:
                v = self.api.watch(self.model, after=after, timeout=timeout)
                backoff = 0.5
            except (errors.ServerUnavailable, errors.ModelNotFound, errors.VersionNotFound) as exc:
                log.debug("watch %s: %s; reconnecting", self.model, exc)
                if stop is not None and stop.wait(backoff):
                    return
                if stop is None:
                    time.sleep(backoff)
                backoff = min(backoff * 2, 10.0)
                continue
            if v is not None:
                version = Version.from_json(v)
                if version.number > after:
                    after = version.number
                    yield version


def _stage(prepared: Prepared, device: Any) -> None:
    from weightsync.client.tensors import _torch

    torch = _torch()
    for u in prepared.updates.values():
        if u.replace is not None:
            u.staged_replace = torch.from_numpy(u.replace).to(device)
        for op in u.ops:
            signed = op.operands.view(f"<i{op.operands.itemsize}") if op.operands.itemsize > 1 else op.operands
            op.staged = (torch.from_numpy(op.positions).to(device), torch.from_numpy(signed).to(device))
    prepared.device = device


def _apply(sub: Subscriber, tensors: Mapping[str, Any], prepared: Prepared, *, verify: bool, strict: bool) -> float:
    from weightsync.client.tensors import _torch, byte_view, int_view, tensor_xxh3, torch_dtype

    torch = _torch()
    if prepared.model != sub.model:
        raise errors.BaseMismatch(f"update is for model {prepared.model!r}, not {sub.model!r}")
    if prepared.base != sub.version:
        raise errors.BaseMismatch(f"update applies to v{prepared.base}, but the tensors hold v{sub.version}")
    held: dict[str, Any] = {}
    for name, (dtype, shape, _) in prepared.specs.items():
        t = tensors.get(name)
        if t is None:
            if strict:
                raise errors.ReloadRequired(f"v{prepared.target} has tensor {name!r}, which the caller does not "
                                            "hold: load the version afresh")
            continue
        if t.dtype != torch_dtype(dtype.name) or tuple(t.shape) != tuple(shape):
            raise errors.ReloadRequired(f"tensor {name!r} is {t.dtype}{list(t.shape)} here but "
                                        f"{dtype.name}{list(shape)} in v{prepared.target}: load the version afresh")
        if not t.is_contiguous():
            raise errors.ReloadRequired(f"tensor {name!r} is not contiguous; apply needs contiguous tensors")
        held[name] = t
    work = [(u, held[name]) for name, u in prepared.updates.items() if name in held]
    if verify:
        for u, t in work:
            if u.base_xxh3 is not None and tensor_xxh3(t) != u.base_xxh3:
                raise errors.BaseMismatch(f"tensor {u.name!r} does not hold v{prepared.base}'s bytes; "
                                          "nothing was changed")
    devices = {t.device for _, t in work}
    t0 = time.perf_counter()
    with torch.no_grad():
        for u, t in work:
            if u.replace is not None:
                src = u.staged_replace if u.staged_replace is not None else torch.from_numpy(u.replace)
                byte_view(t).copy_(src, non_blocking=True)
                continue
            view = int_view(t)
            for op in u.ops:
                if op.staged is not None and op.staged[0].device == t.device:
                    pos, vals = op.staged
                else:
                    signed = op.operands.view(f"<i{op.operands.itemsize}") if op.operands.itemsize > 1 \
                        else op.operands
                    pos = torch.from_numpy(op.positions).to(t.device, non_blocking=True)
                    vals = torch.from_numpy(signed).to(t.device, non_blocking=True)
                cur = view.index_select(0, pos)
                view.index_copy_(0, pos, cur + vals if op.add else cur ^ vals)
        for d in devices:
            if d.type == "cuda":
                torch.cuda.synchronize(d)
    pause = time.perf_counter() - t0
    sub.version = prepared.target
    if verify:
        for u, t in work:
            if tensor_xxh3(t) != u.result_xxh3:
                raise errors.ChecksumMismatch(f"tensor {u.name!r} does not match v{prepared.target} after the "
                                              "update: load the version afresh")
    sub._report(prepared.target, bytes_=prepared.bytes_received, pause_ms=pause * 1000.0, wait=False,
                extra={"mode": "in-place", "prepare_s": round(prepared.seconds, 4), "tensors": len(work),
                       "elements": prepared.changed_elements})
    return pause
