"""Versions of a model: listing, lineage, manifests, plans, the publish protocol, and watching for new ones."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request, Response, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from weightsync import bundle, errors
from weightsync.common import check_model_name
from weightsync.ops import Ops, committed
from weightsync.ops.core import FORMATS, BeginResult, parts_id
from weightsync.service.deps import MetricsDep, OpsDep, Publisher, Reader, SettingsDep
from weightsync.service.metrics import Metrics
from weightsync.service.problems import ApiProblem
from weightsync.service.schemas import (
    INT64,
    BeginIn,
    BeginOut,
    CheckIn,
    CheckOut,
    CommitIn,
    ObjectRef,
    PartIn,
    PartOut,
    PlanOut,
    PresignedPut,
    PublishIn,
    VersionList,
    VersionOut,
    begin_out,
    plan_out,
    version_out,
)
from weightsync.service.settings import Settings

router = APIRouter(prefix="/v1/models/{model:model}", tags=["versions"])
log = logging.getLogger("weightsync.service")

MAX_WATCH_S = 60.0
DEFAULT_LIST_LIMIT = 1000


def _number(number: str) -> int | None:
    """``latest`` → None (the head), else a positive int."""
    if number == "latest":
        return None
    if not number.isascii() or not number.isdigit() or len(number) > 18:
        raise ApiProblem(422, "validation", "Invalid request", "version number must be an integer or 'latest'")
    return int(number)


# --- reading -------------------------------------------------------------------------------

InlineQuery = Annotated[
    int | None,
    Query(
        ge=0,
        le=bundle.MAX_INLINE,
        description=(
            "When the plan's bytes are at most this many, answer the plan with its manifests and objects in "
            f"one body ({bundle.MEDIA_TYPE}, docs/API.md); else, or without it, the plan's JSON."
        ),
    ),
]


@router.get("/versions", operation_id="listVersions", response_model=VersionList)
async def list_versions(
    model: str,
    ops: OpsDep,
    who: Reader,
    limit: Annotated[int, Query(ge=1, le=10_000)] = DEFAULT_LIST_LIMIT,
    before: Annotated[int | None, Query(ge=-INT64, le=INT64)] = None,
    after: Annotated[int | None, Query(ge=-INT64, le=INT64)] = None,
) -> VersionList:
    """Committed versions, ascending. With ``after``: the first ``limit`` above it; otherwise the
    newest ``limit`` (below ``before`` if given), so paging works in both directions."""
    if after is not None:
        found = await ops.list_versions(model, after=after, before=before, limit=limit)
    else:
        found = (await ops.list_versions(model, before=before, limit=limit, descending=True))[::-1]
    return VersionList(versions=[version_out(v) for v in found])


@router.get("/versions/{number}", operation_id="getVersion", response_model=VersionOut)
async def get_version(model: str, number: str, ops: OpsDep, who: Reader) -> VersionOut:
    """One committed version; ``latest`` is the head."""
    return version_out(await ops.get_version(model, _number(number)))


@router.get("/versions/{number}/lineage", operation_id="getLineage", response_model=VersionList)
async def get_lineage(model: str, number: str, ops: OpsDep, who: Reader) -> VersionList:
    """The chain a version is rebuilt from: its keyframe first, then every delta up to it."""
    n = _number(number)
    if n is None:
        n, _ = committed(await ops.get_version(model))
    return VersionList(versions=[version_out(v) for v in await ops.lineage(model, n)])


@router.get(
    "/versions/{number}/manifest",
    operation_id="getManifest",
    response_class=Response,
    responses={
        200: {"content": {"application/octet-stream": {}}, "description": "FORMAT §5.1 bytes"},
        304: {"description": "If-None-Match matched"},
    },
)
async def get_manifest(
    model: str, number: str, ops: OpsDep, who: Reader, if_none_match: Annotated[str | None, Header()] = None
) -> Response:
    """The version's stored manifest bytes, ``ETag: "<digest>"``."""
    _, digest = committed(await ops.get_version(model, _number(number)))
    etag = f'"{digest}"'
    headers = {"ETag": etag, "Cache-Control": "private, max-age=31536000, immutable"}
    if if_none_match is not None and etag in {t.strip() for t in if_none_match.split(",")}:
        return Response(status_code=304, headers=headers)
    data = await ops.read_manifest_bytes(digest)
    return Response(data, media_type="application/octet-stream", headers=headers)


PLAN_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": f"The plan (JSON), or with `inline` the plan and its objects in one body ({bundle.MEDIA_TYPE})",
        "content": {bundle.MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}},
    }
}


