"""A fault-injecting HTTP/1.1 proxy for S3, on loopback, for the reliability tests.

It sits between an S3 client (the ``weightsync serve`` process, or a client using a
presigned URL) and a real SeaweedFS, parses each request and, for a seeded ~``rate`` of
them, injects one fault instead of (or after) forwarding it:

===============  ====================================================================
``error-500``    answered here with 500 InternalError; never reaches the server
``slowdown-503`` answered here with 503 SlowDown; never reaches the server
``stall``        held ``stall_s`` without a byte of answer, then the connection is reset
``reset-before`` connection reset before the request is forwarded
``reset-after``  forwarded and executed by the server, then the reply is lost (reset):
                 the case a retried create-once write must survive
``truncate``     the reply's headers and half of its body are relayed, then the
                 connection closes: a short read
===============  ====================================================================

The decisions come from ``random.Random(seed)`` in arrival order, so a seed fixes the
sequence of faults; which request gets which depends on the order requests arrive in.

With ``strip_if_none_match`` the proxy also impersonates a store that ignores
``If-None-Match``: the header is removed and the request re-signed (SigV4, with the
credentials given), so the server sees a plain overwrite.

The proxy runs on its own event loop in a daemon thread (:class:`LoopThread`), so tests
drive it from synchronous code; counters are only written on that loop.
"""

from __future__ import annotations

import asyncio
import random
import socket
import struct
import threading
from collections import Counter, deque
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

__all__ = ["FAULT_KINDS", "LoopThread", "S3FaultProxy", "reset"]

FAULT_KINDS = ("error-500", "slowdown-503", "stall", "reset-before", "reset-after", "truncate")

_RELAY = 64 << 10


class LoopThread:
    """An asyncio event loop running in a daemon thread; ``run(coro)`` executes on it and waits."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


def reset(writer: asyncio.StreamWriter | None) -> None:
    """Close with an RST instead of a FIN (SO_LINGER 0): the peer sees 'connection reset'."""
    if writer is None:
        return
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()


@dataclass
class _Request:
    method: str
    target: str
    version: str
    headers: list[tuple[str, str]]
    body: bytes
    raw_head: bytes

    def header(self, name: str) -> str | None:
        low = name.lower()
        for k, v in self.headers:
            if k.lower() == low:
                return v
        return None

    def label(self) -> str:
        """A coarse name of the S3 operation, for the counters."""
        path, _, query = self.target.partition("?")
        if "X-Amz-Signature=" in query:
            return f"{self.method} presigned"
        if "uploadId=" in query:
            return {"PUT": "UploadPart", "POST": "CompleteMultipartUpload", "DELETE": "AbortMultipartUpload"}.get(
                self.method, f"{self.method} multipart"
            )
        if "uploads" in query.split("&"):
            return "CreateMultipartUpload"
        if "list-type=2" in query:
            return "ListObjectsV2"
        if path.count("/") <= 1:
            return f"{self.method} bucket"
        if "/probe/" in path:
            return f"{self.method} probe"
        return {"GET": "GetObject", "HEAD": "HeadObject", "PUT": "PutObject", "DELETE": "DeleteObject"}.get(
            self.method, self.method
        )


def _parse_headers(lines: list[bytes]) -> list[tuple[str, str]]:
    out = []
    for line in lines:
        name, _, value = line.decode("latin-1").partition(":")
        out.append((name.strip(), value.strip()))
    return out


def _build_head(start: str, headers: list[tuple[str, str]]) -> bytes:
    return (start + "\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers) + "\r\n").encode("latin-1")


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    body = bytearray()
    while True:
        size_line = await reader.readuntil(b"\r\n")
        size = int(size_line.split(b";", 1)[0].strip(), 16)
        if size == 0:
            while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers
                pass
            return bytes(body)
        body += await reader.readexactly(size)
        await reader.readexactly(2)


async def _read_request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> _Request | None:
    """The next request on a client connection, body included; None at a clean end of stream."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise
    lines = head[:-4].split(b"\r\n")
    method, target, version = lines[0].decode("latin-1").split(" ", 2)
    req = _Request(method, target, version, _parse_headers(lines[1:]), b"", head)
    if (req.header("expect") or "").lower() == "100-continue":
        # Answer it here; the server then gets the request without Expect.
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await writer.drain()
        req.headers = [(k, v) for k, v in req.headers if k.lower() != "expect"]
        req.raw_head = _build_head(lines[0].decode("latin-1"), req.headers)
    if (req.header("transfer-encoding") or "").lower() == "chunked":
        req.body = await _read_chunked(reader)
        req.headers = [(k, v) for k, v in req.headers if k.lower() != "transfer-encoding"]
        req.headers.append(("Content-Length", str(len(req.body))))
        req.raw_head = _build_head(lines[0].decode("latin-1"), req.headers)
    elif req.header("content-length"):
        req.body = await reader.readexactly(int(req.header("content-length") or 0))
    return req


