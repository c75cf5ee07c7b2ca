"""The HTTP API over real HTTP, on SQLite + filesystem and on PostgreSQL + SeaweedFS (docs/API.md)."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator

import httpx
import pytest
import xxhash
from _service_http import files_of, ok, problem, publish, publish_chain, pull
from _service_util import JSON_CAP, ServerThread, running

from weightsync import errors
from weightsync.client._http import Api, Retry
from weightsync.codec import Encoder
from weightsync.codec.pack import pack
from weightsync.service import Settings, create_app

OPERATION_IDS = {
    "health",
    "ready",
    "metrics",
    "listModels",
    "createModel",
    "getModel",
    "updateModel",
    "deleteModel",
    "pinModel",
    "unpinModel",
    "getInfo",
    "listVersions",
    "getVersion",
    "getLineage",
    "getManifest",
    "getPlan",
    "beginPublish",
    "checkObjects",
    "commitPublish",
    "publishVersion",
    "commitPart",
    "abortPublish",
    "putObject",
    "getObject",
    "headObject",
    "presignObject",
    "watchModel",
    "streamEvents",
    "reportReplica",
    "listReplicas",
    "relayHeartbeat",
    "listRelays",
    "fsck",
    "gc",
}


def test_health_ready_and_openapi(service):
    c = service.client(None)
    assert ok(c.get("/healthz"), 200) == {"status": "ok"}
    assert ok(c.get("/readyz"), 200) == {"catalog": True, "store": True}
    schema = ok(c.get("/openapi.json"), 200)
    ids = {op["operationId"] for path in schema["paths"].values() for op in path.values() if "operationId" in op}
    assert ids == OPERATION_IDS
    assert "HTTPBearer" in schema["components"]["securitySchemes"]


def test_publish_commit_plan_manifest_and_ranged_download_round_trip(service, model, versions):
    c = service.client("publisher")
    published = publish_chain(c, model, versions[:3])
    assert [p.version["number"] for p in published] == [1, 2, 3]
    assert [p.version["kind"] for p in published] == ["keyframe", "delta", "delta"]
    v3 = published[-1].version
    assert v3["parent"] == 2 and v3["chain_base"] == 1 and v3["metadata"] == {"by": "test"}
    assert v3["manifest"] == published[-1].manifest and v3["committed_at"]
    if service.s3:
        assert all(p.presigned == len(p.uploaded) > 0 for p in published)  # straight to S3
    else:
        assert all(p.presigned == 0 for p in published)

    reader = service.client("reader")
    full = pull(reader, model)
    assert full.number == 3
    assert {p: a.tobytes() for p, a in full.files.items()} == files_of(versions[2])
    # Incremental: from version 2, only the last delta moves.
    at2 = pull(reader, model, want=2)
    plan = ok(reader.get(f"/v1/models/{model}/plan", params={"have": 2, "holder": "h"}), 200)
    assert [s["number"] for s in plan["steps"]] == [3] and plan["target"] == 3 and plan["lease_expires_at"]
    assert plan["bytes"] < plan["full_bytes"]
    inc = pull(reader, model, have=at2)
    assert {p: a.tobytes() for p, a in inc.files.items()} == files_of(versions[2])
    assert inc.bytes < full.bytes

    # The manifest: stored bytes, ETag, conditional GET.
    r = reader.get(f"/v1/models/{model}/versions/3/manifest")
    assert r.headers["content-type"] == "application/octet-stream"
    assert hashlib.sha256(r.content).hexdigest() == v3["manifest"]
    assert (
        reader.get(f"/v1/models/{model}/versions/3/manifest", headers={"If-None-Match": r.headers["etag"]}).status_code
        == 304
    )

    # Ranged reads of an object agree with the whole object, which hashes to its name.
    obj = plan["steps"][0]["objects"][0]
    whole = reader.get(f"/v1/objects/{obj['digest']}")
    assert whole.status_code == 200 and whole.headers["etag"] == f'"{obj["digest"]}"'
    assert hashlib.sha256(whole.content).hexdigest() == obj["digest"]
    n = len(whole.content)
    for rng, start, end in [
        (f"bytes=3-{n // 2}", 3, n // 2),
        ("bytes=10-", 10, n - 1),
        ("bytes=-7", n - 7, n - 1),
        (f"bytes=0-{n + 100}", 0, n - 1),
    ]:
        part = reader.get(f"/v1/objects/{obj['digest']}", headers={"Range": rng})
        assert part.status_code == 206, (rng, part.text)
        assert part.content == whole.content[start : end + 1]
        assert part.headers["content-range"] == f"bytes {start}-{end}/{n}"

    # The subscriber reports it applied version 3; the ledger shows it.
    rep = ok(
        reader.post(
            f"/v1/models/{model}/replicas",
            json={
                "subscriber": "inference-a",
                "version": 3,
                "pause_ms": 12.5,
                "bytes": inc.bytes,
                "site": "eu",
                "host": "gpu-1",
                "extra": {"gpus": 8},
            },
        ),
        201,
    )
    assert rep["version"] == 3 and rep["bytes"] == inc.bytes and rep["extra"] == {"gpus": 8}
    listed = ok(reader.get(f"/v1/models/{model}/replicas"), 200)["replicas"]
    assert [(r["subscriber"], r["version"]) for r in listed] == [("inference-a", 3)]


def test_models(service):
    c = service.client("admin")
    name = f"policy-m-{hashlib.md5(service.url.encode()).hexdigest()[:6]}-{id(c)}"
    created = c.post("/v1/models", json={"name": name, "keyframe_interval": 5})
    assert created.status_code == 201 and created.json()["keyframe_interval"] == 5
    assert created.json()["head"] is None and created.json()["keep_last"] is None
    again = ok(c.post("/v1/models", json={"name": name, "keyframe_interval": 5}), 200)
    assert again == created.json()
    problem(c.post("/v1/models", json={"name": name, "keyframe_interval": 6}), 409, "conflict")
    problem(c.post("/v1/models", json={"name": "not valid"}), 422, "invalid-name")
    problem(c.post("/v1/models", json={"name": "x", "keyframe_interval": 0}), 422, "validation")
    problem(c.post("/v1/models", content=b"not json", headers={"content-type": "application/json"}), 422, "validation")
    assert ok(c.get(f"/v1/models/{name}"), 200)["name"] == name
    assert name in [m["name"] for m in ok(c.get("/v1/models"), 200)["models"]]
    assert problem(c.get("/v1/models/no-such-model"), 404, "not-found")["resource"] == "model"
    problem(c.get("/v1/no-such-route"), 404, "not-found")


def test_versions_listing_lineage_and_404s(service, model, versions):
    c = service.client("publisher")
    publish_chain(c, model, versions[:4])
    numbers = lambda r: [v["number"] for v in ok(r, 200)["versions"]]  # noqa: E731
    assert numbers(c.get(f"/v1/models/{model}/versions")) == [1, 2, 3, 4]
    assert numbers(c.get(f"/v1/models/{model}/versions", params={"limit": 2})) == [3, 4]
    assert numbers(c.get(f"/v1/models/{model}/versions", params={"after": 1, "limit": 2})) == [2, 3]
    assert numbers(c.get(f"/v1/models/{model}/versions", params={"before": 4, "limit": 2})) == [2, 3]
    assert ok(c.get(f"/v1/models/{model}/versions/latest"), 200)["number"] == 4
    assert ok(c.get(f"/v1/models/{model}/versions/2"), 200)["kind"] == "delta"
    assert numbers(c.get(f"/v1/models/{model}/versions/3/lineage")) == [1, 2, 3]
    assert numbers(c.get(f"/v1/models/{model}/versions/latest/lineage")) == [1, 2, 3, 4]
    assert ok(c.get(f"/v1/models/{model}"), 200)["head"] == 4
    assert problem(c.get(f"/v1/models/{model}/versions/99"), 404, "not-found")["resource"] == "version"
    problem(c.get(f"/v1/models/{model}/versions/99/manifest"), 404, "not-found")
    problem(c.get(f"/v1/models/{model}/versions/99/lineage"), 404, "not-found")
    problem(c.get(f"/v1/models/{model}/versions/abc"), 422, "validation")
    problem(c.get(f"/v1/models/{model}/plan", params={"want": 99}), 404, "not-found")
    problem(c.get(f"/v1/models/{model}/versions", params={"limit": 0}), 422, "validation")
    missing = f"{model}-missing"
    for path in (
        "",
        "/versions",
        "/versions/1",
        "/versions/latest",
        "/versions/1/lineage",
        "/versions/1/manifest",
        "/plan",
        "/replicas",
    ):
        problem(c.get(f"/v1/models/{missing}{path}"), 404, "not-found")
    # Watching waits for a model that does not exist yet (test_service_watch): no version before the timeout.
    assert c.get(f"/v1/models/{missing}/watch", params={"timeout": 0}).status_code == 204
    empty = f"{model}-empty"
    ok(c.post("/v1/models", json={"name": empty}), 201)
    problem(c.get(f"/v1/models/{empty}/versions/latest"), 404, "not-found")
    assert ok(c.get(f"/v1/models/{empty}/versions"), 200) == {"versions": []}


def test_stale_parent_is_409_with_current_head(service, model, versions):
    c = service.client("publisher")
    publish_chain(c, model, versions[:1])
    body = problem(c.post(f"/v1/models/{model}/publishes", json={"parent": None}), 409, "stale-parent")
    assert body["current_head"] == 1
    # Two publishers on parent 1: the second to commit loses the compare-and-swap.
    first = publish(c, model, versions[1], versions[0], 1, commit=False)
    second = publish(c, model, versions[2], versions[0], 1, commit=False)
    ok(
        c.post(f"/v1/models/{model}/publishes/{first.begin['publish_id']}/commit", json={"manifest": first.manifest}),
        201,
    )
    body = problem(
        c.post(f"/v1/models/{model}/publishes/{second.begin['publish_id']}/commit", json={"manifest": second.manifest}),
        409,
        "stale-parent",
    )
    assert body["current_head"] == 2
    body = problem(c.post(f"/v1/models/{model}/publishes", json={"parent": 1}), 409, "stale-parent")
    assert body["current_head"] == 2


def test_commit_is_idempotent_and_its_errors(service, model, versions):
    c = service.client("publisher")
    p = publish(c, model, versions[0], None, None, commit=False)
    pid = p.begin["publish_id"]
    assert p.begin["kind"] == "keyframe" and p.begin["parent"] is None and p.begin["expires_at"]
    commit = f"/v1/models/{model}/publishes/{pid}/commit"
    problem(c.post(commit, json={"manifest": "f" * 64}), 409, "incomplete-publish")
    problem(c.post(commit, json={"manifest": "NOT-A-DIGEST"}), 422, "invalid-digest")
    junk = b"this is not a manifest"
    junk_digest = hashlib.sha256(junk).hexdigest()
    ok(c.put(f"/v1/objects/{junk_digest}", content=junk), 201)
    problem(c.post(commit, json={"manifest": junk_digest}), 422, "bad-manifest")
    v = ok(c.post(commit, json={"manifest": p.manifest}, headers={"Idempotency-Key": "k-1"}), 201)
    assert v["number"] == 1
    assert ok(c.post(commit, json={"manifest": p.manifest}), 201) == v  # a retry returns the same version
    # The same publish committed again with another (complete) manifest: a conflict, not a new version.
    manifest, objects = pack(Encoder(threads=2).encode(versions[1]), target_bytes=1 << 17)
    manifest.model = model
    for o in objects:
        ok(c.put(f"/v1/objects/{o.digest}", content=o.data), 201)
    other = manifest.encode()
    other_digest = hashlib.sha256(other).hexdigest()
    ok(c.put(f"/v1/objects/{other_digest}", content=other), 201)
    problem(c.post(commit, json={"manifest": other_digest}), 409, "conflict")
    problem(
        c.post(f"/v1/models/{model}/publishes/no-such-publish/commit", json={"manifest": p.manifest}), 404, "not-found"
    )
    problem(c.post(f"/v1/models/{model}/publishes/no-such/objects", json={"objects": []}), 404, "not-found")
    problem(c.post(f"/v1/models/{model}/publishes", json={"step": 1}), 422, "validation")  # parent is required
    # Abort: 204, then the publish is gone.
    q = ok(c.post(f"/v1/models/{model}/publishes", json={"parent": 1}), 201)
    assert q["kind"] == "delta" and q["parent_manifest"] == v["manifest"]
    assert c.delete(f"/v1/models/{model}/publishes/{q['publish_id']}").status_code == 204
    problem(c.delete(f"/v1/models/{model}/publishes/{q['publish_id']}"), 404, "not-found")


def test_check_objects_reports_missing_and_refuses_oversized(service, model, versions):
    c = service.client("publisher")
    begin = ok(c.post(f"/v1/models/{model}/publishes", json={"parent": None}), 201)
    data = b"some object bytes"
    d = hashlib.sha256(data).hexdigest()
    path = f"/v1/models/{model}/publishes/{begin['publish_id']}/objects"
    check = ok(c.post(path, json={"objects": [{"digest": d, "size": len(data)}]}), 200)
    assert check["missing"] == [d]
    if service.s3:
        up = check["uploads"][d]
        assert up["method"] == "PUT" and up["url"].startswith("http") and up["headers"]
    else:
        assert "uploads" not in check
    ok(c.put(f"/v1/objects/{d}", content=data), 201)
    assert ok(c.post(path, json={"objects": [{"digest": d, "size": len(data)}]}), 200)["missing"] == []
    # The catalog knows the object with another size.
    problem(c.post(path, json={"objects": [{"digest": d, "size": len(data) + 1}]}), 409, "incomplete-publish")
    problem(c.post(path, json={"objects": [{"digest": "xyz", "size": 1}]}), 422, "invalid-digest")
    problem(
        c.post(path, json={"objects": [{"digest": "a" * 64, "size": service.settings.max_object_size + 1}]}),
        413,
        "too-large",
    )


def test_begin_with_objects_checks_them_when_the_kind_is_the_encodings(service, model, versions):
    """beginPublish with `objects` answers checkObjects' `missing` too, only for the kind they were encoded as."""
    c = service.client("publisher")
    first = publish(c, model, versions[0], None, None)
    data = b"a delta's frames"
    d = hashlib.sha256(data).hexdigest()
    listed = [{"digest": d, "size": len(data)}]
    begin = ok(c.post(f"/v1/models/{model}/publishes", json={"parent": 1, "objects": listed}), 201)
    assert begin["kind"] == "delta" and begin["missing"] == [d]
    assert ("uploads" in begin and begin["uploads"] is not None) == service.s3
    # The objects are held for the publish now: a manifest naming them commits without another check.
    ok(c.put(f"/v1/objects/{d}", content=data), 201)
    check = f"/v1/models/{model}/publishes/{begin['publish_id']}/objects"
    assert ok(c.post(check, json={"objects": listed}), 200)["missing"] == []
    ok(c.delete(f"/v1/models/{model}/publishes/{begin['publish_id']}"), 204)
    # Objects encoded as a delta are not checked when the answer is a keyframe (here: forced by policy).
    kf_only = model + "-kf"
    ok(c.post("/v1/models", json={"name": kf_only, "keyframe_interval": 1}), 201)
    publish(c, kf_only, versions[0], None, None)
    begin = ok(c.post(f"/v1/models/{kf_only}/publishes", json={"parent": 1, "objects": listed}), 201)
    assert begin["kind"] == "keyframe" and begin["missing"] is None
    # A keyframe encoding listed with keyframe=true is checked: the store has the object already.
    begin = ok(c.post(f"/v1/models/{kf_only}/publishes", json={"parent": 1, "keyframe": True, "objects": listed}), 201)
    assert begin["kind"] == "keyframe" and begin["missing"] == []
    big = [{"digest": "a" * 64, "size": service.settings.max_object_size + 1}]
    problem(c.post(f"/v1/models/{model}/publishes", json={"parent": 1, "objects": big}), 413, "too-large")
    problem(
        c.post(f"/v1/models/{model}/publishes", json={"parent": 1, "objects": [{"digest": "x", "size": 1}]}),
        422,
        "invalid-digest",
    )
    assert first.version["number"] == 1 and ok(c.get(f"/v1/models/{model}"), 200)["head"] == 1