@router.get("/plan", operation_id="getPlan", response_model=PlanOut, responses=PLAN_RESPONSES)
async def get_plan(
    model: str,
    ops: OpsDep,
    who: Reader,
    have: Annotated[int | None, Query(ge=-INT64, le=INT64)] = None,
    want: Annotated[int | None, Query(ge=-INT64, le=INT64)] = None,
    holder: Annotated[str | None, Query(min_length=1, max_length=255)] = None,
    formats: Annotated[
        str | None,
        Query(
            max_length=64,
            pattern=r"^[0-9]{1,3}(,[0-9]{1,3})*$",
            description="Manifest formats the reader reads, comma-separated (e.g. 1,2); 406 if the plan needs another.",
        ),
    ] = None,
    inline: InlineQuery = None,
) -> Response | PlanOut:
    """What to fetch to go from ``have`` to ``want`` (default: the head); ``holder`` leases the chain."""
    return await plan_answer(
        ops, await read_plan(model, ops, have=have, want=want, holder=holder, formats=formats), inline
    )


async def plan_answer(ops: Ops, out: PlanOut, inline: int | None) -> Response | PlanOut:
    """getPlan's answer for `out`: its JSON, or with `inline` at least its bytes (and steps to fetch) the
    plan with its objects in one body (:func:`plan_bundle`)."""
    if inline is None or out.bytes > inline or not out.steps:
        return out
    return await plan_bundle(ops, out)


async def read_plan(
    model: str, ops: Ops, *, have: int | None, want: int | None, holder: str | None, formats: str | None
) -> PlanOut:
    """getPlan's plan (its JSON answer), for the service's route and the relay's."""
    readable = None if formats is None else {int(f) for f in formats.split(",")}
    return plan_out(await ops.plan(model, have=have, want=want, holder=holder, formats=readable))


BUNDLE_PRELOAD = 4 << 20
"""Bytes of a plan bundle's objects read whole from the store before its answer starts (the rest are streamed);
objects the server holds in memory (Ops.held) come on top of it."""

_JOINED_PIECE = 1 << 20
"""A bundle's pieces below this size are joined into writes of about this size; larger ones are sent as they are."""


def _coalesced(pieces: Iterable[bytes]) -> Iterator[bytes]:
    """`pieces` as writes: runs of small ones joined (a run ends once it reaches _JOINED_PIECE bytes), the large
    ones as they are, uncopied; one run at a time is held, as the writes are taken."""
    run: list[bytes] = []
    held = 0
    for piece in pieces:
        if len(piece) >= _JOINED_PIECE:
            if run:
                yield b"".join(run)
                run, held = [], 0
            yield piece
            continue
        run.append(piece)
        held += len(piece)
        if held >= _JOINED_PIECE:
            yield b"".join(run)
            run, held = [], 0
    if run:
        yield b"".join(run)


class _PiecesResponse(Response):
    """An answer whose body, all in hand, is sent as its pieces (:func:`_coalesced`): the large ones (objects
    held in memory) are handed to the transport as they are, not copied into one body first."""

    def __init__(self, pieces: list[bytes], length: int, media_type: str, headers: dict[str, str]) -> None:
        self._pieces = pieces
        super().__init__(media_type=media_type, headers={"Content-Length": str(length), **headers})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        last: bytes | None = None
        for piece in _coalesced(self._pieces):
            if last is not None:
                await send({"type": "http.response.body", "body": last, "more_body": True})
            last = piece
        await send({"type": "http.response.body", "body": last or b"", "more_body": False})
        if self.background is not None:
            await self.background()


