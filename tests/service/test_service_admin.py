"""Fleet administration over real HTTP: the server identity, model settings, deleting a model, pins.

On SQLite + filesystem and PostgreSQL + SeaweedFS (the session's ``service``); the identity tests
start services of their own on one catalog.
"""

from __future__ import annotations

import re
import threading
import time
import uuid

import httpx
import pytest
from _service_http import EventReader, files_of, ok, problem, publish, publish_chain, pull
from _service_util import BACKENDS, backend_settings, running
from _versions import checkpoint, model_files, next_step

from weightsync import errors
from weightsync.client._http import Api
from weightsync.codec import Checkpoint
from weightsync.common import VERSION
from weightsync.service import Settings


def wait_until(pred, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def in_background(fn) -> tuple[threading.Thread, dict]:
    """Run ``fn()`` in a thread; its result lands in the dict under "r"."""
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(r=fn()))
    t.start()
    return t, out


# --- the server's identity ---------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_info_id_is_the_catalogs_shared_by_services_and_restarts(backend, tmp_path, request):
    kw, cleanups = backend_settings(backend, tmp_path, request)
    settings = Settings(**kw)  # no tokens: anonymous development mode, on loopback
    try:
        with running(settings) as a, running(settings) as b:
            info = ok(httpx.get(f"{a}/v1/info"), 200)
            assert re.fullmatch(r"[0-9a-f]{32}", info["id"])
            assert info == {"id": info["id"], "version": VERSION, "formats": [1, 2]}
            assert ok(httpx.get(f"{b}/v1/info"), 200) == info  # two services on one catalog: one server
        with running(settings) as again, Api(again) as api:
            assert api.info().to_dict() == info  # the same after a restart
    finally:
        for ctx in cleanups:
            ctx.__exit__(None, None, None)
    with running(Settings(data=tmp_path / "other")) as other:
        assert ok(httpx.get(f"{other}/v1/info"), 200)["id"] != info["id"]  # another catalog, another server


def test_info_needs_a_token(service):
    problem(service.client(None).get("/v1/info"), 401, "unauthorized")
    assert ok(service.client("reader").get("/v1/info"), 200)["formats"] == [1, 2]


# --- model settings ------------------------------------------------------------------------------


def test_settings_round_trip_and_validation(service, model, versions):
    pub, reader = service.client("publisher"), service.client("reader")
    publish_chain(pub, model, versions[:1])
    before = ok(reader.get(f"/v1/models/{model}"), 200)
    assert before["pinned"] is None and before["keep_last"] is None
    after = ok(pub.patch(f"/v1/models/{model}", json={"keep_last": 3, "max_chain_ratio": 0.25}), 200)
    assert after == {**before, "keep_last": 3, "max_chain_ratio": 0.25}
    assert ok(reader.get(f"/v1/models/{model}"), 200) == after
    assert ok(pub.patch(f"/v1/models/{model}", json={}), 200) == after  # nothing given: nothing changes
    assert ok(pub.patch(f"/v1/models/{model}", json={"keep_last": None}), 200)["keep_last"] is None  # keep all
    for bad in ({"keyframe_interval": 0}, {"max_chain_ratio": -1}, {"keep_last": 0}, {"step": 1}, {"keep_last": "x"}):
        problem(pub.patch(f"/v1/models/{model}", json=bad), 422, "validation")
    problem(pub.patch(f"/v1/models/{model}", json={"keyframe_interval": None}), 422, "invalid-argument")
    problem(reader.patch(f"/v1/models/{model}", json={"keep_last": 2}), 403, "forbidden")
    problem(service.client("other").patch(f"/v1/models/{model}", json={"keep_last": 2}), 403, "forbidden")
    missing = problem(pub.patch(f"/v1/models/policy-{uuid.uuid4().hex[:8]}", json={}), 404, "not-found")
    assert missing["resource"] == "model"
    with Api(service.url, token=_token(pub)) as api:
        m = api.update_model(model, keyframe_interval=7, keep_last=None)
        assert (m.keyframe_interval, m.keep_last, m.max_chain_ratio, m.pinned) == (7, None, 0.25, None)
        with pytest.raises(errors.InvalidArgument):
            api.update_model(model, keyframe_interval=None)


