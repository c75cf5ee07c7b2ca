"""One publish on the wire: begin on the base held, encode, pack, upload what is missing, commit.

The protocol is docs/API.md "Publishing"; the order of uploads is DESIGN invariant 2 (data
objects, then the manifest, then the commit). :class:`~weightsync.client.publisher.Publisher`
is the facade that serializes publishes and keeps the next base.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from weightsync import errors
from weightsync.client._http import Api
from weightsync.client._pool import Batch, run_all
from weightsync.client.base import Base, BaseKeeper
from weightsync.client.decode import check_bases
from weightsync.client.models import PublishBegin
from weightsync.client.pull import Meter
from weightsync.codec.checkpoint import Checkpoint, tensor_names
from weightsync.codec.encoder import Encoder
from weightsync.codec.manifest import VERSION_2 as MANIFEST_V2
from weightsync.codec.manifest import Manifest
from weightsync.codec.pack import PackedObject, Packer, pack
from weightsync.common import removal_message, removed_content

log = logging.getLogger("weightsync.client")


@dataclass
class Packed:
    """One version encoded and packed, ready to upload: its manifest, the manifest's stored form, its objects."""

    manifest: Manifest
    manifest_bytes: bytes
    digest: str
    objects: dict[str, bytes]
    """The data objects by digest (each once)."""
    kept: bool = False
    """The encode wrote the version's bytes into the base's buffers (`pack_version` keep_base)."""

    def listed(self) -> list[tuple[str, int]]:
        """(digest, size) of every object to check, the manifest last."""
        return [(d, len(b)) for d, b in self.objects.items()] + [(self.digest, len(self.manifest_bytes))]


def pack_version(
    encoder: Encoder,
    checkpoint: Checkpoint,
    base: Base | None,
    *,
    model: str,
    parent: int | None,
    step: int | None,
    metadata: dict[str, Any] | None,
    object_bytes: int,
    forget_base: Callable[[], None],
    timings: dict[str, float],
    version: int,
    keep_base: bool = False,
    on_object: Callable[[PackedObject], None] | None = None,
) -> Packed:
    """Encode `checkpoint` in manifest format `version` (a delta on `base`, a keyframe without one), pack it.

    ``on_object``: a format 2 encode (keyframe or delta) hands each data object but the last to it as
    soon as the object is packed, while later frames still encode (``Encoder.encode``'s `on_frame` into
    a ``pack.Packer``), so it can be uploaded meanwhile; a format 1 encode hands on nothing (the caller
    uploads ``Packed.objects``). A delta whose base turns out not to be the version it claims is
    packed again as a keyframe, whole: what was handed on is then not among ``Packed.objects``.

    A base whose bytes are not the version it claims (the encoder hashed them), or that is
    stored in another format (a chain never mixes formats), is forgotten through
    `forget_base` and a keyframe is packed instead. Sets ``timings["encode_s"]``.
    ``keep_base``: the encoder may write the version into the base's buffers as it codes it
    (``Encoder.encode``); ``Packed.kept`` says whether it did, and the caller then holds the
    base as the publish's next base, to be undone if the version is not committed. A base that
    came out wrong, or a failure after such an encode, forgets the base.
    """
    t = time.perf_counter()
    encoder.format_version = version
    if base is not None and base.state.digest_kind != encoder.digest_kind:
        base = None  # a format change starts a new chain
    keep = keep_base and base is not None
    encoded = None
    manifest: Manifest | None = None
    objects: list[PackedObject] = []
    try:
        of = base.checkpoint if base else None
        if on_object is not None and version == MANIFEST_V2:
            packer = Packer(target_bytes=object_bytes, on_object=on_object)
            encoded = encoder.encode(checkpoint, of, keep_base=keep, on_frame=packer.add)
            manifest, objects = packer.finish(encoded)
        else:
            encoded = encoder.encode(checkpoint, of, keep_base=keep)
        if base is not None:
            try:  # the encoder hashed the base bytes: they must be the version we think we hold
                check_bases(encoded.manifest, base.state.tree(Path(".")))
            except errors.BaseMismatch as exc:
                log.warning("publisher base does not match v%s (%s): publishing a keyframe", base.state.number, exc)
                forget_base()
                encoded = encoder.encode(checkpoint, None, keyframe=True)
                manifest = None  # packed whole below: the objects handed on were the delta's
        if manifest is None:
            manifest, objects = pack(encoded, target_bytes=object_bytes)
        manifest.model, manifest.parent, manifest.step = model, parent, step
        manifest.metadata = dict(metadata or {})
        manifest_bytes = manifest.encode()
    except BaseException:
        if keep and (encoded is None or encoded.kept):  # the base's buffers may hold neither version now
            forget_base()
        raise
    digest = hashlib.sha256(manifest_bytes).hexdigest()
    timings["encode_s"] = time.perf_counter() - t
    return Packed(manifest, manifest_bytes, digest, {o.digest: o.data for o in objects}, kept=encoded.kept)


