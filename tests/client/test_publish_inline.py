"""One request per version: `Publisher.publish` sends a small delta whole (publishVersion).

Real server, real transport; the transport below only records requests, and where a test says so
answers one request itself (an old server's 405) or loses an answer after the server acted.
"""

from __future__ import annotations

import threading

import httpx
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from _client_util import (  # noqa: E402
    TinyTrainer,
    follow,
    start_server,
    stop_server,
    tree_bytes,
    write_version,
)

from weightsync import errors  # noqa: E402
from weightsync.client import Publisher, Subscriber  # noqa: E402
from weightsync.client._http import Api  # noqa: E402
from weightsync.client.wire import Retry  # noqa: E402

PUBLISH_VERSION = "/versions"


class Recording(httpx.BaseTransport):
    """Passes requests on and records (method, path); `old` answers publishVersion 405 as an older server;
    `lose` drops the answer to that many publishVersion requests after the server acted on them."""

    def __init__(self, *, old: bool = False, lose: int = 0) -> None:
        self.inner = httpx.HTTPTransport()
        self.seen: list[tuple[str, str]] = []
        self.old, self.lose = old, lose
        self._lock = threading.Lock()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        with self._lock:
            self.seen.append((request.method, request.url.path))
        one = request.method == "POST" and request.url.path.endswith(PUBLISH_VERSION)
        if one and self.old:
            return httpx.Response(405, json={"detail": "Method Not Allowed"})
        resp = self.inner.handle_request(request)
        if one and self.lose:
            resp.read()
            self.lose -= 1
            raise httpx.ReadError("connection reset before the answer")
        return resp

    def close(self) -> None:
        self.inner.close()

    def take(self) -> list[tuple[str, str]]:
        with self._lock:
            out, self.seen = self.seen, []
        return out


def kinds(seen: list[tuple[str, str]]) -> list[str]:
    """The requests a publish made, by what they are."""
    out = []
    for method, path in seen:
        if method == "POST" and path.endswith(PUBLISH_VERSION):
            out.append("publishVersion")
        elif method == "POST" and path.endswith("/publishes"):
            out.append("begin")
        elif method == "PUT" and path.startswith("/v1/objects/"):
            out.append("put")
        elif method == "POST" and path.endswith("/commit"):
            out.append("commit")
        elif method == "POST" and path.endswith("/objects"):
            out.append("check")
        else:
            out.append(f"{method} {path}")
    return out


def test_a_small_delta_is_one_request_and_arrives_bit_identical(server, model) -> None:
    trainer, rec = TinyTrainer(seed=11), Recording()
    with Publisher(server.url, model, transport=rec) as pub:
        first = pub.publish(trainer.export(), step=0)
        assert first.kind == "keyframe" and "publishVersion" not in kinds(rec.take())  # no base held yet
        for step in (1, 2, 3):
            trainer.step()
            r = pub.publish(trainer.export(), step=step)
            assert (r.kind, r.version, r.parent, r.step) == ("delta", step + 1, step, step)
            assert kinds(rec.take()) == ["publishVersion"]
            assert r.objects_uploaded == r.objects_total and r.bytes_sent > 0
            # The server's phases (its Server-Timing answer), within the request's own time: the objects
            # stored, then the begin and the commit in one catalog transaction (no begin phase of its own).
            server_side = [r.timings[f"server_{p}_s"] for p in ("store", "commit")]
            assert all(s >= 0 for s in server_side) and sum(server_side) <= r.timings["upload_s"]
            assert "server_begin_s" not in r.timings
    follow(server.url, model, trainer.export(), name="inline-check")
    with Subscriber(server.url, model, name="timed", report=False) as sub:
        got = {k: torch.zeros_like(v) for k, v in trainer.export().items()}
        sub.apply(got, sub.prepare())  # a keyframe: the plan's objects come with it
        assert 0 <= sub.timings["server_plan_s"] <= sub.timings["plan_s"]


def test_inline_bytes_zero_or_too_small_takes_three_requests(server, model) -> None:
    for options in ({"inline_bytes": 0}, {"inline_bytes": 100}):
        trainer, rec = TinyTrainer(seed=12), Recording()
        name = f"{model}-{options['inline_bytes']}"
        with Publisher(server.url, name, transport=rec, **options) as pub:
            pub.publish(trainer.export())
            rec.take()
            trainer.step()
            assert pub.publish(trainer.export()).kind == "delta"
            seen = kinds(rec.take())
            assert "publishVersion" not in seen and seen[0] == "begin" and seen[-1] == "commit" and "put" in seen
        follow(server.url, name, trainer.export(), name="inline-check")
    with pytest.raises(ValueError):
        Publisher(server.url, model, inline_bytes=-1)


