"""One request per update: `prepare` asks for the plan with its objects inline (getPlan?inline=N).

Real server, real transport; the transport below only records requests, and where a test says so
rewrites one answer (a byte flipped, an old server's plain JSON) to prove the fallbacks.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import httpx
import pytest

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")

from _client_util import TinyTrainer, publish_steps, tensor_bits  # noqa: E402

from weightsync import bundle  # noqa: E402
from weightsync.client import Subscriber  # noqa: E402

SMALL = {"chunk_bytes": 16 << 10, "object_bytes": 48 << 10}


class Recording(httpx.BaseTransport):
    """Passes requests to the server and records (method, path, query); `edit` may rewrite a plan's answer."""

    def __init__(self, *, edit=None, strip_inline: bool = False, strip_checked: bool = False, xxh3=None) -> None:
        self.inner = httpx.HTTPTransport()
        self.seen: list[tuple[str, str, str]] = []
        self.edit = edit
        self.strip_inline = strip_inline
        self.strip_checked = strip_checked  # the answer does not say the server checked its parts (an older server)
        self.checked: list[str | None] = []  # each plan answer's Weightsync-Checked, as the server sent it
        self.xxh3: list[dict[str, str]] = []  # each plan answer's Weightsync-Xxh3 entries, as the server sent them
        self.edit_xxh3 = xxh3  # rewrites those entries (a dict → a dict) before the client sees them
        self._lock = threading.Lock()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if self.strip_inline and "inline" in request.url.params:  # a server that predates `inline` ignores it
            request.url = request.url.copy_remove_param("inline")
        with self._lock:
            self.seen.append((request.method, request.url.path, str(request.url.query, "ascii")))
        resp = self.inner.handle_request(request)
        if not request.url.path.endswith("/plan"):
            return resp
        self.checked.append(resp.headers.get(bundle.CHECKED_HEADER))
        sent = bundle.parse_transfer_digests(resp.headers.get(bundle.XXH3_HEADER, ""))
        self.xxh3.append(sent)
        if self.edit is None and not self.strip_checked and self.edit_xxh3 is None:
            return resp
        body = resp.read()
        new = body if self.edit is None else self.edit(resp.headers.get("content-type", ""), body)
        dropped = {
            "content-length",
            *((bundle.CHECKED_HEADER.lower(), bundle.XXH3_HEADER.lower()) if self.strip_checked else ()),
            *((bundle.XXH3_HEADER.lower(),) if self.edit_xxh3 is not None else ()),
        }
        headers = [(k, v) for k, v in resp.headers.items() if k.lower() not in dropped]
        if self.edit_xxh3 is not None:
            headers.append((bundle.XXH3_HEADER, bundle.format_transfer_digests(self.edit_xxh3(sent))))
        return httpx.Response(resp.status_code, headers=headers, content=new)

    def close(self) -> None:
        self.inner.close()


def _versions(url: str, model: str, n: int) -> list[dict]:
    return publish_steps(url, model, TinyTrainer(seed=3), n, **SMALL)


def _follow(url: str, model: str, versions: list[dict], transport: Recording, **options) -> list[list[tuple]]:
    """A subscriber holding v1 prepares and applies v2..vn; the requests of each prepare. Bit-identical after each."""
    tensors = {k: v.clone() for k, v in versions[0].items()}
    requests = []
    with Subscriber(url, model, name="bundle", version=1, report=False, transport=transport, **options) as sub:
        for v in range(2, len(versions) + 1):
            transport.seen.clear()
            prepared = sub.prepare(v)
            requests.append(list(transport.seen))
            sub.apply(tensors, prepared)
            for name, want in versions[v - 1].items():
                assert torch.equal(tensor_bits(tensors[name]), tensor_bits(want)), f"v{v}: {name} differs"
    return requests


def test_a_small_update_is_one_request(server, model) -> None:
    versions = _versions(server.url, model, 3)
    per_prepare = _follow(server.url, model, versions, Recording())
    for seen in per_prepare:
        assert len(seen) == 1, seen
        method, path, query = seen[0]
        assert (method, path) == ("GET", f"/v1/models/{model}/plan") and "inline=" in query


def test_without_inline_or_above_it_the_plan_and_its_objects_are_separate_requests(server, model) -> None:
    versions = _versions(server.url, model, 3)
    for options in ({"inline_bytes": 0}, {"inline_bytes": 64}):  # 64 bytes: every update is larger
        per_prepare = _follow(server.url, model, versions, Recording(), **options)
        for seen in per_prepare:
            paths = [p for _, p, _ in seen]
            assert paths[0] == f"/v1/models/{model}/plan" and len(paths) >= 2, seen
            assert all(p.startswith("/v1/objects/") for p in paths[1:]), seen


