"""S3 object store through aioboto3 (docs/STORE.md, "S3 layout").

Key of an object: ``<prefix>objects/<first two hex>/<digest>``. Writes are
create-once with ``If-None-Match: *`` on PutObject and on
CompleteMultipartUpload: a 412 means another writer got there first, which
for content-addressed bytes is success with ``created=False``. Every upload
carries ``x-amz-checksum-sha256`` (whole object, or per part) so the server
rejects bytes damaged in transit.

Retries are deliberately off in botocore (one attempt per call): retrying is
the job of :class:`weightsync.store.retry.RetryingStore`, so behaviour under
faults is the same for every backend and can be tested with FaultyStore.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import hashlib
import logging
import os
import secrets
import tempfile
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterator
from contextlib import AsyncExitStack
from datetime import UTC, datetime, timedelta
from typing import IO, Any

import aioboto3
import aiohttp
import botocore.exceptions as bex
from botocore.config import Config

from weightsync import errors
from weightsync.common import pread_exact
from weightsync.store.base import (
    DEFAULT_CHUNK_SIZE,
    HASH_OFF_LOOP,
    Capabilities,
    ObjectInfo,
    ObjectStore,
    PresignedRequest,
    PutResult,
    check_expected,
    check_max_size,
    check_range,
    hash_stream,
    sha256_hex_async,
    validate_digest,
    validate_prefix,
)

__all__ = ["S3Store", "MIN_PART_SIZE"]

log = logging.getLogger(__name__)

#: S3 refuses parts smaller than this (except the last); SeaweedFS enforces it too.
MIN_PART_SIZE = 5 * 1024 * 1024
_MAX_PARTS = 10_000
_MAX_OBJECT = 5 * 1024**4  # 5 TiB, the S3 object size limit
_MAX_PRESIGN_S = 7 * 24 * 3600  # SigV4 presigned URLs cannot live longer

# Codes that mean "try again later". ConditionalRequestConflict is AWS's answer
# when two conditional writes race; the retry then sees 412 (already exists).
# BadDigest is transient here because we computed the checksum from the bytes
# we hold: a mismatch means they were damaged on the way.
_TRANSIENT_CODES = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "RequestTimeout",
    "RequestTimeoutException",
    "ServiceUnavailable",
    "InternalError",
    "ConditionalRequestConflict",
    "BadDigest",
    "XAmzContentSHA256Mismatch",
    "OperationAborted",
}
_NOT_FOUND_CODES = {"NoSuchKey", "NotFound", "404"}
_TRANSIENT_BOTO = (
    bex.HTTPClientError,  # includes read/connect timeouts, connection closed
    bex.ConnectionError,
    bex.IncompleteReadError,
    bex.ResponseStreamingError,
    bex.EndpointConnectionError,
)


def _status(e: bex.ClientError) -> int:
    return int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)


def _code(e: bex.ClientError) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))


def _translate(e: BaseException, what: str) -> BaseException:
    """Map an SDK/transport exception to the weightsync error a caller can act on."""
    if isinstance(e, bex.ClientError):
        code, status = _code(e), _status(e)
        if code == "NoSuchBucket":
            return errors.StoreError(f"S3 {what}: bucket does not exist")
        if code in _NOT_FOUND_CODES or status == 404:
            return errors.ObjectNotFound(f"S3 {what}: not found")
        if code in _TRANSIENT_CODES or status >= 500 or status == 429:
            return errors.StoreUnavailable(f"S3 {what}: {code or status}")
        return errors.StoreError(f"S3 {what}: {code or status}")
    if isinstance(e, _TRANSIENT_BOTO + (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError)):
        return errors.StoreUnavailable(f"S3 {what}: {type(e).__name__}")
    if isinstance(e, bex.BotoCoreError):
        # Missing credentials, invalid parameters: configuration, not weather.
        return errors.StoreError(f"S3 {what}: {type(e).__name__}: {e}")
    return e


@contextlib.contextmanager
def _s3_errors(what: str) -> Iterator[None]:
    try:
        yield
    except (TimeoutError, bex.BotoCoreError, bex.ClientError, aiohttp.ClientError, ConnectionError) as e:
        raise _translate(e, what) from e


def _is_precondition_failed(e: BaseException) -> bool:
    return isinstance(e, bex.ClientError) and (_status(e) == 412 or _code(e) == "PreconditionFailed")


def _b64_sha256(data: bytes | bytearray | memoryview) -> str:
    return base64.b64encode(hashlib.sha256(data).digest()).decode("ascii")


def _b64_of_hex(digest: str) -> str:
    return base64.b64encode(bytes.fromhex(digest)).decode("ascii")


def _utc(dt: datetime) -> datetime:
    return dt.astimezone(UTC) if dt.tzinfo else dt.replace(tzinfo=UTC)


class _MultipartUpload:
    """One multipart upload to a final key: parts in parallel, create-once completion, abort on failure.

    ``add_part`` waits for a free slot before accepting a part, so at most
    ``concurrency`` parts are buffered or in flight: memory stays bounded
    however fast the producer is.
    """

    def __init__(self, client: Any, bucket: str, key: str, concurrency: int) -> None:
        self._client = client
        self._bucket = bucket
        self._key = key
        self._slots = asyncio.Semaphore(concurrency)
        self._tasks: list[asyncio.Task[None]] = []
        self._parts: dict[int, dict[str, Any]] = {}
        self.upload_id: str | None = None

    async def start(self) -> None:
        with _s3_errors("CreateMultipartUpload"):
            resp = await self._client.create_multipart_upload(
                Bucket=self._bucket, Key=self._key, ChecksumAlgorithm="SHA256"
            )
        self.upload_id = resp["UploadId"]

    async def add_part(self, load: bytes | Callable[[], bytes]) -> None:
        """Queue the next part: its bytes, or a function producing them in a worker thread once a slot is free."""
        await self._slots.acquire()
        for t in self._tasks:
            if t.done() and t.exception() is not None:
                self._slots.release()
                raise t.exception()  # type: ignore[misc]
        number = len(self._tasks) + 1
        self._tasks.append(asyncio.ensure_future(self._upload(number, load)))

    async def _upload(self, number: int, load: bytes | Callable[[], bytes]) -> None:
        try:
            data = load if isinstance(load, bytes) else await asyncio.to_thread(load)
            checksum = await asyncio.to_thread(_b64_sha256, data)
            with _s3_errors("UploadPart"):
                resp = await self._client.upload_part(
                    Bucket=self._bucket,
                    Key=self._key,
                    UploadId=self.upload_id,
                    PartNumber=number,
                    Body=data,
                    ChecksumSHA256=checksum,
                )
            self._parts[number] = {
                "PartNumber": number,
                "ETag": resp["ETag"],
                "ChecksumSHA256": checksum,
            }
        finally:
            self._slots.release()

    async def wait_parts(self) -> None:
        """Wait for every queued part; raise the first failure."""
        await asyncio.gather(*self._tasks)

    async def complete(self) -> bool:
        """Make the object visible unless it exists; return whether this upload created it."""
        await self.wait_parts()
        parts = [self._parts[n] for n in sorted(self._parts)]
        try:
            await self._client.complete_multipart_upload(
                Bucket=self._bucket,
                Key=self._key,
                UploadId=self.upload_id,
                MultipartUpload={"Parts": parts},
                IfNoneMatch="*",
            )
        except Exception as e:
            if _is_precondition_failed(e):
                # The object exists; our upload stays pending until aborted.
                await self.abort()
                return False
            raise _translate(e, "CompleteMultipartUpload") from e
        return True

    async def abort(self) -> None:
        """Cancel queued parts and abort the upload so no parts are left billed or visible."""
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.upload_id is None:
            return
        try:
            await self._client.abort_multipart_upload(Bucket=self._bucket, Key=self._key, UploadId=self.upload_id)
        except Exception as e:  # noqa: BLE001 - best effort; the original error matters more
            # A bucket lifecycle rule (AbortIncompleteMultipartUpload) is the
            # backstop for this case; see docs/STORE.md.
            log.warning("could not abort multipart upload of %s: %s", self._key, _translate(e, "Abort"))


class S3Store(ObjectStore):
    """Objects in an S3 bucket under ``prefix``; any S3 API (AWS, MinIO, Ceph RGW, SeaweedFS).

    Credentials come from the arguments or botocore's usual chain
    (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``,
    profiles, instance roles); ``AWS_ENDPOINT_URL`` works too. The client is
    opened on first use (or by ``async with``); it then checks that the
    server honours ``If-None-Match`` unless ``verify_conditional_writes`` is
    False. One instance belongs to one event loop.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        session_token: str | None = None,
        create_bucket: bool = False,
        part_size: int = 16 * 1024 * 1024,
        max_concurrency: int = 8,
        verify_conditional_writes: bool = True,
        spool_dir: str | None = None,
        connect_timeout_s: float = 10.0,
        read_timeout_s: float = 60.0,
    ) -> None:
        if not bucket or "/" in bucket:
            raise errors.StoreError(f"invalid bucket name {bucket!r}")
        if part_size < MIN_PART_SIZE:
            raise ValueError(f"part_size must be at least {MIN_PART_SIZE} (the S3 minimum)")
        if max_concurrency < 1:
            raise ValueError("max_concurrency must be at least 1")
        prefix = prefix.strip("/")
        # Resolved here rather than left to botocore so that addressing style
        # below knows a custom endpoint is in use.
        endpoint_url = (
            endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None
        )
        self.bucket = bucket
        self.prefix = f"{prefix}/" if prefix else ""
        self._endpoint_url = endpoint_url
        self._region = region
        self._session = aioboto3.Session(
            aws_access_key_id=access_key_id,
            aws_secret_access_key=secret_access_key,
            aws_session_token=session_token,
            region_name=region,
        )
        self._create_bucket = create_bucket
        self._part_size = part_size
        self._concurrency = max_concurrency
        self._verify_conditional = verify_conditional_writes
        self._spool_dir = spool_dir
        self._config = Config(
            signature_version="s3v4",
            # Custom endpoints (MinIO, SeaweedFS) rarely have wildcard DNS.
            s3={"addressing_style": "path" if endpoint_url else "auto"},
            retries={"total_max_attempts": 1, "mode": "standard"},
            connect_timeout=connect_timeout_s,
            read_timeout=read_timeout_s,
            max_pool_connections=max(10, 2 * max_concurrency),
            # botocore >= 1.36 would otherwise add CRC32 trailers in
            # aws-chunked encoding, which several S3-compatible servers
            # mishandle; we send our own SHA-256 checksums instead.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        self._stack: AsyncExitStack | None = None
        self._client: Any = None
        self._open_lock = asyncio.Lock()
        self._atomic_create: bool | None = None
        self._probe_failure: errors.StoreError | None = None

    def __repr__(self) -> str:
        return f"S3Store(bucket={self.bucket!r}, prefix={self.prefix!r}, endpoint_url={self._endpoint_url!r})"

    @property
    def capabilities(self) -> Capabilities:
        """Presigned URLs; multipart parts of ``part_size``; atomic_create from the If-None-Match probe."""
        return Capabilities(
            presigned_urls=True,
            max_object_size=min(_MAX_OBJECT, self._part_size * _MAX_PARTS),
            multipart_part_size=self._part_size,
            atomic_create=self._atomic_create,
        )

    def key_of(self, digest: str) -> str:
        """Return the S3 key of ``digest``; derived only from a validated digest."""
        d = validate_digest(digest)
        return f"{self.prefix}objects/{d[:2]}/{d}"

    # --- connection -----------------------------------------------------------------

    async def open(self) -> None:
        """Connect, create the bucket if allowed and missing, and probe If-None-Match; idempotent.

        A transient failure of any step (the probe included) raises StoreUnavailable, so a
        retrying wrapper can open again; the lazy open of other calls only logs a failed probe.
        """
        await self._s3()
        if self._verify_conditional and isinstance(self._probe_failure, errors.StoreUnavailable):
            self._probe_failure = None
            try:
                await self.check_conditional_writes()
            except errors.StoreUnavailable as e:
                self._probe_failure = e
                raise
            except errors.StoreError as e:
                self._probe_failure = e
                log.warning("could not probe If-None-Match support: %s", e)

    async def __aenter__(self) -> S3Store:
        await self.open()
        return self

    async def _s3(self) -> Any:
        if self._client is not None:
            return self._client
        async with self._open_lock:
            if self._client is None:
                stack = AsyncExitStack()
                try:
                    client = await stack.enter_async_context(
                        self._session.client("s3", endpoint_url=self._endpoint_url, config=self._config)
                    )
                    if self._create_bucket:
                        await self._ensure_bucket(client)
                    self._client, self._stack = client, stack
                except BaseException:
                    await stack.aclose()
                    raise
                if self._verify_conditional:
                    try:
                        await self.check_conditional_writes()
                    except errors.StoreError as e:
                        # Not fatal: a read-only identity cannot write the
                        # probe. atomic_create then stays None (unknown).
                        # A transient failure is probed again by open().
                        self._probe_failure = e
                        log.warning("could not probe If-None-Match support: %s", e)
        return self._client

    async def _ensure_bucket(self, client: Any) -> None:
        try:
            await client.head_bucket(Bucket=self.bucket)
            return
        except bex.ClientError as e:
            if _status(e) != 404 and _code(e) not in ("NoSuchBucket", "404", "NotFound"):
                raise _translate(e, "HeadBucket") from e
        except Exception as e:
            raise _translate(e, "HeadBucket") from e
        kwargs: dict[str, Any] = {"Bucket": self.bucket}
        region = client.meta.region_name
        if region and region != "us-east-1":
            kwargs["CreateBucketConfiguration"] = {"LocationConstraint": region}
        try:
            await client.create_bucket(**kwargs)
            log.info("created bucket %s", self.bucket)
        except bex.ClientError as e:
            # Lost a race with another process creating it: fine.
            if _code(e) not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise _translate(e, "CreateBucket") from e

    async def close(self) -> None:
        """Close the HTTP client; calls after this reopen a fresh one."""
        stack, self._stack, self._client = self._stack, None, None
        if stack is not None:
            await stack.aclose()

    async def check_conditional_writes(self) -> bool:
        """Return whether the server refuses a second ``If-None-Match: *`` PUT of a key; records it in capabilities.

        Writes a probe object twice under ``<prefix>probe/`` (outside the
        object namespace) and deletes it. A server that ignores the header
        still stores correct bytes (names are content hashes) but reports
        ``created=True`` to racing writers and overwrites instead of refusing.
        """
        client = await self._s3()
        key = f"{self.prefix}probe/if-none-match-{secrets.token_hex(8)}"
        try:
            with _s3_errors("PutObject(probe)"):
                await client.put_object(Bucket=self.bucket, Key=key, Body=b"1", IfNoneMatch="*")
            try:
                await client.put_object(Bucket=self.bucket, Key=key, Body=b"2", IfNoneMatch="*")
                honoured = False
            except Exception as e:
                if not _is_precondition_failed(e):
                    if isinstance(e, bex.ClientError) and _status(e) in (400, 501):
                        honoured = False  # "NotImplemented" and friends
                    else:
                        raise _translate(e, "PutObject(probe)") from e
                else:
                    honoured = True
        finally:
            with contextlib.suppress(Exception):
                await client.delete_object(Bucket=self.bucket, Key=key)
        self._atomic_create = honoured
        if not honoured:
            log.warning(
                "S3 endpoint %s ignores If-None-Match: writes stay correct (content-addressed) but are not create-once",
                self._endpoint_url or "(AWS)",
            )
        return honoured

    # --- writes ---------------------------------------------------------------------

    async def _put_single(self, key: str, body: bytes, digest: str) -> bool:
        client = await self._s3()
        try:
            await client.put_object(
                Bucket=self.bucket,
                Key=key,
                Body=body,
                IfNoneMatch="*",
                ChecksumSHA256=_b64_of_hex(digest),
            )
        except Exception as e:
            if _is_precondition_failed(e):
                return False
            raise _translate(e, "PutObject") from e
        return True

    async def _put_parts(self, key: str, size: int, read: Callable[[int, int], bytes]) -> bool:
        """Upload ``size`` bytes as a multipart upload; ``read(offset, n)`` yields each part's bytes."""
        upload = _MultipartUpload(await self._s3(), self.bucket, key, self._concurrency)
        try:
            await upload.start()
            for off in range(0, size, self._part_size):
                n = min(self._part_size, size - off)
                await upload.add_part(functools.partial(read, off, n))
            return await upload.complete()
        except BaseException:
            await upload.abort()
            raise

    async def put(self, data: bytes, *, expected_digest: str | None = None) -> PutResult:
        """See :meth:`ObjectStore.put`. Single PUT up to ``part_size``, parallel multipart above."""
        if expected_digest is not None:
            validate_digest(expected_digest)
        digest = await sha256_hex_async(data)
        check_expected(digest, expected_digest)
        size = len(data)
        check_max_size(size, self.capabilities.max_object_size)
        key = self.key_of(digest)
        if size <= self._part_size:
            created = await self._put_single(key, bytes(data), digest)
        elif await self.exists(digest):
            created = False  # skip re-uploading a large object we already hold
        else:
            view = memoryview(data)
            created = await self._put_parts(key, size, lambda off, n: bytes(view[off : off + n]))
        return PutResult(digest=digest, size=size, created=created)

    async def put_stream(
        self,
        chunks: AsyncIterable[bytes],
        *,
        expected_digest: str | None = None,
        max_size: int | None = None,
    ) -> PutResult:
        """See :meth:`ObjectStore.put_stream`.

        With ``expected_digest`` the bytes go straight to their final key as a
        multipart upload, hashed on the way, and the hash is checked before
        CompleteMultipartUpload (a mismatch aborts the upload). Without it the
        key is unknown until the end, so the stream is spooled (memory up to
        ``part_size``, then an unnamed temp file) and uploaded afterwards.
        """
        limit = self.capabilities.max_object_size
        if max_size is not None:
            limit = min(limit, max_size) if limit is not None else max_size
        if expected_digest is None:
            return await self._put_spooled(chunks, limit)
        validate_digest(expected_digest)
        if await self.exists(expected_digest):
            digest, size = await hash_stream(chunks, limit)
            check_expected(digest, expected_digest)
            return PutResult(digest=digest, size=size, created=False)
        return await self._put_direct(chunks, expected_digest, limit)

    async def _put_direct(self, chunks: AsyncIterable[bytes], expected: str, limit: int | None) -> PutResult:
        key = self.key_of(expected)
        hasher = hashlib.sha256()
        size = 0
        pending: list[bytes] = []
        pending_len = 0
        upload: _MultipartUpload | None = None
        try:
            async for chunk in chunks:
                if not chunk:
                    continue
                size += len(chunk)
                check_max_size(size, limit)
                if len(chunk) > HASH_OFF_LOOP:
                    await asyncio.to_thread(hasher.update, chunk)
                else:
                    hasher.update(chunk)
                pending.append(bytes(chunk))
                pending_len += len(chunk)
                while pending_len >= self._part_size:
                    # The upload is only created once a full part exists, so
                    # small objects cost one PutObject and nothing to abort.
                    if upload is None:
                        upload = _MultipartUpload(await self._s3(), self.bucket, key, self._concurrency)
                        await upload.start()
                    joined = b"".join(pending)
                    part, rest = joined[: self._part_size], joined[self._part_size :]
                    pending, pending_len = ([rest] if rest else []), len(rest)
                    await upload.add_part(part)
            digest = hasher.hexdigest()
            check_expected(digest, expected)
            tail = b"".join(pending)
            if upload is None:
                created = await self._put_single(key, tail, digest)
            else:
                if tail:
                    await upload.add_part(tail)
                created = await upload.complete()
        except BaseException:
            if upload is not None:
                await upload.abort()
            raise
        return PutResult(digest=digest, size=size, created=created)

    async def _put_spooled(self, chunks: AsyncIterable[bytes], limit: int | None) -> PutResult:
        hasher = hashlib.sha256()
        size = 0
        # Spills to an already-unlinked temp file past part_size: nothing can
        # be left behind on disk even if the process dies.
        spool: IO[bytes] = tempfile.SpooledTemporaryFile(  # noqa: SIM115 - closed in the finally below
            max_size=self._part_size, dir=self._spool_dir
        )
        try:
            async for chunk in chunks:
                if not chunk:
                    continue
                size += len(chunk)
                check_max_size(size, limit)
                await asyncio.to_thread(_hash_and_write, spool, hasher, chunk)
            digest = hasher.hexdigest()
            key = self.key_of(digest)
            if size <= self._part_size:
                spool.seek(0)
                created = await self._put_single(key, spool.read(), digest)
            elif await self.exists(digest):
                created = False
            else:
                spool.flush()  # pread below bypasses the file object's buffer
                fd = spool.fileno()
                created = await self._put_parts(key, size, lambda off, n: pread_exact(fd, n, off))
        finally:
            spool.close()
        return PutResult(digest=digest, size=size, created=created)

    # --- reads ----------------------------------------------------------------------

    async def _open_range(self, digest: str, offset: int, length: int | None) -> tuple[Any | None, int]:
        """Start a GET of the range; return (body or None for an empty range, byte count)."""
        key = self.key_of(digest)
        if offset < 0 or (length is not None and length < 0):
            check_range(0, offset, length)  # raises InvalidRange
        if length == 0:
            # A zero-length Range cannot be expressed in HTTP; check bounds by HEAD.
            check_range((await self.stat(digest)).size, offset, 0)
            return None, 0
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": key}
        ranged = offset != 0 or length is not None
        if ranged:
            end = "" if length is None else str(offset + length - 1)
            kwargs["Range"] = f"bytes={offset}-{end}"
        client = await self._s3()
        try:
            resp = await client.get_object(**kwargs)
        except Exception as e:
            if isinstance(e, bex.ClientError) and (_status(e) == 416 or _code(e) == "InvalidRange"):
                # Either offset == size (a valid empty range) or out of bounds.
                check_range((await self.stat(digest)).size, offset, length)
                return None, 0
            raise _translate(e, f"GetObject {digest}") from e
        body = resp["Body"]
        try:
            got = int(resp["ContentLength"])
            content_range = resp.get("ContentRange")
            if content_range:
                total = int(content_range.rsplit("/", 1)[1])
            elif ranged:
                raise errors.StoreError("S3 server ignored the Range header")
            else:
                total = got
            # S3 clips a range that runs past the end; our contract refuses it.
            want = check_range(total, offset, length)
            if got != want:
                raise errors.StoreUnavailable(f"S3 sent {got} bytes for a {want}-byte range")
        except BaseException:
            body.close()
            raise
        return body, want

    async def get(self, digest: str, *, offset: int = 0, length: int | None = None) -> bytes:
        """See :meth:`ObjectStore.get`."""
        body, n = await self._open_range(digest, offset, length)
        if body is None:
            return b""
        try:
            with _s3_errors(f"GetObject {digest}"):
                data: bytes = await body.read()
        finally:
            body.close()
        if len(data) != n:
            raise errors.StoreUnavailable(f"S3 GET of {digest} ended after {len(data)} of {n} bytes")
        return data

    async def iter_range(
        self,
        digest: str,
        *,
        offset: int = 0,
        length: int | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
    ) -> AsyncIterator[bytes]:
        """See :meth:`ObjectStore.iter_range`."""
        if chunk_size <= 0:
            raise ValueError("chunk_size must be positive")
        body, remaining = await self._open_range(digest, offset, length)
        if body is None:
            return
        try:
            while remaining:
                want = min(chunk_size, remaining)
                pieces: list[bytes] = []
                got = 0
                # aiohttp hands out whatever is buffered; gather full chunks
                # so callers see predictable sizes.
                while got < want:
                    with _s3_errors(f"GetObject {digest}"):
                        piece = await body.read(want - got)
                    if not piece:
                        raise errors.StoreUnavailable(f"S3 GET of {digest} ended {remaining - got} bytes early")
                    pieces.append(piece)
                    got += len(piece)
                remaining -= got
                yield b"".join(pieces)
        finally:
            # Closes the connection if unread bytes remain, so an abandoned
            # stream never hands a half-read socket back to the pool.
            body.close()

    async def stat(self, digest: str) -> ObjectInfo:
        """See :meth:`ObjectStore.stat`."""
        key = self.key_of(digest)
        client = await self._s3()
        with _s3_errors(f"HeadObject {digest}"):
            resp = await client.head_object(Bucket=self.bucket, Key=key)
        return ObjectInfo(digest=digest, size=int(resp["ContentLength"]), mtime=_utc(resp["LastModified"]))

    async def list(self, prefix: str = "") -> AsyncIterator[ObjectInfo]:
        """See :meth:`ObjectStore.list`. One ListObjectsV2 page (1000 keys) at a time."""
        validate_prefix(prefix)
        base = f"{self.prefix}objects/"
        key_prefix = base + (f"{prefix[:2]}/{prefix}" if len(prefix) >= 2 else prefix)
        client = await self._s3()
        paginator = client.get_paginator("list_objects_v2")
        pages = paginator.paginate(Bucket=self.bucket, Prefix=key_prefix)
        it = pages.__aiter__()
        while True:
            with _s3_errors("ListObjectsV2"):
                try:
                    page = await it.__anext__()
                except StopAsyncIteration:
                    return
            for obj in page.get("Contents", ()):
                rel = obj["Key"][len(base) :]
                fan, _, digest = rel.partition("/")
                # Skip anything that is not exactly objects/<ab>/<digest>.
                if len(digest) != 64 or fan != digest[:2] or not digest.startswith(prefix):
                    continue
                try:
                    validate_digest(digest)
                except errors.InvalidDigest:
                    continue
                yield ObjectInfo(digest=digest, size=int(obj["Size"]), mtime=_utc(obj["LastModified"]))

    async def delete(self, digest: str) -> None:
        """See :meth:`ObjectStore.delete`. S3 answers 204 for absent keys, which is the idempotence we want."""
        key = self.key_of(digest)
        client = await self._s3()
        with _s3_errors(f"DeleteObject {digest}"):
            await client.delete_object(Bucket=self.bucket, Key=key)

    # --- presigned requests ---------------------------------------------------------

    @staticmethod
    def _check_expiry(expires_s: int) -> None:
        if not 1 <= expires_s <= _MAX_PRESIGN_S:
            raise ValueError(f"expires_s must be within 1..{_MAX_PRESIGN_S}")

    async def presign_get(self, digest: str, expires_s: int) -> str:
        """See :meth:`ObjectStore.presign_get`. The URL answers 404 if the object is absent."""
        key = self.key_of(digest)
        self._check_expiry(expires_s)
        client = await self._s3()
        with _s3_errors("presign GetObject"):
            return str(
                await client.generate_presigned_url(
                    "get_object", Params={"Bucket": self.bucket, "Key": key}, ExpiresIn=expires_s
                )
            )

    async def presign_put(self, digest: str, size: int, expires_s: int) -> PresignedRequest:
        """See :meth:`ObjectStore.presign_put`.

        Signs ``x-amz-checksum-sha256`` (the digest itself, base64), the
        Content-Length and ``If-None-Match: *`` into the URL: the server
        recomputes SHA-256 over the body and refuses a mismatch (400
        BadDigest); dropping or changing a signed header breaks the signature
        (403); a second upload of an existing object gets 412. The signature
        is only checked by servers that verify SigV4 (SeaweedFS only with an
        S3 identity configured).
        """
        key = self.key_of(digest)
        self._check_expiry(expires_s)
        if size < 0:
            raise errors.InvalidRange("size must not be negative")
        checksum = _b64_of_hex(digest)
        client = await self._s3()
        with _s3_errors("presign PutObject"):
            url = await client.generate_presigned_url(
                "put_object",
                Params={
                    "Bucket": self.bucket,
                    "Key": key,
                    "ChecksumSHA256": checksum,
                    "ContentLength": size,
                    "IfNoneMatch": "*",
                },
                ExpiresIn=expires_s,
            )
        return PresignedRequest(
            method="PUT",
            url=str(url),
            headers={
                "x-amz-checksum-sha256": checksum,
                "content-length": str(size),
                "if-none-match": "*",
            },
            expires_at=datetime.now(UTC) + timedelta(seconds=expires_s),
        )


def _hash_and_write(f: IO[bytes], hasher: Any, chunk: bytes) -> None:
    hasher.update(chunk)
    f.write(chunk)