def test_an_older_server_is_asked_once_then_three_requests(server, model) -> None:
    trainer, rec = TinyTrainer(seed=13), Recording(old=True)
    with Publisher(server.url, model, transport=rec) as pub:
        pub.publish(trainer.export())
        rec.take()
        for expect_probe in (True, False):
            trainer.step()
            assert pub.publish(trainer.export()).kind == "delta"
            seen = kinds(rec.take())
            assert seen.count("publishVersion") == (1 if expect_probe else 0)
            assert seen[-1] == "commit"
    follow(server.url, model, trainer.export(), name="inline-check")


def test_a_lost_answer_is_retried_and_replayed_not_published_twice(server, model) -> None:
    """The server committed, the answer was lost: the retry gets the same version; no second version."""
    trainer, rec = TinyTrainer(seed=14), Recording()
    with Publisher(server.url, model, transport=rec, retry=Retry(attempts=3, base=0.01)) as pub:
        pub.publish(trainer.export())
        trainer.step()
        rec.take()
        rec.lose = 1
        r = pub.publish(trainer.export())
        assert (r.version, r.kind) == (2, "delta")
        assert kinds(rec.take()) == ["publishVersion", "publishVersion"]
        trainer.step()
        assert pub.publish(trainer.export()).version == 3  # and the publisher goes on from it
    with Api(server.url) as api:
        assert [v.number for v in api.list_versions(model)] == [1, 2, 3]
    follow(server.url, model, trainer.export(), name="inline-check")


@pytest.mark.parametrize("source", ["state_dict", "path"])
def test_when_the_chain_policy_wants_a_keyframe_the_publisher_sends_one(server, model, tmp_path, source) -> None:
    """The server answers 202 (a keyframe is due): the publisher encodes one and commits it; from files, the
    next base patched during the refused request is undone first, and after every publish the base holds
    exactly the files published."""
    trainer, rec = TinyTrainer(seed=15), Recording()

    def version(i: int):
        if source == "state_dict":
            return trainer.export()
        return write_version(tmp_path / f"v{i}", trainer.export())

    def base_is(path) -> None:
        if source == "path":
            held = pub._base.held()
            assert held is not None and {f.layout.path: bytes(f.data) for f in held.checkpoint.files} == tree_bytes(
                path
            )

    with Publisher(server.url, model, transport=rec) as pub:
        pub.publish(v := version(0))
        base_is(v)
        pub.api.update_model(model, keyframe_interval=3)
        for i in (1, 2):
            trainer.step()
            assert pub.publish(v := version(i)).kind == "delta"
            base_is(v)
        trainer.step()
        rec.take()
        r = pub.publish(v := version(3))  # the chain holds 3 versions: the server answers 202
        assert (r.kind, r.version) == ("keyframe", 4)
        seen = kinds(rec.take())
        assert seen[0] == "publishVersion" and seen[-1] == "commit"
        base_is(v)
        trainer.step()
        assert pub.publish(v := version(4)).kind == "delta"
        base_is(v)
    follow(server.url, model, trainer.export(), name="inline-check")


def test_a_stale_base_catches_up_and_a_removal_is_refused_before_sending(server, model) -> None:
    trainer, rec = TinyTrainer(seed=16), Recording()
    with Publisher(server.url, model, transport=rec) as a, Publisher(server.url, model) as b:
        a.publish(trainer.export())
        trainer.step()
        b.publish(trainer.export())  # b catches up on v1, publishes v2
        trainer.step()
        r = a.publish(trainer.export())  # a holds v1: its one request is stale, it catches up
        assert r.version == 3 and r.parent == 2
        rec.take()
        smaller = dict(list(trainer.export().items())[1:])
        with pytest.raises(errors.RemovesContent):
            a.publish(smaller)
        assert "publishVersion" not in kinds(rec.take())
    follow(server.url, model, trainer.export(), name="inline-check")