def test_commit_refuses_a_version_that_is_not_publishable(service, model, versions):
    """The service checks the final manifest itself: a raw client's broken shard or pickle is 422 invalid-checkpoint."""
    from weightsync.codec.checkpoint import Checkpoint

    c = service.client("publisher")
    first = publish(c, model, versions[0], None, None)
    good = {f.layout.path: bytes(f.data) for f in versions[0].files}
    weights = next(p for p in good if p.endswith(".safetensors"))
    for files, why in [
        ({**good, weights: good[weights][:-1000]}, weights),  # cut short: encoded as a blob
        ({**good, "training_args.bin": b"pickle"}, "training_args.bin"),
        ({p: b for p, b in good.items() if p != weights}, "no safetensors"),
    ]:
        bad = publish(c, model, Checkpoint.from_bytes(files), None, 1, keyframe=True, commit=False)
        path = f"/v1/models/{model}/publishes/{bad.begin['publish_id']}/commit"
        assert why in problem(c.post(path, json={"manifest": bad.manifest}), 422, "invalid-checkpoint")["detail"]
    assert ok(c.get(f"/v1/models/{model}"), 200)["head"] == first.version["number"]


def test_formats_are_negotiated(service, model, versions):
    """Begin answers the formats the server reads; a plan names what the reader reads (406 otherwise);
    a chain never mixes formats (a format-2 delta on a format-1 parent is 409 base-mismatch)."""
    c = service.client("publisher")
    begin = ok(c.post(f"/v1/models/{model}/publishes", json={"parent": None}), 201)
    assert begin["formats"] == [1, 2]
    ok(c.delete(f"/v1/models/{model}/publishes/{begin['publish_id']}"), 204)
    publish_chain(c, model, versions[:2])  # the test helper's Encoder writes the default: format 2
    reader = service.client("reader")
    plan = f"/v1/models/{model}/plan"
    assert [s["number"] for s in ok(reader.get(plan, params={"formats": "1,2"}), 200)["steps"]] == [1, 2]
    assert "format 2" in problem(reader.get(plan, params={"formats": "1"}), 406, "format-not-readable")["detail"]
    problem(reader.get(plan, params={"formats": "one"}), 422, "validation")
    # A format-1 keyframe, then a format-2 delta on it: refused at commit.
    other = model + "-v1"
    v1 = publish(c, other, versions[0], None, None, format_version=1)
    assert v1.version["number"] == 1
    assert ok(reader.get(f"/v1/models/{other}/plan", params={"formats": "1"}), 200)["target"] == 1
    bad = publish(c, other, versions[1], versions[0], 1, format_version=2, commit=False)
    commit = f"/v1/models/{other}/publishes/{bad.begin['publish_id']}/commit"
    assert (
        "never mixes formats"
        in problem(c.post(commit, json={"manifest": bad.manifest}), 409, "base-mismatch")["detail"]
    )
    assert publish(c, other, versions[1], versions[0], 1, format_version=1).version["kind"] == "delta"


