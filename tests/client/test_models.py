"""The client's API types (client/models.py): strict parsing, unknown fields ignored, the service's field names."""

from __future__ import annotations

import dataclasses
import json
import types
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

import pytest
from _client_util import TinyTrainer, write_version

from weightsync import errors
from weightsync.client import models
from weightsync.client._http import Api

VERSION = {
    "model": "m",
    "number": 3,
    "parent": 2,
    "kind": "delta",
    "chain_base": 1,
    "step": 30,
    "metadata": {"loss": 0.5, "tags": ["a"]},
    "raw_bytes": 1000,
    "stored_bytes": 120,
    "manifest": "a" * 64,
    "committed_at": "2025-03-01T12:00:00.250000Z",
}
PLAN = {
    "model": "m",
    "have": 1,
    "target": 3,
    "bytes": 240,
    "full_bytes": 900,
    "lease_expires_at": "2025-03-01T12:05:00Z",
    "steps": [
        {
            "number": n,
            "kind": "delta",
            "manifest": f"{n}" * 64,
            "manifest_bytes": 80,
            "stored_bytes": 120,
            "objects": [{"digest": "b" * 64, "size": 40}, {"digest": "c" * 64, "size": 0}],
        }
        for n in (2, 3)
    ],
}


def _wire_types() -> list[type[models.Wire]]:
    return [
        c for c in vars(models).values() if isinstance(c, type) and issubclass(c, models.Wire) and c is not models.Wire
    ]


def test_round_trip_is_exact_and_typed() -> None:
    v = models.Version.from_json(VERSION)
    assert v.committed_at == datetime(2025, 3, 1, 12, 0, 0, 250000, tzinfo=UTC)
    assert v.to_dict() == VERSION
    plan = models.Plan.from_json(PLAN)
    assert [s.number for s in plan.steps] == [2, 3]
    assert plan.steps[0].objects[1] == models.PlanObject(digest="c" * 64, size=0)
    assert plan.to_dict() == PLAN
    assert json.loads(json.dumps(plan.to_dict())) == PLAN


def test_unknown_fields_are_ignored() -> None:
    newer = {**VERSION, "shards": 8, "relay": {"site": "eu"}}
    assert models.Version.from_json(newer) == models.Version.from_json(VERSION)
    plan = {**PLAN, "steps": [{**s, "parts": [1, 2]} for s in PLAN["steps"]]}
    assert models.Plan.from_json(plan) == models.Plan.from_json(PLAN)


@pytest.mark.parametrize(
    "field,value,expected",
    [
        ("number", "3", "integer"),
        ("number", True, "integer"),  # a bool is not an integer here
        ("number", 3.0, "integer"),
        ("number", None, "integer"),
        ("kind", 1, "string"),
        ("metadata", [], "object"),
        ("committed_at", "yesterday", "ISO 8601"),
        ("committed_at", 1700000000, "ISO 8601"),
        ("parent", "2", "integer"),
    ],
)
def test_a_mistyped_known_field_is_bad_response(field: str, value: Any, expected: str) -> None:
    with pytest.raises(errors.BadResponse) as info:
        models.Version.from_json({**VERSION, field: value})
    assert f"Version.{field}" in str(info.value) and expected in str(info.value)
    assert isinstance(info.value, errors.ClientError) and info.value.exit_code == errors.EXIT_ERROR


def test_bad_response_names_the_nested_field() -> None:
    bad = json.loads(json.dumps(PLAN))
    bad["steps"][1]["objects"][0]["size"] = "40"
    with pytest.raises(errors.BadResponse, match=r"Plan\.steps\[1\]\.objects\[0\]\.size"):
        models.Plan.from_json(bad)
    missing = {k: v for k, v in VERSION.items() if k != "manifest"}
    with pytest.raises(errors.BadResponse, match=r"Version\.manifest is missing"):
        models.Version.from_json(missing)
    for not_an_object in (None, [], "x", 3):
        with pytest.raises(errors.BadResponse):
            models.Model.from_json(not_an_object)
    with pytest.raises(errors.BadResponse, match=r"GcReport\.versions_deleted\['m'\]\[1\]"):
        models.GcReport.from_json(
            {
                "versions_deleted": {"m": [1, "2"]},
                "pending_expired": 0,
                "objects_deleted": 0,
                "bytes_deleted": 0,
                "objects_kept_in_grace": 0,
            }
        )


