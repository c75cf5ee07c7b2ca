"""Large answers read straight into their buffers (client/_direct.py): the same bytes as through httpx, and the
same retries, errors, limits and cancellation, against a real server and a loopback server that misbehaves
on cue."""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from weightsync import errors
from weightsync.client import Publisher, _direct, _http
from weightsync.client._http import Api
from weightsync.client._pool import Cancelled, _current, pool_of, run_all
from weightsync.client.wire import Retry, TokenBucket

ONE = Retry(attempts=1)
TWO = Retry(attempts=2, base=0.0, cap=0.0)
Answer = Callable[[socket.socket], bool]
"""Writes one answer on the connection; whether the connection stays open for the next request."""


class Scripted:
    """A loopback HTTP/1.1 server answering the n-th request with ``answers[n]`` (keep-alive between them)."""

    def __init__(self, answers: list[Answer], tls: ssl.SSLContext | None = None) -> None:
        self.answers = list(answers)
        self.tls = tls
        self.requests: list[str] = []
        self.accepted = 0
        self.conns: list[socket.socket] = []
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            self.accepted += 1
            if self.tls is not None:
                try:
                    conn = self.tls.wrap_socket(conn, server_side=True)
                except OSError:  # a client that refused our certificate
                    conn.close()
                    continue
            self.conns.append(conn)
            t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            buf = b""
            while True:
                while b"\r\n\r\n" not in buf:
                    try:
                        got = conn.recv(65536)
                    except OSError:
                        return
                    if not got:
                        return
                    buf += got
                head, _, buf = buf.partition(b"\r\n\r\n")
                self.requests.append(head.decode("latin-1"))
                if not self.answers or not self.answers.pop(0)(conn):
                    return

    def close(self) -> None:
        for c in [self._sock, *self.conns]:  # a shutdown wakes a thread blocked in accept() or recv()
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._sock.close()
        for t in self._threads:
            t.join(10)


@pytest.fixture
def scripted() -> Iterator[Callable[[list[Answer]], Scripted]]:
    made: list[Scripted] = []

    def make(answers: list[Answer], tls: ssl.SSLContext | None = None) -> Scripted:
        made.append(Scripted(answers, tls))
        return made[-1]

    yield make
    for s in made:
        s.close()


def ok(body: bytes, status: int = 200, *, headers: str = "", keep: bool = True) -> Answer:
    def answer(conn: socket.socket) -> bool:
        head = f"HTTP/1.1 {status} X\r\nContent-Length: {len(body)}\r\n{headers}\r\n".encode()
        conn.sendall(head + body)
        return keep

    return answer