def begin(
    api: Api,
    keeper: BaseKeeper,
    model: str,
    *,
    keyframe: bool,
    step: int | None,
    metadata: dict[str, Any] | None,
    catch_up: Meter,
    prepare: Callable[[Base], Packed],
    part: tuple[int, int] | None = None,
    inline: Callable[[Base, Packed], Committed | PublishBegin | None] | None = None,
    stream: bool = False,
) -> tuple[Base | None, PublishBegin | Committed, Packed | None]:
    """Begin a publish: on the base held when it is still the head, else on the head.

    Returns the base to diff against (None: a keyframe), the server's answer, and the version
    already packed when there was a base: `prepare` encodes against the base held *before*
    beginning, so the begin also checks its objects (begin and checkObjects in one round trip).
    With `stream` (a delta expected to span several objects), the begin on the base held comes
    first and nothing is packed: `commit` then encodes it, uploading each object as it is packed.
    With `inline` (:func:`publish_inline`), a version packed on the held base is first offered
    whole in one request: the answer is then the version Committed already, or the publish the
    server began for another kind (None: too large, or a server without publishVersion).
    Behind the head, the keeper catches up (an incremental pull counted by `catch_up`) or gives
    up its base, and nothing is packed yet.
    """
    on_head: dict[str, Any] = dict(keyframe=keyframe, step=step, metadata=metadata, catch_up=catch_up, part=part)
    base = None if keyframe else keeper.held()
    if base is not None and stream:
        try:
            begun = api.begin_publish(
                model, parent=base.state.number, step=step, metadata=metadata, keyframe=False, part=part
            )
            return base, begun, None
        except errors.StaleParent:
            return _on_head(api, keeper, model, **on_head)
    if base is not None:
        packed = prepare(base)
        try:  # begin answers the parent's manifest: `commit` checks the base against it
            got = None if inline is None else inline(base, packed)
            if isinstance(got, Committed) or (got is not None and keeper.held() is base):
                return base, got, packed
            if keeper.held() is not base:  # the one request went, and the base with it (overwrite_early)
                return (None, got, None) if got is not None else _on_head(api, keeper, model, **on_head)
            return (
                base,
                api.begin_publish(
                    model,
                    parent=base.state.number,
                    step=step,
                    metadata=metadata,
                    keyframe=packed.manifest.kind == "keyframe",
                    objects=packed.listed(),
                    part=part,
                ),
                packed,
            )
        except errors.StaleParent:
            pass
    return _on_head(api, keeper, model, **on_head)


def _on_head(
    api: Api,
    keeper: BaseKeeper,
    model: str,
    *,
    keyframe: bool,
    step: int | None,
    metadata: dict[str, Any] | None,
    catch_up: Meter,
    part: tuple[int, int] | None,
) -> tuple[Base | None, PublishBegin, None]:
    """Begin on the server's head: with the base held when it is the head, after a catch-up, or none."""
    head = api.head(model)
    base = None if keyframe else keeper.for_head(head, catch_up)
    answer = api.begin_publish(
        model,
        parent=head.number if head is not None else None,
        step=step,
        metadata=metadata,
        keyframe=base is None,
        part=part,
    )
    return base, answer, None


@dataclass
class Committed:
    """What `commit` did: the version, its manifest, and the objects it listed and uploaded."""

    number: int
    digest: str
    manifest: Manifest
    objects_total: int
    objects_uploaded: int
    objects: dict[str, bytes] = field(default_factory=dict)
    """The data objects of `manifest` by digest (what the publisher keeps its next base from)."""


