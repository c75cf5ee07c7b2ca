"""Bearer tokens: 401 without a known token, 403 without the scope or the model, on every endpoint."""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from pathlib import Path

import httpx
import pytest
from _service_http import ok, problem, publish
from _service_util import TOKENS, running

from weightsync.service import Settings
from weightsync.service.auth import AuthDenied, TokenTable
from weightsync.service.settings import ConfigError

D = hashlib.sha256(b"auth test object").hexdigest()

# (method, path, json body or raw bytes, scope, model-scoped)
ENDPOINTS = [
    ("GET", "/v1/models", None, "read", False),
    ("GET", "/v1/models/{m}", None, "read", True),
    ("GET", "/v1/models/{m}/versions", None, "read", True),
    ("GET", "/v1/models/{m}/versions/1", None, "read", True),
    ("GET", "/v1/models/{m}/versions/1/lineage", None, "read", True),
    ("GET", "/v1/models/{m}/versions/1/manifest", None, "read", True),
    ("GET", "/v1/models/{m}/plan", None, "read", True),
    ("GET", "/v1/models/{m}/watch?after=1&timeout=0", None, "read", True),
    ("GET", "/v1/models/{m}/events", None, "read", True),
    ("POST", "/v1/models/{m}/replicas", {"subscriber": "s", "version": 1}, "read", True),
    ("GET", "/v1/models/{m}/replicas", None, "read", True),
    ("GET", f"/v1/objects/{D}", None, "read", False),
    ("HEAD", f"/v1/objects/{D}", None, "read", False),
    ("GET", f"/v1/objects/{D}/url", None, "read", False),
    ("GET", "/v1/info", None, "read", False),
    ("PATCH", "/v1/models/{m}", {}, "publish", True),
    ("PUT", "/v1/models/{m}/pin", {"version": 1}, "publish", True),
    ("DELETE", "/v1/models/{m}/pin", None, "publish", True),
    ("DELETE", "/v1/models/{m}-gone", None, "admin", True),
    ("POST", "/v1/models", {"name": "{m}"}, "publish", True),
    ("POST", "/v1/models/{m}/publishes", {"parent": 1}, "publish", True),
    ("POST", "/v1/models/{m}/publishes/nope/objects", {"objects": []}, "publish", True),
    ("POST", "/v1/models/{m}/publishes/nope/commit", {"manifest": "0" * 64}, "publish", True),
    ("DELETE", "/v1/models/{m}/publishes/nope", None, "publish", True),
    ("PUT", f"/v1/objects/{D}", b"auth test object", "publish", False),
    ("POST", "/v1/admin/fsck", {}, "admin", False),
    ("POST", "/v1/admin/gc", {"dry_run": True}, "admin", False),
]
IDS = [f"{m} {p.split('?')[0]}" for m, p, *_ in ENDPOINTS]
LOWER = {"read": [], "publish": ["reader"], "admin": ["reader", "publisher"]}
EXACT = {"read": "reader", "publish": "publisher", "admin": "admin"}


@pytest.fixture(scope="module")
def auth_model(service, versions) -> str:
    """A model (matching policy-*) with one committed version."""
    name = f"policy-auth-{uuid.uuid4().hex[:8]}"
    publish(service.client("publisher"), name, versions[0], None, None)
    return name


def call(client: httpx.Client, endpoint, model: str) -> httpx.Response:
    """Make the request and return as soon as the status is known (event streams stay open otherwise)."""
    method, path, body, _, _ = endpoint
    path = path.replace("{m}", model)
    kwargs: dict = {}
    if isinstance(body, bytes):
        kwargs["content"] = body
    elif body is not None:
        kwargs["content"] = json.dumps(body).replace("{m}", model).encode()
        kwargs["headers"] = {"content-type": "application/json"}
    with client.stream(method, path, **kwargs) as r:
        if r.headers.get("content-type", "").startswith("application/problem+json"):
            r.read()
        return r