def cut(body: bytes, sent: int, *, hold: threading.Event | None = None, rest: bool = False) -> Answer:
    """The whole body's Content-Length, `sent` bytes of it, then (with `hold`) nothing until it is set, then (with
    `rest`) the rest of the body; then the connection closes."""

    def answer(conn: socket.socket) -> bool:
        conn.sendall(f"HTTP/1.1 200 X\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body[:sent])
        if hold is not None:
            hold.wait(30)
        if rest:
            try:
                conn.sendall(body[sent:])
            except OSError:
                pass
        return False

    return answer


def problem(status: int, code: str, *, headers: str = "") -> Answer:
    body = f'{{"type": "https://weightsync.dev/problems/{code}", "title": "{code}", "status": {status}}}'.encode()
    return ok(body, status, headers=f"Content-Type: application/problem+json\r\n{headers}")


DATA = np.random.default_rng(7).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
DIGEST = "ab" * 32


def test_the_direct_path_reads_what_httpx_reads(server, model: str, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Plan bundles and object ranges from a real server: byte for byte the same through either path."""
    rng = np.random.default_rng(3)
    tensors = {f"w{i}": rng.integers(0, 256, n, dtype=np.uint8) for i, n in enumerate((5 << 20, 777, 0))}
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text('{"a": 1}')
    with Publisher(server.url, model) as pub:
        pub.publish(tmp_path)
    seen: list[tuple] = []
    for direct in ("1", "0"):
        monkeypatch.setenv(_direct.ENV_SWITCH, direct)
        with Api(server.url) as api:
            assert (api._direct is not None) is (direct == "1")
            counted: list[int] = []
            api.on_bytes = counted.append
            plan, objects = api.get_plan_bundle(model, have=None, inline=64 << 20)
            got = {d: bytes(v) for d, (v, h) in objects.items()}
            assert all(hashlib.sha256(v).hexdigest() == d for d, v in got.items())
            assert sum(counted) == sum(len(v) for v in got.values())
            big = max(got, key=lambda d: len(got[d]))
            counted.clear()
            whole = api.read_object(big)
            part = api.read_object(big, start=1000, end=(3 << 20) + 5)
            assert sum(counted) == len(whole) + len(part)
            pieces = bytearray()

            def sink(chunk: memoryview | bytes, pieces: bytearray = pieces) -> None:
                pieces[:] = pieces + chunk if chunk else b""

            api.get_object(big, sink, start=17)
            assert bytes(whole) == got[big] and bytes(part) == got[big][1000 : (3 << 20) + 5]
            assert bytes(pieces) == got[big][17:]
            seen.append((plan.target, got, bytes(whole)))
    assert seen[0] == seen[1]


def test_a_body_cut_short_is_retried_and_the_retry_read_whole(scripted) -> None:
    srv = scripted([cut(DATA, 1 << 20), ok(DATA)])
    with Api(srv.url, retry=TWO) as api:
        assert api._direct is not None
        assert bytes(api.read_object(DIGEST)) == DATA
    assert len(srv.requests) == 2


def test_a_body_cut_short_with_no_retry_left_is_server_unavailable(scripted) -> None:
    srv = scripted([cut(DATA, 1 << 20)])
    with Api(srv.url, retry=ONE) as api, pytest.raises(errors.ServerUnavailable, match="RemoteProtocolError"):
        api.read_object(DIGEST)


def test_connections_are_reused_and_one_the_server_closed_is_replaced(scripted) -> None:
    srv = scripted([ok(DATA), ok(DATA[:10], keep=False), ok(DATA[5:9])])
    with Api(srv.url, retry=ONE) as api:  # no retry: a stale connection must not cost an attempt
        assert bytes(api.read_object(DIGEST)) == DATA
        assert bytes(api.read_object(DIGEST)) == DATA[:10]  # same connection; the server closes it after
        assert srv.accepted == 1
        for _ in range(500):  # the server has closed its end
            if srv.conns[0].fileno() == -1:
                break
            time.sleep(0.01)
        assert bytes(api.read_object(DIGEST)) == DATA[5:9]
    assert srv.accepted == 2


def test_a_stalled_body_is_a_read_timeout(scripted) -> None:
    hold = threading.Event()
    srv = scripted([cut(DATA, 1000, hold=hold)])
    try:
        with Api(srv.url, retry=ONE, timeout=0.3) as api, pytest.raises(errors.ServerUnavailable, match="ReadTimeout"):
            api.read_object(DIGEST)
    finally:
        hold.set()


def test_error_answers_map_to_named_errors_and_transient_ones_are_retried(scripted) -> None:
    srv = scripted(
        [problem(404, "object_not_found"), problem(503, "unavailable", headers="Retry-After: 0\r\n"), ok(DATA)]
    )
    with Api(srv.url, retry=TWO) as api:
        with pytest.raises(errors.ObjectNotFound):
            api.read_object(DIGEST)
        assert bytes(api.read_object(DIGEST, start=0, end=len(DATA))) == DATA
    assert srv.accepted == 1  # an error answer's body is read: the connection serves the next request
    assert "range: bytes=0-3145727" in srv.requests[2].lower()


def test_a_refused_connection_is_server_unavailable() -> None:
    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    with (
        Api(f"http://127.0.0.1:{port}", retry=TWO) as api,
        pytest.raises(errors.ServerUnavailable, match="ConnectError"),
    ):
        api.read_object(DIGEST)


def test_requests_carry_the_clients_headers_and_ask_for_no_encoding(scripted) -> None:
    srv = scripted([ok(DATA[5:105], 206)])
    with Api(srv.url, "tok-1", retry=ONE) as api:
        assert bytes(api.read_object(DIGEST, start=5, end=105)) == DATA[5:105]
    head = srv.requests[0].lower().split("\r\n")
    assert head[0] == f"get /v1/objects/{DIGEST} http/1.1"
    assert "authorization: bearer tok-1" in head and "accept-encoding: identity" in head
    assert any(h.startswith("user-agent: weightsync/") for h in head)
    assert any(h.startswith("host: 127.0.0.1:") for h in head)


def test_received_bytes_pay_the_rate_limit(scripted) -> None:
    class Counting(TokenBucket):
        paid = 0

        def acquire(self, n: int) -> None:
            Counting.paid += n
            super().acquire(n)

    srv = scripted([ok(DATA), ok(DATA)])
    with Api(srv.url, retry=ONE, limiter=Counting(rate=1 << 40)) as api:
        api.read_object(DIGEST)
        api.get_object(DIGEST, lambda c: None)
    assert Counting.paid == 2 * len(DATA)


def test_a_stopped_batch_stops_a_read_between_two_pieces(scripted) -> None:
    """A transfer of a batch that another job's failure stopped ends at its next piece, not at its body's end."""
    hold = threading.Event()
    scope: list = []

    def release_when_stopped() -> None:
        for _ in range(3000):
            if scope and scope[0].stopped():
                break
            time.sleep(0.01)
        hold.set()

    srv = scripted([cut(DATA, 1 << 20, hold=hold, rest=True)])  # 1 MiB, then the rest once the batch stopped
    got: list[int] = []
    with Api(srv.url, retry=ONE) as api:
        api.on_bytes = got.append
        first = threading.Event()

        def job(i: int) -> None:
            if i == 0:
                api.on_bytes = lambda n: (got.append(n), first.set())
                api.read_object(DIGEST)
            else:
                first.wait(30)
                scope.append(_current())
                threading.Thread(target=release_when_stopped, daemon=True).start()
                raise errors.InvalidArgument("the other job failed")

        with pytest.raises((errors.InvalidArgument, Cancelled)) as failure:
            run_all(pool_of(2), job, [0, 1])
    assert isinstance(failure.value, errors.InvalidArgument)
    assert sum(got) == 1 << 20  # the first piece; the read after it found the batch stopped


@pytest.mark.parametrize(
    ("env", "server", "direct"),
    [
        ({}, "http://weightsync.test:8400", True),
        ({"HTTP_PROXY": "http://proxy.example:3128"}, "http://weightsync.test:8400", False),
        ({"ALL_PROXY": "http://proxy.example:3128"}, "http://weightsync.test:8400", False),
        ({"HTTPS_PROXY": "http://proxy.example:3128"}, "http://weightsync.test:8400", True),  # another scheme's
        (
            {"HTTP_PROXY": "http://proxy.example:3128", "NO_PROXY": "weightsync.test"},
            "http://weightsync.test:8400",
            True,
        ),
        # httpx reads a leading dot as "subdomains only": the domain itself still goes through the proxy
        (
            {"HTTP_PROXY": "http://proxy.example:3128", "NO_PROXY": ".weightsync.test"},
            "http://weightsync.test:8400",
            False,
        ),
        ({"HTTP_PROXY": "http://proxy.example:3128", "NO_PROXY": ".weightsync.test"}, "http://a.weightsync.test", True),
        ({}, "http://alice:s3cret@weightsync.test:8400", False),  # httpx sends these as Basic auth
        ({_direct.ENV_SWITCH: "0"}, "http://weightsync.test:8400", False),
    ],
)
def test_the_direct_path_is_used_only_where_httpx_would_go_direct(
    env: dict, server: str, direct: bool, monkeypatch
) -> None:
    for name in list(os.environ):
        if name.lower().endswith("_proxy") or name == _direct.ENV_SWITCH:
            monkeypatch.delenv(name)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with httpx.Client() as client:
        assert _direct.usable(client, server, None) is direct


def test_an_injected_transport_keeps_every_request_on_httpx() -> None:
    transport = httpx.MockTransport(lambda r: httpx.Response(200))
    with Api("http://weightsync.test:8400", transport=transport) as api:
        assert api._direct is None


def test_a_closed_client_sends_nothing_more(scripted) -> None:
    srv = scripted([ok(DATA[:10])])
    api = Api(srv.url, retry=ONE)
    assert bytes(api.read_object(DIGEST)) == DATA[:10]
    api.close()
    with pytest.raises(RuntimeError, match="closed"):
        api.read_object(DIGEST)
    assert len(srv.requests) == 1


def raw(text: str, keep: bool = True) -> Answer:
    """An answer written as given (status line, headers and body: whatever framing the test needs)."""

    def answer(conn: socket.socket) -> bool:
        conn.sendall(text.encode())
        return keep

    return answer


def test_a_chunked_body_is_taken_as_framed_whatever_its_content_length_says(scripted) -> None:
    """A Content-Length beside Transfer-Encoding says nothing: the body is the chunks, never a buffer of that
    length filled with whatever memory held."""
    srv = scripted(
        [raw("HTTP/1.1 206 X\r\nContent-Length: 4096\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n")]
    )
    with Api(srv.url, retry=ONE) as api:
        assert bytes(api.read_object(DIGEST, start=0, end=4096)) == b"hello"


def test_a_chunked_body_cut_short_is_refused(scripted) -> None:
    srv = scripted([raw("HTTP/1.1 200 X\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel", keep=False)])
    with Api(srv.url, retry=ONE) as api, pytest.raises(errors.ServerUnavailable, match="RemoteProtocolError"):
        api.read_object(DIGEST)


def test_a_body_cut_short_is_refused_whatever_its_headers_look_like(scripted) -> None:
    """Two equal Content-Length headers (which httpx's header view joins): still framed by the length, and a body
    that ends before it is refused, not taken short."""
    srv = scripted(
        [raw("HTTP/1.1 200 X\r\nContent-Length: 1000\r\nContent-Length: 1000\r\n\r\n" + "x" * 10, keep=False)]
    )
    with Api(srv.url, retry=ONE) as api, pytest.raises(errors.ServerUnavailable, match="RemoteProtocolError"):
        api.read_object(DIGEST)


def test_a_range_answered_as_the_whole_object_or_longer_is_refused(scripted) -> None:
    srv = scripted([ok(DATA[:100]), ok(DATA[:100], 206), ok(DATA[:100])])
    with Api(srv.url, retry=ONE) as api:
        with pytest.raises(errors.BadResponse, match="not 206"):
            api.read_object(DIGEST, start=10, end=110)  # a 200: the bytes from 0, not from 10
        with pytest.raises(errors.BadResponse, match="100 bytes answered for a range of 50"):
            api.read_object(DIGEST, start=10, end=60)
        with pytest.raises(errors.BadResponse, match="not 206"):
            api.get_object(DIGEST, lambda c: None, start=10)


def test_an_answer_with_connection_close_is_followed_by_a_new_connection(scripted) -> None:
    srv = scripted([ok(DATA[:10], headers="Connection: close\r\n", keep=False), ok(DATA[:20])])
    with Api(srv.url, retry=ONE) as api:
        assert bytes(api.read_object(DIGEST)) == DATA[:10]
        assert bytes(api.read_object(DIGEST)) == DATA[:20]
    assert srv.accepted == 2


def test_a_connection_idle_past_its_expiry_is_not_used(scripted) -> None:
    """A connection a middlebox dropped without a word looks open: one idle longer than the expiry is closed
    instead of waiting a read timeout for an answer that never comes."""
    hold = threading.Event()

    def then_silent(conn: socket.socket) -> bool:  # answers, then never reads this connection again
        ok(DATA[:10])(conn)
        hold.wait(30)
        return False

    srv = scripted([then_silent, ok(DATA[:20])])
    pool = _direct.Direct(srv.url, connect_timeout=5, read_timeout=5, tls=None, keep=4, expiry=0.0)
    try:
        for want in (DATA[:10], DATA[:20]):
            answer = pool.send(httpx.Request("GET", f"{srv.url}/v1/objects/{DIGEST}"))
            assert answer.read() == want
            answer.close()
    finally:
        hold.set()
        pool.close()
    assert srv.accepted == 2


def test_idle_connections_are_checked_without_poll(scripted, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where select has no poll (Windows), an idle connection is checked with select() and reused."""
    import select

    monkeypatch.delattr(select, "poll")
    srv = scripted([ok(DATA[:10]), ok(DATA[:20])])
    with Api(srv.url, retry=ONE) as api:
        assert bytes(api.read_object(DIGEST)) == DATA[:10]
        assert bytes(api.read_object(DIGEST)) == DATA[:20]
    assert srv.accepted == 1


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_https_uses_the_clients_certificate_store_and_refuses_an_unknown_certificate(
    scripted, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(cert, key)
    srv = scripted([ok(DATA), ok(DATA[:5])], tls=server_tls)
    url = srv.url.replace("http://", "https://")
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))  # httpx's default context trusts it
    _http._tls_context.cache_clear()
    try:
        with Api(url, retry=ONE) as api:
            assert api._direct is not None
            assert bytes(api.read_object(DIGEST)) == DATA
            assert bytes(api.read_object(DIGEST)) == DATA[:5]
        assert srv.accepted == 1
        monkeypatch.delenv("SSL_CERT_FILE")
        _http._tls_context.cache_clear()
        with Api(url, retry=ONE) as api, pytest.raises(errors.ServerUnavailable, match="ConnectError"):
            api.read_object(DIGEST)
    finally:
        _http._tls_context.cache_clear()


@pytest.mark.parametrize("direct", ["1", "0"])
def test_watch_sees_every_piece_in_order_and_a_restart_before_each_attempt(scripted, direct, monkeypatch) -> None:
    monkeypatch.setenv(_direct.ENV_SWITCH, direct)
    srv = scripted([cut(DATA, 1 << 20), ok(DATA)])
    seen: list[bytes] = []
    with Api(srv.url, retry=TWO) as api:
        assert (api._direct is not None) is (direct == "1")
        got = api.read_object(DIGEST, watch=lambda piece: seen.append(bytes(piece)))
    restarts = [i for i, piece in enumerate(seen) if not piece]
    assert len(restarts) == 2, "one restart before each of the two attempts"
    assert b"".join(seen[restarts[-1] + 1 :]) == bytes(got) == DATA


def _object_of(server_url: str, model: str, tmp_path: Path) -> tuple[str, int]:
    """Publish a version and return its largest object (digest, size)."""
    rng = np.random.default_rng(5)
    save_file({"w": rng.integers(0, 256, 3 << 20, dtype=np.uint8)}, tmp_path / "model.safetensors")
    with Publisher(server_url, model) as pub:
        pub.publish(tmp_path / "model.safetensors")
    with Api(server_url) as api:
        plan = api.get_plan(model, have=None)
    return max(((o.digest, o.size) for s in plan.steps for o in s.objects), key=lambda o: o[1])


class _FlipFirstRange(httpx.BaseTransport):
    """Real HTTP, with one byte of every object range that starts at 0 flipped on the way."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.flipped = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        resp = self.inner.handle_request(request)
        if "/v1/objects/" not in request.url.path or not request.headers.get("range", "").startswith("bytes=0-"):
            return resp
        body = bytearray(resp.read())
        body[len(body) // 3] ^= 0x01
        self.flipped += 1
        headers = [(k, v) for k, v in resp.headers.items() if k.lower() != "content-length"]
        return httpx.Response(resp.status_code, headers=headers, content=bytes(body))

    def close(self) -> None:
        self.inner.close()


@pytest.mark.parametrize("range_bytes", [64 << 20, 1 << 20])  # the object in one range, and in several
def test_an_object_hashed_as_its_first_range_arrives_is_checked_whole(server, model, tmp_path, range_bytes) -> None:
    """In memory, an object's first range is hashed as it arrives and the join goes on from there: the object is
    byte for byte, and a byte flipped in that first range is still a DigestMismatch."""
    from concurrent.futures import ThreadPoolExecutor

    from weightsync.client._objects import ObjectCache

    digest, size = _object_of(server.url, model, tmp_path)
    assert size > 2 << 20
    with Api(server.url) as api, ThreadPoolExecutor(4) as pool:
        want = bytes(api.read_object(digest))
        cache = ObjectCache(None)
        cache.fetch(api, {digest: size}, pool, range_bytes=range_bytes)
        assert bytes(cache.read(digest)) == want
    flip = _FlipFirstRange()
    with Api(server.url, retry=ONE, transport=flip) as api, ThreadPoolExecutor(4) as pool:
        with pytest.raises(errors.DigestMismatch):
            ObjectCache(None).fetch(api, {digest: size}, pool, range_bytes=range_bytes)
    assert flip.flipped >= 1


def test_a_selections_ranges_are_not_hashed(server, model, tmp_path) -> None:
    """Ranges read for a tensor selection are never joined into their object: no SHA-256 is taken of them (it
    would be CPU on the selection's critical path for nothing), and their bytes are the object's."""
    from concurrent.futures import ThreadPoolExecutor

    from weightsync.client._objects import ObjectCache

    digest, size = _object_of(server.url, model, tmp_path)
    with Api(server.url) as api, ThreadPoolExecutor(4) as pool:
        want = bytes(api.read_object(digest))
        cache = ObjectCache(None)
        cache.fetch_extents(api, {digest: [(0, 1 << 20)]}, pool)
        assert bytes(cache.read_part(digest, 0, 1 << 20)) == want[: 1 << 20]
        assert not cache._mem_hashed


@pytest.mark.parametrize("direct", ["1", "0"])
def test_a_range_read_into_a_buffer_fills_it(scripted, direct, monkeypatch) -> None:
    """`into` receives the answer in place (the returned view is that memory, nothing around it touched); an answer
    of another length than `into` is BadResponse."""
    monkeypatch.setenv(_direct.ENV_SWITCH, direct)
    srv = scripted(
        [
            ok(DATA[100:300], 206, headers=f"Content-Range: bytes 100-299/{len(DATA)}\r\n"),
            ok(DATA[:50]),
            ok(DATA[100:300], 206),
        ]
    )
    with Api(srv.url, retry=ONE) as api:
        assert (api._direct is not None) is (direct == "1")
        buf = np.zeros(400, dtype=np.uint8)
        got = api.read_object(DIGEST, start=100, end=300, into=buf.data[100:300])
        assert bytes(got) == DATA[100:300] == buf[100:300].tobytes()
        assert np.shares_memory(np.frombuffer(got, dtype=np.uint8), buf)
        assert not buf[:100].any() and not buf[300:].any()
        assert bytes(api.read_object(DIGEST, into=np.empty(50, np.uint8).data)) == DATA[:50]
        with pytest.raises(errors.BadResponse, match="200 bytes answered for a range of 150"):
            api.read_object(DIGEST, start=100, end=250, into=np.empty(150, np.uint8).data)


@pytest.mark.parametrize("direct", ["1", "0"])
def test_a_206_holding_other_bytes_than_asked_for_is_refused(scripted, direct, monkeypatch) -> None:
    """A 206 whose Content-Range says it holds other bytes than the range asked for (a relay or proxy that answers
    from byte 0, or past the range) is BadResponse on every reader, not bytes taken for the range; one clipped at
    the object's end, or open-ended, is what was asked for."""
    monkeypatch.setenv(_direct.ENV_SWITCH, direct)
    size = len(DATA)
    srv = scripted(
        [
            ok(DATA[:200], 206, headers=f"Content-Range: bytes 0-199/{size}\r\n"),
            ok(DATA[100:400], 206, headers=f"Content-Range: bytes 100-399/{size}\r\n"),
            ok(DATA[:200], 206, headers=f"Content-Range: bytes 0-199/{size}\r\n"),
            ok(DATA[size - 10 :], 206, headers=f"Content-Range: bytes {size - 10}-{size - 1}/{size}\r\n"),
            ok(DATA[5:], 206, headers=f"Content-Range: bytes 5-{size - 1}/{size}\r\n"),
        ]
    )
    with Api(srv.url, retry=ONE) as api:
        with pytest.raises(errors.BadResponse, match="bytes 100-299 asked for, 'bytes 0-199/"):
            api.read_object(DIGEST, start=100, end=300)
        with pytest.raises(errors.BadResponse, match="bytes 100-299 asked for, 'bytes 100-399/"):
            api.read_object(DIGEST, start=100, end=300)
        with pytest.raises(errors.BadResponse, match="asked for"):
            api.get_object(DIGEST, lambda c: None, start=100, end=300)
        assert bytes(api.read_object(DIGEST, start=size - 10, end=size + 90)) == DATA[size - 10 :]
        assert bytes(api.read_object(DIGEST, start=5)) == DATA[5:]


def test_an_object_read_as_ranges_in_memory_lands_in_one_buffer(server, model, tmp_path) -> None:
    """The ranges of an object fetched into memory are read into one buffer of its size: the object is that buffer,
    byte for byte, not a copy joined from its ranges."""
    from concurrent.futures import ThreadPoolExecutor

    from weightsync.client._objects import ObjectCache

    digest, size = _object_of(server.url, model, tmp_path)
    with Api(server.url) as api, ThreadPoolExecutor(4) as pool:
        want = bytes(api.read_object(digest))
        cache = ObjectCache(None)
        stats = cache.fetch(api, {digest: size}, pool, range_bytes=1 << 20)
        got = cache.read(digest)
    assert stats.fetched == 1
    assert bytes(got) == want
    assert isinstance(got.obj, np.ndarray) and got.obj.nbytes == size  # one buffer: the ranges' views of it


def test_an_empty_object_is_fetched_into_memory(server) -> None:
    """An object of no bytes (no range to read into a buffer) is held, and checked, all the same."""
    from concurrent.futures import ThreadPoolExecutor

    from weightsync.client._objects import ObjectCache

    empty = hashlib.sha256(b"").hexdigest()
    with Api(server.url) as api, ThreadPoolExecutor(2) as pool:
        api.put_object(empty, b"")
        cache = ObjectCache(None)
        assert cache.fetch(api, {empty: 0}, pool).fetched == 1
        assert bytes(cache.read(empty)) == b""


@given(
    size=st.integers(1, 300),
    cuts=st.lists(st.integers(0, 300), max_size=6),
    gap=st.sampled_from(["none", "hole", "other buffer", "reversed"]),
)
@settings(max_examples=200, deadline=None)
def test_parts_are_joined_without_a_copy_only_when_they_lie_one_after_another(size, cuts, gap) -> None:
    """`_joined` gives the parts' bytes in order, always; it is a view of their buffer (no copy) exactly when the
    parts lie one after another in one buffer, else a copy."""
    from weightsync.client._objects import _joined

    buf = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    bounds = sorted({0, size, *(c for c in cuts if c < size)})
    view = buf.data.toreadonly()
    chunks: list[memoryview | bytes] = [view[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    adjacent = True
    if gap == "hole" and len(chunks) > 1 and len(chunks[0]) > 1:
        chunks[0] = chunks[0][:-1]  # a byte left out between the first two
        adjacent = False
    elif gap == "other buffer" and len(chunks) > 1:
        chunks[-1] = bytes(chunks[-1])
        adjacent = False
    elif gap == "reversed" and len(chunks) > 1:
        chunks.reverse()
        adjacent = False
    got = _joined(chunks)
    assert bytes(got) == b"".join(bytes(c) for c in chunks)
    shares = isinstance(got, memoryview) and np.shares_memory(np.frombuffer(got, dtype=np.uint8), buf)
    assert shares is adjacent


def early(status: int, code: str) -> Answer:
    """A problem answer sent as soon as the request's head is in, its body left unread; then the connection closes
    (as a server does that refuses a body over its cap: the unread bytes make the close a reset)."""
    body = f'{{"type": "https://weightsync.dev/problems/{code}", "title": "{code}", "status": {status}}}'.encode()

    def answer(conn: socket.socket) -> bool:
        head = f"HTTP/1.1 {status} X\r\nContent-Type: application/problem+json\r\nConnection: close\r\n"
        conn.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
        return False

    return answer


def test_an_answer_sent_before_the_body_was_read_is_read_all_the_same(scripted) -> None:
    """A body far larger than the sockets' buffers, refused by the server as soon as it saw the head: the client
    cannot send the rest, and reads the server's answer (413) instead of failing the request."""
    srv = scripted([early(413, "too-large")])
    piece = bytes(1 << 20)
    with Api(srv.url, retry=ONE) as api:
        assert api._direct is not None
        resp = api.request(
            "POST",
            "/v1/models/m/versions",
            headers={"Content-Length": str(128 * len(piece))},
            content=lambda: (piece for _ in range(128)),
            ok=(201, 413),
            direct_body=True,
        )
    assert resp.status_code == 413 and resp.json()["status"] == 413
    assert srv.requests[0].startswith("POST /v1/models/m/versions ")