def _error_response(method: str, status: int, reason: str, code: str, message: str) -> bytes:
    body = (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
        f"<Message>{message}</Message><RequestId>fault-proxy</RequestId></Error>"
    ).encode()
    if method == "HEAD":
        body = b""  # a HEAD answer never has a body (S3 sends the status alone)
    head = _build_head(
        f"HTTP/1.1 {status} {reason}",
        [("Content-Type", "application/xml"), ("Content-Length", str(len(body))), ("x-amz-request-id", "fault-proxy")],
    )
    return head + body


class S3FaultProxy:
    """A loopback HTTP proxy in front of ``upstream`` (an S3 endpoint URL) that injects seeded faults."""

    def __init__(
        self,
        upstream: str,
        *,
        seed: int,
        rate: float = 0.0,
        stall_s: float = 1.5,
        kinds: tuple[str, ...] = FAULT_KINDS,
        credentials: tuple[str, str, str] | None = None,
    ) -> None:
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.seed = seed
        self.rate = rate
        self.stall_s = stall_s
        self.kinds = kinds
        self.credentials = credentials
        self.strip_if_none_match = False
        #: Requests seen, by S3 operation; faults injected, by kind; If-None-Match headers stripped.
        self.requests: Counter[str] = Counter()
        self.faults: Counter[str] = Counter()
        self.faults_by_op: Counter[str] = Counter()
        self.stripped = 0
        self._forced: deque[str] = deque()
        self._targeted: dict[str, deque[str]] = {}
        self._rng = random.Random(seed)
        self._loop = LoopThread("s3-fault-proxy")
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.url = ""

    # --- control (from the test's thread) ---------------------------------------------------

    def start(self) -> str:
        async def listen() -> asyncio.AbstractServer:
            return await asyncio.start_server(self._serve, "127.0.0.1", 0, limit=1 << 20)

        self._server = self._loop.run(listen())
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    def stop(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

        self._loop.run(close())
        self._loop.stop()

    def force(self, *kinds: str) -> None:
        """Inject exactly these faults into the next requests, whatever the rate ("pass": none)."""
        self._loop.loop.call_soon_threadsafe(self._forced.extend, kinds)

    def force_op(self, op: str, *kinds: str) -> None:
        """Inject these faults into the next requests of S3 operation ``op`` (a :meth:`_Request.label`)."""

        def add() -> None:
            self._targeted.setdefault(op, deque()).extend(kinds)

        self._loop.loop.call_soon_threadsafe(add)

    def total_requests(self) -> int:
        return sum(self.requests.values())

    def total_faults(self) -> int:
        return sum(self.faults.values())

    def snapshot(self) -> dict[str, Any]:
        return {
            "requests": self.total_requests(),
            "by_op": dict(self.requests),
            "faults": self.total_faults(),
            "faults_by_kind": dict(self.faults),
            "faults_by_op": dict(self.faults_by_op),
            "stripped_if_none_match": self.stripped,
        }

    # --- the proxy (on its loop) ----------------------------------------------------------

    def _decide(self, req: _Request) -> str | None:
        targeted = self._targeted.get(req.label())
        if targeted:
            return targeted.popleft()
        if self._forced:
            kind = self._forced.popleft()
            return None if kind == "pass" else kind
        if self.rate <= 0:
            return None
        # Two draws per request whatever the outcome, so the sequence depends only on the seed.
        hit, which = self._rng.random(), self._rng.choice(self.kinds)
        return which if hit < self.rate else None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        up_r: asyncio.StreamReader | None = None
        up_w: asyncio.StreamWriter | None = None
        try:
            while True:
                req = await _read_request(reader, writer)
                if req is None:
                    return
                op = req.label()
                self.requests[op] += 1
                fault = self._decide(req)
                if fault is not None:
                    self.faults[fault] += 1
                    self.faults_by_op[op] += 1
                if fault == "error-500":
                    writer.write(_error_response(req.method, 500, "Internal Server Error", "InternalError", "injected"))
                    await writer.drain()
                    continue
                if fault == "slowdown-503":
                    writer.write(
                        _error_response(req.method, 503, "Slow Down", "SlowDown", "injected: reduce your request rate")
                    )
                    await writer.drain()
                    continue
                if fault == "stall":
                    await asyncio.sleep(self.stall_s)
                    reset(writer)
                    return
                if fault == "reset-before":
                    reset(writer)
                    return
                if up_w is None:
                    up_r, up_w = await asyncio.open_connection(*self.upstream, limit=1 << 20)
                up_w.write(self._outgoing(req))
                await up_w.drain()
                assert up_r is not None
                keep = await self._relay(up_r, writer, req.method, fault)
                if fault in ("reset-after", "truncate") or not keep:
                    return
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
            return
        finally:
            self._tasks.discard(task)
            if not writer.is_closing():
                writer.close()
            if up_w is not None:
                up_w.close()

    def _outgoing(self, req: _Request) -> bytes:
        if not (
            self.strip_if_none_match
            and req.header("if-none-match") is not None
            and "X-Amz-Signature=" not in req.target
        ):
            return req.raw_head + req.body
        self.stripped += 1
        headers = _resign(req, self.credentials)
        return _build_head(f"{req.method} {req.target} {req.version}", headers) + req.body

    async def _relay(
        self, up: asyncio.StreamReader, client: asyncio.StreamWriter, method: str, fault: str | None
    ) -> bool:
        """Relay one response (applying a reply-side fault); return whether the connection stays usable."""
        while True:
            head = await up.readuntil(b"\r\n\r\n")
            lines = head[:-4].split(b"\r\n")
            status = int(lines[0].split(b" ", 2)[1])
            if status >= 200 or status == 101:
                break
            if fault is None:
                client.write(head)  # an interim 1xx: relay and read the real answer
        headers = _parse_headers(lines[1:])
        hmap = {k.lower(): v for k, v in headers}
        keep = hmap.get("connection", "").lower() != "close"
        if method == "HEAD" or status in (204, 304):
            body_len: int | None = 0
        elif hmap.get("transfer-encoding", "").lower() == "chunked":
            body_len = None
        elif "content-length" in hmap:
            body_len = int(hmap["content-length"])
        else:
            body_len, keep = -1, False  # until the server closes
        if fault == "reset-after":
            await _drain_body(up, body_len)  # the server did the work; the client never hears of it
            reset(client)
            return False
        if fault == "truncate":
            if body_len is not None and body_len >= 2:
                client.write(head)
                client.write(await up.readexactly(body_len // 2))
                await client.drain()
                client.close()  # FIN after half the body: a short read
            else:
                await _drain_body(up, body_len)
                reset(client)
            return False
        client.write(head)
        if body_len is None:
            while True:
                line = await up.readuntil(b"\r\n")
                client.write(line)
                size = int(line.split(b";", 1)[0].strip(), 16)
                if size == 0:
                    while True:
                        trailer = await up.readuntil(b"\r\n")
                        client.write(trailer)
                        if trailer == b"\r\n":
                            break
                    break
                client.write(await up.readexactly(size + 2))
                await client.drain()
        elif body_len < 0:
            while chunk := await up.read(_RELAY):
                client.write(chunk)
                await client.drain()
        else:
            left = body_len
            while left:
                chunk = await up.read(min(_RELAY, left))
                if not chunk:
                    raise ConnectionError("upstream closed mid-body")
                client.write(chunk)
                left -= len(chunk)
                await client.drain()
        await client.drain()
        return keep


async def _drain_body(up: asyncio.StreamReader, body_len: int | None) -> None:
    if body_len is None:
        await _read_chunked(up)
    elif body_len < 0:
        while await up.read(_RELAY):
            pass
    elif body_len:
        await up.readexactly(body_len)


def _resign(req: _Request, credentials: tuple[str, str, str] | None) -> list[tuple[str, str]]:
    """The request's headers without If-None-Match, signed anew (SigV4) as the server will see them."""
    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    if credentials is None:
        raise RuntimeError("strip_if_none_match needs the S3 credentials to re-sign requests")
    access_key, secret_key, region = credentials
    drop = {"authorization", "x-amz-date", "x-amz-content-sha256", "if-none-match", "expect"}
    kept = [(k, v) for k, v in req.headers if k.lower() not in drop]
    host = req.header("host") or "localhost"
    aws = AWSRequest(method=req.method, url=f"http://{host}{req.target}", data=req.body, headers=dict(kept))
    S3SigV4Auth(Credentials(access_key, secret_key), "s3", region).add_auth(aws)
    return list(aws.headers.items())