async def plan_bundle(ops: Ops, out: PlanOut) -> Response:
    """The plan and every manifest and object of its steps in one body (weightsync/bundle.py).

    Objects the store does not hold are left out (the reader fetches what it lacks the usual way).
    Objects the server holds in memory (ops/hot.py: those written or read whole lately, up to
    HOT_OBJECT_BYTES each) are in hand already; of the others, the small ones (the manifests first,
    then a small update's frames: up to BUNDLE_PRELOAD bytes in all) and the target step's objects
    that the memory keeps (up to its budget in all) are read whole before the answer starts, one
    store read each, all at once, the latter kept in memory for the plans that follow. What is in
    hand goes first, with the plan, its large pieces uncopied, except an object whose step's
    manifest is not in hand; the rest follows in the plan's order, streamed as getObject streams it
    where it is not in hand. So each step's manifest comes before its objects. The length is known
    up front from what is in hand and the store's sizes.
    """
    wanted: dict[str, int] = {}
    step_of: dict[str, str | None] = {}  # an object's step's manifest (None: a manifest), where it first shows
    for step in out.steps:
        wanted.setdefault(step.manifest, step.manifest_bytes)
        step_of.setdefault(step.manifest, None)
        for o in step.objects:
            wanted.setdefault(o.digest, o.size)
            step_of.setdefault(o.digest, step.manifest)
    held = {d: data for d in wanted if (data := ops.held(d)) is not None}
    budget, preload = BUNDLE_PRELOAD, set[str]()
    for d in sorted(wanted, key=lambda d: step_of[d] is not None):  # the manifests first, then the plan's order
        if d not in held and wanted[d] <= budget:
            preload.add(d)
            budget -= wanted[d]
    # The plan's target step's objects, what every follower of that version asks for next, are read whole
    # into memory when it keeps them all (once for the plans that ask together: Ops.read_whole): a server
    # that did not take the upload (another worker process, one restarted since) then serves the followers
    # that come after from memory, as the one that took it does. All or none: a target larger than the
    # memory would push its own objects out of it at every plan. Older steps' objects (a catch-up) are
    # not read so: they would push the target's out.
    budget_of_memory, largest = ops.memory
    target = out.steps[-1]
    mine = [(target.manifest, target.manifest_bytes), *((o.digest, o.size) for o in target.objects)]
    kept = [(d, n) for d, n in mine if n <= largest]
    if sum(n for _, n in kept) <= budget_of_memory:
        preload.update(d for d, _ in kept if d not in held)

    vouched = set(held)  # the objects whose bytes this process checked against their names (ops/hot.py)

    async def read(digest: str) -> bytes | None:
        try:
            data, intact = await ops.read_whole_checked(digest)
        except errors.ObjectNotFound:
            return None
        if intact:
            vouched.add(digest)
        return data

    async def size_of(digest: str) -> int | None:
        try:
            return (await ops.stat_object(digest)).size
        except errors.ObjectNotFound:
            return None

    missing = [d for d in wanted if d not in held]
    found = dict(
        zip(missing, await asyncio.gather(*(read(d) if d in preload else size_of(d) for d in missing)), strict=True)
    )
    in_hand = {d: x for d in wanted if isinstance(x := held.get(d, found.get(d)), bytes)}  # the plan's order
    streamed = {d: x for d, x in found.items() if isinstance(x, int)}
    first = {d: x for d, x in in_hand.items() if (m := step_of[d]) is None or m in in_hand}
    after = [d for d in wanted if d not in first and (d in in_hand or d in streamed)]
    pieces = bundle.chunks(out.model_dump_json().encode(), first, first=bundle.PLAN)
    head = sum(map(len, pieces))
    # Every part checked here (none streamed from the store unread): said so, with the xxh3 of the largest parts,
    # taken of the bytes checked (ops/hot.py, as each was kept; here, of one read whole for this plan), which the
    # reader checks their way across with instead of hashing them (weightsync/bundle.py XXH3_HEADER).
    checked = {}
    if not streamed and vouched.issuperset(in_hand):
        biggest = sorted(in_hand, key=lambda d: len(in_hand[d]), reverse=True)[: bundle.XXH3_PARTS]
        xxh3 = {d: ops.transfer_digest(d) or bundle.transfer_digest(in_hand[d]) for d in biggest}
        checked = {bundle.CHECKED_HEADER: "sha256", bundle.XXH3_HEADER: bundle.format_transfer_digests(xxh3)}
    if not after:  # all of it in hand: no streaming machinery (its task group costs the small answer)
        if head < _JOINED_PIECE:
            return Response(b"".join(pieces), media_type=bundle.MEDIA_TYPE, headers=checked)
        return _PiecesResponse(pieces, head, bundle.MEDIA_TYPE, checked)
    sizes = {d: len(in_hand[d]) if d in in_hand else streamed[d] for d in after}
    total = head + sum(bundle.part_overhead(d) + n for d, n in sizes.items())

    async def body() -> AsyncIterator[bytes]:
        for piece in _coalesced(pieces):  # the plan and the objects in hand, the small ones joined
            yield piece
        for digest in after:
            yield bundle.part_header(digest, sizes[digest])
            if digest in in_hand:
                yield in_hand[digest]
                continue
            async for chunk in ops.read_object(digest):
                yield chunk

    return StreamingResponse(body(), media_type=bundle.MEDIA_TYPE, headers={"Content-Length": str(total), **checked})


