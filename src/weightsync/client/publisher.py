"""Publishing versions: encode against the last published version, upload what is missing, commit.

The protocol is docs/API.md "Publishing": beginPublish (the server decides
keyframe or delta) → encode → pack → checkObjects → upload the missing objects
in parallel → upload the manifest → commitPublish. Encoding is deterministic
(same source, same base, same parent → the same frames, objects and digests),
so re-running a publish that died half way uploads only what the server lacks.

The publisher keeps the bytes of the version it last published (in memory, or
in a checkout directory under ``cache_dir``) to diff against without
downloading anything. When that base is not the server's head (first use, a
restart without a cache, another publisher moved the head) it publishes a
keyframe on top of the head — or, with ``on_mismatch="download"`` (the default
when a cache directory is set), first brings the cache to the head by an
incremental pull and publishes a delta.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from weightsync import errors
from weightsync.client._checkout import (CheckoutState, HeldFile, Tree, Workspace, check_bases, install, locked,
                                         verify)
from weightsync.client._http import Api, Retry, TokenBucket
from weightsync.client._pool import run_all
from weightsync.client.models import PublishResult
from weightsync.client.subscriber import Progress, _Meter, pull_into
from weightsync.codec.checkpoint import Checkpoint, CheckpointFile, layout_of
from weightsync.codec.encoder import DEFAULT_CHUNK, Encoder
from weightsync.codec.pack import DEFAULT_OBJECT_BYTES, pack

log = logging.getLogger("weightsync.client")

STATE_DICT_FILE = "model.safetensors"
"""File name a published state_dict gets."""


@dataclass
class _Base:
    """The version a publisher diffs against: its checkout state and its bytes."""

    state: CheckoutState
    checkpoint: Checkpoint


def _snapshot(source: Any) -> tuple[Checkpoint, bool]:
    """(checkpoint, owned): owned when the bytes are ours (a serialized state_dict), not the caller's files."""
    if isinstance(source, Checkpoint):
        return source, False
    if isinstance(source, (str, os.PathLike)):
        return Checkpoint.open(source), False
    if isinstance(source, (bytes, bytearray, np.ndarray)):
        data = np.frombuffer(source, dtype=np.uint8) if not isinstance(source, np.ndarray) else source
        return Checkpoint([CheckpointFile(layout_of(STATE_DICT_FILE, data), data)], single_file=True), True
    if isinstance(source, Mapping):
        from weightsync.client.tensors import serialize_state_dict

        data = serialize_state_dict(source)
        return Checkpoint([CheckpointFile(layout_of(STATE_DICT_FILE, data), data)], single_file=True), True
    raise TypeError(f"cannot publish a {type(source).__name__}: give a path, a state_dict or safetensors bytes")


def _checkout_checkpoint(root: Path, state: CheckoutState) -> Checkpoint:
    files = []
    for f in state.files:
        p = root / f.path
        data = np.memmap(p, dtype=np.uint8, mode="r") if f.size else np.zeros(0, dtype=np.uint8)
        files.append(CheckpointFile(layout_of(f.path, data), data))
    return Checkpoint(files, single_file=state.single_file)


