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

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path
from typing import Any

from weightsync import errors
from weightsync.client import upload
from weightsync.client._http import Api
from weightsync.client._pool import HelpingPool, cpu_pool, release_later
from weightsync.client.base import Base, BaseKeeper, snapshot
from weightsync.client.models import PublishBegin, PublishResult
from weightsync.client.pull import Meter, Progress
from weightsync.client.state import CheckoutState
from weightsync.client.tensors import SnapshotBuffers, snapshot_state_dict
from weightsync.client.wire import Retry, TokenBucket
from weightsync.codec.encoder import DEFAULT_CHUNK, Encoder
from weightsync.codec.manifest import DIGEST_KINDS, Manifest
from weightsync.codec.manifest import VERSION as MANIFEST_V1
from weightsync.codec.pack import DEFAULT_OBJECT_BYTES, PackedObject
from weightsync.common import gc_paused, model_path_name

log = logging.getLogger("weightsync.client")
KIND_FORMAT = {kind: version for version, kind in DIGEST_KINDS.items()}
_BACKGROUND = "weightsync-publish"
"""Name prefix of the thread publish_async's publishes run on."""
DEFAULT_PUBLISH_INLINE = 8 << 20
"""Versions up to this many bytes go in one request: well below the service's 16 MiB default cap on
non-object bodies (max_json_body), and small enough that one stream loses nothing to parallel uploads."""