def test_replica_ledger(service, model, versions):
    c = service.client("reader")
    publish_chain(service.client("publisher"), model, versions[:2])
    for sub, v in (("a", 1), ("b", 1), ("a", 2)):
        ok(c.post(f"/v1/models/{model}/replicas", json={"subscriber": sub, "version": v}), 201)
    latest = ok(c.get(f"/v1/models/{model}/replicas"), 200)["replicas"]
    assert sorted((r["subscriber"], r["version"]) for r in latest) == [("a", 2), ("b", 1)]
    hist = ok(c.get(f"/v1/models/{model}/replicas", params={"subscriber": "a", "all": "true"}), 200)["replicas"]
    assert [r["version"] for r in hist] == [1, 2]
    problem(c.post(f"/v1/models/{model}/replicas", json={"subscriber": "a", "version": 9}), 404, "not-found")
    problem(c.post(f"/v1/models/{model}/replicas", json={"subscriber": "", "version": 1}), 422, "validation")
    problem(
        c.post(f"/v1/models/{model}/replicas", json={"subscriber": "a", "version": 1, "pause_ms": -1}),
        422,
        "validation",
    )


def test_admin_fsck_and_gc(service, model, versions):
    publish_chain(service.client("publisher"), model, versions[:2])
    c = service.client("admin")
    report = ok(c.post("/v1/admin/fsck", json={"read_data": False, "repair": False}), 200)
    assert report["versions_checked"] >= 2 and report["objects_checked"] >= 2
    assert not [p for p in report["problems"] if p["model"] == model]
    assert set(report) == {"ok", "versions_checked", "objects_checked", "bytes_verified", "problems"}
    gc = ok(c.post("/v1/admin/gc", json={"dry_run": True}), 200)
    assert set(gc) == {
        "versions_deleted",
        "pending_expired",
        "objects_deleted",
        "bytes_deleted",
        "objects_kept_in_grace",
        "leases_purged",
    }
    assert gc["leases_purged"] == 0  # a dry run changes nothing
    # Nothing a committed version needs is ever deleted.
    ok(c.post("/v1/admin/gc", json={"dry_run": False, "grace_s": 0}), 200)
    after = pull(c, model)
    assert {p: a.tobytes() for p, a in after.files.items()} == files_of(versions[1])
    problem(c.post("/v1/admin/gc", json={"dry_run": "maybe"}), 422, "validation")