@pytest.mark.parametrize("endpoint", ENDPOINTS, ids=IDS)
def test_missing_or_unknown_token_is_401(service, auth_model, endpoint):
    for client in (service.client(None), service.client(token="not-a-configured-token")):
        r = call(client, endpoint, auth_model)
        assert r.status_code == 401, (endpoint, r.status_code)
        assert r.headers["www-authenticate"].startswith("Bearer")
        if endpoint[0] != "HEAD":
            assert r.json()["type"].endswith("/unauthorized")
    basic = httpx.Client(base_url=service.url, headers={"Authorization": "Basic dXNlcjpwYXNz"})
    with basic:
        assert call(basic, endpoint, auth_model).status_code == 401


@pytest.mark.parametrize("endpoint", ENDPOINTS, ids=IDS)
def test_insufficient_scope_or_model_is_403(service, auth_model, endpoint):
    scope, model_scoped = endpoint[3], endpoint[4]
    for who in LOWER[scope]:
        r = call(service.client(who), endpoint, auth_model)
        assert r.status_code == 403, (who, endpoint, r.status_code)
        if endpoint[0] != "HEAD":
            assert r.json()["type"].endswith("/forbidden")
    if model_scoped:
        # "other" may publish, but only models named other-*.
        r = call(service.client("other"), endpoint, auth_model)
        assert r.status_code == 403, (endpoint, r.status_code)


@pytest.mark.parametrize("endpoint", ENDPOINTS, ids=IDS)
def test_the_scope_that_suffices_is_admitted(service, auth_model, endpoint):
    for who in {EXACT[endpoint[3]], "admin"}:
        r = call(service.client(who), endpoint, auth_model)
        assert r.status_code not in (401, 403), (who, endpoint, r.status_code)


def test_list_models_shows_only_the_tokens_models(service, auth_model):
    other = f"other-{uuid.uuid4().hex[:8]}"
    ok(service.client("other").post("/v1/models", json={"name": other}), 201)
    seen = {m["name"] for m in ok(service.client("reader").get("/v1/models"), 200)["models"]}
    assert auth_model in seen and other not in seen
    seen = {m["name"] for m in ok(service.client("admin").get("/v1/models"), 200)["models"]}
    assert {auth_model, other} <= seen
    problem(service.client("reader").get(f"/v1/models/{other}"), 403, "forbidden")


def test_health_endpoints_need_no_token(service):
    c = service.client(None)
    for path in ("/healthz", "/readyz", "/metrics", "/openapi.json"):
        assert c.get(path).status_code == 200, path


def test_tokens_are_never_logged(service, auth_model, caplog):
    caplog.set_level(logging.DEBUG)
    for who in TOKENS:
        for endpoint in ENDPOINTS:
            call(service.client(who), endpoint, auth_model)
    wrong = "wrong-" + uuid.uuid4().hex
    call(service.client(token=wrong), ENDPOINTS[1], auth_model)
    service.client(None).get(f"/v1/models/{auth_model}", headers={"Authorization": f"Bearer {wrong} extra"})
    text = caplog.text + "".join(str(r.__dict__) for r in caplog.records)
    assert "weightsync.access" in text  # the access log was captured
    for token, *_ in TOKENS.values():
        assert token not in text
        assert hashlib.sha256(token.encode()).hexdigest() not in text
    assert wrong not in text


# --- anonymous development mode -------------------------------------------------------------


def test_anonymous_mode_admits_everyone_on_loopback(tmp_path, versions):
    with running(Settings(data=tmp_path)) as url, httpx.Client(base_url=url) as c:
        p = publish(c, "anything", versions[0], None, None)
        assert p.version["number"] == 1
        ok(c.post("/v1/admin/fsck", json={}), 200)
        assert c.get("/v1/models/anything/versions/1", headers={"Authorization": "Bearer whatever"}).status_code == 200


