"""An in-process publisher over `Ops` for tests: encode, pack, upload what is missing, commit.

`stop_after` simulates a publisher that dies at a step of the publish protocol; `publish_part` is one
rank of a multi-part publish.
"""

from __future__ import annotations

import hashlib

from weightsync.codec import Checkpoint, Encoder
from weightsync.codec.pack import pack

STEPS = ("begin", "some-objects", "objects", "manifest")


class Stopped(Exception):
    """The simulated publisher stopped here."""


async def publish(
    ops,
    model: str,
    ck: Checkpoint,
    base: Checkpoint | None,
    parent: int | None,
    *,
    keyframe: bool = False,
    stop_after: str | None = None,
    step: int | None = None,
    idempotency_key: str | None = None,
    chunk_bytes: int = 1 << 16,
    object_bytes: int = 1 << 17,
):
    begin = await ops.begin_publish(model, parent=parent, keyframe=keyframe, step=step)
    if stop_after == "begin":
        raise Stopped(begin.publish_id)
    encoded = Encoder(chunk_bytes=chunk_bytes, threads=2).encode(ck, base if begin.kind == "delta" else None)
    manifest, objects = pack(encoded, target_bytes=object_bytes)
    manifest.model, manifest.parent, manifest.step = model, parent, step
    missing = set(await ops.missing_objects(model, begin.publish_id, [(o.digest, len(o.data)) for o in objects]))
    uploaded = 0
    for o in objects:
        if o.digest in missing:
            await ops.put_bytes(o.data, expected_digest=o.digest)
            uploaded += 1
            if stop_after == "some-objects":
                raise Stopped(begin.publish_id)
    if stop_after == "objects":
        raise Stopped(begin.publish_id)
    digest = (await ops.put_bytes(manifest.encode())).digest
    if stop_after == "manifest":
        raise Stopped(begin.publish_id)
    version = await ops.commit_publish(model, begin.publish_id, manifest_digest=digest, idempotency_key=idempotency_key)
    return version, begin, digest


async def publish_one(
    ops,
    model: str,
    ck: Checkpoint,
    base: Checkpoint | None,
    parent: int | None,
    *,
    idempotency_key: str | None = None,
    chunk_bytes: int = 1 << 16,
    object_bytes: int = 1 << 17,
):
    """The same version in one call (Ops.publish_version, as publishVersion runs it): begin with every
    object, the objects in order, the manifest last, the commit. A delta on `base` (a keyframe without)."""
    encoded = Encoder(chunk_bytes=chunk_bytes, threads=2).encode(ck, base)
    manifest, objects = pack(encoded, target_bytes=object_bytes)
    manifest.model, manifest.parent = model, parent
    mbytes = manifest.encode()
    digest = hashlib.sha256(mbytes).hexdigest()
    blobs = {**{o.digest: o.data for o in objects}, digest: mbytes}

    async def body(data: bytes):
        for at in range(0, len(data), 64 << 10):
            yield data[at : at + (64 << 10)]

    async def parts():
        for d, data in blobs.items():
            yield d, len(data), body(data)

    return await ops.publish_version(
        model,
        parent=parent,
        step=None,
        metadata=None,
        keyframe=base is None,
        objects=[(d, len(b)) for d, b in blobs.items()],
        manifest_digest=digest,
        parts=parts(),
        idempotency_key=idempotency_key,
        record_later=False,  # as `publish` commits: the record before the call returns
    )


async def publish_part(
    ops,
    model: str,
    ck: Checkpoint,
    base: Checkpoint | None,
    parent: int | None,
    *,
    rank: int,
    world: int,
    step: int,
    stop_after: str | None = None,
    allow_removals: bool = False,
    chunk_bytes: int = 1 << 16,
    object_bytes: int = 1 << 17,
):
    """One rank of a multi-part publish, as the SDK sends it (docs/API.md "Multi-part publish").

    Begin the group (its id derived from model, parent and step), encode this rank's files with
    frames that never straddle files (as deltas on `base`, the rank's previous part, when the
    group is a delta), check the objects and the part manifest (held for the group), upload the
    missing, then commitPart. Returns (PartsResult, Begin, part manifest digest); `stop_after`
    as in :func:`publish`.
    """
    from weightsync.ops.core import parts_id

    publish_id = parts_id(model, parent, step)
    begin = await ops.begin_publish(model, parent=parent, step=step, publish_id=publish_id)
    if stop_after == "begin":
        raise Stopped(publish_id)
    encoder = Encoder(chunk_bytes=chunk_bytes, threads=1, frames_per_file=True)
    encoded = encoder.encode(ck, base if begin.kind == "delta" else None)
    manifest, objects = pack(encoded, target_bytes=object_bytes)
    manifest.model, manifest.parent, manifest.step = model, parent, step
    data = manifest.encode()
    digest = hashlib.sha256(data).hexdigest()
    listed = [(o.digest, len(o.data)) for o in objects] + [(digest, len(data))]
    missing = set(await ops.missing_objects(model, publish_id, listed))
    for o in objects:
        if o.digest in missing:
            await ops.put_bytes(o.data, expected_digest=o.digest)
            if stop_after == "some-objects":
                raise Stopped(publish_id)
    if stop_after == "objects":
        raise Stopped(publish_id)
    if digest in missing:
        await ops.put_bytes(data, expected_digest=digest)
    if stop_after == "manifest":
        raise Stopped(publish_id, digest)
    result = await ops.commit_part(
        model, publish_id, rank=rank, world=world, manifest_digest=digest, allow_removals=allow_removals
    )
    return result, begin, digest