def _flipping(where: str, at: int = -1):
    """An `edit` flipping one byte (at offset `at`) of the bundle's manifest ("manifest", its first object part)
    or of its last object ("last object"); the names of the parts it spoiled, one per answer."""
    spoiled: list[str] = []

    def flip_a_byte(kind: str, body: bytes) -> bytes:
        assert kind.startswith(bundle.MEDIA_TYPE)
        (_, plan), *parts = bundle.parts(body)
        objects = {name: bytearray(data) for name, data in parts}
        name = list(objects)[-1 if where == "last object" else 0]
        objects[name][at] ^= 1
        spoiled.append(name)
        return bundle.encode(bytes(plan), {n: bytes(d) for n, d in objects.items()})

    return flip_a_byte, spoiled


@pytest.mark.parametrize("damaged", ["last object", "manifest"])
@pytest.mark.parametrize("ahead", [False, True])
@pytest.mark.parametrize("unvouched", ["server checked", "older server", "disk cache"])
def test_an_object_damaged_in_the_bundle_is_fetched_again(
    server, model, caplog, monkeypatch, tmp_path, damaged, ahead, unvouched
) -> None:
    """A byte flipped in the bundle's last object, or in its manifest (the first object part, decoded while
    the objects after it hash): that object is fetched again, the rest used as they came. With `ahead`
    (HASH_AHEAD made small) the objects are hashed on the process's hashing thread, their hashes still
    being taken when the body has ended. Every object is hashed as it arrives whatever the answer says: when
    it says the server checked them (the result checks would miss some damaged frames, docs/FORMAT.md
    §10.3), when it does not (an older server), and when they go to a cache on disk."""
    if ahead:
        monkeypatch.setattr(bundle, "HASH_AHEAD", 1024)
    versions = _versions(server.url, model, 3)
    flip_a_byte, spoiled = _flipping(damaged)
    transport = Recording(edit=flip_a_byte, strip_checked=unvouched == "older server")
    options = {"cache_dir": tmp_path / "cache"} if unvouched == "disk cache" else {}
    with caplog.at_level(logging.WARNING, logger="weightsync.client"):
        per_prepare = _follow(server.url, model, versions, transport, **options)
    assert transport.checked == ["sha256"] * len(per_prepare)  # the server did check them
    if unvouched == "server checked":  # the damaged part was one its transfer digest named
        assert all(name in sent for sent, name in zip(transport.xxh3, spoiled, strict=True))
    for seen, name in zip(per_prepare, spoiled, strict=True):
        assert [p for _, p, _ in seen if p.startswith("/v1/objects/")] == [f"/v1/objects/{name}"], seen  # again
    assert "came with the plan with other bytes" in caplog.text


def test_a_server_that_answers_the_plan_alone_is_followed_the_usual_way(server, model) -> None:
    versions = _versions(server.url, model, 3)
    per_prepare = _follow(server.url, model, versions, Recording(strip_inline=True))
    for seen in per_prepare:
        assert [p for _, p, _ in seen][0] == f"/v1/models/{model}/plan" and len(seen) >= 2, seen


