"""Large answers (plan bundles, object ranges) read straight into the buffers they stay in, with http.client.

httpx hands every byte of an answer's body through four user-space copies before our code sees it
(httpcore's socket read, h11's receive buffer, the slice h11 hands out as data, httpx's chunk); the
bundle's Receiver then copied it once more. On the 2-core box a 13.8 MB plan bundle cost the client
8.3 ms of CPU that way against 2.8 ms read by the standard library's ``http.client`` with ``readinto``
into the one buffer the bytes stay in (run AK's probe, docs/SCALE-RUNS.md). So the GETs whose answers
are large go through here, and so does a version's one request (publishVersion), whose body the caller
gives as a factory of its pieces: httpx's own work cost ~0.4-0.6 ms a request (run AT). Every other
request, and every answer that is an error, is httpx's (an error answer read here comes back as one).

:class:`Direct` speaks HTTP/1.1 to the one server of an :class:`~weightsync.client._http.Api`, with the
request httpx built (its URL, query and headers: User-Agent, Authorization) and the Api's TLS context
and timeouts: the connect timeout for connecting, the read timeout for every receive. It keeps idle
connections for reuse (one whose server closed it is dropped before use, and a request the server
closed a reused connection under is sent once more on a new one: a GET is safe to repeat, and a body
is made afresh from its factory; publishVersion carries an idempotency key). It asks
for ``Accept-Encoding: identity``: the bodies are compressed objects already. Failures are raised as
httpx's own exceptions (ConnectError, ConnectTimeout, ReadTimeout, ReadError, RemoteProtocolError),
so the Api's one retry loop treats both paths alike; an answer that ends before its Content-Length
is a RemoteProtocolError, as with httpx. The Api uses it only where it behaves as httpx would: no
transport injected, no credentials in the URL, and httpx's own routing of the server's URL going
to no proxy (:func:`usable`). ``WEIGHTSYNC_HTTP_DIRECT=0`` turns it off.
"""

from __future__ import annotations

import http.client
import os
import select
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx

ENV_SWITCH = "WEIGHTSYNC_HTTP_DIRECT"


def usable(client: httpx.Client, server: str, transport: Any) -> bool:
    """Whether `client` (an Api's, for `server`) may have its large answers read directly: not turned off
    (``WEIGHTSYNC_HTTP_DIRECT=0``), no injected transport, no credentials in the URL (httpx sends them as
    Basic auth), and httpx itself would reach `server` with its own transport, not a proxy's (its rules:
    ``HTTP(S)_PROXY``, ``ALL_PROXY``, ``NO_PROXY``, the system's settings). Where httpx no longer tells
    (its routing is not public API), large answers stay with it."""
    if transport is not None or os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    parts = urlsplit(server)
    if parts.username is not None or parts.password is not None:
        return False
    route = getattr(client, "_transport_for_url", None)
    own = getattr(client, "_transport", None)
    if route is None or own is None:
        return False
    try:
        return route(httpx.URL(server)) is own
    except Exception:  # noqa: BLE001 - a changed private signature: stay with httpx
        return False


class Direct:
    """HTTP/1.1 GETs to one server with a pool of idle connections. Thread-safe (a connection serves one
    request at a time)."""

    def __init__(
        self,
        server: str,
        *,
        connect_timeout: float,
        read_timeout: float,
        tls: ssl.SSLContext | None,
        keep: int,
        expiry: float | None = 5.0,
    ) -> None:
        parts = urlsplit(server)
        self._host = parts.hostname or ""
        self._https = parts.scheme == "https"
        self._port = parts.port or (443 if self._https else 80)
        if self._https and tls is None:
            raise ValueError("an https server needs a TLS context")
        self._tls = tls
        self._connect_timeout, self._read_timeout = connect_timeout, read_timeout
        self._keep, self._expiry = keep, expiry
        # Idle connections and when each was handed back: one idle longer than `expiry` (httpx's keepalive_expiry)
        # is closed, not used: a middlebox may have dropped it without a word, and a request sent on it would
        # wait a whole read timeout.
        self._idle: list[tuple[http.client.HTTPConnection, float]] = []
        self._lock = threading.Lock()
        self._closed = False

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn, _ in idle:
            conn.close()

    def send(
        self,
        request: httpx.Request,
        *,
        timeout: float | None = None,
        body: Callable[[], Iterable[bytes]] | None = None,
    ) -> DirectResponse:
        """Send `request` and return its answer with the body still to read.

        A GET or HEAD has no body. With `body` (a factory of the request body's pieces, whose length the
        request's Content-Length states) any method: its pieces are sent after the headers, made afresh
        where a reused connection turns out closed and the request goes once more on a new one. An
        answer the server sends before it has read the whole body (a 413 for a body over its cap) is
        still read when the rest of the body cannot be sent, as httpx does.
        """
        if self._closed:
            raise RuntimeError("the client has been closed")
        if body is not None and "content-length" not in request.headers:
            raise ValueError("a body sent directly needs its Content-Length")
        target = request.url.raw_path.decode("ascii")
        headers = [(k, "identity" if k.lower() == "accept-encoding" else v) for k, v in request.headers.multi_items()]
        if not any(k.lower() == "accept-encoding" for k, _ in headers):
            headers.append(("Accept-Encoding", "identity"))
        while True:
            conn, reused = self._connection()
            try:
                if conn.sock is None:
                    _connect(conn)
                assert conn.sock is not None
                conn.sock.settimeout(self._read_timeout if timeout is None else timeout)
                conn.putrequest(request.method, target, skip_host=True, skip_accept_encoding=True)
                for k, v in headers:
                    conn.putheader(k, v)
                conn.endheaders()
                if body is not None:
                    _send_body(conn, body())
                answer = conn.getresponse()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError) as exc:
                conn.close()
                if reused:  # the server closed an idle connection as we sent: once more on a new one
                    continue
                raise httpx.RemoteProtocolError(_describe(exc)) from exc
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                raise _transport_error(exc) from exc
            except BaseException:  # httpx's errors from connecting, an interrupt
                conn.close()
                raise
            return DirectResponse(self, conn, answer)

    def _connection(self) -> tuple[http.client.HTTPConnection, bool]:
        """An idle connection the server has not closed (and True), or a new one, not yet connected (and False)."""
        now = time.monotonic()
        with self._lock:
            while self._idle:
                conn, since = self._idle.pop()
                if (self._expiry is None or now - since <= self._expiry) and _idle_ok(conn):
                    return conn, True
                conn.close()
        if self._https:
            return http.client.HTTPSConnection(
                self._host, self._port, timeout=self._connect_timeout, context=self._tls
            ), False
        return http.client.HTTPConnection(self._host, self._port, timeout=self._connect_timeout), False

    def _release(self, conn: http.client.HTTPConnection, reusable: bool) -> None:
        """Keep `conn` for the next request if its answer was read to the end and it is still open (not after
        an answer with ``Connection: close``); close it otherwise."""
        with self._lock:
            if reusable and conn.sock is not None and not self._closed and len(self._idle) < self._keep:
                self._idle.append((conn, time.monotonic()))
                return
        conn.close()