class Publisher:
    """Publishes versions of one model. ``publish`` blocks; ``publish_async`` returns a Future.

    ``cache_dir`` keeps the last published version on disk (a checkout under
    ``cache_dir/<model>``) instead of in memory, so a restarted trainer still
    publishes deltas. ``concurrency`` is the number of parallel uploads,
    ``bandwidth`` an upload cap in bytes/s. Thread-safe: publishes run one at a
    time, in call order for ``publish_async``.
    """

    def __init__(self, server: str, model: str, *, token: str | None = None,
                 cache_dir: str | os.PathLike | None = None, concurrency: int = 8, bandwidth: float | None = None,
                 on_mismatch: str = "auto", encoder_threads: int | None = None, chunk_bytes: int = DEFAULT_CHUNK,
                 object_bytes: int = DEFAULT_OBJECT_BYTES, timeout: float = 120.0, retry: Retry | None = None,
                 transport: Any = None, progress: Progress | None = None) -> None:
        if on_mismatch not in ("auto", "keyframe", "download"):
            raise ValueError("on_mismatch must be 'auto', 'keyframe' or 'download'")
        self.model = model
        self.cache_dir = Path(cache_dir) / model if cache_dir is not None else None
        self.concurrency = max(1, concurrency)
        self.on_mismatch = on_mismatch if on_mismatch != "auto" else \
            ("download" if self.cache_dir is not None else "keyframe")
        self.encoder = Encoder(threads=encoder_threads, chunk_bytes=chunk_bytes)
        self.object_bytes = object_bytes
        self.progress = progress
        limiter = TokenBucket(bandwidth) if bandwidth else None
        self.api = Api(server, token, timeout=timeout, concurrency=self.concurrency, retry=retry,
                       limiter=limiter, transport=transport)
        self._base: _Base | None = None
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="weightsync-upload")
        self._background: ThreadPoolExecutor | None = None

    @property
    def version(self) -> int | None:
        """The version this publisher last published or caught up with (None: none yet)."""
        if self._base is not None:
            return self._base.state.number
        if self.cache_dir is not None:
            state = CheckoutState.load(self.cache_dir)
            return state.number if state else None
        return None

    def close(self) -> None:
        """Wait for background publishes, then release connections."""
        if self._background is not None:
            self._background.shutdown(wait=True)
        self._pool.shutdown(wait=True)
        self.api.close()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- publishing ---------------------------------------------------------------------

    def publish_async(self, source: Any, *, step: int | None = None, metadata: dict | None = None,
                      keyframe: bool = False) -> Future[PublishResult]:
        """Queue a publish on the one background worker and return its Future (publishes run in order).

        A state_dict is serialized to host memory before this returns, so the
        caller may keep updating its tensors. A path must stay unchanged until
        the Future completes.
        """
        if isinstance(source, Mapping):
            from weightsync.client.tensors import serialize_state_dict

            source = serialize_state_dict(source)
        if self._background is None:
            self._background = ThreadPoolExecutor(1, thread_name_prefix="weightsync-publish")
        return self._background.submit(self.publish, source, step=step, metadata=metadata, keyframe=keyframe)

    def publish(self, source: Any, *, step: int | None = None, metadata: dict | None = None,
                keyframe: bool = False) -> PublishResult:
        """Publish `source` as the model's next version and return what was done.

        `source`: a safetensors file, a directory (sharded checkpoint, configs
        carried along), a torch state_dict (published as ``model.safetensors``)
        or safetensors bytes. Raises StaleParent when another publisher moved
        the head during the publish, AuthError, ServerUnavailable, ...
        """
        with self._lock:
            t0 = time.perf_counter()
            timings: dict[str, float] = {}
            meter = _Meter(self.progress)
            checkpoint, owned = _snapshot(source)
            head = self.api.head(self.model)
            catch_up = _Meter(None)
            base = None if keyframe else self._base_for(head, catch_up)  # a keyframe needs no base
            if catch_up.bytes:
                timings["catch_up_s"] = time.perf_counter() - t0
            parent = int(head["number"]) if head else None
            begin = self.api.begin_publish(self.model, parent=parent, step=step, metadata=metadata,
                                           keyframe=base is None)
            publish_id = begin["publish_id"]
            try:
                kind = begin["kind"]
                use = base if kind == "delta" and base is not None else None
                if use is not None and begin.get("parent_manifest") not in (None, use.state.manifest):
                    use = None
                t = time.perf_counter()
                encoded = self.encoder.encode(checkpoint, use.checkpoint if use else None)
                if use is not None:
                    try:  # the encoder hashed the base bytes: they must be the version we think we hold
                        check_bases(encoded.manifest, Tree.of_state(Path("."), use.state))
                    except errors.BaseMismatch as exc:
                        log.warning("publisher base does not match v%s (%s): publishing a keyframe",
                                    use.state.number, exc)
                        self._forget_base()
                        encoded = self.encoder.encode(checkpoint, None, keyframe=True)
                manifest, objects = pack(encoded, target_bytes=self.object_bytes)
                manifest.model, manifest.parent, manifest.step = self.model, parent, step
                manifest.metadata = dict(metadata or {})
                manifest_bytes = manifest.encode()
                digest = hashlib.sha256(manifest_bytes).hexdigest()
                timings["encode_s"] = time.perf_counter() - t

                t = time.perf_counter()
                unique = {o.digest: o.data for o in objects}
                listed = [(d, len(b)) for d, b in unique.items()] + [(digest, len(manifest_bytes))]
                check = self.api.check_objects(self.model, publish_id, listed)
                missing = set(check.get("missing") or [])
                uploads = check.get("uploads") or {}
                todo = [(d, b) for d, b in unique.items() if d in missing]
                meter.total = sum(len(b) for _, b in todo) + (len(manifest_bytes) if digest in missing else 0)
                self.api.on_bytes = meter
                try:
                    # Publish order (DESIGN invariant 2): data objects, then the manifest, then the commit.
                    run_all(self._pool, lambda it: self.api.put_object(it[0], it[1], uploads.get(it[0])), todo)
                    if digest in missing:
                        self.api.put_object(digest, manifest_bytes, uploads.get(digest))
                finally:
                    self.api.on_bytes = None
                timings["upload_s"] = time.perf_counter() - t
                t = time.perf_counter()
                key = hashlib.sha256(f"{self.model}\0{publish_id}\0{digest}".encode()).hexdigest()[:32]
                version = self.api.commit_publish(self.model, publish_id, manifest=digest, idempotency_key=key)
                number = int(version["number"])
                timings["commit_s"] = time.perf_counter() - t
            except BaseException:
                self._abort(publish_id)
                raise
            t = time.perf_counter()
            try:
                self._remember(checkpoint, owned, CheckoutState.of(self.model, number, digest, manifest,
                                                                    self.api.server))
            except OSError as exc:  # committed already: only the next publish's base is lost
                log.warning("could not keep v%s as the next base (%s): the next publish is a keyframe", number, exc)
                self._forget_base()
            timings["cache_s"] = time.perf_counter() - t
            return PublishResult(self.model, number, manifest.kind, parent, meter.bytes, manifest.raw_bytes,
                                 manifest.stored_bytes, len(unique) + 1, len(todo) + (digest in missing), digest,
                                 step, time.perf_counter() - t0, catch_up.bytes, timings)

    def _abort(self, publish_id: str) -> None:
        """Best effort: release a failed publish's hold on its objects (a re-run still finds them in the store)."""
        try:
            self.api.abort_publish(self.model, publish_id)
        except Exception as exc:  # noqa: BLE001 - the pending publish expires anyway
            log.debug("abort of publish %s failed: %s", publish_id, exc)

    # --- the base ----------------------------------------------------------------------

    def _base_for(self, head: dict | None, meter: _Meter) -> _Base | None:
        """The held version if it is the server's head; else catch up (download mode) or None (keyframe)."""
        if head is None:
            return None
        number, digest = int(head["number"]), head.get("manifest")
        if self._base is not None and self._base.state.number == number and self._base.state.manifest == digest:
            return self._base
        if self.cache_dir is not None:
            state = CheckoutState.load(self.cache_dir)
            if state is not None and state.model == self.model and state.number == number \
                    and state.manifest == digest:
                with ThreadPoolExecutor(1) as one:
                    if verify(self.cache_dir, state, one, deep=False):
                        return _Base(state, _checkout_checkpoint(self.cache_dir, state))
        if self.on_mismatch != "download":
            return None
        return self._download(number, meter)

    def _download(self, number: int, meter: _Meter) -> _Base | None:
        root = self.cache_dir if self.cache_dir is not None else Path(tempfile.mkdtemp(prefix="weightsync-base-"))
        try:
            self.api.on_bytes = meter
            try:
                pull_into(self.api, self.model, root, version=number, pool=self._pool, meter=meter)
            finally:
                self.api.on_bytes = None
            state = CheckoutState.load(root)
            assert state is not None
            if self.cache_dir is not None:
                return _Base(state, _checkout_checkpoint(root, state))
            ck = _checkout_checkpoint(root, state)
            return _Base(state, Checkpoint([CheckpointFile(f.layout, np.array(f.data)) for f in ck.files],
                                           single_file=ck.single_file))
        finally:
            if self.cache_dir is None:
                shutil.rmtree(root, ignore_errors=True)

    def _forget_base(self) -> None:
        self._base = None
        if self.cache_dir is not None:
            CheckoutState.remove(self.cache_dir)

    def _remember(self, checkpoint: Checkpoint, owned: bool, state: CheckoutState) -> None:
        """Keep the published bytes as the next base: in memory, or written into the cache checkout."""
        if self.cache_dir is None:
            if not owned:  # the caller's files may change under us: copy them
                checkpoint = Checkpoint([CheckpointFile(f.layout, np.array(f.data)) for f in checkpoint.files],
                                        single_file=checkpoint.single_file)
            self._base = _Base(state, checkpoint)
            return
        root = self.cache_dir
        root.mkdir(parents=True, exist_ok=True)
        self._base = None
        with locked(root):
            old = CheckoutState.load(root)
            CheckoutState.remove(root)
            work = Workspace(root)
            try:
                tree = Tree(state.single_file)
                for f in checkpoint.files:
                    loc = work.new()
                    with open(loc, "wb") as fh:
                        fh.write(memoryview(np.ascontiguousarray(f.data)))
                    tree.files[f.layout.path] = HeldFile(loc, f.layout.size, True, {})
                install(root, tree, old)
                state.save(root)
            finally:
                work.clear()
        self._base = _Base(state, _checkout_checkpoint(root, state))


def publish(server: str, model: str, source: Any, *, token: str | None = None, step: int | None = None,
            metadata: dict | None = None, keyframe: bool = False, **options: Any) -> PublishResult:
    """One-shot publish with a throwaway :class:`Publisher` (options as its constructor's)."""
    with Publisher(server, model, token=token, **options) as pub:
        return pub.publish(source, step=step, metadata=metadata, keyframe=keyframe)