def _token(client: httpx.Client) -> str:
    return client.headers["Authorization"].removeprefix("Bearer ")


# --- deleting a model ------------------------------------------------------------------------------


def _stored(client: httpx.Client, digest: str) -> bool:
    r = client.head(f"/v1/objects/{digest}")
    assert r.status_code in (200, 404), r.status_code
    return r.status_code == 200


def _own_versions(seed: int) -> list[Checkpoint]:
    """Four consecutive checkpoints of tensors made from ``seed`` (the ``versions`` fixture's, from another seed)."""
    t = model_files(seed=seed)
    out = []
    for i in range(4):
        out.append(checkpoint(t, i))
        t = next_step(t, i + 1)
    return out


def test_delete_model_then_gc_after_its_grace(service):
    suffix = uuid.uuid4().hex[:8]
    doomed, kept = f"policy-doomed-{suffix}", f"policy-kept-{suffix}"
    # Bytes no other test publishes: the service is the session's, and objects are content-addressed, so
    # another model holding the session's `versions` would keep "only the doomed model's" objects alive.
    versions = _own_versions(seed=int(suffix, 16))
    pub, admin, reader = service.client("publisher"), service.client("admin"), service.client("reader")
    gone = publish_chain(pub, doomed, versions[:3])
    publish_chain(pub, kept, versions[:2])  # the same bytes: the two models share data objects
    plan = ok(reader.get(f"/v1/models/{doomed}/plan", params={"have": 2}), 200)
    only_doomed = {o["digest"] for o in plan["steps"][0]["objects"]} | {p.manifest for p in gone}
    kept_plan = ok(reader.get(f"/v1/models/{kept}/plan"), 200)
    kept_objects = {o["digest"] for s in kept_plan["steps"] for o in s["objects"]} | {
        s["manifest"] for s in kept_plan["steps"]
    }
    only_doomed -= kept_objects
    assert only_doomed and kept_objects
    pending = publish(pub, doomed, versions[3], versions[2], 3, commit=False)  # in flight
    ok(reader.post(f"/v1/models/{doomed}/replicas", json={"subscriber": "r", "version": 3}), 201)

    problem(pub.delete(f"/v1/models/{doomed}"), 403, "forbidden")  # admin only
    deleted = ok(admin.delete(f"/v1/models/{doomed}"), 200)
    assert deleted["name"] == doomed and deleted["versions_deleted"] == [1, 2, 3]
    assert deleted["publishes_aborted"] == 1 and deleted["deleted_at"]
    for path in ("", "/versions", "/versions/latest", "/plan", "/replicas"):
        assert problem(reader.get(f"/v1/models/{doomed}{path}"), 404, "not-found")["resource"] == "model", path
    # A watch waits for the name to be used again, like one on a model that does not exist yet.
    assert reader.get(f"/v1/models/{doomed}/watch", params={"after": 3, "timeout": 0.2}).status_code == 204
    commit = pub.post(
        f"/v1/models/{doomed}/publishes/{pending.begin['publish_id']}/commit", json={"manifest": pending.manifest}
    )
    problem(commit, 404, "not-found")  # the in-flight publish was aborted
    assert doomed not in {m["name"] for m in ok(admin.get("/v1/models"), 200)["models"]}
    problem(admin.delete(f"/v1/models/{doomed}"), 404, "not-found")

    # GC keeps the objects through its grace period, then deletes only what no other model uses.
    report = ok(admin.post("/v1/admin/gc", json={"grace_s": 3600}), 200)
    assert doomed not in report["versions_deleted"]
    assert all(_stored(admin, d) for d in only_doomed | kept_objects)
    ok(admin.post("/v1/admin/gc", json={"grace_s": 0}), 200)
    assert not any(_stored(admin, d) for d in only_doomed)
    assert all(_stored(admin, d) for d in kept_objects)
    assert {p: a.tobytes() for p, a in pull(reader, kept).files.items()} == files_of(versions[1])

    # The name is free again; the new model numbers on after the deleted one's versions.
    again = publish(pub, doomed, versions[0], None, None)
    assert again.version["number"] == 4 and again.version["kind"] == "keyframe"
    assert ok(reader.get(f"/v1/models/{doomed}"), 200)["head"] == 4
    assert ok(reader.get(f"/v1/models/{doomed}/replicas"), 200)["replicas"] == []
    with Api(service.url, token=_token(admin)) as api:
        assert api.delete_model(doomed).versions_deleted == [4]
        with pytest.raises(errors.ModelNotFound):
            api.get_model(doomed)


