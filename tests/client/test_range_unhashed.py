"""An update too large for the plan's answer is read as parallel ranges; for an in-place apply that checks its
results, its objects go into the prepare's memory unhashed, as a checked plan bundle's do (docs/DESIGN.md
"Subscribe").

Real server, real transport (httpx's, so each answer can be seen and, where a test says so, damaged); the
subscribers read every update as ranges (``inline_bytes=0``) of 1 KiB, so each object comes in several.
"""

from __future__ import annotations

import logging
import threading

import httpx
import pytest

torch = pytest.importorskip("torch")

from _client_util import TinyTrainer, publish_steps, tensor_bits  # noqa: E402

from weightsync import errors  # noqa: E402
from weightsync.client import Publisher, Subscriber  # noqa: E402
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


def test_an_update_read_as_ranges_goes_unhashed_into_memory_and_applies_bit_identical(server, model) -> None:
    """Each object of the update comes in several ranges and is kept unhashed (the manifests are hashed); the apply
    checks every result and is bit-identical, version after version."""
    versions = _versions(server.url, model, 4)
    transport = Objects()
    tensors = {k: v.clone() for k, v in versions[0].items()}
    with Subscriber(server.url, model, name="r", version=1, report=False, transport=transport, **RANGES) as sub:
        for v in (2, 3, 4):
            transport.reads.clear()
            prepared = sub.prepare(v)
            objects = set().union(*(m.objects() for m in prepared.manifests))
            assert objects and set(prepared.unhashed_objects) == objects
            assert any(transport.reads.count(d) > 1 for d in objects), "an object read in several ranges"
            sub.apply(tensors, prepared)
            assert prepared.unhashed_objects == {} and sub.version == v
            _same(tensors, versions[v - 1])


@pytest.mark.parametrize("verify", [True, False])
def test_a_byte_damaged_in_a_range_fails_the_apply_and_changes_nothing(server, model, verify) -> None:
    """The last byte of the update's largest object flipped on the way: with verification the result check fails
    and every change is undone, without it the object is hashed before any write; either way DigestMismatch names
    it, the tensors hold v1 and the next prepare brings v2 bit-identical."""
    versions = _versions(server.url, model, 2)
    transport = Objects()
    transport.flip = (_largest_object(server.url, model, 1, 2), "last")
    tensors = {k: v.clone() for k, v in versions[0].items()}
    with Subscriber(server.url, model, name="r", version=1, report=False, transport=transport, **RANGES) as sub:
        prepared = sub.prepare(2)
        assert transport.flip[0] in prepared.unhashed_objects
        then = "every change was undone" if verify else "nothing was changed"
        with pytest.raises(errors.DigestMismatch, match=f"{transport.flip[0]} was received with other bytes; {then}"):
            sub.apply(tensors, prepared, verify=verify)
        assert sub.version == 1
        _same(tensors, versions[0])
        transport.flip = None
        sub.apply(tensors, sub.prepare(2), verify=verify)
        assert sub.version == 2
    _same(tensors, versions[1])


@pytest.mark.parametrize("want", [2, 3], ids=["one step", "two steps"])
def test_a_damaged_frame_header_in_a_range_is_fetched_again_at_prepare(server, model, caplog, want) -> None:
    """The first byte of the largest object (a frame's header) flipped once: the prepare refuses it, hashes what it
    took unhashed, fetches that object again (checked) and goes on; the apply is bit-identical."""
    versions = _versions(server.url, model, 3)
    transport = Objects()
    damaged = _largest_object(server.url, model, 1, want)
    transport.flip = (damaged, "first")
    tensors = {k: v.clone() for k, v in versions[0].items()}
    transport.flips = 1
    with caplog.at_level(logging.WARNING, logger="weightsync.client"):
        with Subscriber(server.url, model, name="r", version=1, report=False, transport=transport, **RANGES) as sub:
            prepared = sub.prepare(want)
            assert transport.flips == 0 and transport.reads.count(damaged) > 1
            assert damaged not in prepared.unhashed_objects
            sub.apply(tensors, prepared)
    assert f"objects {damaged} were received with other bytes" in caplog.text
    _same(tensors, versions[want - 1])


def test_a_keyframe_plan_a_disk_cache_and_a_first_version_hash_what_they_read_as_ranges(
    server, model, tmp_path
) -> None:
    """A plan that replaces tensors whole (a keyframe step, or from nothing) and a cache on disk take nothing
    unhashed: a failed whole replacement cannot be undone, and a disk cache outlives the apply."""
    versions = _versions(server.url, model, 2)
    with Publisher(server.url, model, **SMALL) as pub:
        assert pub.publish(versions[1], keyframe=True).kind == "keyframe"
    for have, options in ((2, {}), (None, {}), (1, {"cache_dir": tmp_path / "cache"})):
        with Subscriber(server.url, model, name="r", version=have, report=False, **RANGES, **options) as sub:
            prepared = sub.prepare(3 if have is not None else 2)
            assert prepared.unhashed_objects == {}, (have, options)
