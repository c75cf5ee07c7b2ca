"""One publish on the wire: begin on the base held, encode, pack, upload what is missing, commit.

The protocol is docs/API.md "Publishing"; the order of uploads is DESIGN invariant 2 (data
objects, then the manifest, then the commit). :class:`~weightsync.client.publisher.Publisher`
is the facade that serializes publishes and keeps the next base.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weightsync import errors
from weightsync.client._http import Api
from weightsync.client._pool import run_all
from weightsync.client.base import Base, BaseKeeper
from weightsync.client.decode import check_bases
from weightsync.client.models import PublishBegin
from weightsync.client.pull import Meter
from weightsync.codec.checkpoint import Checkpoint
from weightsync.codec.encoder import Encoder
from weightsync.codec.manifest import Manifest
from weightsync.codec.pack import pack

log = logging.getLogger("weightsync.client")


def begin(
    api: Api,
    keeper: BaseKeeper,
    model: str,
    *,
    keyframe: bool,
    step: int | None,
    metadata: dict[str, Any] | None,
    catch_up: Meter,
) -> tuple[Base | None, PublishBegin]:
    """Begin a publish: on the base held when it is still the head (one round trip), else on the head.

    Returns the base to diff against (None: a keyframe) and the server's answer. Behind the
    head, the keeper catches up (an incremental pull counted by `catch_up`) or gives up its base.
    """
    base = None if keyframe else keeper.held()
    if base is not None:
        try:  # begin answers the parent's manifest: `commit` checks the base against it
            return base, api.begin_publish(
                model, parent=base.state.number, step=step, metadata=metadata, keyframe=False
            )
        except errors.StaleParent:
            pass
    head = api.head(model)
    base = None if keyframe else keeper.for_head(head, catch_up)
    answer = api.begin_publish(
        model,
        parent=head.number if head is not None else None,
        step=step,
        metadata=metadata,
        keyframe=base is None,
    )
    return base, answer


@dataclass
class Committed:
    """What `commit` did: the version, its manifest, and the objects it listed and uploaded."""

    number: int
    digest: str
    manifest: Manifest
    objects_total: int
    objects_uploaded: int


def commit(
    api: Api,
    pool: ThreadPoolExecutor,
    encoder: Encoder,
    model: str,
    begun: PublishBegin,
    checkpoint: Checkpoint,
    base: Base | None,
    *,
    step: int | None,
    metadata: dict[str, Any] | None,
    object_bytes: int,
    meter: Meter,
    timings: dict[str, float],
    forget_base: Callable[[], None],
) -> Committed:
    """Encode `checkpoint` (a delta on `base` when the server asked for one), upload what it lacks, commit.

    A base whose bytes are not the parent's (the encoder hashed them) is forgotten through
    `forget_base` and a keyframe is published instead. Raises what the API raises; the caller
    aborts the pending publish.
    """
    use = base if begun.kind == "delta" and base is not None else None
    if use is not None and begun.parent_manifest not in (None, use.state.manifest):
        use = None
    t = time.perf_counter()
    encoded = encoder.encode(checkpoint, use.checkpoint if use else None)
    if use is not None:
        try:  # the encoder hashed the base bytes: they must be the version we think we hold
            check_bases(encoded.manifest, use.state.tree(Path(".")))
        except errors.BaseMismatch as exc:
            log.warning("publisher base does not match v%s (%s): publishing a keyframe", use.state.number, exc)
            forget_base()
            encoded = encoder.encode(checkpoint, None, keyframe=True)
    manifest, objects = pack(encoded, target_bytes=object_bytes)
    manifest.model, manifest.parent, manifest.step = model, begun.parent, step
    manifest.metadata = dict(metadata or {})
    manifest_bytes = manifest.encode()
    digest = hashlib.sha256(manifest_bytes).hexdigest()
    timings["encode_s"] = time.perf_counter() - t

    t = time.perf_counter()
    unique = {o.digest: o.data for o in objects}
    listed = [(d, len(b)) for d, b in unique.items()] + [(digest, len(manifest_bytes))]
    check = api.check_objects(model, begun.publish_id, listed)
    missing = set(check.missing)
    uploads = check.uploads or {}
    todo = [(d, b) for d, b in unique.items() if d in missing]
    meter.total = sum(len(b) for _, b in todo) + (len(manifest_bytes) if digest in missing else 0)
    api.on_bytes = meter
    try:
        # Publish order (DESIGN invariant 2): data objects, then the manifest, then the commit.
        run_all(pool, lambda it: api.put_object(it[0], it[1], uploads.get(it[0])), todo)
        if digest in missing:
            api.put_object(digest, manifest_bytes, uploads.get(digest))
    finally:
        api.on_bytes = None
    timings["upload_s"] = time.perf_counter() - t
    t = time.perf_counter()
    key = hashlib.sha256(f"{model}\0{begun.publish_id}\0{digest}".encode()).hexdigest()[:32]
    number = api.commit_publish(model, begun.publish_id, manifest=digest, idempotency_key=key).number
    timings["commit_s"] = time.perf_counter() - t
    return Committed(number, digest, manifest, len(unique) + 1, len(todo) + (digest in missing))