# --- publishing -----------------------------------------------------------------------------


@router.post("/publishes", operation_id="beginPublish", status_code=status.HTTP_201_CREATED, response_model=BeginOut)
async def begin_publish(model: str, body: BeginIn, ops: OpsDep, who: Publisher, settings: SettingsDep) -> BeginOut:
    """Open a publish on top of ``parent``; says whether to encode a keyframe or a delta. Creates the model.

    With ``objects`` (an encoding made before asking: a delta on ``parent``, or a keyframe when
    ``keyframe`` is set) the answer also says which of them to upload, as checkObjects would,
    when the answered kind is that encoding's: one round trip instead of two.
    """
    objects = None
    if body.objects is not None:
        _refuse_too_large(body.objects, settings.max_object_size)
        objects = [(o.digest, o.size) for o in body.objects]
    publish_id = None
    if body.part is not None:
        if body.step is None:
            raise errors.InvalidArgument("a part (multi-part publish) needs its step: ranks join by (parent, step)")
        if body.part.rank >= body.part.world:
            raise errors.InvalidArgument(f"part {body.part.rank} of {body.part.world}: rank must be below world")
        publish_id = parts_id(model, body.parent, body.step)
    begun = await ops.begin_publish(
        model,
        parent=body.parent,
        step=body.step,
        metadata=body.metadata,
        keyframe=body.keyframe,
        objects=objects,
        publish_id=publish_id,
    )
    out = begin_out(begun)
    out.formats = list(FORMATS)
    if begun.missing is not None and body.objects is not None:
        out.uploads = await _presigned(begun.missing, body.objects, ops, settings)
    return out


def _refuse_too_large(objects: list[ObjectRef], limit: int) -> None:
    """413 too-large when any listed object is over the server's object size cap."""
    too_big = [o.digest for o in objects if o.size > limit]
    if too_big:
        raise ApiProblem(
            413,
            "too-large",
            "Object too large",
            f"{len(too_big)} object(s) exceed the {limit}-byte limit",
            digests=too_big[:10],
        )


async def _check(model: str, publish_id: str, objects: list[ObjectRef], ops: Ops, settings: Settings) -> CheckOut:
    """Which of `objects` the store lacks (held for the publish meanwhile), with presigned uploads where it can."""
    missing = await ops.missing_objects(model, publish_id, [(o.digest, o.size) for o in objects])
    return CheckOut(missing=missing, uploads=await _presigned(missing, objects, ops, settings))


async def _presigned(
    missing: list[str], objects: list[ObjectRef], ops: Ops, settings: Settings
) -> dict[str, PresignedPut] | None:
    """Presigned uploads for the `missing` objects where the server hands them out (S3), else None."""
    if not (settings.presign and ops.can_presign and missing):
        return None
    sizes = {o.digest: o.size for o in objects}
    signed = await ops.presign_uploads({d: sizes[d] for d in missing}, settings.presign_expires_s)
    return {d: PresignedPut(method=r.method, url=r.url, headers=dict(r.headers)) for d, r in signed.items()}


@router.post(
    "/publishes/{publish_id}/objects",
    operation_id="checkObjects",
    response_model=CheckOut,
    response_model_exclude_none=True,
)
async def check_objects(
    model: str, publish_id: str, body: CheckIn, ops: OpsDep, who: Publisher, settings: SettingsDep
) -> CheckOut:
    """Which objects the store lacks (held for this publish meanwhile); presigned uploads where the store can."""
    _refuse_too_large(body.objects, settings.max_object_size)
    return await _check(model, publish_id, body.objects, ops, settings)


@router.post(
    "/publishes/{publish_id}/commit",
    operation_id="commitPublish",
    status_code=status.HTTP_201_CREATED,
    response_model=VersionOut,
)
async def commit_publish(
    model: str,
    publish_id: str,
    body: CommitIn,
    ops: OpsDep,
    who: Publisher,
    metrics: MetricsDep,
    idempotency_key: Annotated[str | None, Header(max_length=128)] = None,
) -> VersionOut:
    """Make the publish visible (compare-and-swap on the head); a retried commit returns the same version."""
    started = ops.clock()
    version = await ops.commit_publish(
        model,
        publish_id,
        manifest_digest=body.manifest,
        idempotency_key=body.idempotency_key or idempotency_key,
        allow_removals=body.allow_removals,
        record_later=True,
    )
    # A replay returns the version committed earlier: count each commit once.
    if version.committed_at is not None and version.committed_at >= started:
        metrics.versions_committed.inc()
        metrics.publish_to_commit.observe(max(0.0, (version.committed_at - version.created_at).total_seconds()))
    return version_out(version)


