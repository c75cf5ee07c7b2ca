"""In-place updates: decode a plan into per-tensor changes (prepare), then change tensors in place (apply).

`prepare` does the network and decode work of an update off the critical
path: every delta step of every tensor is decoded into a
:class:`~weightsync.codec.values.Change` and the steps are composed
(``codec.values.compose``), so each element changes at most once however many
versions the update spans. `apply` is the only part that pauses serving: it
changes just those elements, with torch index ops on the tensors' own device;
only the small (positions, operands) arrays cross to it, staged compactly
(client/tensors.py: ~4 bytes per changed bf16 element).

Verification uses the digests of the manifests' kind (client/verify.py): for
FORMAT v2 the tensor checksum, computed where the tensors live (no host copy);
for v1 xxh3-128 through pinned host buffers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from weightsync import errors
from weightsync.client import frames_apply, stage_frames
from weightsync.client._pool import cpu_pool, pool_of, run_all
from weightsync.client.tensors import HostOps, StagedChange
from weightsync.client.verify import HostHasher, digests
from weightsync.codec.checksum import MASK, TensorSum
from weightsync.codec.decoder import check_frame
from weightsync.codec.dtypes import DType, by_name
from weightsync.codec.manifest import DIGEST_SUM, DIGEST_XXH3, FrameRef, Manifest
from weightsync.codec.values import Change, compose, decode_pieces, keyframe_bytes

DEVICE_DECODE_THREADS = 2
"""Threads that decode frames into changes for tensors off the host (`prepare` with a device, when not told).
That decode holds the GIL for most of each frame's work: on the H100 box's 16 cores a 5.7 GB model's
update (19.8 M changes, 1468 frames) decoded and staged in 0.59 / 0.50 / 0.56 / 0.75 / 0.84 s on
1 / 2 / 4 / 8 / 16 threads (docs/SCALE-RUNS.md, run Y)."""

_REPLACE_PIECE = 8 << 20
"""Whole replacements of host tensors are copied in pieces of this many bytes, spread over the CPU pool."""


@dataclass
class TensorUpdate:
    """What `apply` does to one tensor: replace it whole, or change some elements."""

    name: str
    dtype: DType
    shape: tuple[int, ...]
    base_digest: str | None
    """Digest the tensor must have before (None when it is replaced whole)."""
    base_kind: str = DIGEST_XXH3
    """The kind of `base_digest`: that of the manifest it came from."""
    result_digest: str = ""
    """Digest the tensor must have after, of the kind of `Prepared.digest_kind`."""
    replace: np.ndarray | None = None
    staged_replace: Any = None
    ops: Sequence[Change] = ()
    """Changes to apply in order (one per run of a kind: in practice one). Replaced, never appended to:
    an empty tuple by default, so the tens of thousands of updates of a large MoE's `prepare` make no
    list each for the garbage collector to walk."""
    staged: Sequence[StagedChange] = ()
    """`ops` on the staging device, compact (client/tensors.py)."""

    @property
    def changed_elements(self) -> int:
        if self.replace is not None:
            return len(self.replace) // self.dtype.width
        if isinstance(self.ops, HostOps):
            return self.ops.elements
        return sum(len(op) for op in self.ops)


@dataclass
class Prepared:
    """An update from version `base` (what the tensors hold; None: nothing) to `target`, decoded and ready."""

    model: str
    base: int | None
    target: int
    updates: dict[str, TensorUpdate]
    specs: dict[str, tuple[DType, tuple[int, ...], str]]
    """Every tensor of the target version: dtype, shape, digest."""
    steps: int
    bytes_received: int
    seconds: float
    device: Any = None
    digest_kind: str = DIGEST_XXH3
    """The kind of the target version's digests (its manifest's)."""
    frames: list[frames_apply.Frame] | None = None
    """A one-step FORMAT v2 delta prepared for host tensors: its frames, not decoded (client/frames_apply.py);
    `updates` then name the touched tensors and their digests, with no changes."""
    manifests: list[Manifest] = field(default_factory=list, repr=False)
    select: Callable[[str], bool] | None = field(default=None, repr=False)
    """The tensors this update is for (None: all of the version's)."""
    partial_objects: list[str] = field(default_factory=list, repr=False)
    """Objects read from byte ranges (not checked against their SHA-256; a failed check drops them)."""

    def decode_frames(self, threads: int | None = None) -> None:
        """Decode the frames this update kept (if any) into per-tensor changes: what tensors off the host need
        (`apply` does it when it finds them there)."""
        if self.frames is None:
            return
        blobs = {f.ref: f.blob for f in self.frames}
        self.updates, _ = decode_updates(self.manifests, lambda ref: blobs[ref], pool_of(threads), select=self.select)
        self.frames = None

    @property
    def changed_elements(self) -> int:
        if self.frames is not None:
            return sum(f.changes for f in self.frames)
        return sum(u.changed_elements for u in self.updates.values())

    @property
    def staged_bytes(self) -> int:
        """Bytes the element-wise changes hold on the staging device (whole replacements not included)."""
        return sum(s.nbytes for u in self.updates.values() for s in u.staged)


_JOBS_PER_BATCH = 64
"""A step's frames are decoded in about this many pool jobs (at least one frame each)."""
_FRAMES_PER_JOB = 8
"""At most this many frames per decode job."""


def _frames_per_job(frames: int) -> int:
    """Frames each decode job takes: one each for a small update, up to _FRAMES_PER_JOB for a large one.

    A job per frame cost the pool's hand-over (submit, wake a thread, a future, its result) per
    frame; a GPU's update holds hundreds to thousands of frames of ~10^4-10^5 changes each, where that
    is a fair share of the frame's own work (docs/SCALE-RUNS.md, run Z). About _JOBS_PER_BATCH jobs still
    keep every thread busy to the end.
    """
    return max(1, min(_FRAMES_PER_JOB, frames // _JOBS_PER_BATCH))


def _touched(
    manifest: Manifest, updates: dict[str, TensorUpdate], select: Callable[[str], bool] | None = None
) -> tuple[dict[tuple[int, int], str], set[str]]:
    """Tensor names by (file, segment) of one step, and the tensors it changes (their updates made ready);
    with `select`, only the selected tensors count as changed."""
    names: dict[tuple[int, int], str] = {}
    touched: set[str] = set()
    for fi, f in enumerate(manifest.files):
        for si, e in enumerate(f.segments):
            seg = e.segment
            if seg.kind != "tensor":
                continue
            names[(fi, si)] = seg.name
            if select is not None and not select(seg.name):
                continue
            if e.base_offset is None:
                updates[seg.name] = TensorUpdate(
                    seg.name, seg.dtype, seg.shape, None, replace=np.empty(seg.length, dtype=np.uint8)
                )
                touched.add(seg.name)
            elif not e.unchanged:
                u = updates.get(seg.name)
                if u is None or u.dtype is not seg.dtype or u.shape != seg.shape:
                    kind = manifest.digest_kind
                    updates[seg.name] = TensorUpdate(seg.name, seg.dtype, seg.shape, e.base_digest, kind)
                touched.add(seg.name)
    return names, touched


def decode_updates(
    manifests: list[Manifest],
    read_frame: Callable[[FrameRef], Any],
    pool: ThreadPoolExecutor,
    *,
    frames: list[frames_apply.Frame] | None = None,
    select: Callable[[str], bool] | None = None,
) -> tuple[dict[str, TensorUpdate], dict[str, tuple[DType, tuple[int, ...], str]]]:
    """The per-tensor updates that take tensors holding the parent of `manifests[0]` to `manifests[-1]`,
    and every tensor of the final version (dtype, shape, digest). Frames decode on `pool`.

    With `frames` (one step, :func:`frames_apply.eligible`), the step's frames are fetched
    into it (by the calling thread) instead of decoded: the updates then carry digests and no changes. With `select`,
    only the selected tensors: frames that change none of them are never read.
    """
    updates: dict[str, TensorUpdate] = {}
    for manifest in manifests:
        names, touched = _touched(manifest, updates, select)
        if frames is not None:
            frames.extend(frames_apply.fetch(manifest, names, touched, read_frame))
            continue
        pieces: dict[str, list[Change]] = {}
        lock = threading.Lock()

        def run(
            ref: FrameRef,
            manifest: Manifest = manifest,
            names: dict[tuple[int, int], str] = names,
            touched: set[str] = touched,
            pieces: dict[str, list[Change]] = pieces,
            lock: threading.Lock = lock,
        ) -> None:
            if not any(names.get((p.file, p.seg)) in touched for p in ref.pieces):
                return
            blob = read_frame(ref)
            check_frame(manifest, ref, blob)
            width = by_name(ref.dtype).width
            if ref.delta:  # one pass for all its pieces, outside the GIL (codec.values.decode_pieces)
                changes = decode_pieces(blob, [(p.length // width, p.offset // width) for p in ref.pieces])
                for p, piece in zip(ref.pieces, changes, strict=True):
                    name = names.get((p.file, p.seg))
                    if name is None or name not in touched:
                        continue
                    u = updates[name]
                    if u.replace is not None:  # replaced earlier in this plan: compose on the host copy
                        piece.apply(u.replace)
                    else:
                        with lock:
                            pieces.setdefault(name, []).append(piece)
                return
            data = keyframe_bytes(blob)
            pos = 0
            for p in ref.pieces:
                name = names.get((p.file, p.seg))
                start = pos
                pos += p.length
                if name is None or name not in touched:
                    continue
                u = updates[name]
                assert u.replace is not None
                u.replace[p.offset : p.offset + p.length] = data[start : start + p.length]

        refs = manifest.frames
        per = _frames_per_job(len(refs))

        def run_some(
            i: int, refs: list[FrameRef] = refs, per: int = per, run: Callable[[FrameRef], None] = run
        ) -> None:
            for ref in refs[i : i + per]:
                run(ref)

        run_all(pool, run_some, range(0, len(refs), per))
        for name, parts in pieces.items():
            # Pieces of one step are disjoint: composing them with earlier steps is one pass.
            updates[name].ops = compose([*updates[name].ops, *parts])
    return _finish(manifests, updates, select, kept_frames=frames is not None)


def _finish(
    manifests: Sequence[Manifest],
    updates: dict[str, TensorUpdate],
    select: Callable[[str], bool] | None,
    *,
    kept_frames: bool,
) -> tuple[dict[str, TensorUpdate], dict[str, tuple[DType, tuple[int, ...], str]]]:
    """`updates` without the tensors the final version lacks or that end up unchanged, their result digests set;
    and every (selected) tensor of the final version (dtype, shape, digest)."""
    final = manifests[-1]
    specs = {
        e.segment.name: (e.segment.dtype, e.segment.shape, e.digest)
        for f in final.files
        for e in f.segments
        if e.segment.kind == "tensor" and (select is None or select(e.segment.name))
    }
    for name in list(updates):
        if name not in specs:
            del updates[name]  # removed by the update: nothing to apply
            continue
        u = updates[name]
        u.result_digest = specs[name][2]
        if u.replace is None and not u.ops and not kept_frames:
            del updates[name]  # changes that cancelled out over several steps
    return updates, specs


def frames_needed(manifests: Sequence[Manifest], select: Callable[[str], bool]) -> list[FrameRef]:
    """The frames of `manifests` (a plan's steps) that :func:`decode_updates` reads for the tensors `select`
    takes: those with a piece of a selected tensor its step changes (a frame shared with other tensors whole)."""
    out: list[FrameRef] = []
    for manifest in manifests:
        names, touched = _touched(manifest, {}, select)
        out.extend(ref for ref in manifest.frames if any(names.get((p.file, p.seg)) in touched for p in ref.pieces))
    return out


def stage(prepared: Prepared, device: Any) -> None:
    """Copy `prepared`'s changes to `device` ahead of `apply`, so the apply moves nothing (compactly:
    `Prepared.staged_bytes` tells what they hold there)."""
    from weightsync.client.tensors import ready_to_apply, stage_changes, torch_module, warm_device_kernels

    torch = torch_module()
    target = torch.empty(0, device=device).device  # "cuda" is the current CUDA device: its index named
    changes: list[tuple[Change, int]] = []
    restage = []
    for u in prepared.updates.values():
        if u.replace is not None:
            u.staged_replace = torch.from_numpy(u.replace).to(device)
        if u.staged and all(s.operands.device == target for s in u.staged):
            continue  # staged there already (client/stage_frames.py)
        restage.append(u)
        elements = int(np.prod(u.shape, dtype=np.int64))
        changes.extend((op, elements) for op in u.ops)
    ordered = iter(stage_changes(changes, device) if changes else [])  # one copy to the device for all of them
    for u in restage:
        u.staged = [next(ordered) for _ in u.ops]
    prepared.device = device
    # The device's kernels for these changes and for the checksum compile now, not in the pause, and what the
    # apply kernel would compute first for each change is computed now too.
    updates = prepared.updates.values()
    ready_to_apply(s for u in updates for s in u.staged)
    warm_device_kernels(
        device,
        {(u.dtype.width, s.positions is None, s.add) for u in updates for s in u.staged},
        widths={u.dtype.width for u in updates},
    )


def prepare(
    manifests: Sequence[Manifest],
    read_frame: Callable[[FrameRef], Any],
    *,
    model: str,
    base: int | None,
    target: int,
    threads: int | None = None,
    device: Any = None,
    bytes_received: int = 0,
    select: Callable[[str], bool] | None = None,
) -> Prepared:
    """The update from `base` to `target` of `model` that `manifests` (a plan's steps, in order) describe.

    With `select` (client/selection.py), the update of the selected tensors only: `specs`
    names only those, and only the frames that change them are read.

    The lowest door to in-place updates, with no server: `read_frame` returns
    each frame's bytes (already verified by whoever fetched them). Frames decode
    on `threads` threads (default ``os.cpu_count()``, or :data:`DEVICE_DECODE_THREADS` with
    `device`); with `device`, the changes are staged there too (:func:`stage`). ``seconds`` counts decode and staging.

    Without `device`, a one-step FORMAT v2 delta is kept as its frames (read and
    their headers checked, not decoded): `apply` patches host tensors from them in
    one checked pass (client/frames_apply.py), and decodes them first for tensors
    elsewhere.
    """
    t0 = time.perf_counter()
    updates: dict[str, TensorUpdate] = {}
    specs: dict[str, tuple[DType, tuple[int, ...], str]] = {}
    frames: list[frames_apply.Frame] | None = [] if device is None and frames_apply.eligible(list(manifests)) else None
    if device is not None and threads is None:
        threads = DEVICE_DECODE_THREADS
    staged = False
    if device is not None and len(manifests) == 1 and stage_frames.available(device):
        # One step for a device: staged straight from its frames (client/stage_frames.py), but for the tensors
        # it leaves to the reference path (a dense frame's), decoded here; or, when it stages nothing, all.
        names, touched = _touched(manifests[0], updates, select)
        per = _frames_per_job(len(manifests[0].frames))
        left = stage_frames.stage_step(
            manifests[0], read_frame, pool_of(threads), names, touched, updates, device, per_job=per
        )
        if left is None:
            updates = {}  # the reference path for all of it, afresh
        else:
            if left:
                rest, _ = decode_updates(list(manifests), read_frame, pool_of(threads), select=left.__contains__)
                for name in left:
                    updates.pop(name, None)
                updates.update(rest)
            updates, specs = _finish(manifests, updates, select, kept_frames=False)
            staged = True
    if manifests and not staged:
        updates, specs = decode_updates(list(manifests), read_frame, pool_of(threads), frames=frames, select=select)
    prepared = Prepared(
        model=model,
        base=base,
        target=target,
        updates=updates,
        specs=specs,
        steps=len(manifests),
        bytes_received=bytes_received,
        seconds=0.0,
        digest_kind=manifests[-1].digest_kind if manifests else DIGEST_XXH3,
        frames=frames,
        manifests=list(manifests),
        select=select,
    )
    if device is not None and manifests:
        stage(prepared, device)
    prepared.seconds = time.perf_counter() - t0
    return prepared


@dataclass
class Applied:
    """What `apply` did: the pause it took, the tensors it changed, and how they were verified."""

    target: int
    pause: float
    """Seconds from the first write until the result check passed (until the last write landed without `verify`)."""
    tensors: int
    changed: list[tuple[TensorUpdate, Any]] = field(repr=False)
    """(update, tensor) pairs that were changed."""
    digest_kind: str = DIGEST_XXH3
    """The kind of the target version's digests: what `check` computes."""
    hasher: HostHasher = field(default_factory=HostHasher, repr=False)
    base_check_s: float = 0.0
    """Seconds the base check took, before the first write (0 without verification)."""
    result_check_s: float = 0.0
    """Seconds the result check took inside the pause (and then :meth:`check`'s, once it ran)."""
    verified_by: tuple[str, ...] = ()
    """How tensors were verified, over both checks (client/verify.py path names, and :data:`CHANGE_SUMS`
    for results checked from their base and the changed elements; empty: not verified)."""

    def check(self) -> None:
        """Read every changed tensor again and check it against the target version's digests.

        `apply` with verification has checked the results already; this is a second,
        full check (every byte read again where the tensors live, in one batched pass,
        client/verify.py). ChecksumMismatch names the first tensor, in update order, that
        differs; nothing is restored.
        """
        t0 = time.perf_counter()
        hashed = digests([t for _, t in self.changed], self.digest_kind, self.hasher)
        self.result_check_s = time.perf_counter() - t0
        self.verified_by = tuple(sorted({*self.verified_by, *hashed.paths}))
        for (u, _), digest in zip(self.changed, hashed.digests, strict=True):
            if digest != u.result_digest:
                raise errors.ChecksumMismatch(
                    f"tensor {u.name!r} does not match v{self.target} after the update: load the version afresh"
                )


CHANGE_SUMS = "change-sums"
"""Path name: a result checked from its verified base checksum and the elements that changed (FORMAT §10)."""


def _held(tensors: Mapping[str, Any], prepared: Prepared, strict: bool) -> dict[str, Any]:
    """The caller's tensors of the target version, each checked for dtype, shape and layout."""
    from weightsync.client.tensors import torch_dtype

    held: dict[str, Any] = {}
    dtypes: dict[str, Any] = {}  # torch dtype by name, looked up once per dtype (models hold ~10^4-10^5 tensors)
    for name, (dtype, shape, _) in prepared.specs.items():
        t = tensors.get(name)
        if t is None:
            if strict:
                raise errors.ReloadRequired(
                    f"v{prepared.target} has tensor {name!r}, which the caller does not hold: load the version afresh"
                )
            continue
        want = dtypes.get(dtype.name)
        if want is None:
            want = dtypes[dtype.name] = torch_dtype(dtype.name)
        if t.dtype != want or t.shape != tuple(shape):  # torch.Size is a tuple
            raise errors.ReloadRequired(
                f"tensor {name!r} is {t.dtype}{list(t.shape)} here but "
                f"{dtype.name}{list(shape)} in v{prepared.target}: load the version afresh"
            )
        if not t.is_contiguous():
            raise errors.ReloadRequired(f"tensor {name!r} is not contiguous; apply needs contiguous tensors")
        held[name] = t
    return held


def apply(
    tensors: Mapping[str, Any],
    prepared: Prepared,
    *,
    model: str,
    version: int | None,
    verify: bool,
    strict: bool,
    hasher: HostHasher | None = None,
) -> Applied:
    """Apply `prepared` in place into `tensors` (name → torch tensor) holding `version` of `model`.

    Refuses, changing nothing: BaseMismatch (another model or base version,
    or with `verify` a tensor whose digest is not the base's), ReloadRequired (a
    tensor missing, or of another dtype, shape or layout). With `verify`, every
    tensor about to change is digested in one batched pass before the first
    write, with its manifest's digest kind (client/verify.py: the FORMAT v2
    checksum where the tensor lives; for v1 xxh3 via `hasher`, default
    :class:`HostHasher()`: CPU tensors where they lie, device tensors through
    pinned staging buffers), and every result is checked before this returns:

    - FORMAT v2: from the base's checksum and the changed elements, each read back
      after its write (the checksum is linear, FORMAT §10): work proportional to the
      changed elements, no second pass over the tensors. Whole replacements are summed
      again in full.
    - FORMAT v1: every changed tensor hashed again.

    A result that fails raises ChecksumMismatch after undoing every element change, so
    the tensors hold `version` again, unless the update replaced some tensor whole (a
    new chain): then they hold neither version and must be loaded afresh (the message
    says which). The pause runs from the first write until the result check passed.

    Without `verify` an update is applied unchecked only where its objects' bytes were checked: hashed
    whole against their names. One read from byte
    ranges (:attr:`Prepared.partial_objects`: a tensor selection) cannot be hashed, and the checks of
    its results are all that would catch a range damaged on the way: it is verified all the same.
    """
    if prepared.partial_objects:
        verify = True  # nothing else checks bytes read from ranges
    from weightsync.client.tensors import byte_view, copy_pieces, host_bytes, torch_module

    torch = torch_module()
    if prepared.model != model:
        raise errors.BaseMismatch(f"update is for model {prepared.model!r}, not {model!r}")
    if prepared.base != version:
        raise errors.BaseMismatch(f"update applies to v{prepared.base}, but the tensors hold v{version}")
    held = _held(tensors, prepared, strict)
    if prepared.frames is not None:
        touched = {name: held[name] for name in prepared.updates if name in held}
        if frames_apply.on_host(touched):
            return _apply_frames(prepared, touched, verify)
        prepared.decode_frames()  # tensors elsewhere: decoded changes, staged at the apply
    work = [(u, held[name]) for name, u in prepared.updates.items() if name in held]
    hasher = hasher if hasher is not None else HostHasher()
    base_check_s = 0.0
    paths: set[str] = set()
    bases: dict[str, TensorSum] = {}  # v2 base checksums, by tensor name
    if verify:
        t0 = time.perf_counter()
        checked = [(u, t) for u, t in work if u.base_digest is not None]  # whole replacements have no base
        for kind in sorted({u.base_kind for u, _ in checked}):
            of_kind = [(u, t) for u, t in checked if u.base_kind == kind]
            hashed = digests([t for _, t in of_kind], kind, hasher)
            paths.update(hashed.paths)
            for (u, _), digest in zip(of_kind, hashed.digests, strict=True):
                if digest != u.base_digest:
                    raise errors.BaseMismatch(
                        f"tensor {u.name!r} does not hold v{prepared.base}'s bytes; nothing was changed"
                    )
                if kind == DIGEST_SUM:
                    bases[u.name] = TensorSum.from_digest(u.dtype.width, bytes.fromhex(digest))
        base_check_s = time.perf_counter() - t0
    # Results of v2 element changes are checked from their base and the changed elements.
    track = verify and prepared.digest_kind == DIGEST_SUM
    t0 = time.perf_counter()
    moved: dict[str, list[Any]] = {}
    with torch.no_grad():
        # Whole replacements of host tensors: numpy copies on the CPU pool (tensors.copy_pieces: no OpenMP
        # worker left spinning on a core after the apply, as torch's copy_ leaves one).
        host = [(host_bytes(t), u.replace) for u, t in work if u.replace is not None and t.device.type == "cpu"]
        copy_pieces(host, cpu_pool(), piece=_REPLACE_PIECE)
        for u, t in work:
            if u.replace is not None:
                if t.device.type != "cpu":
                    src = u.staged_replace if u.staged_replace is not None else torch.from_numpy(u.replace)
                    byte_view(t).copy_(src, non_blocking=True)
                continue
            tracked = track and u.name in bases
            for i in range(len(u.ops)):
                lanes = _change(u, i, t, track=tracked)
                if tracked and lanes is not None:
                    moved.setdefault(u.name, []).append(lanes)
        _synchronize(torch, work)
    write_s = time.perf_counter() - t0
    applied = Applied(
        prepared.target,
        write_s,
        len(work),
        work,
        digest_kind=prepared.digest_kind,
        hasher=hasher,
        base_check_s=base_check_s,
    )
    if verify:
        r0 = time.perf_counter()
        bad = _check_results(work, bases, moved, applied, track)
        if bad is not None:
            _undo(work, prepared, bad)
        applied.result_check_s = time.perf_counter() - r0
        applied.pause = time.perf_counter() - t0
        paths.update(applied.verified_by)
        applied.verified_by = tuple(sorted(paths))
    return applied


def _change(u: TensorUpdate, i: int, t: Any, *, track: bool = False, inverse: bool = False) -> Any:
    """Apply (or with `inverse` undo) change `i` of `u` to tensor `t` where it lives; with `track`, the move of its
    checksum lanes (a tuple for host tensors, an int64 tensor on the device otherwise; None: nothing moved).

    Host tensors take the decoded change through numpy; others the change staged on their device
    (staged now when `prepare` staged it elsewhere or not at all).
    """
    from weightsync.client.tensors import apply_change_host, apply_staged, stage_change

    if t.device.type == "cpu":
        return apply_change_host(t, u.ops[i], track=track, inverse=inverse)
    staged = u.staged[i] if i < len(u.staged) and u.staged[i].operands.device == t.device else None
    if staged is None:  # staged elsewhere or not at all: from the decoded change (tensors.HostOps makes it)
        staged = stage_change(u.ops[i], t.device, elements=t.numel())
    return apply_staged(t, staged, track=track, inverse=inverse)


def _synchronize(torch: Any, work: list[tuple[TensorUpdate, Any]]) -> None:
    """Wait until every write queued on the CUDA devices of `work`'s tensors has landed."""
    for d in {t.device for _, t in work}:
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def _apply_frames(prepared: Prepared, touched: dict[str, Any], verify: bool) -> Applied:
    """`apply` of a prepared that kept its frames, into host tensors: one pass, base and result checked in it."""
    assert prepared.frames is not None
    digests_of = {n: (u.base_digest, u.result_digest) for n, u in prepared.updates.items() if n in touched}
    pause = frames_apply.apply(
        prepared.frames, touched, digests_of, base=prepared.base, target=prepared.target, verify=verify
    )
    work = [(prepared.updates[n], t) for n, t in touched.items()]
    return Applied(
        prepared.target,
        pause,
        len(work),
        work,
        digest_kind=prepared.digest_kind,
        verified_by=(frames_apply.FUSED,) if verify else (),
    )


def _check_results(
    work: list[tuple[TensorUpdate, Any]],
    bases: dict[str, TensorSum],
    moved: dict[str, list[Any]],
    applied: Applied,
    track: bool,
) -> TensorUpdate | None:
    """The first update, in order, whose tensor does not hold its result digest now (None: all do).

    Tracked tensors: their base checksum moved by the changed elements; the rest are read again.
    """
    ok: dict[str, bool] = {}
    tracked = [u for u, _ in work if track and u.name in bases and u.replace is None]
    ints = _read_back({u.name: moved.get(u.name, []) for u in tracked})
    for u in tracked:
        delta = [0] * len(bases[u.name].lanes)
        for lanes in ints[u.name]:
            delta = [(a + b) & MASK for a, b in zip(delta, lanes, strict=True)]
        ok[u.name] = bases[u.name].moved(delta).hex() == u.result_digest
    rest = [(u, t) for u, t in work if u.name not in ok]
    if rest:
        hashed = digests([t for _, t in rest], applied.digest_kind, applied.hasher)
        applied.verified_by = tuple(sorted({*applied.verified_by, *hashed.paths}))
        for (u, _), digest in zip(rest, hashed.digests, strict=True):
            ok[u.name] = digest == u.result_digest
    if len(ok) > len(rest):
        applied.verified_by = tuple(sorted({*applied.verified_by, CHANGE_SUMS}))
    return next((u for u, _ in work if not ok[u.name]), None)


def _read_back(moved: dict[str, list[Any]]) -> dict[str, list[tuple[int, ...]]]:
    """Each tensor's checksum moves as ints: host tensors' are tuples already; a device's int64 lanes are read
    back all at once, one copy per device (``devsum.lanes_to_ints_many``), not one per tensor inside the pause."""
    on_device = [lanes for each in moved.values() for lanes in each if not isinstance(lanes, tuple)]
    read: Iterator[tuple[int, ...]] = iter(())
    if on_device:
        from weightsync import devsum  # imports torch: only where device tensors were tracked

        read = iter(devsum.lanes_to_ints_many(on_device))
    return {name: [lanes if isinstance(lanes, tuple) else next(read) for lanes in each] for name, each in moved.items()}


def _undo(work: list[tuple[TensorUpdate, Any]], prepared: Prepared, bad: TensorUpdate) -> None:
    """Undo every element change of `work` and raise ChecksumMismatch naming `bad` (the tensors hold the base
    again), or, when some tensor was replaced whole (nothing to undo it with), say they must be reloaded."""
    from weightsync.client.tensors import torch_module

    torch = torch_module()
    what = f"tensor {bad.name!r} does not match v{prepared.target} after the update"
    if any(u.replace is not None for u, _ in work):
        raise errors.ChecksumMismatch(f"{what}; the tensors hold neither version: load the version afresh")
    with torch.no_grad():
        for u, t in work:
            for i in reversed(range(len(u.ops))):
                _change(u, i, t, inverse=True)
        _synchronize(torch, work)
    raise errors.ChecksumMismatch(f"{what}; every change was undone: the tensors hold v{prepared.base} again")