def commit(
    api: Api,
    pool: ThreadPoolExecutor,
    model: str,
    begun: PublishBegin,
    base: Base | None,
    packed: Packed | None,
    *,
    checkpoint: Checkpoint,
    pack_for: Callable[..., Packed],
    allow_removals: bool,
    meter: Meter,
    timings: dict[str, float],
    part: tuple[int, int] | None = None,
    wait: bool = True,
    poll_s: float = 0.1,
    before_upload: Callable[[Manifest], None] | None = None,
) -> Committed:
    """Upload what the server lacks of the version (a delta on `base` when the server asked for one), commit.

    `packed` (from `begin`) is used when it is what the server asked for (kind and parent),
    with the objects check that came with the begin; otherwise `pack_for(base or None,
    parent)` encodes anew here, each data object checked and uploaded as soon as it is packed,
    while the rest encodes (``_encode_uploading``). `before_upload` is called with the version's
    manifest once the version is encoded, before the uploads (or, for a version encoded here,
    while they go on): the publisher starts keeping the next base then. Raises what the API raises
    (RemovesContent: the version drops files or tensors of its parent, without `allow_removals`); the
    caller aborts the pending publish.
    """
    use = base if begun.kind == "delta" and base is not None else None
    if use is not None and begun.parent_manifest not in (None, use.state.manifest):
        use = None
    if part is None and base is not None and begun.parent == base.state.number and not allow_removals:
        refuse_removals(base, checkpoint)
    fits = (
        packed is not None
        and packed.manifest.version in (begun.formats or [1])
        and packed.manifest.parent == begun.parent
        and packed.manifest.kind == begun.kind
        and (begun.kind == "keyframe" or use is not None)
    )
    checked = begun.checked() if fits else None
    streamed: set[str] = set()
    uploaded: set[str] = set()  # of those, the ones the store lacked
    waited = 0.0  # seconds spent on them after the encode
    if packed is None or not fits:
        # Encoded after the begin (a keyframe, or a delta begun before its encode: `begin`'s `stream`): each
        # data object is checked and uploaded as soon as it is packed, while the frames after it encode (the
        # encode and the upload overlap); the uploads that outlast the encode count in upload_s.
        t = time.perf_counter()
        packed, streamed, uploaded = _encode_uploading(
            api, pool, model, begun.publish_id, meter, use, begun.parent, pack_for, before_upload
        )
        waited = time.perf_counter() - t - timings.get("encode_s", 0.0)
        before_upload = None
        uploaded &= packed.objects.keys()  # not a delta's objects streamed before its base was found wrong

    t = time.perf_counter()
    if checked is None:
        checked = api.check_objects(model, begun.publish_id, [x for x in packed.listed() if x[0] not in streamed])
    if before_upload is not None:
        before_upload(packed.manifest)
    missing = set(checked.missing)
    uploads = checked.uploads or {}
    todo = [(d, b) for d, b in packed.objects.items() if d in missing and d not in streamed]
    if packed.digest in missing:
        todo.append((packed.digest, packed.manifest_bytes))
    meter.total = meter.bytes + sum(len(b) for _, b in todo)
    api.on_bytes = meter
    try:
        # Data objects and the manifest at once (DESIGN invariant 2: all of them before the commit).
        run_all(pool, lambda it: api.put_object(it[0], it[1], uploads.get(it[0])), todo)
    finally:
        api.on_bytes = None
    timings["upload_s"] = time.perf_counter() - t + waited
    t = time.perf_counter()
    if part is not None:
        number, digest = commit_part(api, model, begun.publish_id, part, packed.digest, allow_removals, wait, poll_s)
        timings["commit_s"] = time.perf_counter() - t
        # The version's manifest digest (the merge's), and this part's manifest: the files this rank holds.
        return Committed(
            number, digest, packed.manifest, len(packed.objects) + 1, len(todo) + len(uploaded), packed.objects
        )
    key = hashlib.sha256(f"{model}\0{begun.publish_id}\0{packed.digest}".encode()).hexdigest()[:32]
    number = api.commit_publish(
        model, begun.publish_id, manifest=packed.digest, idempotency_key=key, allow_removals=allow_removals
    ).number
    timings["commit_s"] = time.perf_counter() - t
    return Committed(
        number, packed.digest, packed.manifest, len(packed.objects) + 1, len(todo) + len(uploaded), packed.objects
    )


