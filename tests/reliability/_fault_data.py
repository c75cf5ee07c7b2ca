"""Consecutive test versions of a model (safetensors + config), their expected file digests, and
an httpx transport that records what the client saw, for the reliability tests.
"""

from __future__ import annotations

import hashlib
import threading
from collections import Counter
from collections.abc import Callable

import httpx
import numpy as np
from _ckpt import safetensors_file

from weightsync.codec import Checkpoint

__all__ = ["ClientStats", "RecordingTransport", "kind_of", "checkpoint_of", "digests_of", "make_versions"]


def make_versions(
    n: int, *, seed: int, big: int = 2 << 20, small: int = 4, fraction: float = 0.02
) -> list[dict[str, bytes]]:
    """``n`` consecutive versions (file name → bytes): two ``big``-byte BF16 tensors and ``small``
    little F32 ones; each step flips one bit in ``fraction`` of the bytes, like a training step."""
    rng = np.random.default_rng(seed)
    tensors: dict[str, tuple[str, tuple[int, ...], np.ndarray]] = {}
    for i in range(2):
        tensors[f"layer.{i}.weight"] = ("BF16", (big // 2048, 1024), rng.integers(0, 256, big, dtype=np.uint8))
    for i in range(small):
        tensors[f"layer.{i}.bias"] = ("F32", (1024,), rng.integers(0, 256, 4096, dtype=np.uint8))
    out = []
    for step in range(n):
        if step:
            nxt = {}
            for name, (dt, shape, data) in tensors.items():
                d = data.copy()
                idx = rng.integers(0, len(d), size=max(1, int(len(d) * fraction)))
                d[idx] ^= 1
                nxt[name] = (dt, shape, d)
            tensors = nxt
        out.append(
            {
                "model.safetensors": safetensors_file(tensors, {"step": str(step)}),
                "config.json": b'{"hidden": 1024, "step": %d}' % step,
            }
        )
    return out


def checkpoint_of(files: dict[str, bytes]) -> Checkpoint:
    return Checkpoint.from_bytes(files)


def digests_of(files: dict[str, bytes]) -> dict[str, str]:
    return {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}


class ClientStats:
    """What clients saw, summed over their transports (thread-safe): statuses, transport errors, Retry-After."""

    def __init__(self) -> None:
        self.statuses: Counter[tuple[str, str, int]] = Counter()
        self.errors: Counter[str] = Counter()
        self.retry_after: list[str | None] = []
        self._lock = threading.Lock()

    def transport(self, hook: Callable[[httpx.Request], None] | None = None) -> RecordingTransport:
        """A new transport reporting here: one per client, since a client closes its transport."""
        return RecordingTransport(self, hook)

    def count(self, status: int) -> int:
        with self._lock:
            return sum(n for (_, _, s), n in self.statuses.items() if s == status)

    def count_kind(self, kind: str, status: int | None = None) -> int:
        with self._lock:
            return sum(n for (_, k, s), n in self.statuses.items() if k == kind and status in (None, s))


def kind_of(request: httpx.Request) -> str:
    """A coarse name of the API call (or ``presigned`` for a request straight to S3); ``commit`` for either
    request that commits (commitPublish, publishVersion)."""
    path = request.url.path
    if "X-Amz-Signature" in str(request.url.query):
        return "presigned"
    if path.startswith("/v1/objects"):
        return "object"
    if request.method == "POST" and path.endswith("/versions"):
        return "commit"  # publishVersion: a whole publish in one request, its commit included
    for part in ("commit", "objects", "publishes", "plan", "manifest", "replicas", "versions"):
        if f"/{part}" in path:
            return part
    return path


class RecordingTransport(httpx.HTTPTransport):
    """httpx's transport, reporting to a :class:`ClientStats`, optionally running ``hook(request)`` first
    (a test cuts a dependency there)."""

    def __init__(self, stats: ClientStats, hook: Callable[[httpx.Request], None] | None = None) -> None:
        super().__init__()
        self.stats = stats
        self.hook = hook

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if self.hook is not None:
            self.hook(request)
        st = self.stats
        try:
            resp = super().handle_request(request)
        except httpx.TransportError as exc:
            with st._lock:
                st.errors[f"{type(exc).__name__} on {request.method} {kind_of(request)}"] += 1
            raise
        with st._lock:
            st.statuses[(request.method, kind_of(request), resp.status_code)] += 1
            if resp.status_code == 503:
                st.retry_after.append(resp.headers.get("retry-after"))
        return resp