PUBLISH_RESPONSES: dict[int | str, dict[str, Any]] = {
    202: {
        "model": BeginOut,
        "description": "Not committed: the publish needs another kind than the one sent (the chain policy asks "
        "for a keyframe). Nothing was stored; the publish is begun, as beginPublish answers it: encode "
        "that kind, then checkObjects, putObject and commitPublish as usual.",
    },
    415: {"description": f"The body is not a {bundle.PUBLISH_MEDIA_TYPE}"},
}


@router.post(
    "/versions",
    operation_id="publishVersion",
    status_code=status.HTTP_201_CREATED,
    response_model=VersionOut,
    responses=PUBLISH_RESPONSES,
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {bundle.PUBLISH_MEDIA_TYPE: {"schema": {"type": "string", "format": "binary"}}},
        }
    },
)
async def publish_version(
    model: str,
    request: Request,
    ops: OpsDep,
    who: Publisher,
    metrics: MetricsDep,
    settings: SettingsDep,
    content_type: Annotated[str | None, Header()] = None,
) -> Response | VersionOut:
    """Publish a version in one request: beginPublish, the uploads and commitPublish (docs/API.md
    "One request per version"). The body (weightsync/bundle.py) is a ``publish`` part (PublishIn's
    JSON) and then every listed object; only those the store lacks are stored. Bodies are capped
    like JSON bodies (the service's max_json_body)."""
    check_model_name(model)
    if content_type is None or content_type.split(";")[0].strip() != bundle.PUBLISH_MEDIA_TYPE:
        raise ApiProblem(
            415, "unsupported-media-type", "Unsupported media type", f"send a {bundle.PUBLISH_MEDIA_TYPE} body"
        )
    reader = bundle.StreamedBundle(request.stream(), first=bundle.PUBLISH, max_json=settings.max_json_body)
    try:
        body = PublishIn.model_validate_json(await reader.json_part())
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None
    _refuse_too_large(body.objects, settings.max_object_size)
    started = ops.clock()
    got = await ops.publish_version(
        model,
        parent=body.parent,
        step=body.step,
        metadata=body.metadata,
        keyframe=body.keyframe,
        objects=[(o.digest, o.size) for o in body.objects],
        manifest_digest=body.manifest,
        parts=reader.objects(),
        idempotency_key=body.idempotency_key,
        allow_removals=body.allow_removals,
    )
    if isinstance(got, BeginResult):
        out = begin_out(got)
        out.formats = list(FORMATS)
        return JSONResponse(out.model_dump(mode="json"), status_code=status.HTTP_202_ACCEPTED)
    if got.committed_at is not None and got.committed_at >= started:  # a replay was counted the first time
        metrics.versions_committed.inc()
        metrics.publish_to_commit.observe(max(0.0, (got.committed_at - got.created_at).total_seconds()))
    return version_out(got)


@router.post("/publishes/{publish_id}/parts/{rank}", operation_id="commitPart", response_model=PartOut)
async def commit_part(
    model: str, publish_id: str, rank: int, body: PartIn, ops: OpsDep, who: Publisher, metrics: MetricsDep
) -> PartOut:
    """Record one part of a multi-part publish; the last part commits the version (all parts or nothing).

    Idempotent: a retried part answers the group's state, or the committed version once it is.
    """
    if not 0 <= rank < body.world:
        raise errors.InvalidArgument(f"part {rank} of {body.world}: rank must lie in [0, world)")
    started = ops.clock()
    got = await ops.commit_part(
        model,
        publish_id,
        rank=rank,
        world=body.world,
        manifest_digest=body.manifest,
        allow_removals=body.allow_removals,
    )
    if not got.committed:
        return PartOut(state="pending", world=got.world, ranks=got.ranks)
    v = got.version
    if v.committed_at is not None and v.committed_at >= started:
        metrics.versions_committed.inc()
    return PartOut(state="committed", world=got.world, ranks=got.ranks, version=version_out(v))