def test_metrics_request_id_and_problem_shape(service, model, versions):
    c = service.client("publisher")
    publish_chain(c, model, versions[:1])
    r = c.get(f"/v1/models/{model}/versions/77", headers={"X-Request-ID": "trace-abc.123"})
    assert r.headers["x-request-id"] == "trace-abc.123"
    assert problem(r, 404, "not-found")["request_id"] == "trace-abc.123"
    generated = c.get("/healthz", headers={"X-Request-ID": "bad id with spaces"}).headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", generated)
    text = c.get("/metrics").text
    assert re.search(
        r'weightsync_http_requests_total\{method="GET",route="/v1/models/\{model\}/versions/'
        r'\{number\}",status="404"\} [1-9]',
        text,
    )
    assert re.search(
        r'weightsync_http_request_duration_seconds_count\{method="POST",'
        r'route="/v1/models/\{model\}/publishes/\{publish_id\}/commit",status="201"\} [1-9]',
        text,
    )
    assert re.search(r"weightsync_versions_committed_total [1-9]", text)
    assert re.search(r"weightsync_publish_to_commit_seconds_count [1-9]", text)
    assert re.search(r'weightsync_http_received_bytes_total\{route="/v1/objects/\{digest\}"\} [1-9]', text)
    assert re.search(
        r'weightsync_http_sent_bytes_total\{route="/v1/models/\{model\}"\}|'
        r'weightsync_http_sent_bytes_total\{route="/v1/models/\{model\}/versions',
        text,
    )