def test_anonymous_mode_refuses_non_loopback_addresses():
    table = TokenTable()
    table.check_server_address(("127.0.0.1", 8400))
    table.check_server_address(("::1", 8400))
    with pytest.raises(AuthDenied):
        table.check_server_address(("10.1.2.3", 8400))
    configured = TokenTable.from_settings(
        Settings(tokens=json.dumps([{"name": "a", "token": "x" * 20, "scopes": ["read"]}]))
    )
    configured.check_server_address(("10.1.2.3", 8400))  # with tokens any address is fine


# --- token configuration --------------------------------------------------------------------


SECRET = "s3cr3t-" + "q" * 24


def table_of(tmp_path: Path, name: str, text: str) -> TokenTable:
    path = tmp_path / name
    path.write_text(text)
    return TokenTable.from_settings(Settings(token_file=path))


def test_token_file_json_and_toml(tmp_path):
    h = hashlib.sha256(SECRET.encode()).hexdigest()
    for name, text in [
        ("t.json", json.dumps([{"name": "trainer", "token_sha256": h, "scopes": ["publish"], "models": ["p-*"]}])),
        (
            "t2.json",
            json.dumps({"tokens": [{"name": "trainer", "token": SECRET, "scopes": "publish", "models": "p-*"}]}),
        ),
        ("t.toml", f'[[tokens]]\nname = "trainer"\ntoken_sha256 = "{h}"\nscopes = ["publish"]\nmodels = ["p-*"]\n'),
    ]:
        table = table_of(tmp_path, name, text)
        who = table.authenticate(SECRET)
        assert who.name == "trainer" and who.scopes == {"read", "publish"} and who.models == ("p-*",)
        who.require("read", "p-1")
        with pytest.raises(AuthDenied) as e:
            who.require("admin")
        assert e.value.status == 403
        with pytest.raises(AuthDenied) as e:
            who.require("read", "q-1")
        assert e.value.status == 403
        with pytest.raises(AuthDenied) as e:
            table.authenticate(SECRET + "x")
        assert e.value.status == 401


def test_token_env_and_file_combine(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps([{"name": "a", "token": SECRET, "scopes": ["admin"]}]))
    table = TokenTable.from_settings(
        Settings(
            token_file=path,
            tokens=json.dumps([{"name": "b", "token": SECRET + "b", "scopes": ["read"], "models": ["*"]}]),
        )
    )
    assert table.authenticate(SECRET).scopes == {"read", "publish", "admin"}
    assert table.authenticate(SECRET + "b").name == "b"


@pytest.mark.parametrize(
    "entries",
    [
        "not json " + SECRET,
        json.dumps({"name": "a"}),
        json.dumps([{"name": "a", "token": SECRET}]),  # no scopes
        json.dumps([{"name": "a", "token": SECRET, "scopes": ["write"]}]),
        json.dumps([{"name": "a", "token": SECRET, "token_sha256": "0" * 64, "scopes": ["read"]}]),
        json.dumps([{"name": "a", "token_sha256": SECRET, "scopes": ["read"]}]),
        json.dumps([{"name": "a", "token": "short", "scopes": ["read"]}]),
        json.dumps(
            [
                {"name": "a", "token": SECRET, "scopes": ["read"]},
                {"name": "a", "token": SECRET + "2", "scopes": ["read"]},
            ]
        ),
        json.dumps(
            [{"name": "a", "token": SECRET, "scopes": ["read"]}, {"name": "b", "token": SECRET, "scopes": ["read"]}]
        ),
        json.dumps([{"name": "a", "token": SECRET, "scopes": ["read"], "models": []}]),
        json.dumps([{"name": "a", "token": SECRET, "scopes": ["read"], "secret": SECRET}]),
    ],
)
def test_bad_token_config_is_one_line_without_secrets(entries):
    with pytest.raises(ConfigError) as e:
        TokenTable.from_settings(Settings(tokens=entries))
    message = str(e.value)
    assert "\n" not in message and SECRET not in message and "short" not in message
