"""Objects over HTTP: streamed PUT checked against its digest, GET with Range, HEAD, presigned GET."""

from __future__ import annotations

import hashlib
import os
import socket
from urllib.parse import urlsplit

import httpx
import pytest
from _service_http import ok, problem
from _service_util import TOKENS, UPLOAD_CAP

from weightsync.service.ranges import RangeNotSatisfiable, parse_range


def raw_request(url: str, head: str, body: bytes = b"") -> tuple[int, bytes]:
    """Send a hand-written HTTP/1.1 request (for headers httpx will not send) and return (status, response)."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=30) as s:
        s.sendall(head.encode() + b"\r\n" + body)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        head_, _, body_ = data.partition(b"\r\n\r\n")
        length = next(
            (
                int(line.split(b":", 1)[1])
                for line in head_.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            ),
            0,
        )
        while len(body_) < length:
            chunk = s.recv(65536)
            if not chunk:
                break
            body_ += chunk
    return int(data.split(b" ", 2)[1]), head_ + b"\r\n\r\n" + body_


def auth(who: str = "admin") -> str:
    return f"Authorization: Bearer {TOKENS[who][0]}\r\n"


@pytest.fixture
def stored(service):
    data = os.urandom(100_000)
    digest = hashlib.sha256(data).hexdigest()
    put = ok(service.client("publisher").put(f"/v1/objects/{digest}", content=data), 201)
    assert put == {"digest": digest, "size": len(data), "created": True}
    return digest, data


def test_put_is_idempotent_and_head_gives_the_size(service, stored):
    digest, data = stored
    c = service.client("publisher")
    again = ok(c.put(f"/v1/objects/{digest}", content=data), 201)
    assert again["created"] is False and again["size"] == len(data)
    h = service.client("reader").head(f"/v1/objects/{digest}")
    assert h.status_code == 200 and int(h.headers["content-length"]) == len(data)
    assert h.headers["etag"] == f'"{digest}"' and h.content == b""
    assert service.client("reader").head(f"/v1/objects/{'0' * 64}").status_code == 404
    empty = hashlib.sha256(b"").hexdigest()
    ok(c.put(f"/v1/objects/{empty}", content=b""), 201)
    assert c.get(f"/v1/objects/{empty}").content == b""


def test_digest_mismatch_is_422_and_leaves_nothing(service):
    c = service.client("publisher")
    data = os.urandom(50_000)
    actual = hashlib.sha256(data).hexdigest()
    claimed = hashlib.sha256(b"something else").hexdigest()
    problem(c.put(f"/v1/objects/{claimed}", content=data), 422, "digest-mismatch")
    assert c.head(f"/v1/objects/{claimed}").status_code == 404
    assert c.head(f"/v1/objects/{actual}").status_code == 404
    if not service.s3:  # no temporary file left behind either
        leftovers = [p for p in (service.settings.data_dir() / "store").rglob("*") if p.is_file() and actual in p.name]
        assert leftovers == []


def test_invalid_digests_are_422(service):
    c = service.client("publisher")
    for bad in ("abc", "A" * 64, "g" * 64, "0" * 63):
        problem(c.put(f"/v1/objects/{bad}", content=b"x"), 422, "invalid-digest")
        problem(c.get(f"/v1/objects/{bad}"), 422, "invalid-digest")
        assert c.head(f"/v1/objects/{bad}").status_code == 422


def test_oversized_upload_is_413_before_reading(service):
    digest = "1" * 64
    # A Content-Length over the cap is refused from the headers alone: no body is sent at all.
    status, resp = raw_request(
        service.url, f"PUT /v1/objects/{digest} HTTP/1.1\r\nHost: x\r\n{auth('publisher')}Content-Length: {10**12}\r\n"
    )
    assert status == 413 and b"too-large" in resp
    # An actual body one byte over the cap.
    data = os.urandom(UPLOAD_CAP + 1)
    r = service.client("publisher").put(f"/v1/objects/{hashlib.sha256(data).hexdigest()}", content=data)
    problem(r, 413, "too-large")
    assert service.client("reader").head(f"/v1/objects/{hashlib.sha256(data).hexdigest()}").status_code == 404
    # At the cap it is accepted.
    data = data[:UPLOAD_CAP]
    ok(service.client("publisher").put(f"/v1/objects/{hashlib.sha256(data).hexdigest()}", content=data), 201)


def test_upload_without_content_length_is_411(service):
    def chunks():
        yield b"abc"

    r = service.client("publisher").put(f"/v1/objects/{hashlib.sha256(b'abc').hexdigest()}", content=chunks())
    assert r.request.headers.get("transfer-encoding") == "chunked"
    problem(r, 411, "length-required")


def test_ranges(service, stored):
    digest, data = stored
    c = service.client("reader")
    n = len(data)
    whole = c.get(f"/v1/objects/{digest}")
    assert whole.status_code == 200 and whole.content == data and whole.headers["accept-ranges"] == "bytes"
    assert int(whole.headers["content-length"]) == n
    for rng, start, end in [
        ("bytes=0-0", 0, 0),
        ("bytes=5-9", 5, 9),
        (f"bytes={n - 1}-", n - 1, n - 1),
        ("bytes=-1", n - 1, n - 1),
        (f"bytes=-{n * 2}", 0, n - 1),
        ("bytes=100-", 100, n - 1),
    ]:
        r = c.get(f"/v1/objects/{digest}", headers={"Range": rng})
        assert r.status_code == 206, (rng, r.text)
        assert r.content == data[start : end + 1]
        assert r.headers["content-range"] == f"bytes {start}-{end}/{n}"
        assert int(r.headers["content-length"]) == end - start + 1
    for rng in (
        f"bytes={n}-",
        f"bytes={n + 5}-{n + 9}",
        "bytes=9-5",
        "bytes=-0",
        "bytes=0-1,5-6",
        "items=0-1",
        "bytes=x-y",
        "bytes=5",
    ):
        r = c.get(f"/v1/objects/{digest}", headers={"Range": rng})
        problem(r, 416, "bad-range")
        assert r.headers["content-range"] == f"bytes */{n}"
    assert c.get(f"/v1/objects/{digest}", headers={"If-None-Match": f'"{digest}"'}).status_code == 304
    problem(c.get(f"/v1/objects/{'0' * 64}"), 404, "not-found")
    problem(c.get(f"/v1/objects/{'0' * 64}", headers={"Range": "bytes=0-1"}), 404, "not-found")


def test_large_object_streams_through(service):
    data = os.urandom(UPLOAD_CAP)
    digest = hashlib.sha256(data).hexdigest()
    ok(service.client("publisher").put(f"/v1/objects/{digest}", content=data), 201)
    with service.client("reader").stream("GET", f"/v1/objects/{digest}") as r:
        assert r.status_code == 200
        chunks = list(r.iter_raw())
    assert b"".join(chunks) == data


def test_presigned_get(service, stored):
    digest, data = stored
    c = service.client("reader")
    if not service.s3:
        problem(c.get(f"/v1/objects/{digest}/url"), 404, "not-supported")
        return
    body = ok(c.get(f"/v1/objects/{digest}/url"), 200)
    assert body["expires_at"]
    r = httpx.get(body["url"], timeout=30)  # straight from S3, no bearer token
    assert r.status_code == 200 and r.content == data
    problem(c.get(f"/v1/objects/{'0' * 64}/url"), 404, "not-found")


@pytest.mark.parametrize(
    ("header", "size", "expected"),
    [
        ("bytes=0-9", 10, (0, 10)),
        ("bytes=0-99", 10, (0, 10)),
        ("bytes=3-", 10, (3, 7)),
        ("bytes=-3", 10, (7, 3)),
        ("bytes=-30", 10, (0, 10)),
        ("BYTES = 2-2", 10, (2, 1)),
    ],
)
def test_parse_range(header, size, expected):
    assert parse_range(header, size) == expected


@pytest.mark.parametrize(
    ("header", "size"),
    [
        ("bytes=10-", 10),
        ("bytes=0-", 0),
        ("bytes=-1", 0),
        ("bytes=-0", 10),
        ("bytes=5-4", 10),
        ("bytes=1-2,4-5", 10),
        ("bits=0-1", 10),
        ("bytes=a-", 10),
        ("bytes=-", 10),
        ("bytes=0x1-2", 10),
        ("bytes=+1-2", 10),
        ("bytes=1", 10),
        ("bytes=١-٢", 10),
    ],
)
def test_parse_range_refuses(header, size):
    with pytest.raises(RangeNotSatisfiable):
        parse_range(header, size)