def test_json_bodies_are_capped(service):
    c = service.client("admin")
    problem(
        c.post("/v1/models", content=b"x" * (JSON_CAP + 1), headers={"content-type": "application/json"}),
        413,
        "too-large",
    )

    def chunked():  # no Content-Length: cut off while reading
        for _ in range(4):
            yield b"x" * (JSON_CAP // 2)

    r = c.post("/v1/models", content=chunked(), headers={"content-type": "application/json"})
    assert r.request.headers.get("transfer-encoding") == "chunked"
    problem(r, 413, "too-large")


def test_a_value_the_catalog_refuses_is_422_invalid_argument(service, model):
    # NaN parses as JSON (Python's json module) and passes the schema, but the catalog stores
    # only strict JSON: the named error makes it the caller's fault (422), not a server fault.
    c = service.client("publisher")
    body = b'{"parent": null, "metadata": {"loss": NaN}}'
    r = c.post(f"/v1/models/{model}/publishes", content=body, headers={"content-type": "application/json"})
    assert "not JSON-serializable" in problem(r, 422, "invalid-argument")["detail"]


# --- the error table, end to end: a route raises, the service renders, the client decodes -----------


@pytest.fixture(scope="module")
def raising(tmp_path_factory) -> Iterator[str]:
    """A real service (SQLite + filesystem) with two extra routes: one raises any weightsync error by
    class name, one fails with an internal ValueError (a bug, as a client can cause none)."""
    app = create_app(Settings(data=tmp_path_factory.mktemp("raising")))

    @app.get("/test/raise/{name}")
    async def raise_named(name: str) -> None:
        cls = getattr(errors, name)
        raise (
            cls("boom from a route", current_head=4)
            if issubclass(cls, errors.StaleParent)
            else cls("boom from a route")
        )

    @app.get("/test/value-error")
    async def value_error() -> None:
        int("this is no number")  # raises ValueError: an internal bug

    server = ServerThread(app)
    url = server.start()
    try:
        yield url
    finally:
        server.stop()


def test_an_internal_value_error_is_a_500_not_a_client_error(raising):
    r = httpx.get(f"{raising}/test/value-error")
    body = problem(r, 500, "internal")
    assert "this is no number" not in body["detail"]  # internals stay in the server log


def test_invalid_argument_raised_in_a_route_is_422(raising):
    body = problem(httpx.get(f"{raising}/test/raise/InvalidArgument"), 422, "invalid-argument")
    assert body["detail"] == "boom from a route" and body["title"] == errors.InvalidArgument.title


_ERROR_CLASSES = sorted(
    (c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.WeightsyncError)),
    key=lambda c: c.__name__,
)