@router.delete(
    "/publishes/{publish_id}",
    operation_id="abortPublish",
    status_code=status.HTTP_204_NO_CONTENT,
    response_class=Response,
)
async def abort_publish(model: str, publish_id: str, ops: OpsDep, who: Publisher) -> Response:
    """Abandon a pending publish; the objects only it held become garbage after the grace period."""
    await ops.abort_publish(model, publish_id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


# --- watching -------------------------------------------------------------------------------


@router.get(
    "/watch",
    operation_id="watchModel",
    response_model=VersionOut,
    responses={204: {"description": "no newer version before the timeout"}},
)
async def watch_model(
    model: str,
    ops: OpsDep,
    who: Reader,
    settings: SettingsDep,
    metrics: MetricsDep,
    after: Annotated[int | None, Query(ge=-INT64, le=INT64)] = None,
    timeout: Annotated[float, Query(ge=0, le=MAX_WATCH_S)] = 30.0,
) -> VersionOut | Response:
    """Long poll: the version to hold as soon as it is not ``after`` (200), or 204 after ``timeout`` seconds.

    That is the pinned version while the model is pinned (a rollback below ``after`` too), else
    the head once it is newer than ``after``. A model that does not exist yet is waited for: its
    first version answers as soon as it commits.
    """
    metrics.watchers.inc()
    try:
        target = await ops.wait_for_version(model, after=after, timeout=timeout, poll=settings.watch_poll_s)
    finally:
        metrics.watchers.dec()
    if target is None or target.version is None:
        return Response(status_code=status.HTTP_204_NO_CONTENT)
    return version_out(target.version)


@router.get(
    "/events",
    operation_id="streamEvents",
    response_class=StreamingResponse,
    responses={
        200: {
            "content": {"text/event-stream": {}},
            "description": "`event: version` with a Version as `data` for every new version",
        }
    },
)
async def stream_events(
    model: str,
    ops: OpsDep,
    who: Reader,
    settings: SettingsDep,
    metrics: MetricsDep,
    after: Annotated[int | None, Query(ge=-INT64, le=INT64)] = None,
    last_event_id: Annotated[str | None, Header()] = None,
) -> StreamingResponse:
    """Server-Sent Events: every version committed after ``after`` (or ``Last-Event-ID``), with keep-alives.

    Without either, the first event is the current head (if any). While the model is pinned, the
    pinned version alone (unless it is the last one sent) and then nothing; after an unpin, the head
    alone. A model that does not exist yet is waited for (a replica may start before the trainer's
    first push); the stream ends when the model it has seen is deleted.
    """
    check_model_name(model)  # 422 now, not inside the stream
    if (
        last_event_id is not None
        and last_event_id.isascii()
        and last_event_id.isdigit()
        and int(last_event_id) <= INT64
    ):
        after = max(after or 0, int(last_event_id))
    return StreamingResponse(
        _events(ops, model, after, settings.sse_keepalive_s, settings.watch_poll_s, metrics),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _events(
    ops: Ops, model: str, after: int | None, keepalive: float, poll: float, metrics: Metrics
) -> AsyncIterator[str]:
    """The event stream; runs until the client disconnects (the server then cancels it)."""
    metrics.sse_streams.inc()
    try:
        yield f"retry: {int(poll * 4000)}\n: watching {model}\n\n"
        last = after
        held = False  # the last event sent was a pinned version
        seen: bool | None = None  # whether the model existed since the stream began (None: not asked yet)
        while True:
            try:
                if not seen:
                    seen = await _exists(ops, model)
                # Until the model exists it is waited for; once seen, its deletion ends the stream.
                target = await ops.wait_for_version(model, after=last, timeout=keepalive, poll=poll, absent_ok=not seen)
                if target is None or target.version is None:
                    yield ": keep-alive\n\n"
                    continue
                seen = True
                number = committed(target.version)[0]
                if last is None or target.pinned or held or number < last:
                    new = [target.version]  # a pin, the head after an unpin, or the first event
                else:
                    new = await ops.list_versions(model, after=last, before=number + 1, limit=None)
            except errors.CatalogUnavailable as exc:
                log.warning("event stream of %s: %s", model, exc)
                yield ": catalog unavailable, retrying\n\n"
                await asyncio.sleep(keepalive)
                continue
            except errors.ModelNotFound:
                yield f": {model} was deleted\n\n"
                return
            for v in new:
                data = version_out(v).model_dump_json()
                yield f"id: {v.number}\nevent: version\ndata: {data}\n\n"
            last, held = number, target.pinned
    finally:
        metrics.sse_streams.dec()


async def _exists(ops: Ops, model: str) -> bool:
    """Whether model `model` exists now."""
    try:
        await ops.get_model(model)
    except errors.ModelNotFound:
        return False
    return True