def test_nullable_and_defaulted_fields() -> None:
    check = models.CheckObjects.from_json({"missing": ["a" * 64]})  # "uploads" absent: the store does not presign
    assert check.uploads is None
    signed = models.CheckObjects.from_json(
        {
            "missing": ["a" * 64],
            "uploads": {"a" * 64: {"method": "PUT", "url": "http://s3/x", "headers": {"If-None-Match": "*"}}},
        }
    )
    assert signed.uploads == {"a" * 64: models.PresignedPut("PUT", "http://s3/x", {"If-None-Match": "*"})}
    m = models.Model.from_json(
        {
            "name": "m",
            "head": None,
            "created_at": "2025-03-01T00:00:00Z",
            "keyframe_interval": 16,
            "max_chain_ratio": 4,
            "keep_last": None,
        }
    )
    assert m.head is None and m.max_chain_ratio == 4.0 and isinstance(m.max_chain_ratio, float)
    # A server older than lease purging sends no leases_purged: it purged none.
    gc = {
        "versions_deleted": {"m": [1]},
        "pending_expired": 0,
        "objects_deleted": 2,
        "bytes_deleted": 9,
        "objects_kept_in_grace": 1,
    }
    assert models.GcReport.from_json(gc).leases_purged == 0
    assert models.GcReport.from_json({**gc, "leases_purged": 3}).to_dict() == {**gc, "leases_purged": 3}
    with pytest.raises(errors.BadResponse, match=r"GcReport\.leases_purged"):
        models.GcReport.from_json({**gc, "leases_purged": None})


def test_list_answers_name_the_bad_item() -> None:
    with pytest.raises(errors.BadResponse, match=r"VersionList\.versions\[1\]\.number"):
        models.VersionList.from_json({"versions": [VERSION, {**VERSION, "number": "4"}]})
    with pytest.raises(errors.BadResponse, match=r"ModelList\.models is missing"):
        models.ModelList.from_json({"items": []})
    assert models.VersionList.from_json({"versions": [VERSION], "next": 4}).versions == [
        models.Version.from_json(VERSION)
    ]


# --- the service renders the same field names -------------------------------------------------


def _pairs() -> list[tuple[type[models.Wire], type]]:
    schemas = pytest.importorskip("weightsync.service.schemas")
    return [
        (models.Health, schemas.Health),
        (models.Model, schemas.ModelOut),
        (models.Info, schemas.InfoOut),
        (models.DeletedModel, schemas.DeletedModelOut),
        (models.ModelList, schemas.ModelList),
        (models.Version, schemas.VersionOut),
        (models.VersionList, schemas.VersionList),
        (models.PlanObject, schemas.PlanObject),
        (models.PlanStep, schemas.PlanStepOut),
        (models.Plan, schemas.PlanOut),
        (models.PublishBegin, schemas.BeginOut),
        (models.PresignedPut, schemas.PresignedPut),
        (models.CheckObjects, schemas.CheckOut),
        (models.Replica, schemas.ReplicaOut),
        (models.ReplicaList, schemas.ReplicaList),
        (models.RelayModel, schemas.RelayModel),
        (models.Relay, schemas.RelayOut),
        (models.RelayList, schemas.RelayList),
        (models.FsckProblem, schemas.ProblemOut),
        (models.FsckReport, schemas.FsckOut),
        (models.GcReport, schemas.GcOut),
    ]


def _nullable(annotation: Any) -> bool:
    return get_origin(annotation) in (Union, types.UnionType) and type(None) in get_args(annotation)