def test_a_lost_answer_keeps_the_base_whole_and_the_same_publish_again_replays_as_a_delta(
    server, model, tmp_path
) -> None:
    """From files (bytes not the publisher's), the next base is the held one patched by the delta's own
    frames after the commit (the first publishVersion), or, once a publish went in one request, written
    into the held base by the encode itself (Encoder keep_base), undone if the request fails: a request
    whose answer is lost leaves the held base whole (its version, its bytes), so the same publish again
    is replayed (the version the lost request committed, still a delta) and the chain goes on in deltas,
    right to the bit."""
    from weightsync.client import base as base_mod

    trainer, rec = TinyTrainer(seed=17), Recording()
    paths = []
    for i in range(5):
        paths.append(write_version(tmp_path / f"v{i}", trainer.export()))
        trainer.step()
    patched: list[int | None] = []
    real = base_mod.patch_jobs

    undos: list[int | None] = []  # bases made during the request (their undo made ready)
    kept: list[int | None] = []  # bases the encode wrote
    real_kept = base_mod.BaseKeeper.kept

    def spy(old, manifest, objects, *, undo=False):
        (undos if undo else patched).append(manifest.parent)
        return real(old, manifest, objects, undo=undo)

    def spy_kept(self, checkpoint, manifest, objects):
        kept.append(manifest.parent)
        return real_kept(self, checkpoint, manifest, objects)

    with (
        pytest.MonkeyPatch.context() as mp,
        Publisher(server.url, model, transport=rec, retry=Retry(attempts=2, base=0.01)) as pub,
    ):
        mp.setattr(base_mod, "patch_jobs", spy)
        mp.setattr(base_mod.BaseKeeper, "kept", spy_kept)
        assert [pub.publish(p).kind for p in paths[:3]] == ["keyframe", "delta", "delta"]
        # v2 (the first publishVersion) was patched in after its commit; v3 went in one request as v2 did:
        # its encode wrote it into the base
        assert patched == [1] and kept == [2] and undos == [2], (patched, kept, undos)
        rec.lose = 2  # both attempts' answers lost: the version committed, the publisher cannot know
        with pytest.raises(errors.ServerUnavailable):
            pub.publish(paths[3])
        # The failed publish's encode wrote v4 into the base; that was undone (the base's bytes below are v3's).
        assert patched == [1] and kept == [2, 3] and undos == [2, 3], (patched, kept, undos)
        held = pub._base.held()
        assert held is not None and held.state.number == 3
        assert {f.layout.path: bytes(f.data) for f in held.checkpoint.files} == tree_bytes(paths[2])
        r = pub.publish(paths[3])  # the same version again: the server answers what the lost request committed
        assert (r.version, r.parent, r.kind) == (4, 3, "delta")
        r = pub.publish(paths[4])
        assert (r.version, r.parent, r.kind) == (5, 4, "delta")
    with Subscriber(server.url, model, name="paths") as sub:
        sub.pull(tmp_path / "out")
    assert tree_bytes(tmp_path / "out") == tree_bytes(paths[4])


def test_a_base_copied_during_the_request_is_dropped_when_it_fails(server, model, tmp_path) -> None:
    """A delta whose frames cannot be applied into the held base (a tensor moved in the file) has the
    next base copied in while the one request is in flight: a request that fails leaves no half-copied
    base behind (the next publish is a keyframe, right to the bit)."""
    import safetensors.numpy as stn

    from weightsync.client import base as base_mod

    rec = Recording()
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal(4000).astype(np.float32), rng.standard_normal(4000).astype(np.float32)
    paths = []
    for i, names in enumerate([("a", "b"), ("a", "b"), ("b", "c"), ("b", "c")]):  # v2: "a" renamed "c"
        d = tmp_path / f"v{i}"
        d.mkdir()
        a, b = a.copy(), b.copy()
        a[rng.integers(0, a.size, 40)] += 1.0
        stn.save_file({names[0]: a, names[1]: b} if names[0] == "a" else {"c": a, "b": b}, str(d / "w.safetensors"))
        paths.append(d)
    copies = []
    real = base_mod.BaseKeeper._copy_jobs

    def spy(self, old, checkpoint, manifest):
        copies.append(manifest.parent)
        return real(self, old, checkpoint, manifest)

    with Publisher(server.url, model, transport=rec, retry=Retry(attempts=2, base=0.01)) as pub:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(base_mod.BaseKeeper, "_copy_jobs", spy)
            assert [pub.publish(p).kind for p in paths[:2]] == ["keyframe", "delta"]
            assert copies == []  # the delta's frames were applied into the base: nothing copied
            rec.lose = 2
            with pytest.raises(errors.ServerUnavailable):
                pub.publish(paths[2], allow_removals=True)
            assert copies == [2]  # "b" moved: the next base was being copied in during the request
            assert pub._base.held() is None
        r = pub.publish(paths[3], allow_removals=True)  # on the head (v3, committed by the lost request)
        assert (r.version, r.parent, r.kind) == (4, 3, "keyframe")
    with Subscriber(server.url, model, name="paths") as sub:
        sub.pull(tmp_path / "out")
    assert tree_bytes(tmp_path / "out") == tree_bytes(paths[3])