def test_a_malformed_bundle_is_a_named_error_and_changes_nothing(server, model) -> None:
    from weightsync import errors

    versions = _versions(server.url, model, 2)
    transport = Recording(edit=lambda kind, body: body[: len(body) // 2])  # cut in the middle of a part
    tensors = {k: v.clone() for k, v in versions[0].items()}
    with Subscriber(server.url, model, name="bundle", version=1, report=False, transport=transport) as sub:
        with pytest.raises(errors.BadResponse, match="truncated"):
            sub.prepare(2)
        assert sub.version == 1
    for name, want in versions[0].items():
        assert torch.equal(tensor_bits(tensors[name]), tensor_bits(want))


def test_bundle_path_in_tmp_is_not_left_behind(server, model, tmp_path: Path) -> None:
    """With a disk cache, objects that came with the plan land in it verified, like downloaded ones."""
    versions = _versions(server.url, model, 2)
    transport = Recording()
    tensors = {k: v.clone() for k, v in versions[0].items()}
    with Subscriber(
        server.url, model, name="bundle", version=1, report=False, transport=transport, cache_dir=tmp_path
    ) as sub:
        sub.apply(tensors, sub.prepare(2))
    cached = sorted(p.name for p in (tmp_path / "objects").iterdir())
    assert cached and all(len(n) == 64 for n in cached), cached  # whole objects only, no temporaries
    assert len(transport.seen) == 1


def test_a_damaged_frame_header_from_a_server_that_checked_it_is_fetched_again(server, model, caplog) -> None:
    """A byte flipped in the first frame's header of an object the server checked: its hash refuses it before any
    decode, the object is fetched again (checked); the apply is bit-identical."""
    versions = _versions(server.url, model, 3)
    flip_a_byte, spoiled = _flipping("last object", at=0)
    transport = Recording(edit=flip_a_byte)
    tensors = {k: v.clone() for k, v in versions[0].items()}
    with caplog.at_level(logging.WARNING, logger="weightsync.client"):
        with Subscriber(server.url, model, name="bundle", version=1, report=False, transport=transport) as sub:
            prepared = sub.prepare(3)  # two steps: decoded at the prepare
            sub.apply(tensors, prepared)
    assert [p for _, p, _ in transport.seen if p.startswith("/v1/objects/")] == [f"/v1/objects/{spoiled[0]}"]
    assert "came with the plan with other bytes" in caplog.text
    for name, want in versions[2].items():
        assert torch.equal(tensor_bits(tensors[name]), tensor_bits(want)), name


def test_a_plan_with_a_keyframe_step_has_its_objects_hashed_at_the_prepare(server, model) -> None:
    """A plan that starts a new chain replaces tensors whole (a failed result cannot be undone): its objects are
    hashed as they come, whatever the answer says; so are a first version's (from nothing)."""
    from weightsync.client import Publisher

    versions = _versions(server.url, model, 2)
    with Publisher(server.url, model, **SMALL) as pub:
        assert pub.publish(versions[1], keyframe=True).kind == "keyframe"
    for have in (2, None):
        transport = Recording()
        with Subscriber(server.url, model, name="bundle", version=have, report=False, transport=transport) as sub:
            prepared = sub.prepare(3)
        assert len(transport.seen) == 1 and transport.checked == ["sha256"]
        assert [s.kind for s in prepared.manifests][-1:] == ["keyframe"]
        assert any(u.replace is not None for u in prepared.updates.values())


def test_a_damaged_manifest_is_fetched_again_even_from_a_server_that_checked_it(server, model, caplog) -> None:
    """The manifests hold the checksums every result is checked against: hashed whatever the answer says."""
    versions = _versions(server.url, model, 3)
    flip_a_byte, spoiled = _flipping("manifest")
    transport = Recording(edit=flip_a_byte)
    with caplog.at_level(logging.WARNING, logger="weightsync.client"):
        per_prepare = _follow(server.url, model, versions, transport)
    assert transport.checked == ["sha256"] * len(per_prepare)
    for seen, name in zip(per_prepare, spoiled, strict=True):
        assert [p for _, p, _ in seen if p.startswith("/v1/objects/")] == [f"/v1/objects/{name}"], seen


def test_a_delta_that_adds_a_tensor_has_its_objects_hashed_at_the_prepare(server, model, caplog) -> None:
    """A tensor new in a delta is a whole replacement, which an apply cannot undo: the objects the server checked
    are hashed at the prepare, off the apply's path, and one damaged on the way is fetched again."""
    from weightsync.client import Publisher

    trainer = TinyTrainer(seed=3)
    with Publisher(server.url, model, **SMALL) as pub:
        trainer.step()
        first = {k: v.clone() for k, v in trainer.export().items()}
        pub.publish(first)
        trainer.step()
        added = torch.arange(96, dtype=torch.float32).reshape(8, 12).to(torch.bfloat16)
        grown = {**{k: v.clone() for k, v in trainer.export().items()}, "added.weight": added}
        assert pub.publish(grown).kind == "delta"
    flip_a_byte, spoiled = _flipping("last object")
    transport = Recording(edit=flip_a_byte)
    tensors = {k: v.clone() for k, v in first.items()} | {"added.weight": torch.zeros(8, 12, dtype=torch.bfloat16)}
    with caplog.at_level(logging.WARNING, logger="weightsync.client"):
        with Subscriber(server.url, model, name="bundle", version=1, report=False, transport=transport) as sub:
            prepared = sub.prepare(2)
            assert prepared.updates["added.weight"].replace is not None
            sub.apply(tensors, prepared)
    assert [p for _, p, _ in transport.seen if p.startswith("/v1/objects/")] == [f"/v1/objects/{spoiled[0]}"]
    assert "came with the plan with other bytes" in caplog.text
    for name, want in grown.items():
        assert torch.equal(tensor_bits(tensors[name]), tensor_bits(want)), name


@pytest.mark.parametrize("at", [-1, -7, -40], ids=["last", "7th-last", "40th-last"])
@pytest.mark.parametrize("steps", [1, 2])
def test_a_damaged_object_from_a_server_that_checked_it_never_becomes_a_wrong_weight(server, model, at, steps) -> None:
    """A byte flipped in the last object the server checked, wherever it falls (values, positions): the client's
    hash refuses it and fetches it again, so the apply is bit-identical whatever the flip would have decoded to
    (the result checks alone miss some damaged gaps: docs/FORMAT.md §10.3)."""
    versions = _versions(server.url, model, 3)
    flip_a_byte, spoiled = _flipping("last object", at=at)
    transport = Recording(edit=flip_a_byte)
    tensors = {k: v.clone() for k, v in versions[0].items()}
    with Subscriber(server.url, model, name="bundle", version=1, report=False, transport=transport) as sub:
        prepared = sub.prepare(1 + steps)
        assert [p for _, p, _ in transport.seen if p.startswith("/v1/objects/")] == [f"/v1/objects/{spoiled[0]}"]
        sub.apply(tensors, prepared)
        assert sub.version == 1 + steps
    for name, bits in versions[steps].items():
        assert torch.equal(tensor_bits(tensors[name]), tensor_bits(bits)), name


def test_parts_the_server_checked_are_checked_by_their_transfer_digest_not_hashed(server, model, monkeypatch) -> None:
    """A bundle whose server checked its parts names their xxh3-128 (Weightsync-Xxh3): the client checks each part
    that way and takes no SHA-256 of them, and the apply is bit-identical; an answer that does not name them (an
    older server) has every part hashed."""
    hashed: list[int] = []
    real = bundle.hashlib

    class Counting:
        @staticmethod
        def sha256(*args):
            hashed.append(1)
            return real.sha256(*args)

    monkeypatch.setattr(bundle, "hashlib", Counting)
    versions = _versions(server.url, model, 3)
    for strip, expect_hashing in ((False, False), (True, True)):
        hashed.clear()
        transport = Recording(strip_checked=strip)
        _follow(server.url, model, versions, transport)
        assert all(transport.xxh3) and transport.checked == ["sha256", "sha256"]
        assert bool(hashed) is expect_hashing, (strip, len(hashed))


@pytest.mark.parametrize("how", ["another digest", "a malformed entry"])
def test_a_transfer_digest_that_does_not_match_has_its_part_fetched_again(server, model, caplog, how) -> None:
    """The bytes intact, the xxh3 the answer names for the largest part changed on the way (another digest: the part
    is left out and fetched again, checked) or made malformed (the entry is ignored and the part hashed instead);
    either way the apply is bit-identical."""
    versions = _versions(server.url, model, 3)
    spoiled: list[str] = []

    def edit(sent: dict[str, str]) -> dict[str, str]:
        name = next(iter(sent))
        spoiled.append(name)
        return {**sent, name: ("0" * 32 if sent[name] != "0" * 32 else "1" * 32) if how == "another digest" else "zz"}

    transport = Recording(xxh3=edit)
    with caplog.at_level(logging.WARNING, logger="weightsync.client"):
        per_prepare = _follow(server.url, model, versions, transport)
    for seen, name in zip(per_prepare, spoiled, strict=True):
        fetched = [p for _, p, _ in seen if p.startswith("/v1/objects/")]
        assert fetched == ([f"/v1/objects/{name}"] if how == "another digest" else []), seen
    assert ("came with the plan with other bytes" in caplog.text) is (how == "another digest")


@pytest.mark.parametrize("size", [bundle.HASH_AHEAD - 1, bundle.HASH_AHEAD, 3 * bundle.HASH_AHEAD + 5])
def test_a_part_checked_by_its_transfer_digest_is_kept_only_when_it_matches(size: int) -> None:
    """A part the answer names an xxh3-128 for: checked at once when small, as a Future on the hashing thread when
    large (it runs while the manifests decode); either way `checked` keeps it only if its bytes match."""
    from concurrent.futures import Future

    from weightsync.client import _http

    data = memoryview(bytes(range(256)) * (size // 256) + bytes(size % 256))
    name = "a" * 64  # a part's name as the bundle gives it (its SHA-256 hex, not checked here)
    good = _http._checked_across(name, data, bundle.transfer_digest(data))
    bad = _http._checked_across(name, data, "0" * 32)
    assert isinstance(good, Future) is isinstance(bad, Future) is (size >= bundle.HASH_AHEAD)
    assert _http.checked({name: (data, good)}, [name]) == {name: data}
    assert _http.checked({name: (data, bad)}, [name]) == {}
