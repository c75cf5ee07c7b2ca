"""Schemathesis against a running ``weightsync serve``: no 5xx, no schema violation, no authorization bypass.

The schema is the server's own ``/openapi.json``. For every operation, schemathesis
generates valid (positive) and invalid (negative) requests; each is sent with a caller
drawn from {no token, unknown token, reader, publisher, admin, wrong-model-pattern} and
with path parameters either generated or pinned to things that exist (a model with two
versions, its objects, a pending publish), so requests reach the handlers, not just the
validators. Every answer must:

- not be a 5xx;
- conform to the schema (documented status code, content type, headers, body schema);
- never be a 2xx for a caller without the scope or the model pattern the operation
  needs (tests/reliability/_sec_api.py) — an authorization bypass.

Bounded by default (40 examples per operation), 400 with ``--long``; seed ``WEIGHTSYNC_FUZZ_SEED``. The figures
(requests sent, violations) are printed by ``test_api_fuzz`` (run with ``-s``).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest
from _sec_api import CALLERS, REQUIRED_SCOPE, allowed, operations
from _sec_server import SecServer, publish_versions, start_server, stop_server, version_files
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

schemathesis = pytest.importorskip("schemathesis")
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import (  # noqa: E402
    content_type_conformance,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

SEED = int(os.environ.get("WEIGHTSYNC_FUZZ_SEED", "20261122"))
MODEL = "policy-fuzz"
OTHER = "other-fuzz"
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]
# Server-Sent Events never end: the security matrix covers streamEvents with a streamed request instead.
SKIP = {"streamEvents"}


def _publish_bundles() -> st.SearchStrategy[bytes]:
    """publishVersion bodies: bundles whose JSON part is any JSON object (sometimes near a valid request) and
    whose object parts are any bytes under any names; or any bytes at all. None may get a 5xx."""
    from weightsync import bundle

    digest = st.text("0123456789abcdef", min_size=64, max_size=64)
    ref = st.fixed_dictionaries({"digest": digest, "size": st.integers(-1, 4096)})
    near = st.fixed_dictionaries(
        {
            "parent": st.one_of(st.none(), st.integers(-2, 5)),
            "keyframe": st.booleans(),
            "objects": st.lists(ref, max_size=3),
            "manifest": digest,
        }
    )
    anything = st.dictionaries(st.text(max_size=8), st.one_of(st.integers(), st.text(max_size=8)), max_size=4)
    parts = st.dictionaries(digest, st.binary(max_size=256), max_size=3)
    bundles = st.builds(
        lambda doc, objs: bundle.encode(json.dumps(doc).encode(), objs, first=bundle.PUBLISH),
        st.one_of(near, anything),
        parts,
    )
    return st.one_of(bundles, st.binary(max_size=512))


schemathesis.openapi.media_type("application/vnd.weightsync.publish-bundle", _publish_bundles())


@dataclass
class Fixture:
    server: SecServer
    schema: object
    pins: dict[str, list[str]]
    sent: int = 0
    by_status: Counter = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def api(tmp_path_factory) -> Iterator[Fixture]:
    root = tmp_path_factory.mktemp("api-fuzz")
    server = start_server(
        root / "server",
        log_level="warning",
        env={
            "WEIGHTSYNC_MAX_UPLOAD_BODY": str(1 << 20),
            "WEIGHTSYNC_MAX_JSON_BODY": str(64 << 10),
            "WEIGHTSYNC_GC_GRACE_S": "3600",
        },
    )
    try:
        published = publish_versions(server, MODEL, version_files(2, seed=11), root / "src")
        publish_versions(server, OTHER, version_files(1, seed=12), root / "src-other", who="admin")
        with httpx.Client(base_url=server.url, headers=server.headers("admin"), timeout=30) as c:
            begin = c.post(f"/v1/models/{MODEL}/publishes", json={"parent": 2, "keyframe": False})
            assert begin.status_code == 201, begin.text
        pins = {
            "model": [MODEL, OTHER],
            "number": ["1", "2", "latest"],
            "digest": [published[1]["manifest"], *published[1]["objects"][:2]],
            "publish_id": [begin.json()["publish_id"]],
        }
        schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
        yield Fixture(server, schema, pins)
    finally:
        stop_server(server)


def _operation_strategy(op, pins: dict[str, list[str]]):
    """Positive and negative cases, with generated path parameters or ones pinned to existing things."""
    names = [p.name for p in op.path_parameters] if op.path_parameters else []
    pinned = st.fixed_dictionaries({n: st.sampled_from(pins[n]) for n in names if n in pins})
    strategies = [
        op.as_strategy(generation_mode=GenerationMode.POSITIVE),
        op.as_strategy(generation_mode=GenerationMode.NEGATIVE),
    ]
    if names:
        strategies.append(
            pinned.flatmap(lambda pp: op.as_strategy(generation_mode=GenerationMode.POSITIVE, path_parameters=pp))
        )
    return st.one_of(*strategies)


def _model_of(operation_id: str, case) -> str | None:
    if operation_id == "createModel":
        return case.body.get("name") if isinstance(case.body, dict) else None
    return (case.path_parameters or {}).get("model")


def _cap_watch(case) -> None:
    """A long poll of up to 60 s is legal; the fuzzer does not wait for it."""
    query = dict(case.query or {})
    try:
        if float(query.get("timeout", 30)) > 0.2:
            query["timeout"] = "0.1"
    except (TypeError, ValueError):
        pass
    case.query = query


def test_api_fuzz(api: Fixture, long_run: bool):
    raw = httpx.get(api.server.url + "/openapi.json", timeout=30).json()
    ids = [op_id for op_id, _, _ in operations(raw)]
    missing = sorted(set(ids) - set(REQUIRED_SCOPE))
    assert not missing, f"operations without an authorization decision in _sec_api.REQUIRED_SCOPE: {missing}"
    examples = 400 if long_run else 40

    for result in api.schema.get_all_operations():
        op = result.ok()
        operation_id = op.definition.raw["operationId"]
        if operation_id in SKIP:
            continue

        @seed(SEED)
        @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(case=_operation_strategy(op, api.pins), caller=st.sampled_from(CALLERS))
        def run(case, caller: str) -> None:
            # Runs inside this iteration (run() below), so the loop variable is the current one.
            if operation_id == "watchModel":
                _cap_watch(case)
            headers = dict(case.headers or {})
            headers.pop("Authorization", None)
            headers.pop("authorization", None)
            if caller != "none":
                headers["Authorization"] = f"Bearer {api.server.token(caller)}"
            case.headers = headers
            response = case.call(base_url=api.server.url, timeout=30)
            api.sent += 1
            if response.status_code == 400 and response.text == "Invalid HTTP request received.":
                # Refused by the HTTP server (uvicorn/h11) before the app sees it, e.g. "Content-Length: &".
                api.by_status["http-layer"] += 1
                return
            api.by_status[response.status_code // 100] += 1
            where = f"{operation_id} as {caller}: {case.method} {case.formatted_path} -> {response.status_code}"
            if response.status_code >= 500:
                api.violations.append(f"5xx: {where}: {response.text[:200]}")
            if (
                200 <= response.status_code < 300
                and allowed(operation_id, caller, _model_of(operation_id, case)) is False
            ):
                api.violations.append(f"authorization bypass: {where}")
            try:
                case.validate_response(response, checks=CHECKS, headers=headers)
            except BaseExceptionGroup as exc:  # schemathesis's FailureGroup of named failures
                api.violations.append(
                    f"schema: {where}: " + "; ".join(f"{type(e).__name__}: {str(e)[:300]}" for e in exc.exceptions)
                )

        run()

    print(
        f"\nFIGURE api-fuzz: {api.sent} requests, {len(api.violations)} violations, seed {SEED}, "
        f"status classes {dict(sorted((f'{k}xx' if isinstance(k, int) else k, v) for k, v in api.by_status.items()))}"
    )
    assert not api.violations, json.dumps(api.violations[:20], indent=1)
