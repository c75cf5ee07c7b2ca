"""What a publisher diffs: its source as a Checkpoint, and the base version it keeps to diff against.

The base is the version the publisher last published (or caught up with):
in memory, or in a checkout directory under the publisher's ``cache_dir`` so
a restarted trainer still publishes deltas. When it is not the server's head
the publisher either publishes a keyframe or (``on_mismatch="download"``)
brings the base to the head with an incremental pull first.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from weightsync import errors
from weightsync.client._http import Api
from weightsync.client._pool import cpu_pool, run_all
from weightsync.client.checkout import Checkout
from weightsync.client.decode import HeldFile, Tree
from weightsync.client.models import Version
from weightsync.client.pull import Meter, pull
from weightsync.client.state import CheckoutState
from weightsync.client.tensors import copy_pieces
from weightsync.codec.checkpoint import Checkpoint, CheckpointFile, layout_of
from weightsync.codec.frame import apply_frame_pieces, undo_frame
from weightsync.codec.manifest import VERSION_2 as MANIFEST_V2
from weightsync.codec.manifest import FrameRef, Manifest
from weightsync.codec.validate import validate_for_publish

log = logging.getLogger("weightsync.client")

STATE_DICT_FILE = "model.safetensors"
"""File name a published state_dict gets."""


def snapshot(source: Any, *, warnings: list[str] | None = None) -> tuple[Checkpoint, bool]:
    """(checkpoint, owned) of a publish source, checked for publishing: what to upload, nothing uploaded yet.

    owned: the bytes are ours (a serialized state_dict), not the caller's files.
    Every source (path, directory, state_dict, bytes, Checkpoint) is validated
    (codec/validate.py): InvalidCheckpoint for a broken safetensors file, no
    safetensors weights, or only pickles; pickles next to safetensors weights
    are left out of the checkpoint returned, with a warning that is logged
    (logger "weightsync.client") and appended to `warnings` when given.
    TypeError for a source that is none of path, state_dict, bytes.
    """
    checkpoint, owned, name = _open_source(source)
    checked = validate_for_publish(checkpoint, source=name)
    for line in checked.warnings:
        log.warning("%s", line)
        if warnings is not None:
            warnings.append(line)
    return checked.checkpoint, owned


def _open_source(source: Any) -> tuple[Checkpoint, bool, str]:
    """(checkpoint, owned, how messages name it) of a publish source, unchecked."""
    if isinstance(source, Checkpoint):
        return source, False, "the checkpoint"
    if isinstance(source, (str, os.PathLike)):
        return Checkpoint.open(source), False, os.fspath(source)
    if isinstance(source, (bytes, bytearray, np.ndarray)):
        data = np.frombuffer(source, dtype=np.uint8) if not isinstance(source, np.ndarray) else source
        return _single(data), True, "the bytes"
    if isinstance(source, Mapping):
        from weightsync.client.tensors import serialize_state_dict

        return _single(serialize_state_dict(source)), True, "the state_dict"
    raise TypeError(f"cannot publish a {type(source).__name__}: give a path, a state_dict or safetensors bytes")


def _single(data: np.ndarray) -> Checkpoint:
    """Bytes published as the one file STATE_DICT_FILE."""
    return Checkpoint([CheckpointFile(layout_of(STATE_DICT_FILE, data), data)], single_file=True)


def _in_memory(ck: Checkpoint) -> Checkpoint:
    """A copy of `ck` in new buffers of our own, copied in pieces on the process's CPU pool."""
    files, copies = _fresh_copy_jobs(ck)
    _copy(copies)
    return Checkpoint(files, single_file=ck.single_file)


def _fresh_copy_jobs(ck: Checkpoint) -> tuple[list[CheckpointFile], list[tuple[np.ndarray, np.ndarray]]]:
    """New buffers for `ck`'s files (not yet filled), and the (destination, source) pairs that fill them."""
    files = [CheckpointFile(f.layout, np.empty(f.data.size, dtype=np.uint8)) for f in ck.files]
    return files, [(mine.data, theirs.data) for mine, theirs in zip(files, ck.files, strict=True)]


