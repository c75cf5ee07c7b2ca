"""S3-only behaviour against a real SeaweedFS: conditional writes, presigned requests, layout, errors."""

from __future__ import annotations

import base64
import hashlib
import socket
import uuid
from collections.abc import AsyncIterator

import httpx
import pytest

from weightsync import errors
from weightsync.store import open_store
from weightsync.store.s3 import MIN_PART_SIZE, S3Store

pytestmark = [pytest.mark.anyio, pytest.mark.s3]


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
async def s3(s3_factory) -> AsyncIterator[S3Store]:
    async with s3_factory() as st:
        assert isinstance(st, S3Store)
        yield st


async def test_seaweedfs_honours_if_none_match(s3: S3Store) -> None:
    # Probed at open (verify_conditional_writes defaults to True) and on demand.
    assert s3.capabilities.atomic_create is True
    assert await s3.check_conditional_writes() is True
    # The probe object is removed and never shows up as an object.
    assert [i async for i in s3.list()] == []


async def test_key_layout(s3: S3Store, seaweed) -> None:
    data = b"where does it go"
    digest = (await s3.put(data)).digest
    key = f"{s3.prefix}objects/{digest[:2]}/{digest}"
    assert s3.key_of(digest) == key
    head = seaweed.boto3_client().head_object(Bucket=s3.bucket, Key=key)
    assert head["ContentLength"] == len(data)


async def test_large_objects_are_multipart_uploads(s3: S3Store, seaweed) -> None:
    data = bytes(range(256)) * (2 * MIN_PART_SIZE // 256) + b"tail"
    digest = (await s3.put(data)).digest
    etag = seaweed.boto3_client().head_object(Bucket=s3.bucket, Key=s3.key_of(digest))["ETag"]
    assert etag.strip('"').endswith("-3")  # two full parts and the tail
    assert await s3.get(digest) == data


async def test_presigned_get(s3: S3Store) -> None:
    data = b"fetch me without credentials"
    digest = (await s3.put(data)).digest
    url = await s3.presign_get(digest, 60)
    async with httpx.AsyncClient() as http:
        r = await http.get(url)
        assert r.status_code == 200 and r.content == data
        r = await http.get(url, headers={"Range": "bytes=6-7"})
        assert r.status_code == 206 and r.content == data[6:8]
        # The signature covers the key: another object is not reachable with it.
        other = (await s3.put(b"other")).digest
        r = await http.get(url.replace(digest, other))
        assert r.status_code == 403


async def test_presigned_put_is_bound_to_the_bytes(s3: S3Store) -> None:
    data = b"exactly these bytes, once"
    digest = sha(data)
    req = await s3.presign_put(digest, len(data), 60)
    assert req.method == "PUT"
    assert req.headers["x-amz-checksum-sha256"] == base64.b64encode(bytes.fromhex(digest)).decode()
    async with httpx.AsyncClient() as http:
        # Same length, different bytes: the server's SHA-256 check refuses it.
        wrong = data[:-1] + b"?"
        r = await http.put(req.url, content=wrong, headers=req.headers)
        assert r.status_code == 400 and "BadDigest" in r.text
        assert not await s3.exists(digest)
        # Dropping the checksum header breaks the signature.
        bare = {k: v for k, v in req.headers.items() if k != "x-amz-checksum-sha256"}
        r = await http.put(req.url, content=wrong, headers=bare)
        assert r.status_code == 403
        # Claiming another checksum (matching the wrong bytes) breaks it too.
        forged = {**req.headers, "x-amz-checksum-sha256": base64.b64encode(hashlib.sha256(wrong).digest()).decode()}
        r = await http.put(req.url, content=wrong, headers=forged)
        assert r.status_code == 403
        # A body of another length does not match the signed Content-Length.
        longer = data + b"!"
        r = await http.put(
            req.url, content=longer, headers={k: v for k, v in req.headers.items() if k != "content-length"}
        )
        assert r.status_code in (400, 403)
        assert not await s3.exists(digest)
        # The right bytes go in, once.
        r = await http.put(req.url, content=data, headers=req.headers)
        assert r.status_code == 200
        assert await s3.get(digest) == data
        r = await http.put(req.url, content=data, headers=req.headers)
        assert r.status_code == 412
    assert [i.digest async for i in s3.list()] == [digest]


async def test_missing_bucket_is_created_only_when_allowed(seaweed) -> None:
    bucket = f"ws-{uuid.uuid4().hex[:12]}"
    st = S3Store(
        bucket,
        endpoint_url=seaweed.endpoint_url,
        access_key_id=seaweed.access_key,
        secret_access_key=seaweed.secret_key,
        region=seaweed.region,
        create_bucket=False,
        verify_conditional_writes=False,
    )
    async with st:
        with pytest.raises(errors.StoreError) as info:
            await st.put(b"x")
        assert not isinstance(info.value, errors.StoreUnavailable)
    created = open_store(
        f"s3://{bucket}/some/prefix/",
        endpoint_url=seaweed.endpoint_url,
        access_key_id=seaweed.access_key,
        secret_access_key=seaweed.secret_key,
        region=seaweed.region,
        create_bucket=True,
    )
    async with created as st2:
        assert isinstance(st2, S3Store) and st2.prefix == "some/prefix/"
        digest = (await st2.put(b"in a new bucket")).digest
        assert st2.key_of(digest).startswith("some/prefix/objects/")
        assert await st2.get(digest) == b"in a new bucket"


async def test_credentials_from_the_environment(seaweed, monkeypatch) -> None:
    for k, v in seaweed.env().items():
        monkeypatch.setenv(k, v)
    # Endpoint, region and keys all come from AWS_* variables.
    async with open_store(f"s3://env-{uuid.uuid4().hex[:12]}/p", create_bucket=True) as st:
        digest = (await st.put(b"env creds")).digest
        assert await st.get(digest) == b"env creds"


async def test_bad_credentials_are_a_permanent_error(s3_factory) -> None:
    st = s3_factory(secret_access_key="wrong-secret", verify_conditional_writes=False, create_bucket=False)
    async with st:
        with pytest.raises(errors.StoreError) as info:
            await st.exists(sha(b"x"))
        assert not isinstance(info.value, errors.StoreUnavailable)


async def test_unreachable_endpoint_is_store_unavailable() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    st = S3Store(
        "bucket",
        endpoint_url=f"http://127.0.0.1:{port}",
        access_key_id="x",
        secret_access_key="y",
        region="us-east-1",
        verify_conditional_writes=False,
        connect_timeout_s=1,
    )
    async with st:
        with pytest.raises(errors.StoreUnavailable):
            await st.exists(sha(b"x"))
        with pytest.raises(errors.StoreUnavailable):
            await st.put(b"x")


async def test_part_size_below_the_s3_minimum_is_refused() -> None:
    with pytest.raises(ValueError):
        S3Store("bucket", part_size=MIN_PART_SIZE - 1)
