"""Hugging Face-style model names (`Org/Name`) through every model route, tokens, watch, the ledger and GC."""

from __future__ import annotations

import uuid

from _service_http import ok, problem, publish_chain, pull


def test_org_names_work_on_every_model_route(service, versions):
    name = f"Acme/Policy-{uuid.uuid4().hex[:8]}.v2"
    org = service.client("org")
    published = publish_chain(org, name, versions[:2])
    assert [p.version["model"] for p in published] == [name, name]
    assert ok(org.get(f"/v1/models/{name}"), 200)["name"] == name  # case preserved
    assert [v["number"] for v in ok(org.get(f"/v1/models/{name}/versions"), 200)["versions"]] == [1, 2]
    assert ok(org.get(f"/v1/models/{name}/versions/latest"), 200)["number"] == 2
    assert [v["number"] for v in ok(org.get(f"/v1/models/{name}/versions/2/lineage"), 200)["versions"]] == [1, 2]
    assert org.get(f"/v1/models/{name}/versions/2/manifest").status_code == 200
    assert ok(org.get(f"/v1/models/{name}/watch", params={"after": 1, "timeout": 1}), 200)["number"] == 2
    got = pull(org, name)
    assert got.number == 2
    ok(org.post(f"/v1/models/{name}/replicas", json={"subscriber": "r1", "version": 2}), 201)
    assert [r["subscriber"] for r in ok(org.get(f"/v1/models/{name}/replicas"), 200)["replicas"]] == ["r1"]
    # Exactly as written: another case is another (missing) model.
    assert problem(service.client("admin").get(f"/v1/models/{name.lower()}"), 404, "not-found")["resource"] == "model"
    fsck = ok(service.client("admin").post("/v1/admin/fsck", json={"read_data": True}), 200)
    assert fsck["versions_checked"] >= 2 and not [p for p in fsck["problems"] if p["model"] == name]
    ok(service.client("admin").post("/v1/admin/gc", json={"dry_run": True}), 200)


def test_token_patterns_star_stays_in_a_part_double_star_crosses(service):
    org, publisher, admin = service.client("org"), service.client("publisher"), service.client("admin")
    suffix = uuid.uuid4().hex[:8]
    ok(org.post("/v1/models", json={"name": f"Acme/m-{suffix}"}), 201)  # "Acme/*"
    problem(org.post("/v1/models", json={"name": f"Other/m-{suffix}"}), 403, "forbidden")
    problem(org.post("/v1/models", json={"name": f"acme/m-{suffix}"}), 403, "forbidden")  # case-sensitive
    # "policy-*" does not reach into an organisation's models; "**" (admin) does.
    problem(publisher.post("/v1/models", json={"name": f"policy-x/m-{suffix}"}), 403, "forbidden")
    ok(admin.post("/v1/models", json={"name": f"policy-x/m-{suffix}"}), 201)
    assert f"Acme/m-{suffix}" in {m["name"] for m in ok(org.get("/v1/models"), 200)["models"]}
    assert f"policy-x/m-{suffix}" not in {m["name"] for m in ok(org.get("/v1/models"), 200)["models"]}


def test_names_that_break_the_rules_are_refused(service):
    admin = service.client("admin")
    for bad in ["Acme/x/y", "Acme--x", "Acme/..x", "Acme/versions", "-Acme/x", "Acme/" + "x" * 96]:
        problem(admin.post("/v1/models", json={"name": bad}), 422, "invalid-name")
    # A route word after the slash is the route, not a model: `m/versions` lists m's versions.
    ok(admin.post("/v1/models", json={"name": "plain-m"}), 201)
    assert ok(admin.get("/v1/models/plain-m/versions"), 200)["versions"] == []
    problem(admin.get("/v1/models/a/b/c"), 404, "not-found")