class DirectResponse:
    """An answer whose body is read with :meth:`readinto` (or :meth:`iter_bytes`, :meth:`read`); :meth:`close`
    hands the connection back for reuse when the body was read to its end, and closes it otherwise."""

    def __init__(self, pool: Direct, conn: http.client.HTTPConnection, answer: http.client.HTTPResponse) -> None:
        self._pool, self._conn, self._answer = pool, conn, answer
        self.status_code = answer.status
        self.headers = httpx.Headers(answer.getheaders())
        self._ended = answer.isclosed()
        self._released = False

    @property
    def ended(self) -> bool:
        """Whether the body was read to its end."""
        return self._ended

    def readinto(self, view: memoryview) -> int:
        """Receive up to ``len(view)`` bytes of the body into `view` (fewer only at its end); 0 at its end."""
        if self._ended or not len(view):
            return 0
        try:
            n = self._answer.readinto(view)
        except (OSError, http.client.HTTPException) as exc:
            self._conn.close()
            raise _transport_error(exc) from exc
        if n == 0 or self._answer.isclosed():
            self._ended = True
            # http.client frames the body as it parsed the headers (Content-Length, chunked, until close) and
            # counts down what its length leaves; at a connection closed early it returns 0 without a word.
            left = self._answer.length
            if left:
                self._conn.close()
                raise httpx.RemoteProtocolError(
                    f"the server closed the connection {left} bytes before the answer's end"
                )
        return n

    def iter_bytes(self, size: int = 1 << 20) -> Iterator[memoryview]:
        """The body in pieces of up to `size` bytes, each a view of one buffer that the next piece overwrites."""
        buf = memoryview(bytearray(size))
        while n := self.readinto(buf):
            yield buf[:n]

    def read(self) -> bytes:
        """The rest of the body."""
        return b"".join(bytes(piece) for piece in self.iter_bytes())

    def buffered(self, request: httpx.Request) -> httpx.Response:
        """The answer, body read, as an httpx Response (an error answer takes the path httpx answers take)."""
        try:
            content = self.read()
        finally:
            self.close()
        return httpx.Response(self.status_code, headers=self.headers, content=content, request=request)

    def close(self) -> None:
        if self._released:
            return
        self._released = True
        if not self._ended and self._answer.length == 0:  # a body of no bytes, never read: it has ended
            self._answer.close()
            self._ended = True
        if not self._ended:
            self._answer.close()
            self._conn.close()
        self._pool._release(self._conn, self._ended)


def _send_body(conn: http.client.HTTPConnection, pieces: Iterable[bytes]) -> None:
    """Send the request body's pieces. Where the server stops taking them (it answered early and closed), the
    rest is dropped and its answer read all the same; where it has sent no answer, the send's error stands."""
    try:
        for piece in pieces:
            conn.send(piece)
    except (BrokenPipeError, ConnectionResetError):
        sock = conn.sock
        if sock is None or not _readable(sock):
            raise
    except TimeoutError as exc:
        raise httpx.WriteTimeout(_describe(exc)) from exc


def _readable(sock: Any) -> bool:
    """Whether `sock` has bytes (or its end) to read now."""
    if hasattr(select, "poll"):
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        return bool(poller.poll(0))
    return bool(select.select([sock], [], [], 0)[0])  # Windows: no poll (and no limit on descriptor numbers)


def _connect(conn: http.client.HTTPConnection) -> None:
    try:
        conn.connect()
    except TimeoutError as exc:
        raise httpx.ConnectTimeout(_describe(exc)) from exc
    except OSError as exc:  # refused, unreachable, name not found, TLS handshake (ssl.SSLError)
        raise httpx.ConnectError(_describe(exc)) from exc


def _idle_ok(conn: http.client.HTTPConnection) -> bool:
    """An idle connection is fit to reuse unless its socket is readable: the server closed it (or sent bytes
    nobody asked for)."""
    sock = conn.sock
    return sock is not None and not _readable(sock)


def _transport_error(exc: OSError | http.client.HTTPException) -> httpx.TransportError:
    """httpx's exception for a failure of http.client or the socket."""
    if isinstance(exc, TimeoutError):
        return httpx.ReadTimeout(_describe(exc))
    if isinstance(exc, http.client.HTTPException):
        return httpx.RemoteProtocolError(_describe(exc))
    return httpx.ReadError(_describe(exc))


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