# --- pins --------------------------------------------------------------------------------------------


def test_followers_hold_the_pin_while_the_head_moves_on(service, model, versions):
    pub, reader = service.client("publisher"), service.client("reader")
    publish_chain(pub, model, versions[:2])
    base = f"/v1/models/{model}"
    assert ok(pub.put(f"{base}/pin", json={"version": 1}), 200)["pinned"] == 1
    assert ok(reader.get(base), 200)["pinned"] == 1
    # Watch: the pin at once, even below `after` (a rollback); held while it is what one has.
    assert ok(reader.get(f"{base}/watch", params={"after": 2, "timeout": 30}), 200)["number"] == 1
    assert ok(reader.get(f"{base}/watch", params={"timeout": 30}), 200)["number"] == 1
    assert reader.get(f"{base}/watch", params={"after": 1, "timeout": 0.3}).status_code == 204
    # Plan: the default target is the pin; an explicit one, and `latest`, are still the head.
    assert ok(reader.get(f"{base}/plan"), 200)["target"] == 1
    assert ok(reader.get(f"{base}/plan", params={"have": 1}), 200)["steps"] == []
    assert ok(reader.get(f"{base}/plan", params={"want": 2}), 200)["target"] == 2
    assert ok(reader.get(f"{base}/versions/latest"), 200)["number"] == 2
    assert {p: a.tobytes() for p, a in pull(reader, model).files.items()} == files_of(versions[0])

    with httpx.Client(base_url=service.url, headers=reader.headers) as own:
        events = EventReader(own, f"{base}/events")
        events.wait_for(lambda v: v["number"] == 1)  # the pin first, not the head
        waiting, result = in_background(
            lambda: reader.get(f"{base}/watch", params={"after": 1, "timeout": 60}, timeout=90)
        )
        publish(pub, model, versions[2], versions[1], 2)  # publishing is unaffected: the head moves to 3
        assert ok(reader.get(base), 200)["head"] == 3
        events.wait_comments(events.comments + 2)  # keep-alives pass; no event for 3
        assert ok(reader.get(f"{base}/plan"), 200)["target"] == 1
        assert waiting.is_alive()

        # Unpin: followers move to the head (the stream sends the head alone, not 2).
        ok(pub.delete(f"{base}/pin"), 200)
        waiting.join(90)
        assert ok(result["r"], 200)["number"] == 3
        events.wait_for(lambda v: v["number"] == 3)
        # A rollback while streaming, then back to the head.
        ok(pub.put(f"{base}/pin", json={"version": 2}), 200)
        assert wait_until(lambda: [v["number"] for v in events.versions()][-1:] == [2])
        ok(pub.delete(f"{base}/pin"), 200)
        assert wait_until(lambda: len(events.versions()) == 4)
        assert [v["number"] for v in events.versions()] == [1, 3, 2, 3]
        events.close()
    assert ok(reader.get(f"{base}/plan"), 200)["target"] == 3


