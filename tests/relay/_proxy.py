"""A TCP proxy on loopback for the relay tests: counts the bytes it carries, can slow them down, cut the link,
and flip a byte of an object on its way.

Each accepted connection is forwarded to ``target`` by two threads (one per direction). The
upstream → client direction sleeps as needed to stay under ``rate`` bytes/s (all connections
together; None: no limit), which a test can change at any time: a relay's prefetch through a slow
proxy is in flight long enough to be killed in the middle.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time


class Proxy:
    """Forward 127.0.0.1:``port`` to ``target`` (host, port); ``down`` counts bytes from the target."""

    CORRUPT_AT = 4096  # past the response headers, inside the object's bytes

    def __init__(self, target: tuple[str, int], *, rate: float | None = None) -> None:
        self.target = target
        self.rate = rate
        self.down = 0
        self._lock = threading.Lock()
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._conns: list[socket.socket] = []
        self._closed = False
        self._down = False
        # Bytes of object answers (GET /v1/objects/…) the target may still send, all connections together,
        # before the proxy holds them; None: any.
        self.budget: int | None = None
        self.corrupt: str | None = None  # a digest: flip one byte of the next answer to a GET of that object
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self) -> None:
        """The link goes down: every open connection is reset, new ones are closed at once (until :meth:`mend`)."""
        self._down = True
        self._close_all()

    def mend(self) -> None:
        """The link is back."""
        self._down = False

    def _close_all(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                s.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            if self._down:
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=10)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._conns += [client, upstream]
            state: dict = {}  # shared by the connection's two directions
            threading.Thread(target=self._pipe, args=(client, upstream, False, state), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, True, state), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, down: bool, state: dict | None = None) -> None:
        try:
            seen = 0  # bytes of the current object answer (down) since the request for `corrupt` went up
            while True:
                rate = self.rate if down else None
                data = src.recv(16384 if rate is None else max(1024, min(16384, int(rate / 20))))
                if not data:
                    break
                if not down and state is not None and b" HTTP/1.1\r\n" in data:  # a request goes up
                    state["object"] = b"GET /v1/objects/" in data
                    if self.corrupt is not None and f"GET /v1/objects/{self.corrupt} ".encode() in data:
                        state["armed"] = True
                if down:
                    # The budget holds object answers only: the rest of the API keeps working meanwhile.
                    held = state is not None and state.get("object")
                    while held and self.budget is not None and self.budget < len(data) and not self._closed:
                        time.sleep(0.01)  # held until the test grants more bytes
                    with self._lock:
                        self.down += len(data)
                        if held and self.budget is not None:
                            self.budget -= len(data)
                    if state is not None and state.get("armed"):
                        if seen <= self.CORRUPT_AT < seen + len(data):
                            flipped = bytearray(data)
                            flipped[self.CORRUPT_AT - seen] ^= 0xFF
                            data = bytes(flipped)
                            state["armed"] = False
                        seen += len(data)
                    if rate:
                        time.sleep(len(data) / rate)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._closed = True
        self._sock.close()
        self._close_all()