def _encode_uploading(
    api: Api,
    pool: ThreadPoolExecutor,
    model: str,
    publish_id: str,
    meter: Meter,
    base: Base | None,
    parent: int | None,
    pack_for: Callable[..., Packed],
    before_upload: Callable[[Manifest], None] | None,
) -> tuple[Packed, set[str], set[str]]:
    """`pack_for(base, parent)` with each data object but the last (``pack.Packer``) checked (held for the
    publish, a presigned upload where the store gives one) and uploaded on `pool` as soon as it is packed,
    in one batch (``_pool.Batch``: a failure or an interrupt stops every upload in flight, and a failure
    stops the encode at its next object). `before_upload` is called once the encode is done, while those
    uploads go on. Returns once they are stored, with their digests and those of them the store lacked
    (uploaded)."""
    lock = threading.Lock()
    batch = Batch(pool)
    sent: set[str] = set()
    uploaded: set[str] = set()

    def upload(obj: PackedObject) -> None:
        checked = api.check_objects(model, publish_id, [(obj.digest, len(obj.data))])
        if obj.digest in checked.missing:
            api.put_object(obj.digest, obj.data, (checked.uploads or {}).get(obj.digest))
            with lock:
                uploaded.add(obj.digest)

    def hand_on(obj: PackedObject) -> None:
        with lock:
            meter.total += len(obj.data)
            sent.add(obj.digest)
        batch.submit(upload, obj)  # raises the batch's failure once there is one: the encode stops

    api.on_bytes = meter
    try:
        try:
            packed = pack_for(base, parent, on_object=hand_on)
            if before_upload is not None:
                before_upload(packed.manifest)
            batch.finish()
        except BaseException:
            batch.stop()
            raise
    finally:
        api.on_bytes = None
    return packed, sent, uploaded


def refuse_removals(base: Base, checkpoint: Checkpoint) -> None:
    """RemovesContent when `checkpoint` drops files or tensors of the held base, its parent: refused
    before uploading anything (the server's commit checks it anyway)."""
    dropped = removed_content(
        tensor_names(f.layout for f in base.checkpoint.files),
        tensor_names(f.layout for f in checkpoint.files),
        single_file=checkpoint.single_file,
    )
    if dropped:
        raise errors.RemovesContent(removal_message(base.state.number, dropped))


def publish_inline(
    api: Api,
    model: str,
    base: Base,
    packed: Packed,
    *,
    checkpoint: Checkpoint,
    limit: int,
    allow_removals: bool,
    meter: Meter,
    timings: dict[str, float],
    before_send: Callable[[], None] | None = None,
) -> Committed | PublishBegin | None:
    """Offer `packed` (encoded on the held `base`) whole in one request (publishVersion, docs/API.md
    "One request per version"), when its objects add up to at most `limit` bytes. `before_send` is
    called right before the request goes (the publisher starts keeping the next base then).

    Returns the version Committed; the publish the server began instead, for another kind than
    the one packed (the caller encodes that and goes on as after a begin); or None when the version
    is larger than `limit` or than the server's body cap (a 413 taught it), or the server predates
    publishVersion. Raises what the API raises
    (StaleParent: the head moved; RemovesContent without `allow_removals`). The request's time is
    ``timings["upload_s"]``: it carries the objects and the commit.
    """
    # The manifest first: the server parses it while it writes the data objects (any order is valid).
    objects = {packed.digest: packed.manifest_bytes, **packed.objects}
    total = sum(len(b) for b in objects.values())
    cap = api.publish_version_cap
    if total > limit or api.publish_version_missing or (cap is not None and total > cap):
        return None
    if not allow_removals:
        refuse_removals(base, checkpoint)
    m = packed.manifest
    # The same key for the same manifest on the same parent: a retry whose answer was lost replays it.
    key = hashlib.sha256(f"{model}\0{m.parent}\0{packed.digest}".encode()).hexdigest()[:32]
    t = time.perf_counter()
    meter.total = total
    if before_send is not None:
        before_send()
    api.on_bytes = meter
    try:
        got = api.publish_version(
            model,
            parent=m.parent,
            step=m.step,
            metadata=m.metadata,
            keyframe=m.kind == "keyframe",
            objects=objects,
            manifest=packed.digest,
            idempotency_key=key,
            allow_removals=allow_removals,
            timings=timings,
        )
    finally:
        api.on_bytes = None
    timings["upload_s"] = time.perf_counter() - t
    if got is None:  # an older server (405) or a body over its cap (413): three requests instead
        return None
    if isinstance(got, PublishBegin):
        return got
    return Committed(got.number, packed.digest, packed.manifest, len(objects), len(objects), packed.objects)


def commit_part(
    api: Api,
    model: str,
    publish_id: str,
    part: tuple[int, int],
    manifest: str,
    allow_removals: bool,
    wait: bool,
    poll_s: float,
) -> tuple[int, str]:
    """Record this part (commitPart); with `wait`, send it again (idempotent) until the version commits.

    Returns the committed version's number and manifest digest, or (0, "") when not waiting and
    other parts are missing.
    Raises PublishNotFound when the publish expired (a rank never arrived) or was aborted.
    """
    rank, world = part
    while True:
        version = api.commit_part(
            model, publish_id, rank=rank, world=world, manifest=manifest, allow_removals=allow_removals
        )
        if version is not None:
            return version.number, version.manifest
        if not wait:
            return 0, ""
        time.sleep(poll_s)
