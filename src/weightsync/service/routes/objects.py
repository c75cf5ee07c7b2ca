"""Objects: streamed upload (hashed by the store, never trusted), ranged download, HEAD, presigned GET."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Header, Request, Response, status
from fastapi.responses import StreamingResponse

from weightsync import errors
from weightsync.service.deps import OpsDep, Publisher, Reader, SettingsDep
from weightsync.service.problems import ApiProblem
from weightsync.service.ranges import RangeNotSatisfiable, parse_range
from weightsync.service.schemas import PresignedGet, PutObjectOut
from weightsync.store import validate_digest

router = APIRouter(prefix="/v1/objects", tags=["objects"])

# Objects never change, so any cache may keep them; "private" because reading needs a token.
IMMUTABLE_CACHE = "private, max-age=31536000, immutable"

_BINARY_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
    }
}


def etag_matches(if_none_match: str | None, etag: str) -> bool:
    if if_none_match is None:
        return False
    tags = {t.strip().removeprefix("W/") for t in if_none_match.split(",")}
    return "*" in tags or etag in tags


async def _prefetched(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Read the first chunk now, so a missing object is a 404 and not a broken 200 stream."""
    it = aiter(chunks)
    try:
        first: bytes | None = await anext(it)
    except StopAsyncIteration:
        first = None

    async def stream() -> AsyncIterator[bytes]:
        try:
            if first:
                yield first
            async for chunk in it:
                yield chunk
        finally:
            close = getattr(it, "aclose", None)
            if close is not None:
                await close()

    return stream()


@router.put(
    "/{digest}",
    operation_id="putObject",
    status_code=status.HTTP_201_CREATED,
    response_model=PutObjectOut,
    openapi_extra=_BINARY_BODY,
    responses={
        411: {"description": "Content-Length missing"},
        413: {"description": "body over the cap"},
        422: {"description": "bytes do not hash to the digest (digest-mismatch)"},
    },
)
async def put_object(
    digest: str,
    request: Request,
    ops: OpsDep,
    who: Publisher,
    settings: SettingsDep,
    content_length: Annotated[str | None, Header()] = None,
) -> PutObjectOut:
    """Store the body under its SHA-256, which must equal ``digest``; a mismatch stores nothing."""
    validate_digest(digest)
    if content_length is None or not content_length.isascii() or not content_length.isdigit():
        raise ApiProblem(
            411,
            "length-required",
            "Length required",
            "send the object with a Content-Length header (no chunked uploads)",
        )
    cap, declared = settings.upload_cap(), int(content_length)
    if declared > cap:
        # Refused before reading a byte of the body.
        raise ApiProblem(
            413,
            "too-large",
            "Object too large",
            f"Content-Length {content_length} exceeds the {cap}-byte upload limit",
            headers={"Connection": "close"},
        )
    try:
        result = await ops.put_object(request.stream(), expected_digest=digest, max_size=cap, size=declared)
    except errors.LimitExceeded as exc:
        raise ApiProblem(413, "too-large", "Object too large", str(exc), headers={"Connection": "close"}) from None
    return PutObjectOut(digest=result.digest, size=result.size, created=result.created)


GET_OBJECT_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"content": {"application/octet-stream": {}}},
    206: {"content": {"application/octet-stream": {}}, "description": "the requested range"},
    304: {"description": "If-None-Match matched"},
    416: {"description": "Range malformed or outside the object"},
}
"""getObject's answers besides problems (the relay's getObject documents the same)."""


@router.get(
    "/{digest}",
    operation_id="getObject",
    response_class=StreamingResponse,
    responses=GET_OBJECT_RESPONSES,
)
async def get_object(
    digest: str,
    ops: OpsDep,
    who: Reader,
    range_: Annotated[str | None, Header(alias="range")] = None,
    if_none_match: Annotated[str | None, Header()] = None,
) -> Response:
    """The object's bytes, streamed; one ``Range: bytes=a-b | a- | -n`` gives 206."""
    validate_digest(digest)
    info = await ops.stat_object(digest)
    etag = f'"{digest}"'
    headers = {"ETag": etag, "Accept-Ranges": "bytes", "Cache-Control": IMMUTABLE_CACHE}
    if etag_matches(if_none_match, etag):
        return Response(status_code=status.HTTP_304_NOT_MODIFIED, headers=headers)
    offset, length, code = 0, info.size, status.HTTP_200_OK
    if range_ is not None:
        try:
            offset, length = parse_range(range_, info.size)
        except RangeNotSatisfiable as exc:
            raise ApiProblem(
                416, "bad-range", "Range not satisfiable", str(exc), headers={"Content-Range": f"bytes */{info.size}"}
            ) from None
        code = status.HTTP_206_PARTIAL_CONTENT
        headers["Content-Range"] = f"bytes {offset}-{offset + length - 1}/{info.size}"
    headers["Content-Length"] = str(length)
    body = await _prefetched(ops.read_object(digest, offset=offset, length=length))
    return StreamingResponse(body, status_code=code, headers=headers, media_type="application/octet-stream")


@router.head(
    "/{digest}",
    operation_id="headObject",
    response_class=Response,
    responses={200: {"description": "the object exists; its size is the Content-Length"}},
)
async def head_object(digest: str, ops: OpsDep, who: Reader) -> Response:
    """Whether the object exists, and its size (``Content-Length``)."""
    validate_digest(digest)
    info = await ops.stat_object(digest)
    return Response(
        status_code=status.HTTP_200_OK,
        media_type="application/octet-stream",
        headers={
            "Content-Length": str(info.size),
            "ETag": f'"{digest}"',
            "Accept-Ranges": "bytes",
            "Cache-Control": IMMUTABLE_CACHE,
        },
    )


@router.get("/{digest}/url", operation_id="presignObject", response_model=PresignedGet)
async def presign_object(digest: str, ops: OpsDep, who: Reader, settings: SettingsDep) -> PresignedGet:
    """A URL that GETs the object straight from the S3 store (404 ``not-supported`` on other stores)."""
    validate_digest(digest)
    if not settings.presign:
        raise errors.Unsupported("this server's store does not hand out presigned URLs")
    url = await ops.presign_get(digest, settings.presign_expires_s)
    expires = datetime.now(UTC) + timedelta(seconds=settings.presign_expires_s)
    return PresignedGet(url=url, expires_at=expires)