def test_client_types_have_the_service_schemas_field_names() -> None:
    pairs = _pairs()
    assert {c for c, _ in pairs} == set(_wire_types()), "every API type is checked against its service schema"
    for client, service in pairs:
        assert [f.name for f in dataclasses.fields(client)] == list(service.model_fields), client.__name__
        hints = get_type_hints(client)
        for name, info in service.model_fields.items():
            assert _nullable(hints[name]) == _nullable(info.annotation), (client.__name__, name)


# --- against a real server ----------------------------------------------------------------------


def test_real_answers_parse_and_round_trip(server, model, tmp_path: Path) -> None:
    """Every typed Api call equals, through ``to_dict``, the JSON the server sent (what the CLI prints)."""
    from weightsync.client import Publisher

    trainer = TinyTrainer(seed=53)
    with Publisher(server.url, model) as pub:
        for i in range(2):
            trainer.step()
            pub.publish(write_version(tmp_path / f"v{i}", trainer.export()), step=i, metadata={"i": i})
    with Api(server.url) as api:

        def raw(method: str, path: str, **kwargs: Any) -> Any:
            return api.request(method, path, **kwargs).json()

        base = f"/v1/models/{model}"
        begin = api.begin_publish(model, parent=2, step=None, metadata=None, keyframe=False)
        assert isinstance(begin, models.PublishBegin) and begin.kind == "delta" and begin.parent == 2
        check = api.check_objects(model, begin.publish_id, [("d" * 64, 5)])
        assert check == models.CheckObjects(missing=["d" * 64])
        api.abort_publish(model, begin.publish_id)
        replica = api.report_replica(model, subscriber="s", version=2, bytes=10)
        assert (replica.subscriber, replica.version, replica.bytes, replica.pause_ms) == ("s", 2, 10, None)
        plan = api.get_plan(model, have=None, holder="test")
        watched = api.watch(model, after=1, timeout=5)
        pairs: list[tuple[Any, Any]] = [
            (api.health(), raw("GET", "/healthz")),
            (api.get_model(model), raw("GET", base)),
            ([m.to_dict() for m in api.list_models()], raw("GET", "/v1/models")["models"]),
            ([v.to_dict() for v in api.list_versions(model)], raw("GET", f"{base}/versions")["versions"]),
            (
                [v.to_dict() for v in api.list_versions(model, after=1, limit=1)],
                raw("GET", f"{base}/versions", params={"after": 1, "limit": 1})["versions"],
            ),
            (api.get_version(model, 1), raw("GET", f"{base}/versions/1")),
            (api.head(model), raw("GET", f"{base}/versions/latest")),
            (watched, raw("GET", f"{base}/watch", params={"after": 1, "timeout": 5})),
            (api.get_plan(model, have=1), raw("GET", f"{base}/plan", params={"have": 1})),
            ([r.to_dict() for r in api.list_replicas(model)], raw("GET", f"{base}/replicas")["replicas"]),
            (
                api.fsck(read_data=False, repair=False),
                raw("POST", "/v1/admin/fsck", json={"read_data": False, "repair": False}),
            ),
            (api.gc(dry_run=True), raw("POST", "/v1/admin/gc", json={"dry_run": True})),
        ]
        assert api.head(model + "-missing") is None
        assert api.watch(model, after=2, timeout=0.2) is None  # nothing newer: the poll times out (204)
    for typed, answer in pairs:
        got = typed.to_dict() if isinstance(typed, models.Wire) else typed
        assert got == answer, answer
    assert plan.target == 2 and plan.lease_expires_at is not None and plan.bytes > 0
    assert [s.number for s in plan.steps] == [1, 2]
    assert watched is not None and watched.number == 2 and watched.metadata == {"i": 1}
    assert isinstance(pairs[-1][0], models.GcReport) and pairs[-1][0].leases_purged == 0  # a dry run purges none
