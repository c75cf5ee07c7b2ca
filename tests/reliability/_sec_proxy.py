"""A loopback HTTP proxy that damages response bodies deterministically, between a client and a real server.

The client talks to the proxy's URL as if it were the server. Each request is
forwarded upstream whole (one upstream connection per request, ``Connection: close``
downstream); the answer passes through unchanged unless a :class:`Fault` matches it.
A fault damages the first ``times`` matching answers (None: all of them) in one way:

- ``bitflip``: one bit in the middle of the body flipped (Content-Length kept);
- ``truncate``: the first half of the body, with an honest shorter Content-Length;
- ``cut``: the original Content-Length but only half the body, then the connection
  closes (what a dropped connection looks like);
- ``empty``: a zero-length body;
- ``swap``: the answer for another path (``swap_path``), e.g. object A's bytes for B;
- ``rewrite``: the body passed through ``rewrite(body) -> body`` (a malicious server's answer).

Faults are deterministic: no randomness, the same request sequence damages the same
answers. Bound to 127.0.0.1 only.
"""

from __future__ import annotations

import http.client
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

KINDS = ("bitflip", "truncate", "cut", "empty", "swap", "rewrite")
_HOP = {
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "content-length",
    "host",
}


@dataclass
class Fault:
    """Damage answers to requests for which ``match(method, path)`` is true; ``times`` None: every one."""

    kind: str
    match: Callable[[str, str], bool]
    times: int | None = None
    swap_path: str | None = None
    rewrite: Callable[[bytes], bytes] | None = None
    applied: int = 0
    seen: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown fault kind {self.kind!r}")
        if self.kind == "swap" and not self.swap_path:
            raise ValueError("a swap fault needs swap_path")


@dataclass
class _State:
    upstream: tuple[str, int]
    faults: list[Fault] = field(default_factory=list)
    requests: list[tuple[str, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _ProxyServer

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - keep test output quiet
        pass

    def _fault_for(self, method: str, path: str) -> Fault | None:
        st = self.server.state
        with st.lock:
            st.requests.append((method, path))
            for f in st.faults:
                if f.match(method, path):
                    f.seen += 1
                    if f.times is None or f.applied < f.times:
                        f.applied += 1
                        return f
        return None

    def _forward(
        self, method: str, path: str, headers: dict[str, str], body: bytes | None
    ) -> tuple[int, str, list[tuple[str, str]], bytes]:
        host, port = self.server.state.upstream
        conn = http.client.HTTPConnection(host, port, timeout=60)
        try:
            conn.request(method, path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            return resp.status, resp.reason, resp.getheaders(), data
        finally:
            conn.close()

    def _handle(self) -> None:
        method, path = self.command, self.path
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
        if body is not None:
            headers["Content-Length"] = str(len(body))
        fault = self._fault_for(method, path)
        if fault is not None and fault.kind == "swap":
            # Ask for the other path whole: its bytes go back as if they were this path's.
            headers.pop("Range", None)
            headers.pop("range", None)
            status, reason, resp_headers, data = self._forward(method, fault.swap_path, headers, body)
        else:
            status, reason, resp_headers, data = self._forward(method, path, headers, body)
        declared = len(data)
        send_len = len(data)
        if fault is not None and method != "HEAD" and data:
            if fault.kind == "bitflip":
                damaged = bytearray(data)
                damaged[len(damaged) // 2] ^= 0x10
                data = bytes(damaged)
            elif fault.kind == "truncate":
                data = data[: len(data) // 2]
                declared = send_len = len(data)
            elif fault.kind == "cut":
                send_len = len(data) // 2
            elif fault.kind == "empty":
                data = b""
                declared = send_len = 0
            elif fault.kind == "rewrite":
                assert fault.rewrite is not None
                data = fault.rewrite(data)
                declared = send_len = len(data)
        elif fault is not None and fault.kind == "empty":
            data, declared, send_len = b"", 0, 0
        self.send_response_only(status, reason)
        for k, v in resp_headers:
            if k.lower() not in _HOP and k.lower() not in ("date", "server"):
                self.send_header(k, v)
        if method == "HEAD":
            # A HEAD answer's Content-Length is the object's size: pass it through.
            for k, v in resp_headers:
                if k.lower() == "content-length":
                    self.send_header(k, v)
        else:
            self.send_header("Content-Length", str(declared))
        self.send_header("Connection", "close")
        self.end_headers()
        if method != "HEAD":
            self.wfile.write(data[:send_len])
        self.wfile.flush()
        self.close_connection = True

    def do_GET(self) -> None:  # noqa: N802
        self._handle()

    def do_HEAD(self) -> None:  # noqa: N802
        self._handle()

    def do_POST(self) -> None:  # noqa: N802
        self._handle()

    def do_PUT(self) -> None:  # noqa: N802
        self._handle()

    def do_DELETE(self) -> None:  # noqa: N802
        self._handle()


class _ProxyServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, state: _State) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.state = state


class CorruptingProxy:
    """``with CorruptingProxy(upstream_url) as proxy:`` — point the client at ``proxy.url``."""

    def __init__(self, upstream: str) -> None:
        parts = urlsplit(upstream)
        self.state = _State((parts.hostname or "127.0.0.1", parts.port or 80))
        self._server = _ProxyServer(self.state)
        self._thread = threading.Thread(target=self._server.serve_forever, name="corrupting-proxy", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def set_faults(self, *faults: Fault) -> None:
        """Replace the active faults (none: pass everything through). The request log is kept."""
        with self.state.lock:
            self.state.faults = list(faults)

    @property
    def requests(self) -> list[tuple[str, str]]:
        with self.state.lock:
            return list(self.state.requests)

    def __enter__(self) -> CorruptingProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)


def object_path(digest: str) -> Callable[[str, str], bool]:
    """Matches GET requests for object ``digest`` (whole or ranged)."""
    target = f"/v1/objects/{digest}"
    return lambda method, path: method == "GET" and path.split("?", 1)[0] == target
