"""An in-process publisher over `Ops` for tests: encode, pack, upload what is missing, commit.

`stop_after` simulates a publisher that dies at a step of the publish protocol.
"""

from __future__ import annotations

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
