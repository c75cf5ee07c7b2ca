"""The WAN emulator the relay tests and benchmarks use (tests/_wan.py): exact bytes, counted, and outages."""

from __future__ import annotations

import os
import socket
import threading

import pytest
from _wan import WanLink


@pytest.fixture
def echo():
    """A TCP server on loopback that sends back everything it reads, then closes."""
    srv = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            with conn:
                while data := conn.recv(1 << 16):
                    conn.sendall(data)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield srv.getsockname()
    stop.set()
    t.join(5)
    srv.close()


def _roundtrip(port: int, payload: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        sender = threading.Thread(target=lambda: (s.sendall(payload), s.shutdown(socket.SHUT_WR)))
        sender.start()
        got = bytearray()
        while data := s.recv(1 << 16):
            got += data
        sender.join(30)
    return bytes(got)


def test_bytes_cross_unchanged_and_are_counted_per_direction(echo) -> None:
    payload = os.urandom(3 << 20)
    with WanLink(echo, mbit_s=800, delay_s=0.005) as link:
        assert _roundtrip(link.port, payload) == payload
        assert _roundtrip(link.port, b"x" * 1000) == b"x" * 1000
        assert (link.up_bytes, link.down_bytes, link.connections) == (len(payload) + 1000, len(payload) + 1000, 2)


def test_a_severed_link_drops_connections_until_restored(echo) -> None:
    with WanLink(echo) as link:
        held = socket.create_connection(("127.0.0.1", link.port), timeout=10)
        held.sendall(b"ping")
        assert held.recv(4) == b"ping"
        link.sever()
        assert held.recv(4) == b""  # cut
        held.close()
        with socket.create_connection(("127.0.0.1", link.port), timeout=10) as s:
            assert s.recv(4) == b""  # refused while down
        link.restore()
        assert _roundtrip(link.port, b"back") == b"back"