def test_a_body_over_the_server_s_cap_goes_in_three_requests_and_is_not_tried_again(tmp_path) -> None:
    """A server whose body cap is below the publisher's inline_bytes answers 413: that version goes the
    usual way, and the next one of that size is not offered in one request again."""
    srv = start_server(tmp_path / "srv", env={"WEIGHTSYNC_MAX_JSON_BODY": str(4 << 10)})
    try:
        trainer, rec = TinyTrainer(seed=18), Recording()
        with Publisher(srv.url, "capped", transport=rec, inline_bytes=64 << 20) as pub:
            pub.publish(trainer.export())
            rec.take()
            for expect_try in (True, False):
                trainer.step()
                assert pub.publish(trainer.export()).kind == "delta"
                seen = kinds(rec.take())
                assert seen.count("publishVersion") == (1 if expect_try else 0) and seen[-1] == "commit"
        follow(srv.url, "capped", trainer.export(), name="inline-check")
    finally:
        stop_server(srv)


class DirectSends:
    """Records what goes through the direct path (client/_direct.py): (method, path, whether a body went)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from weightsync.client import _direct

        self.seen: list[tuple[str, str, bool]] = []
        real = _direct.Direct.send

        def send(direct, request, *, timeout=None, body=None):
            self.seen.append((request.method, request.url.path, body is not None))
            return real(direct, request, timeout=timeout, body=body)

        monkeypatch.setattr(_direct.Direct, "send", send)

    def publishes(self) -> int:
        return sum(1 for m, p, body in self.seen if m == "POST" and p.endswith(PUBLISH_VERSION) and body)


def test_a_version_in_one_request_goes_through_the_direct_path_and_arrives_bit_identical(
    server, model, monkeypatch
) -> None:
    """With no transport injected, publishVersion's body is sent by the standard library (httpx's own work per
    request is gone), and the versions it commits are the ones httpx's path commits: bit for bit."""
    sent = DirectSends(monkeypatch)
    trainer = TinyTrainer(seed=23)
    with Publisher(server.url, model) as pub:
        assert pub.api._direct is not None
        assert pub.publish(trainer.export()).kind == "keyframe"
        for _ in range(2):
            trainer.step()
            before = sent.publishes()
            r = pub.publish(trainer.export())
            assert r.kind == "delta" and sent.publishes() == before + 1
    follow(server.url, model, trainer.export(), name="direct-check")


def test_a_body_over_the_cap_sent_directly_is_refused_with_the_cap_and_goes_in_three_requests(
    tmp_path, monkeypatch
) -> None:
    """The server's 413 to a publishVersion sent through the direct path is read (its cap learned), the version goes
    the usual way, and the next one of that size is not offered in one request again."""
    sent = DirectSends(monkeypatch)
    srv = start_server(tmp_path / "srv", env={"WEIGHTSYNC_MAX_JSON_BODY": str(4 << 10)})
    try:
        trainer = TinyTrainer(seed=24)
        with Publisher(srv.url, "capped", inline_bytes=64 << 20) as pub:
            assert pub.api._direct is not None
            pub.publish(trainer.export())
            for expect_try in (True, False):
                before = sent.publishes()
                trainer.step()
                assert pub.publish(trainer.export()).kind == "delta"
                assert sent.publishes() == before + (1 if expect_try else 0)
                assert pub.api.publish_version_cap is not None and pub.api.publish_version_cap < 4 << 10
        follow(srv.url, "capped", trainer.export(), name="inline-check")
    finally:
        stop_server(srv)