def _copy(pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """Copy (destination, source) pairs in pieces of at most _COPY_PIECE bytes on the process's CPU pool, so a
    large file is copied on every core (one thread copies pages it has never touched at a fraction of the
    memory's speed)."""
    copy_pieces(pairs, cpu_pool(), piece=_COPY_PIECE)


def _same_sizes(a: Checkpoint, b: Checkpoint) -> bool:
    """Whether `b`'s files have the paths and sizes of `a`'s, in order (its bytes fit `a`'s buffers)."""
    return len(a.files) == len(b.files) and all(
        x.layout.path == y.layout.path and x.data.size == y.data.size for x, y in zip(a.files, b.files, strict=False)
    )


def _own(path: Path) -> IO[bytes]:
    """An open file holding an exclusive flock on `path` (created); Conflict when another process holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "a+b")  # noqa: SIM115 - held open for the keeper's lifetime: the lock lives with it
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise errors.Conflict(
            f"{path.parent.parent}: another publisher on this host keeps its base here: one publisher per "
            "model and server, or give this one another cache directory"
        ) from None
    return f


_COPY_PIECE = 8 << 20
"""Bytes per copy job when the next base is copied in (pieces run on the CPU pool)."""


def same_ranges(manifest: Manifest, base_number: int | None) -> dict[str, list[tuple[int, int]]]:
    """Per file, the byte ranges (start, end) of `manifest`'s segments that hold what the base version
    `base_number` holds at the same place: delta-coded on that base, stated unchanged (the format 2
    encoder compares their bytes), not moved. Empty unless `manifest` is a format 2 delta on it."""
    if manifest.kind != "delta" or manifest.version != MANIFEST_V2 or manifest.parent != base_number:
        return {}
    out: dict[str, list[tuple[int, int]]] = {}
    for f in manifest.files:
        for e in f.segments:
            if e.unchanged and e.base_offset == e.segment.offset:
                out.setdefault(f.path, []).append((e.segment.offset, e.segment.offset + e.segment.length))
    return out


def _complement(ranges: list[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """The ranges of [0, size) outside `ranges` (sorted, disjoint)."""
    out, at = [], 0
    for a, b in sorted(ranges):
        if a > at:
            out.append((at, a))
        at = max(at, b)
    if at < size:
        out.append((at, size))
    return out


def _pieces(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """`ranges` cut into pieces of at most _COPY_PIECE bytes."""
    return [(a, min(b, a + _COPY_PIECE)) for start, b in ranges for a in range(start, b, _COPY_PIECE)]


def patchable(old: Checkpoint, checkpoint: Checkpoint, manifest: Manifest) -> bool:
    """Whether `manifest`'s frames, applied into `old`'s buffers, give `checkpoint`'s bytes (`patch_jobs`).

    `manifest` is the version just published from `checkpoint`. Its frames apply in place when it
    is a format 2 delta, every file has `old`'s path and size, its segments tile it, and each sits
    where its base did (delta- or keyframe-coded); segments stated unchanged are left as they are.
    """
    if manifest.kind != "delta" or manifest.version != MANIFEST_V2:
        return False
    if not len(manifest.files) == len(old.files) == len(checkpoint.files):
        return False
    for f, mine, theirs in zip(manifest.files, old.files, checkpoint.files, strict=True):
        same_file = mine.layout.path == f.path or (manifest.single_file and len(old.files) == 1)
        if not (same_file and f.path == theirs.layout.path and f.size == mine.data.size == theirs.data.size):
            return False
        at = 0
        for e in sorted(f.segments, key=lambda e: e.segment.offset):
            if e.segment.offset != at or e.base_offset not in (None, e.segment.offset):
                return False
            at += e.segment.length
        if at != f.size:
            return False
    return True


def patch_jobs(
    old: Checkpoint, manifest: Manifest, objects: Mapping[str, bytes], *, undo: bool = False
) -> list[Callable[[], Any]] | None:
    """Jobs that apply `manifest`'s frames (`objects`: its packed objects by digest) into `old`'s buffers, which
    `patchable` allowed; None when a frame's object is not in `objects`.

    A delta frame writes only the elements it changes, so keeping the next base costs work in
    proportion to the changes, not a copy of the model. Nothing is checked here: the next encode
    sums every base byte it reads and checks the sums against this manifest's digests
    (``upload.pack_version``), so a base that came out wrong costs a keyframe, never a wrong delta.
    With `undo`, jobs that take the patched buffers back to `old`'s bytes (delta frames only).
    """
    if any(ref.object not in objects for ref in manifest.frames):
        return None

    def job(ref: FrameRef) -> Callable[[], Any]:
        blob = memoryview(objects[ref.object or ""])[ref.offset : ref.offset + ref.length]
        targets = []
        for p in ref.pieces:
            start = manifest.files[p.file].segments[p.seg].segment.offset + p.offset
            targets.append(old.files[p.file].data[start : start + p.length])
        if undo:
            return lambda: undo_frame(blob, targets)
        return lambda: apply_frame_pieces(blob, targets, verify_base=False)

    return [job(ref) for ref in manifest.frames]


def _in_buffers(old: Checkpoint, checkpoint: Checkpoint) -> list[CheckpointFile]:
    """`checkpoint`'s files laid over `old`'s buffers (the same sizes): the next base once its bytes are in."""
    return [CheckpointFile(theirs.layout, mine.data) for mine, theirs in zip(old.files, checkpoint.files, strict=True)]


@dataclass
class Base:
    """The version a publisher diffs against: its checkout state and its bytes."""

    state: CheckoutState
    checkpoint: Checkpoint
    own: bool = False
    """The checkpoint's buffers are the keeper's own copy (writable, referenced nowhere else)."""


class BaseKeeper:
    """Holds a publisher's base, in memory or in the checkout `cache_dir` (None: memory only).

    A cache directory belongs to one publisher at a time: the keeper holds an exclusive lock
    on it from construction to :meth:`close` (Conflict for a second one on the same host), so
    two publishers never take turns overwriting each other's base. Not thread-safe: the
    publisher calls it under its own lock.
    """

    def __init__(
        self, api: Api, model: str, cache_dir: Path | None, *, download: bool, pool: ThreadPoolExecutor
    ) -> None:
        self.api, self.model, self.download = api, model, download
        self.checkout = Checkout(cache_dir) if cache_dir is not None else None
        self.pool = pool
        self._base: Base | None = None
        self._early: tuple[list[CheckpointFile], Future[Any]] | None = None
        """The next base's files being copied or patched into the held base's buffers, or copied into new ones
        (:meth:`overwrite_early`)."""
        self._fresh = False
        """Whether that copy goes into new buffers (the base held before it stays held until the commit)."""
        self._undo: tuple[Base, list[Callable[[], Any]]] | None = None
        """While an early patch runs: the base it patches and the jobs that undo it (:meth:`abandon_early`)."""
        self._patching: Future[Any] | None = None
        """The held base's buffers being patched by the version just published (:meth:`remember`)."""
        self._owner: IO[bytes] | None = None
        if self.checkout is not None:
            self._owner = _own(self.checkout.meta / "publisher.lock")

    def close(self) -> None:
        """Release the cache directory (the base stays there for the next publisher)."""
        self._ready()
        self._settle()
        if self._owner is not None:
            self._owner.close()  # closing the file releases its flock
            self._owner = None

    @property
    def number(self) -> int | None:
        """The version held (None: none)."""
        self._ready()
        if self._base is not None:
            return self._base.state.number
        if self.checkout is not None:
            state = self.checkout.state()
            return state.number if state else None
        return None

    def held(self) -> Base | None:
        """The base kept from this process's last publish or catch-up, unchecked against the head (None: none)."""
        self._ready()
        return self._base

    def _ready(self) -> None:
        """Wait until the held base's bytes are patched, if :meth:`remember` left that running; if it
        failed, hold nothing (the next publish is a keyframe or a catch-up)."""
        patching, self._patching = self._patching, None
        if patching is None:
            return
        try:
            patching.result()
        except Exception as exc:  # noqa: BLE001 - a failed patch only costs the next base
            log.warning("patching the next base failed (%s): the next publish is a keyframe", exc)
            self._base = None

    def for_head(self, head: Version | None, meter: Meter) -> Base | None:
        """The held version if it is the server's head; else catch up (download mode) or None (keyframe)."""
        self._ready()
        if head is None:
            return None
        number, digest = head.number, head.manifest
        if self._base is not None and self._base.state.number == number and self._base.state.manifest == digest:
            return self._base
        if self.checkout is not None:
            state = self.checkout.state()
            if state is not None and state.model == self.model and state.number == number and state.manifest == digest:
                with ThreadPoolExecutor(1) as one:
                    if self.checkout.verify(state, one, deep=False):
                        return Base(state, self.checkout.checkpoint(state))
        if not self.download:
            return None
        return self._catch_up(number, meter)

    def _catch_up(self, number: int, meter: Meter) -> Base:
        """Pull `number` into the cache checkout (incrementally) or a throwaway one, and hold it."""
        checkout = self.checkout or Checkout(tempfile.mkdtemp(prefix="weightsync-base-"))
        try:
            self.api.on_bytes = meter
            try:
                pull(self.api, self.model, checkout, version=number, pool=self.pool, meter=meter)
            finally:
                self.api.on_bytes = None
            state = checkout.state()
            assert state is not None
            ck = checkout.checkpoint(state)
            return Base(state, ck if self.checkout is not None else _in_memory(ck))
        finally:
            if self.checkout is None:
                shutil.rmtree(checkout.root, ignore_errors=True)

    def forget(self) -> None:
        """Hold nothing: the next publish is a keyframe (or a catch-up)."""
        self._ready()
        self._undo = None
        self._base = None
        self._settle()
        if self.checkout is not None:
            self.checkout.forget()  # one unlink: no lock needed

    def _settle(self) -> list[CheckpointFile] | None:
        """Wait for an early copy, if one runs; its files (None: none ran, or it failed)."""
        early, self._early = self._early, None
        self._fresh = False
        if early is None:
            return None
        files, done = early
        try:
            done.result()
        except Exception as exc:  # noqa: BLE001 - a failed copy only costs the next base
            log.warning("copying the next base failed (%s): the next publish is a keyframe", exc)
            return None
        return files

    def _copy_jobs(self, old: Base, checkpoint: Checkpoint, manifest: Manifest | None) -> tuple[list, list]:
        """The next base's files in `old`'s buffers, and the copy jobs (what `manifest` changed) that fill them."""
        same = same_ranges(manifest, old.state.number) if manifest is not None else {}
        jobs = []
        for mine, theirs in zip(old.checkpoint.files, checkpoint.files, strict=True):
            for a, b in _pieces(_complement(same.get(theirs.layout.path, []), theirs.data.size)):
                jobs.append((mine.data[a:b], theirs.data[a:b]))
        return _in_buffers(old.checkpoint, checkpoint), jobs

    def may_keep(self, checkpoint: Checkpoint, owned: bool) -> bool:
        """Whether the encode of `checkpoint` on the held base may write it into the base's buffers as it codes
        it (``Encoder.encode`` keep_base): a base held in memory as our own copy, files of the same sizes,
        bytes not ours. The publisher then calls :meth:`kept` (or forgets the base)."""
        self._ready()
        old = self._base
        return (
            self.checkout is None
            and not owned
            and old is not None
            and old.own
            and _same_sizes(old.checkpoint, checkpoint)
        )

    def kept(self, checkpoint: Checkpoint, manifest: Manifest, objects: Mapping[str, bytes]) -> None:
        """The encode of `manifest` (packed into `objects`) wrote `checkpoint` into the held base's buffers: hold it
        as :meth:`overwrite_early` leaves a patch that ran, so :meth:`remember` takes it as the next base once the
        version commits and :meth:`abandon_early` undoes it otherwise (its frames undo what they wrote)."""
        old = self._base
        assert old is not None, "kept() follows an encode on the held base"
        undo = None
        if patchable(old.checkpoint, checkpoint, manifest) and all(f.delta for f in manifest.frames):
            undo = patch_jobs(old.checkpoint, manifest, objects, undo=True)
        done: Future[Any] = Future()
        done.set_result(None)
        self._base = None
        self._undo = (old, undo) if undo is not None else None  # without undo jobs, abandoning forgets
        self._early = (_in_buffers(old.checkpoint, checkpoint), done)

    def overwrite_early(
        self,
        checkpoint: Checkpoint,
        owned: bool,
        manifest: Manifest,
        objects: Mapping[str, bytes] | None = None,
        *,
        patch: bool = True,
    ) -> bool:
        """Start making `checkpoint` the next base now, in the background, while its publish is in flight;
        :meth:`remember` then only waits for it. True when it started.

        A format 2 delta on the held base whose frames are all deltas and apply in place (`patchable`;
        `objects`: its packed frames) is patched into the held base's buffers: a publish that does not
        commit calls :meth:`abandon_early`, which undoes every frame (XOR undoes itself, SUB undoes
        ADD), so the base is held again. Without `patch`, such a delta is left to :meth:`remember`
        (patched after the commit, in the background). Other versions of the held base's sizes are
        copied into its buffers: a publish that does not commit leaves nothing held then (the next one
        is a keyframe or a catch-up). Either way, from here until then :meth:`held` is None. Without a
        base of our own of those sizes, the version is copied into new buffers, and the base held
        (if any) stays held until the commit; a publish that does not commit drops the copy. Only
        into memory (no cache directory), from bytes not ours; a delta whose frames cannot all be
        undone is patched after the commit instead.
        """
        self._ready()
        old = self._base
        if self.checkout is not None or owned:
            return False
        fresh = old is None or not old.own or not _same_sizes(old.checkpoint, checkpoint)
        if old is None or fresh:
            files, copies = _fresh_copy_jobs(checkpoint)
        elif (
            manifest is not None
            and manifest.parent == old.state.number
            and patchable(old.checkpoint, checkpoint, manifest)
        ):
            if not patch:
                return False
            jobs = patch_jobs(old.checkpoint, manifest, objects or {})
            undo = patch_jobs(old.checkpoint, manifest, objects or {}, undo=True)
            if jobs is None or undo is None or not all(f.delta for f in manifest.frames):
                return False  # patched into it after the commit (remember)
            self._base, self._undo = None, (old, undo)
            files = _in_buffers(old.checkpoint, checkpoint)
            self._early = (files, self.pool.submit(lambda: run_all(cpu_pool(), lambda job: job(), jobs)))
            return True
        else:
            files, copies = self._copy_jobs(old, checkpoint, manifest)
            self._base = None
        self._early = (files, self.pool.submit(_copy, copies))
        self._fresh = fresh
        return True

    def abandon_early(self) -> None:
        """The publish that :meth:`overwrite_early` started for did not commit (or may not have): an early patch
        is undone, so the base it patched is held again; a copy into new buffers is dropped (the base held
        before stays held); a copy into the base's buffers is dropped (nothing held)."""
        undo, self._undo = self._undo, None
        fresh = self._fresh
        files = self._settle()
        if fresh:
            return
        if undo is None or files is None:  # a copy, or a patch that failed part way: its bytes are unknown
            self.forget()
            return
        old, jobs = undo
        try:
            run_all(cpu_pool(), lambda job: job(), jobs)
        except Exception as exc:  # noqa: BLE001 - only the next base is lost
            log.warning("undoing the next base failed (%s): the next publish is a keyframe", exc)
            self.forget()
            return
        self._base = old

    def remember(
        self,
        checkpoint: Checkpoint,
        owned: bool,
        state: CheckoutState,
        manifest: Manifest | None = None,
        objects: Mapping[str, bytes] | None = None,
    ) -> None:
        """Hold the published bytes as the next base: in memory, or switched into the cache checkout.

        In memory, bytes that are not ours (the caller's files may change) are kept in the
        buffers of the base they replace when it is our own copy of the same sizes, else copied
        into new ones. Into the old buffers: when `manifest` (the version just published) is a
        format 2 delta on the held base and `objects` its packed frames, the frames are applied
        in place (`patch_jobs`: work in proportion to the changes), in the background: this
        returns at once and whatever reads the base next waits for it; else the bytes are copied
        (a copy into memory already mapped is several times faster than into fresh pages),
        skipping the segments `manifest` states unchanged at the same place (`same_ranges`).
        Either runs on the process's CPU pool.
        """
        self._ready()
        self._undo = None  # committed: an early patch stands
        if self.checkout is None:
            old, self._base = self._base, None
            early = self._settle()
            patch = None
            if (
                early is None
                and not owned
                and old is not None
                and old.own
                and manifest is not None
                and objects
                and manifest.parent == old.state.number
                and patchable(old.checkpoint, checkpoint, manifest)
            ):
                patch = patch_jobs(old.checkpoint, manifest, objects)
            if early is not None:  # overwrite_early copied these bytes while the publish was in flight
                self._base = Base(state, Checkpoint(early, single_file=checkpoint.single_file), own=True)
            elif patch is not None and old is not None:  # applied in the background: the next publish waits for it
                patches = patch
                self._patching = self.pool.submit(lambda: run_all(cpu_pool(), lambda job: job(), patches))
                files = _in_buffers(old.checkpoint, checkpoint)
                self._base = Base(state, Checkpoint(files, single_file=checkpoint.single_file), own=True)
            elif owned:
                self._base = Base(state, checkpoint)
            elif old is not None and old.own and _same_sizes(old.checkpoint, checkpoint):
                files, jobs = self._copy_jobs(old, checkpoint, manifest)
                _copy(jobs)
                self._base = Base(state, Checkpoint(files, single_file=checkpoint.single_file), own=True)
            else:
                self._base = Base(state, _in_memory(checkpoint), own=True)
            return
        checkout = self.checkout
        checkout.root.mkdir(parents=True, exist_ok=True)
        self._base = None
        with checkout.locked():
            checkout.sweep()
            checkout.forget()
            work = checkout.workspace()
            try:
                tree = Tree(state.single_file)
                for f in checkpoint.files:
                    loc = work.new()
                    with open(loc, "wb") as fh:
                        fh.write(np.ascontiguousarray(f.data).data)
                    tree.files[f.layout.path] = HeldFile(loc, f.layout.size, True, {})
                checkout.install(tree, state, work)
                checkout.sweep()  # the previous version: the next delta needs only this one
            finally:
                work.clear()
        self._base = Base(state, checkout.checkpoint(state))