def test_pin_errors_and_scopes(service, model, versions):
    pub, reader = service.client("publisher"), service.client("reader")
    publish_chain(pub, model, versions[:1])
    base = f"/v1/models/{model}"
    assert problem(pub.put(f"{base}/pin", json={"version": 9}), 404, "not-found")["resource"] == "version"
    problem(pub.put(f"{base}/pin", json={"version": 0}), 422, "validation")
    problem(pub.put(f"{base}/pin", json={}), 422, "validation")
    problem(reader.put(f"{base}/pin", json={"version": 1}), 403, "forbidden")
    problem(reader.delete(f"{base}/pin"), 403, "forbidden")
    problem(service.client("other").put(f"{base}/pin", json={"version": 1}), 403, "forbidden")
    missing = f"policy-{uuid.uuid4().hex[:8]}"
    assert problem(pub.put(f"/v1/models/{missing}/pin", json={"version": 1}), 404, "not-found")["resource"] == "model"
    with Api(service.url, token=_token(pub)) as api:
        assert api.pin(model, 1).pinned == 1 and api.get_model(model).pinned == 1
        with pytest.raises(errors.VersionNotFound):
            api.pin(model, 5)
        assert api.unpin(model).pinned is None and api.unpin(model).pinned is None  # idempotent


def test_retention_and_gc_keep_the_pinned_chain(service, model, versions):
    pub, admin, reader = service.client("publisher"), service.client("admin"), service.client("reader")
    base = f"/v1/models/{model}"
    publish_chain(pub, model, versions[:2])
    publish(pub, model, versions[2], None, 2, keyframe=True)  # a second chain: 3 (keyframe), 4
    publish(pub, model, versions[3], versions[2], 3)
    ok(pub.patch(base, json={"keep_last": 1}), 200)
    ok(pub.put(f"{base}/pin", json={"version": 2}), 200)
    assert model not in ok(admin.post("/v1/admin/gc", json={"grace_s": 0}), 200)["versions_deleted"]
    assert {p: a.tobytes() for p, a in pull(reader, model).files.items()} == files_of(versions[1])  # pinned: v2
    # Applied: the report releases the pull's lease on that chain, which alone would keep it too.
    ok(reader.post(f"{base}/replicas", json={"subscriber": "test-subscriber", "version": 2}), 201)
    ok(pub.delete(f"{base}/pin"), 200)
    assert ok(admin.post("/v1/admin/gc", json={"grace_s": 0}), 200)["versions_deleted"][model] == [1, 2]
    problem(reader.get(f"{base}/versions/2"), 404, "not-found")
    problem(pub.put(f"{base}/pin", json={"version": 2}), 404, "not-found")  # deleted: not pinnable
    assert {p: a.tobytes() for p, a in pull(reader, model).files.items()} == files_of(versions[3])


def test_org_names_on_the_admin_routes(service, versions):
    name = f"Acme/Fleet-{uuid.uuid4().hex[:8]}"
    org, admin = service.client("org"), service.client("admin")
    publish_chain(org, name, versions[:2])
    assert ok(org.patch(f"/v1/models/{name}", json={"keep_last": 5}), 200)["keep_last"] == 5
    assert ok(org.put(f"/v1/models/{name}/pin", json={"version": 1}), 200)["pinned"] == 1
    assert ok(org.get(f"/v1/models/{name}/watch", params={"after": 2, "timeout": 1}), 200)["number"] == 1
    assert ok(org.delete(f"/v1/models/{name}/pin"), 200)["pinned"] is None
    problem(org.delete(f"/v1/models/{name}"), 403, "forbidden")
    assert ok(admin.delete(f"/v1/models/{name}"), 200)["versions_deleted"] == [1, 2]
    problem(org.get(f"/v1/models/{name}"), 404, "not-found")
