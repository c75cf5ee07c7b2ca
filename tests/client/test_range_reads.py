"""An update too large for the plan's answer is read as parallel ranges into one buffer per object, and every
object is checked against its SHA-256 before the update is used (docs/DESIGN.md "Subscribe"): the apply's
result checks are not enough on their own. The FORMAT v2 checksum is linear, and a damaged gap plane that moves
a run of changes whose values sum to zero moves no lane (session 36's review found 1-3 of 200-300 random
single-bit flips of range-read objects applied silently when they were taken unhashed).

Real server, real transport (httpx's, so each answer can be seen and damaged); the subscribers read every
update as ranges (``inline_bytes=0``) of 1 KiB, so each object comes in several.
"""

from __future__ import annotations

import threading

import httpx
import pytest

torch = pytest.importorskip("torch")

from _client_util import TinyTrainer, publish_steps, tensor_bits  # noqa: E402

from weightsync import errors  # noqa: E402
from weightsync.client import Subscriber  # noqa: E402
from weightsync.client._http import Api  # noqa: E402

SMALL = {"chunk_bytes": 16 << 10, "object_bytes": 48 << 10}
RANGES = {"inline_bytes": 0, "range_bytes": 1024}


class Objects(httpx.BaseTransport):
    """Passes requests to the server and records the object reads; `flip` (digest, where) flips one byte of that
    object where the answers carry it: "last" its last byte, "first" its first (a frame's header); `flips` times
    at most."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.reads: list[str] = []
        self.flip: tuple[str, str] | None = None
        self.flips = 1 << 30
        self._lock = threading.Lock()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        resp = self.inner.handle_request(request)
        if not request.url.path.startswith("/v1/objects/") or request.method != "GET":
            return resp
        digest = request.url.path.rsplit("/", 1)[1]
        with self._lock:
            self.reads.append(digest)
        if self.flip is None or self.flip[0] != digest:
            return resp
        body = bytearray(resp.read())
        first, _, rest = resp.headers.get("content-range", "bytes 0-0/0").removeprefix("bytes ").partition("-")
        last, _, size = rest.partition("/")
        at = 0 if self.flip[1] == "first" else int(size) - 1
        if not body or not int(first) <= at <= int(last) or not self.flips:
            return resp
        body[at - int(first)] ^= 0x01
        self.flips -= 1
        headers = [(k, v) for k, v in resp.headers.items() if k.lower() != "content-length"]
        return httpx.Response(resp.status_code, headers=headers, content=bytes(body))

    def close(self) -> None:
        self.inner.close()


def _versions(url: str, model: str, n: int) -> list[dict]:
    return publish_steps(url, model, TinyTrainer(seed=3), n, **SMALL)


def _largest_object(url: str, model: str, have: int, want: int) -> str:
    with Api(url) as api:
        plan = api.get_plan(model, have=have, want=want)
    return max((o for s in plan.steps for o in s.objects), key=lambda o: o.size).digest


def _same(tensors: dict, want: dict) -> None:
    for name, bits in want.items():
        assert torch.equal(tensor_bits(tensors[name]), tensor_bits(bits)), name


def test_an_update_read_as_ranges_is_bit_identical_version_after_version(server, model) -> None:
    """Each object comes in several ranges; the prepare checks it whole, the apply is bit-identical."""
    versions = _versions(server.url, model, 4)
    transport = Objects()
    tensors = {k: v.clone() for k, v in versions[0].items()}
    with Subscriber(server.url, model, name="r", version=1, report=False, transport=transport, **RANGES) as sub:
        for v in (2, 3, 4):
            transport.reads.clear()
            prepared = sub.prepare(v)
            objects = set().union(*(m.objects() for m in prepared.manifests))
            assert objects
            assert any(transport.reads.count(d) > 1 for d in objects), "an object read in several ranges"
            sub.apply(tensors, prepared)
            assert sub.version == v
            _same(tensors, versions[v - 1])


@pytest.mark.parametrize("where", ["last", "first"])
def test_a_byte_damaged_in_a_range_is_refused_at_prepare_before_any_write(server, model, where) -> None:
    """A byte of the update's largest object flipped on the way (its last, in the values; its first, a frame's
    header): the prepare refuses the object (DigestMismatch) before the apply could write anything, whatever the
    apply would check; the tensors hold v1, and the next prepare brings v2 bit-identical."""
    versions = _versions(server.url, model, 2)
    transport = Objects()
    transport.flip = (_largest_object(server.url, model, 1, 2), where)
    tensors = {k: v.clone() for k, v in versions[0].items()}
    with Subscriber(server.url, model, name="r", version=1, report=False, transport=transport, **RANGES) as sub:
        with pytest.raises(errors.DigestMismatch, match=transport.flip[0]):
            sub.prepare(2)
        assert sub.version == 1
        _same(tensors, versions[0])
        transport.flip = None
        sub.apply(tensors, sub.prepare(2))
        assert sub.version == 2
    _same(tensors, versions[1])
