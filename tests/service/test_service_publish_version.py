"""publishVersion: a whole publish in one request (docs/API.md "One request per version"), over real HTTP,
on SQLite + filesystem and on PostgreSQL + SeaweedFS. Every refusal leaves the model as it was: no new
version (tests/ops/test_publish_version.py shows no publish is left pending either)."""

from __future__ import annotations

import hashlib
import json

import pytest
from _service_http import files_of, ok, problem, publish, pull
from _service_util import JSON_CAP
from _versions import checkpoint, model_files, next_step

from weightsync import bundle
from weightsync.codec import Checkpoint, Encoder
from weightsync.codec.pack import pack

MEDIA = {"Content-Type": bundle.PUBLISH_MEDIA_TYPE}


def encode(model: str, ck: Checkpoint, base: Checkpoint | None, parent: int | None) -> tuple[str, dict[str, bytes]]:
    """The version's manifest digest and its objects by digest, the manifest last (a delta on `base`)."""
    manifest, objects = pack(Encoder(chunk_bytes=1 << 16, threads=2).encode(ck, base), target_bytes=1 << 17)
    manifest.model, manifest.parent = model, parent
    mbytes = manifest.encode()
    digest = hashlib.sha256(mbytes).hexdigest()
    return digest, {**{o.digest: o.data for o in objects}, digest: mbytes}


def body(fields: dict, objects: dict[str, bytes]) -> bytes:
    return bundle.encode(json.dumps(fields).encode(), objects, first=bundle.PUBLISH)


def request(model: str, ck: Checkpoint, base: Checkpoint | None, parent: int | None, **extra) -> tuple[dict, dict]:
    """publishVersion's JSON part and objects for `ck` on `parent`."""
    digest, objects = encode(model, ck, base, parent)
    fields = {
        "parent": parent,
        "keyframe": base is None,
        "objects": [{"digest": d, "size": len(b)} for d, b in objects.items()],
        "manifest": digest,
        **extra,
    }
    return fields, objects


def unchanged(client, model: str, head: int) -> None:
    """The model's head is still `head`, and it has exactly the versions 1..head."""
    assert ok(client.get(f"/v1/models/{model}/versions/latest"), 200)["number"] == head
    listed = ok(client.get(f"/v1/models/{model}/versions"), 200)["versions"]
    assert [v["number"] for v in listed] == list(range(1, head + 1))


@pytest.fixture
def started(service, model, versions):
    """The model with v1 (a keyframe of versions[0]) published the usual way; the publisher's client."""
    pub = service.client("publisher")
    publish(pub, model, versions[0], None, None)
    return pub


def test_one_request_commits_a_delta_that_reads_back_byte_identical(service, model, versions, started):
    fields, objects = request(model, versions[1], versions[0], 1, step=7, metadata={"by": "one-request"})
    got = ok(started.post(f"/v1/models/{model}/versions", content=body(fields, objects), headers=MEDIA), 201)
    assert (got["number"], got["kind"], got["parent"], got["step"]) == (2, "delta", 1, 7)
    assert got["manifest"] == fields["manifest"] and got["metadata"] == {"by": "one-request"}
    reader = service.client("reader")
    assert {k: v.tobytes() for k, v in pull(reader, model).files.items()} == files_of(versions[1])
    for digest, data in objects.items():  # every object stored under its own bytes
        assert reader.get(f"/v1/objects/{digest}").content == data
    unchanged(started, model, 2)


def _phases(resp) -> dict[str, float]:
    """The Server-Timing entries of an answer: {name: ms}."""
    out = {}
    for entry in resp.headers.get("server-timing", "").split(","):
        if entry.strip():
            name, dur = entry.strip().split(";dur=")
            out[name] = float(dur)
    return out


def test_answers_say_the_phases_the_server_spent_their_time_in(service, model, versions, started):
    """Server-Timing (W3C): publishVersion's store, then its begin and commit (one phase when they are one
    catalog transaction); a plan's read; none where no phase ran."""
    fields, objects = request(model, versions[1], versions[0], 1)
    # Frames are content-addressed: another test on this server may have stored the same ones already.
    fresh = all(started.head(f"/v1/objects/{d}").status_code == 404 for d in objects)
    resp = started.post(f"/v1/models/{model}/versions", content=body(fields, objects), headers=MEDIA)
    ok(resp, 201)
    timed = _phases(resp)
    assert list(timed) == (["store", "commit"] if fresh else ["store", "begin", "commit"])
    assert all(ms >= 0 for ms in timed.values())
    reader = service.client("reader")
    plan = reader.get(f"/v1/models/{model}/plan", params={"have": 1, "inline": 1 << 20})
    assert plan.status_code == 200 and list(_phases(plan)) == ["plan"]
    assert "server-timing" not in reader.get(f"/v1/models/{model}/versions/latest").headers
    refused = started.post(f"/v1/models/{model}/versions", content=body(fields, objects), headers=MEDIA)
    problem(refused, 409, "stale-parent")
    # A refusal still says where the time went: the objects were there already, so a begin of its own
    assert list(_phases(refused)) == ["store", "begin"]


def test_a_model_s_first_version_goes_in_one_request(service, model):
    """No parent: the model is created and the keyframe committed, in one request."""
    tiny = [checkpoint(model_files(seed=5, n=2))]
    tiny.append(checkpoint(next_step(model_files(seed=5, n=2), 1), 1))
    pub = service.client("publisher")
    fields, objects = request(model, tiny[0], None, None)
    first = ok(pub.post(f"/v1/models/{model}/versions", content=body(fields, objects), headers=MEDIA), 201)
    assert (first["number"], first["kind"], first["parent"]) == (1, "keyframe", None)
    fields, objects = request(model, tiny[1], tiny[0], 1)
    assert (
        ok(pub.post(f"/v1/models/{model}/versions", content=body(fields, objects), headers=MEDIA), 201)["number"] == 2
    )
    assert {k: v.tobytes() for k, v in pull(service.client("reader"), model).files.items()} == files_of(tiny[1])


