"""A loopback HTTP proxy in front of a weightsync server that counts the object downloads passing through it.

One proxy stands for one host: every worker of that host talks to the server through it, so
``downloads`` is what the server sent that host, per object and byte range
(``GET /v1/objects/{digest}`` with its ``Range`` header, ``""`` when whole; an object that came
inside a plan bundle, ``getPlan?inline=N``, counts as sent whole).
"""

from __future__ import annotations

import http.client
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from weightsync import bundle

_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "proxy-connection"}


class CountingProxy:
    """Forwards every request to ``upstream`` (a ``http://host:port`` URL); ``url`` is where to send them."""

    def __init__(self, upstream: str) -> None:
        target = urlsplit(upstream)
        self.downloads: Counter[tuple[str, str]] = Counter()
        self.bytes = 0
        lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _relay(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                conn = http.client.HTTPConnection(target.hostname, target.port, timeout=300)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                finally:
                    conn.close()
                if self.command == "GET" and self.path.startswith("/v1/objects/") and resp.status in (200, 206):
                    digest = self.path.split("?", 1)[0].rsplit("/", 1)[1]
                    with lock:
                        proxy.downloads[(digest, self.headers.get("Range", ""))] += 1
                        proxy.bytes += len(data)
                elif resp.status == 200 and (resp.getheader("Content-Type") or "").startswith(bundle.MEDIA_TYPE):
                    inlined = [(name, len(part)) for name, part in bundle.parts(data) if name != bundle.PLAN]
                    with lock:
                        for digest, size in inlined:
                            proxy.downloads[(digest, "")] += 1
                            proxy.bytes += size
                self.send_response(resp.status, resp.reason)
                for k, v in resp.getheaders():
                    if k.lower() not in _HOP:
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = do_PATCH = _relay

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="counting-proxy", daemon=True)
        self._thread.start()

    def objects(self) -> Counter[str]:
        """How many times each object's bytes were sent (per range: the largest count over its ranges)."""
        out: Counter[str] = Counter()
        for (digest, _), n in self.downloads.items():
            out[digest] = max(out[digest], n)
        return out

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