class Publisher:
    """Publishes versions of one model. ``publish`` blocks; ``publish_async`` returns a Future.

    ``cache_dir`` keeps the last published version on disk (a checkout under
    ``cache_dir/<model>``) instead of in memory, so a restarted trainer still
    publishes deltas. ``concurrency`` is the number of parallel uploads,
    ``bandwidth`` an upload cap in bytes/s. ``inline_bytes``: a version encoded
    on the held base whose objects add up to at most this many bytes is published
    in one request (publishVersion: begin, objects and commit; docs/API.md "One
    request per version"); larger ones, keyframes and parts take begin, parallel
    uploads and commit (0: always). Thread-safe: publishes run one at a time, in
    call order for ``publish_async``.
    """

    def __init__(
        self,
        server: str,
        model: str,
        *,
        token: str | None = None,
        cache_dir: str | os.PathLike | None = None,
        concurrency: int = 8,
        bandwidth: float | None = None,
        on_mismatch: str = "auto",
        encoder_threads: int | None = None,
        chunk_bytes: int = DEFAULT_CHUNK,
        object_bytes: int = DEFAULT_OBJECT_BYTES,
        timeout: float = 120.0,
        retry: Retry | None = None,
        transport: Any = None,
        progress: Progress | None = None,
        part: tuple[int, int] | None = None,
        parent_wait_s: float = 600.0,
        inline_bytes: int = DEFAULT_PUBLISH_INLINE,
    ) -> None:
        if on_mismatch not in ("auto", "keyframe", "download"):
            raise ValueError("on_mismatch must be 'auto', 'keyframe' or 'download'")
        self.part = check_part(part)
        if self.part is not None and on_mismatch == "download":
            raise ValueError("a part publisher cannot catch up by download (it would fetch every part): use 'keyframe'")
        self.model = model
        self.cache_dir = Path(cache_dir) / model_path_name(model) if cache_dir is not None else None
        if self.cache_dir is not None and self.part is not None:  # each part keeps its own base
            self.cache_dir = self.cache_dir / f"part-{self.part[0]}-of-{self.part[1]}"
        if self.part is not None:
            on_mismatch = "keyframe"
        self.parent_wait_s = parent_wait_s
        if inline_bytes < 0:
            raise ValueError("inline_bytes must be at least 0")
        self.inline_bytes = inline_bytes
        self.concurrency = max(1, concurrency)
        self.on_mismatch = (
            on_mismatch if on_mismatch != "auto" else ("download" if self.cache_dir is not None else "keyframe")
        )
        # A part's frames never straddle files: a file several parts carry is then stored once (codec/parts.py).
        self.encoder = Encoder(
            threads=encoder_threads,
            chunk_bytes=chunk_bytes,
            frames_per_file=self.part is not None,
            # The process's CPU pool unless a size is asked for: no threads started per publish; the publishing
            # thread helps with each batch (client/_pool.HelpingPool).
            pool=HelpingPool(cpu_pool()) if encoder_threads is None else None,
        )
        self.object_bytes = object_bytes
        self.progress = progress
        limiter = TokenBucket(bandwidth) if bandwidth else None
        self.api = Api(
            server,
            token,
            timeout=timeout,
            concurrency=self.concurrency,
            retry=retry,
            limiter=limiter,
            transport=transport,
        )
        self._lock = threading.Lock()
        self._stream_deltas = False  # the last delta spanned several objects (set after each delta publish)
        self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="weightsync-upload")
        try:
            self._base = BaseKeeper(
                self.api, model, self.cache_dir, download=self.on_mismatch == "download", pool=self._pool
            )
        except BaseException:  # the cache directory is another publisher's: release what was opened
            self._pool.shutdown(wait=False)
            self.api.close()
            raise
        self._background: ThreadPoolExecutor | None = None
        self._formats: tuple[int, ...] | None = None  # the server's manifest formats, from its last begin
        self._inline_last = False  # the last publish committed in one request (publishVersion)
        self._snapshots = SnapshotBuffers()  # publish_async's host buffers, reused across publishes

    @property
    def version(self) -> int | None:
        """The version this publisher last published or caught up with (None: none yet)."""
        return self._base.number

    def close(self) -> None:
        """Wait for background publishes, then release connections."""
        if self._background is not None:
            self._background.shutdown(wait=True)
        self._pool.shutdown(wait=True)
        self._base.close()
        self.api.close()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- publishing ---------------------------------------------------------------------

    def publish_async(
        self,
        source: Any,
        *,
        step: int | None = None,
        metadata: dict | None = None,
        keyframe: bool = False,
        allow_removals: bool = False,
    ) -> Future[PublishResult]:
        """Queue a publish on the one background worker and return its Future (publishes run in order).

        A state_dict is snapshotted before this returns, so the caller may keep
        updating its tensors (the next optimizer step may run while encoding and
        upload proceed): its bytes land in a reused host buffer, laid out as the
        safetensors file, by asynchronous copies from the GPU into pinned memory
        (client/tensors.py ``snapshot_state_dict``; GPU cost: none beyond a
        temporary copy of non-contiguous tensors; host cost: see
        ``SnapshotBuffers``). A path must stay unchanged until the Future completes.
        """
        if isinstance(source, Mapping):
            source = snapshot_state_dict(source, buffers=self._snapshots)
        if self._background is None:
            self._background = ThreadPoolExecutor(1, thread_name_prefix=_BACKGROUND)
        return self._background.submit(
            self.publish, source, step=step, metadata=metadata, keyframe=keyframe, allow_removals=allow_removals
        )

    def publish(
        self,
        source: Any,
        *,
        step: int | None = None,
        metadata: dict | None = None,
        keyframe: bool = False,
        allow_removals: bool = False,
        wait: bool = True,
    ) -> PublishResult:
        """Publish `source` as the model's next version and return what was done.

        `source`: a safetensors file, a directory (sharded checkpoint, configs
        carried along), a torch state_dict (published as ``model.safetensors``)
        or safetensors bytes. A version that drops files or tensors the previous
        one had raises RemovesContent unless `allow_removals` (so a wrong path
        or an empty directory cannot wipe the fleet). Raises StaleParent when
        another publisher moved the head during the publish, AuthError,
        ServerUnavailable, ...

        A part publisher (``part=(rank, world)``) publishes only its part of the version of
        `step` (required): every rank with the same step joins the same pending version, which
        commits when the last part arrives. ``wait`` (default) returns once the version is
        committed; without it, once this part is accepted (``version`` 0 while parts are
        missing, and the next publish of this part is a keyframe). Parts of the next step sent
        while this one is pending are answered 409 parent-pending: retried for ``parent_wait_s``,
        as is a begin on a head that another commit moved between reading it and beginning on it.
        """
        if self.part is not None and step is None:
            raise ValueError("a part publisher needs the step: ranks join the version by (parent, step)")
        opened: list[Any] = []  # the source's files, when this publish mapped them
        try:
            return self._publish(
                source,
                step=step,
                metadata=metadata,
                keyframe=keyframe,
                allow_removals=allow_removals,
                wait=wait,
                opened=opened,
            )
        finally:
            # Unmapped on another thread once this publish is done with them (nobody waits for it), not in the
            # caller's time: ~1.3 ms of a 45 MB delta, ~5 ms at 436 MB (client/_pool.release_later).
            release_later(opened)

    def _publish(
        self,
        source: Any,
        *,
        step: int | None,
        metadata: dict | None,
        keyframe: bool,
        allow_removals: bool,
        wait: bool,
        opened: list[Any],
    ) -> PublishResult:
        """:meth:`publish`; a checkpoint it opens from a path goes into `opened` (released by the caller)."""
        # The cyclic collector waits for a publish the caller waits for; one behind publish_async does not
        # hold it off (the trainer keeps running and making garbage, CUDA tensors in cycles among it).
        paused = nullcontext() if threading.current_thread().name.startswith(_BACKGROUND) else gc_paused()
        with self._lock, paused:
            t0 = time.perf_counter()
            timings: dict[str, float] = {}
            meter, catch_up = Meter(self.progress), Meter(None)
            warnings: list[str] = []
            checkpoint, owned = snapshot(source, warnings=warnings)
            if isinstance(source, (str, os.PathLike)):
                opened.append(checkpoint)

            def pack_for(
                base: Base | None,
                parent: int | None,
                keep: bool = False,
                on_object: Callable[[PackedObject], None] | None = None,
            ) -> upload.Packed:
                return upload.pack_version(
                    self.encoder,
                    checkpoint,
                    base,
                    version=self._format_for(base),
                    model=self.model,
                    parent=parent,
                    step=step,
                    metadata=metadata,
                    object_bytes=self.object_bytes,
                    forget_base=self._base.forget,
                    timings=timings,
                    keep_base=keep and self._base.may_keep(checkpoint, owned),
                    on_object=on_object,
                )

            def inline(held: Base, packed: upload.Packed) -> upload.Committed | PublishBegin | None:
                # The next base is made by the encode itself (Packed.kept), or while the request is in flight
                # (BaseKeeper.overwrite_early); unless the request commits the version, that is undone or the
                # base forgotten (abandon_early).
                early = packed.kept
                if early:
                    self._base.kept(checkpoint, packed.manifest, packed.objects)

                def keep_early() -> None:
                    nonlocal early
                    if not early and self.api.publish_version_ok:  # not on a first try: an older server answers 405
                        early = self._base.overwrite_early(checkpoint, owned, packed.manifest, packed.objects)

                try:
                    got = upload.publish_inline(
                        self.api,
                        self.model,
                        held,
                        packed,
                        checkpoint=checkpoint,
                        limit=self.inline_bytes,
                        allow_removals=allow_removals,
                        meter=meter,
                        timings=timings,
                        before_send=keep_early,
                    )
                except BaseException:
                    if early:
                        self._base.abandon_early()
                    raise
                if early and not isinstance(got, upload.Committed):
                    self._base.abandon_early()
                return got

            deadline = time.monotonic() + self.parent_wait_s
            while True:
                try:
                    base, begun, packed = upload.begin(
                        self.api,
                        self._base,
                        self.model,
                        keyframe=keyframe,
                        step=step,
                        metadata=metadata,
                        catch_up=catch_up,
                        # The encode keeps the next base in place when the last publish went in one request
                        # (so this one likely does too: keeping costs an undo when it does not).
                        prepare=lambda held: pack_for(held, held.state.number, keep=self._inline_last),
                        part=self.part,
                        inline=inline if self.part is None and self.inline_bytes else None,
                        stream=self._stream_deltas,
                    )
                    break
                except errors.ParentPending:  # the previous step's parts are still pending: its commit is near
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
                except errors.StaleParent:  # the head moved between reading it and beginning on it: read it again
                    if time.monotonic() > deadline:
                        raise
            # source, base (and a catch-up) and beginPublish; an encoding made first is counted in encode_s,
            # a one-request publish (publishVersion) in upload_s
            timings["begin_s"] = time.perf_counter() - t0 - timings.get("encode_s", 0.0) - timings.get("upload_s", 0.0)
            self._inline_last = isinstance(begun, upload.Committed)  # only the one request commits in begin()
            if isinstance(begun, upload.Committed):
                done = begun
            else:
                # The formats the server reads (one that predates format 2 says nothing: format 1 only).
                self._formats = tuple(begun.formats or [MANIFEST_V1])
                copying = False

                def keep_while_uploading(manifest: Manifest) -> None:
                    # The next base is copied while the objects upload (a delta on the held base is patched
                    # after the commit, in the background, as before); undone below unless the version commits.
                    # Not for a part not waited for: it holds no base after (its version is not known yet).
                    nonlocal copying
                    if self.part is None or wait:
                        copying = self._base.overwrite_early(checkpoint, owned, manifest, patch=False)

                try:
                    done = upload.commit(
                        self.api,
                        self._pool,
                        self.model,
                        begun,
                        base,
                        packed,
                        checkpoint=checkpoint,
                        pack_for=pack_for,
                        allow_removals=allow_removals,
                        meter=meter,
                        timings=timings,
                        part=self.part,
                        wait=wait,
                        before_upload=keep_while_uploading,
                    )
                except BaseException:
                    if copying:
                        self._base.abandon_early()
                    if self.part is None:  # a part's group is shared: it expires if this rank never arrives
                        self._abort(begun.publish_id)
                    raise
            t = time.perf_counter()
            state = CheckoutState.of(self.model, done.number, done.digest, done.manifest, self.api.server)
            try:
                if not done.number:  # a part not waited for: the version is not known yet
                    self._base.forget()
                else:
                    self._base.remember(checkpoint, owned, state, done.manifest, done.objects)
            except OSError as exc:  # committed already: only the next publish's base is lost
                log.warning(
                    "could not keep v%s as the next base (%s): the next publish is a keyframe", done.number, exc
                )
                self._base.forget()
            timings["cache_s"] = time.perf_counter() - t
            if done.manifest.kind == "delta":
                # A delta of several objects, too large for one request: the next one likely is too, so it
                # begins first and each object uploads as soon as it is packed, while the rest encodes
                # (upload.begin's `stream`). Any other delta keeps encoding first: one request (publishVersion),
                # or a begin that checks its objects; streaming it would only add round trips.
                data = sum(len(b) for b in done.objects.values())
                self._stream_deltas = len(done.objects) > 1 and (self.part is not None or data > self.inline_bytes)
            return PublishResult(
                model=self.model,
                version=done.number,
                kind=done.manifest.kind,
                parent=done.manifest.parent,
                bytes_sent=meter.bytes,
                raw_bytes=done.manifest.raw_bytes,
                stored_bytes=done.manifest.stored_bytes,
                objects_total=done.objects_total,
                objects_uploaded=done.objects_uploaded,
                manifest=done.digest,
                step=step,
                seconds=time.perf_counter() - t0,
                bytes_received=catch_up.bytes,
                timings=timings,
                warnings=tuple(warnings),
            )

    def _format_for(self, base: Base | None) -> int:
        """The manifest format to encode in: the base's while the server reads it (a chain never mixes
        formats), else the newest format both sides read (a keyframe starts the chain in it)."""
        readable = [v for v in self._formats or DIGEST_KINDS if v in DIGEST_KINDS]
        held = None if base is None else KIND_FORMAT.get(base.state.digest_kind)
        return held if held in readable else max(readable)

    def _abort(self, publish_id: str) -> None:
        """Best effort: release a failed publish's hold on its objects (a re-run still finds them in the store)."""
        try:
            self.api.abort_publish(self.model, publish_id)
        except Exception as exc:  # noqa: BLE001 - the pending publish expires anyway
            log.debug("abort of publish %s failed: %s", publish_id, exc)


def check_part(part: tuple[int, int] | None) -> tuple[int, int] | None:
    """`part` as (rank, world) with 0 <= rank < world; ValueError otherwise."""
    if part is None:
        return None
    try:
        rank, world = (int(x) for x in part)
    except (TypeError, ValueError):
        raise ValueError(f"part must be (rank, world), not {part!r}") from None
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"part {rank} of {world}: rank must lie in [0, world)")
    return rank, world


def publish(
    server: str,
    model: str,
    source: Any,
    *,
    token: str | None = None,
    step: int | None = None,
    metadata: dict | None = None,
    keyframe: bool = False,
    allow_removals: bool = False,
    **options: Any,
) -> PublishResult:
    """One-shot publish with a throwaway :class:`Publisher` (options as its constructor's)."""
    with Publisher(server, model, token=token, **options) as pub:
        return pub.publish(source, step=step, metadata=metadata, keyframe=keyframe, allow_removals=allow_removals)