def test_a_retry_with_the_same_key_replays_the_version(service, model, versions, started):
    """The answer was lost: the retry finds the head moved by itself and gets the same version back; the
    same key with another manifest is a conflict; without a key it is a stale parent."""
    fields, objects = request(model, versions[1], versions[0], 1, idempotency_key="k-1")
    first = ok(started.post(f"/v1/models/{model}/versions", content=body(fields, objects), headers=MEDIA), 201)
    again = ok(started.post(f"/v1/models/{model}/versions", content=body(fields, objects), headers=MEDIA), 201)
    assert again["number"] == first["number"] == 2 and again["manifest"] == first["manifest"]
    other, other_objects = request(model, versions[2], versions[0], 1, idempotency_key="k-1")
    problem(
        started.post(f"/v1/models/{model}/versions", content=body(other, other_objects), headers=MEDIA), 409, "conflict"
    )
    del fields["idempotency_key"]
    problem(
        started.post(f"/v1/models/{model}/versions", content=body(fields, objects), headers=MEDIA), 409, "stale-parent"
    )
    unchanged(started, model, 2)


def test_a_delta_where_the_policy_wants_a_keyframe_is_answered_as_a_begin(service, model, versions, started):
    """202 with beginPublish's answer (kind keyframe), nothing committed; the publish goes on the usual way."""
    ok(started.patch(f"/v1/models/{model}", json={"keyframe_interval": 1}), 200)
    fields, objects = request(model, versions[1], versions[0], 1)
    got = ok(started.post(f"/v1/models/{model}/versions", content=body(fields, objects), headers=MEDIA), 202)
    assert got["kind"] == "keyframe" and got["parent"] == 1 and got["formats"]
    unchanged(started, model, 1)
    key, key_objects = request(model, versions[1], None, 1)
    check = ok(
        started.post(f"/v1/models/{model}/publishes/{got['publish_id']}/objects", json={"objects": key["objects"]}),
        200,
    )
    for digest in check["missing"]:
        ok(started.put(f"/v1/objects/{digest}", content=key_objects[digest]), 201)
    done = ok(
        started.post(f"/v1/models/{model}/publishes/{got['publish_id']}/commit", json={"manifest": key["manifest"]}),
        201,
    )
    assert (done["number"], done["kind"]) == (2, "keyframe")


@pytest.mark.parametrize(
    "spoil, status, code",
    [
        ("bad-magic", 422, "invalid-argument"),
        ("truncated", 422, "invalid-argument"),
        ("other-bytes", 422, "digest-mismatch"),
        ("unlisted-part", 422, "invalid-argument"),
        ("missing-part", 409, "incomplete-publish"),
        ("manifest-not-listed", 422, "invalid-argument"),
        ("not-json", 422, "validation"),
        ("unknown-field", 422, "validation"),
    ],
)
def test_a_spoiled_request_is_refused_and_changes_nothing(service, model, versions, started, spoil, status, code):
    fields, objects = request(model, versions[1], versions[0], 1)
    data_digest = next(iter(objects))
    if spoil == "bad-magic":
        raw = b"XXXX" + body(fields, objects)[4:]
    elif spoil == "truncated":
        raw = body(fields, objects)[:-10]
    elif spoil == "other-bytes":  # same size, other bytes: the store hashes what arrives
        spoiled = dict(objects)
        spoiled[data_digest] = bytes(b ^ 0xFF for b in objects[data_digest])
        raw = body(fields, spoiled)
    elif spoil == "unlisted-part":
        raw = body(fields, objects) + bundle.part_header("ab" * 32, 3) + b"abc"
    elif spoil == "missing-part":
        raw = body(fields, {d: b for d, b in objects.items() if d != data_digest})
    elif spoil == "manifest-not-listed":
        raw = body({**fields, "manifest": "cd" * 32}, objects)
    elif spoil == "not-json":
        raw = bundle.encode(b"{not json", objects, first=bundle.PUBLISH)
    else:
        raw = body({**fields, "surprise": 1}, objects)
    problem(started.post(f"/v1/models/{model}/versions", content=raw, headers=MEDIA), status, code)
    unchanged(started, model, 1)
    # The same version, sent whole, still commits.
    ok(started.post(f"/v1/models/{model}/versions", content=body(fields, objects), headers=MEDIA), 201)


def test_wrong_media_type_stale_parent_size_cap_and_scopes(service, model, versions, started):
    fields, objects = request(model, versions[1], versions[0], 1)
    raw = body(fields, objects)
    problem(
        started.post(f"/v1/models/{model}/versions", content=raw, headers={"Content-Type": "application/json"}),
        415,
        "unsupported-media-type",
    )
    stale, stale_objects = request(model, versions[1], versions[0], None)
    problem(
        started.post(f"/v1/models/{model}/versions", content=body(stale, stale_objects), headers=MEDIA),
        409,
        "stale-parent",
    )
    big = {**objects, "ee" * 32: bytes(JSON_CAP)}
    fields_big = {**fields, "objects": [*fields["objects"], {"digest": "ee" * 32, "size": JSON_CAP}]}
    problem(
        started.post(f"/v1/models/{model}/versions", content=body(fields_big, big), headers=MEDIA), 413, "too-large"
    )
    problem(service.client("reader").post(f"/v1/models/{model}/versions", content=raw, headers=MEDIA), 403, "forbidden")
    problem(service.client(None).post(f"/v1/models/{model}/versions", content=raw, headers=MEDIA), 401, "unauthorized")
    unchanged(started, model, 1)