@pytest.mark.parametrize("cls", _ERROR_CLASSES, ids=lambda c: c.__name__)
def test_every_error_class_renders_its_attributes_and_the_client_decodes_it(raising, cls):
    r = httpx.get(f"{raising}/test/raise/{cls.__name__}")
    body = problem(r, cls.status, cls.code)
    assert body["title"] == cls.title and body.get("resource") == cls.resource
    if cls.status == 503:
        assert r.headers["retry-after"]
    with Api(raising, retry=Retry(attempts=1, base=0.0, cap=0.0)) as api, pytest.raises(errors.WeightsyncError) as info:
        api.request("GET", f"/test/raise/{cls.__name__}", not_found=errors.ObjectNotFound)
    got = info.value
    if cls.status >= 500:
        # 5xx are retried, then the client reports the server unavailable; 500s carry no class.
        assert isinstance(got, errors.ServerUnavailable) and got.exit_code == errors.EXIT_UNAVAILABLE
        return
    assert got.status == cls.status
    expected = errors.problem_class(cls.code, cls.resource)
    assert expected is not None and type(got) is expected
    assert got.exit_code == cls.exit_code  # the CLI exits alike on both sides of the wire
    if cls is errors.StaleParent:
        assert got.current_head == 4


def test_relay_heartbeats_replace_each_other_and_are_listed(service):
    c = service.client("admin")
    first = ok(c.put("/v1/relays/relay@eu-1", json={"site": "eu", "upstream": "http://o:8400"}), 200)
    assert (first["name"], first["site"], first["degraded"], first["models"]) == ("relay@eu-1", "eu", False, {})
    body = {"site": "eu", "degraded": True, "models": {"m": {"version": 3, "prefetch_lag_s": 0.5}}}
    second = ok(c.put("/v1/relays/relay@eu-1", json=body), 200)
    assert second["first_seen"] == first["first_seen"] and second["last_seen"] >= first["last_seen"]
    listed = [r for r in ok(c.get("/v1/relays"), 200)["relays"] if r["name"] == "relay@eu-1"]
    assert len(listed) == 1 and listed[0]["degraded"] is True and listed[0]["upstream"] is None
    assert listed[0]["models"] == {"m": {"version": 3, "prefetch_lag_s": 0.5}} and listed[0]["age_s"] >= 0
    assert c.put("/v1/relays/-bad", json={}).status_code == 422
    assert c.put("/v1/relays/r", json={"models": {"m": {"version": 0}}}).status_code == 422


@pytest.mark.parametrize(
    ("preload", "held", "joined"),
    [
        (4 << 20, "none", 1 << 20),
        (3000, "none", 1 << 20),
        (0, "none", 1 << 20),
        (3000, "none", 1),
        (0, "all", 1 << 20),
        (0, "all", 1),
        (0, "objects", 1 << 20),
        (0, "objects", 1),
    ],
)
def test_plan_with_inline_objects_is_one_answer_holding_the_plan_and_every_object(
    service, model, versions, monkeypatch, preload, held, joined
):
    """getPlan?inline=N: an update of at most N bytes comes with its manifests and objects, each byte-identical
    to what getObject serves and each step's manifest before its objects, whether held in the server's memory
    (`held`: none, all, or the objects and not the manifests; then never read from the store), read whole
    before the answer (up to BUNDLE_PRELOAD bytes) or streamed after it (both at once here when some fit the
    budget), the pieces in hand joined into writes or (`joined` 1) each sent as it is; a larger one (or no
    `inline`) is the plan's JSON alone; a bad N is a 422."""
    from weightsync import bundle
    from weightsync.ops.core import Ops
    from weightsync.service.routes import versions as routes

    monkeypatch.setattr(routes, "BUNDLE_PRELOAD", preload)
    monkeypatch.setattr(routes, "_JOINED_PIECE", joined)
    publish_chain(service.client("publisher"), model, versions[:3])
    reader = service.client("reader")
    plain = ok(reader.get(f"/v1/models/{model}/plan", params={"have": 1}), 200)
    # What the server holds, as Ops.held answers it: a set of its own here, so that what its memory kept of
    # this run's uploads (shared by the session's tests, bypassed by presigned uploads) does not decide.
    memory: dict[str, bytes] = {}
    for s in plain["steps"]:
        for d in ([] if held == "objects" else [s["manifest"]]) + [o["digest"] for o in s["objects"]]:
            if held != "none":
                memory[d] = reader.get(f"/v1/objects/{d}").content
    monkeypatch.setattr(Ops, "held", lambda self, digest: memory.get(digest))
    guard = [True]
    streamed: list[str] = []

    def unread(real, name):
        def call(self, digest, *args, **kwargs):
            if guard[0] and digest in memory:
                raise AssertionError(f"the store was read for {digest}, which the server holds")
            if guard[0] and name == "read_object":
                streamed.append(digest)
            return real(self, digest, *args, **kwargs)

        return call

    for name in ("read_whole_checked", "stat_object", "read_object"):
        monkeypatch.setattr(Ops, name, unread(getattr(Ops, name), name))
    r = reader.get(f"/v1/models/{model}/plan", params={"have": 1, "inline": plain["bytes"]})
    guard[0] = False
    assert r.status_code == 200 and r.headers["content-type"] == bundle.MEDIA_TYPE
    # Every part held, or read whole and hashed here: the answer says the server checked them all; one streamed
    # from the store unread: it does not.
    assert r.headers.get(bundle.CHECKED_HEADER) == (None if streamed else "sha256")
    _transfer_digests_match(r)
    if held == "all":
        assert not streamed
    assert int(r.headers["content-length"]) == len(r.content)
    got = list(bundle.parts(r.content))
    plan = json.loads(bytes(got[0][1]))
    assert got[0][0] == bundle.PLAN and plan["target"] == 3 and [s["number"] for s in plan["steps"]] == [2, 3]
    wanted = {s["manifest"] for s in plan["steps"]} | {o["digest"] for s in plan["steps"] for o in s["objects"]}
    objects = {name: bytes(data) for name, data in got[1:]}
    assert set(objects) == wanted and len(got) == len(wanted) + 1
    at = {name: i for i, (name, _) in enumerate(got)}
    seen: set[str] = set()
    for s in plan["steps"]:
        for o in s["objects"]:
            if o["digest"] not in seen:  # an object comes once, after the manifest of the first step naming it
                assert at[s["manifest"]] < at[o["digest"]]
                seen.add(o["digest"])
    for digest, data in objects.items():
        assert hashlib.sha256(data).hexdigest() == digest
        fetched = reader.get(f"/v1/objects/{digest}")
        assert fetched.status_code == 200 and fetched.content == data
    # One byte too few: the plan alone, as JSON. Without inline: JSON. Nothing to fetch: JSON.
    small = reader.get(f"/v1/models/{model}/plan", params={"have": 1, "inline": plain["bytes"] - 1})
    assert small.headers["content-type"].startswith("application/json") and small.json()["bytes"] == plain["bytes"]
    same = reader.get(f"/v1/models/{model}/plan", params={"have": 3, "inline": 1 << 20})
    assert same.headers["content-type"].startswith("application/json") and same.json()["steps"] == []
    for bad in (-1, bundle.MAX_INLINE + 1, "x"):
        problem(reader.get(f"/v1/models/{model}/plan", params={"inline": bad}), 422, "validation")
    problem(reader.get(f"/v1/models/{model}/plan", params={"want": 99, "inline": 10}), 404, "not-found")


@pytest.mark.parametrize("memory", ["ample", "none", "short"])
def test_a_server_that_did_not_take_the_upload_keeps_the_targets_objects_after_the_first_plan(
    tmp_path, versions, monkeypatch, memory
):
    """A server process started after the publish (what every other worker of a multi-process server is too)
    reads the plan's target step's objects whole into its memory at the first follower's plan, whatever the
    budget for reading the store before the answer, and serves the next plans from memory: bytes flipped on
    disk after that first plan do not reach them, while an older step's objects (a catch-up) still come
    from the store. With no memory (WEIGHTSYNC_OBJECT_MEMORY 0), or one that holds each of the target's
    objects but not all of them ("short": all or none), every plan reads the store."""
    from weightsync import bundle
    from weightsync.service.routes import versions as routes
    from weightsync.store.fs import FsStore

    monkeypatch.setattr(routes, "BUNDLE_PRELOAD", 0)
    params = {"have": 1, "inline": 1 << 20}
    with running(Settings(data=tmp_path / "data")) as url, httpx.Client(base_url=url) as c:
        first, older, target = publish_chain(c, "m", versions[:3])
        assert first.version["number"] == 1
        last = ok(c.get("/v1/models/m/plan", params={"have": 1}), 200)["steps"][-1]
    sizes = [last["manifest_bytes"], *(o["size"] for o in last["objects"])]
    assert len(sizes) >= 2
    budget = {"ample": 64 << 20, "none": 0, "short": sum(sizes) - 1}[memory]
    assert budget == 0 or budget >= max(sizes)
    with running(Settings(data=tmp_path / "data", object_memory=budget)) as url, httpx.Client(base_url=url) as c:

        def bundled() -> dict[str, bytes]:
            r = c.get("/v1/models/m/plan", params=params)
            assert r.headers["content-type"].startswith(bundle.MEDIA_TYPE)
            return {name: bytes(data) for name, data in list(bundle.parts(r.content))[1:]}

        before = bundled()
        # Each step's objects of frames, as the bundle carries them.
        frames = {k: {d for d in p.uploaded if d != p.manifest and d in before} for k, p in enumerate((older, target))}
        assert frames[0] and frames[1] and not frames[0] & frames[1]
        for path in (tmp_path / "data" / "store" / "objects").rglob("*"):
            if path.is_file() and path.name in frames[0] | frames[1]:
                path.chmod(0o644)
                data = bytearray(path.read_bytes())
                data[len(data) // 2] ^= 0x40
                path.write_bytes(bytes(data))
        after = bundled()
        # The plans after the first read none of the target's objects whole again: what memory keeps comes
        # from it, the rest is streamed (not read whole at every plan, pushing the rest of it out of memory).
        reads: list[str] = []
        real_get = FsStore.get

        async def counted(self, digest, *args, **kwargs):
            reads.append(digest)
            return await real_get(self, digest, *args, **kwargs)

        monkeypatch.setattr(FsStore, "get", counted)
        for _ in range(3):
            assert bundled().keys() == after.keys()
        assert not set(reads) & ({last["manifest"]} | frames[1])
    assert all(hashlib.sha256(before[d]).hexdigest() == d for d in before)  # the first plan read the store
    for d in frames[1]:
        assert (hashlib.sha256(after[d]).hexdigest() == d) == (memory == "ample")
    for d in frames[0]:
        assert hashlib.sha256(after[d]).hexdigest() != d  # from the store: the damaged bytes


@pytest.mark.parametrize(("memory", "preload"), [(64 << 20, 4 << 20), (64 << 20, 0), (0, 4 << 20)])
def test_a_plan_carries_small_objects_from_the_servers_memory_unless_it_keeps_none(
    tmp_path, versions, monkeypatch, memory, preload
):
    """Objects the server stored come with later plans from its memory (WEIGHTSYNC_OBJECT_MEMORY), whatever
    the budget for reading the store before the answer (BUNDLE_PRELOAD), so bytes flipped on disk behind its
    back (bit rot, which fsck finds) do not reach a follower; with 0 the plan reads the store each time and
    carries the damaged bytes, which the follower's check refuses."""
    from weightsync import bundle
    from weightsync.service.routes import versions as routes

    monkeypatch.setattr(routes, "BUNDLE_PRELOAD", preload)

    settings = Settings(data=tmp_path / "data", object_memory=memory)
    with running(settings) as url, httpx.Client(base_url=url) as c:
        first, second = publish_chain(c, "m", versions[:2])
        manifest = second.manifest
        for path in (tmp_path / "data" / "store" / "objects").rglob("*"):
            if path.is_file() and path.name in second.uploaded and path.name != manifest:
                path.chmod(0o644)
                data = bytearray(path.read_bytes())
                data[len(data) // 2] ^= 0x40
                path.write_bytes(bytes(data))
        r = c.get("/v1/models/m/plan", params={"have": first.version["number"], "inline": 1 << 20})
        assert r.headers["content-type"].startswith(bundle.MEDIA_TYPE)
        objects = {name: bytes(data) for name, data in list(bundle.parts(r.content))[1:]}
    frames = [d for d in objects if d != manifest]
    assert frames and set(frames) <= set(second.uploaded)
    intact = [hashlib.sha256(objects[d]).hexdigest() == d for d in frames]
    assert all(intact) if memory else not any(intact)
    # From memory, the server says it checked them; read from the store unhashed (it keeps nothing), it does not.
    assert r.headers.get(bundle.CHECKED_HEADER) == ("sha256" if memory else None)
    _transfer_digests_match(r)


@pytest.mark.parametrize("damaged", [False, True])
def test_a_bundle_says_its_parts_were_checked_only_when_each_hashed_to_its_name_here(tmp_path, versions, damaged):
    """A server that did not take the upload reads the target's objects whole and hashes them (to keep them):
    when every part hashes to its name the bundle says so (Weightsync-Checked: sha256); one damaged on disk
    still goes to the reader, whose own check refuses it, and the bundle does not say so."""
    from weightsync import bundle

    with running(Settings(data=tmp_path / "data")) as url, httpx.Client(base_url=url) as c:
        _, second = publish_chain(c, "m", versions[:2])
    frames = [d for d in second.uploaded if d != second.manifest]
    assert frames
    if damaged:
        for path in (tmp_path / "data" / "store" / "objects").rglob("*"):
            if path.is_file() and path.name == frames[0]:
                path.chmod(0o644)
                data = bytearray(path.read_bytes())
                data[len(data) // 2] ^= 0x40
                path.write_bytes(bytes(data))
    with running(Settings(data=tmp_path / "data")) as url, httpx.Client(base_url=url) as c:
        r = c.get("/v1/models/m/plan", params={"have": 1, "inline": 1 << 20})
    assert r.status_code == 200 and r.headers["content-type"].startswith(bundle.MEDIA_TYPE)
    objects = {name: bytes(data) for name, data in list(bundle.parts(r.content))[1:]}
    assert set(frames) <= set(objects)
    assert (hashlib.sha256(objects[frames[0]]).hexdigest() == frames[0]) is not damaged
    assert r.headers.get(bundle.CHECKED_HEADER) == (None if damaged else "sha256")
    _transfer_digests_match(r)


def _transfer_digests_match(r: httpx.Response) -> None:
    """A bundle the server says it checked names the xxh3-128 of its largest parts (all of them here), each that
    of the bytes sent (Weightsync-Xxh3); one it does not say it checked names none."""
    from weightsync import bundle

    named = bundle.parse_transfer_digests(r.headers.get(bundle.XXH3_HEADER, ""))
    if r.headers.get(bundle.CHECKED_HEADER) != "sha256":
        assert bundle.XXH3_HEADER not in r.headers
        return
    parts = {name: bytes(data) for name, data in list(bundle.parts(r.content))[1:]}
    assert parts and set(named) == set(parts), "every part, fewer than XXH3_PARTS here"
    for name, data in parts.items():
        assert named[name] == bundle.transfer_digest(data) == xxhash.xxh3_128_hexdigest(data), name
