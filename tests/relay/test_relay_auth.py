"""Who may use a relay: its own tokens locally, a read token toward the upstream, anonymous only on loopback."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from _client_util import TOKENS, Server, start_server, stop_server
from _relay_util import Versions, start_relay, tree, wait_for, wait_head
from _serve import clean_env

from weightsync import errors
from weightsync.client import Subscriber

LOCAL = {
    "reader": "relay-reader-0123456789abcdef",
    "admin": "relay-admin-0123456789abcdef",
    "other": "relay-other-0123456789abcdef",
}


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[tuple[Server, Server, Server]]:
    """An origin with tokens, a relay using its read token, and a relay with a token the origin does not know."""
    origin = start_server(
        tmp_path / "origin",
        tokens=[
            {"name": "admin", "token": TOKENS["admin"], "scopes": ["admin"]},
            {"name": "reader", "token": TOKENS["reader"], "scopes": ["read"]},
        ],
    )
    started = [origin]
    try:
        Versions(origin.url, "secured", tmp_path, token=TOKENS["admin"]).publish()
        local = [
            {"name": "relay-reader", "token": LOCAL["reader"], "scopes": ["read"]},
            {"name": "relay-admin", "token": LOCAL["admin"], "scopes": ["admin"]},
            {"name": "relay-other", "token": LOCAL["other"], "scopes": ["read"], "models": ["other-*"]},
        ]
        good = start_relay(
            tmp_path / "relay", origin.url, tokens=local, env={"WEIGHTSYNC_UPSTREAM_TOKEN": TOKENS["reader"]}
        )
        started.append(good)
        bad = start_relay(
            tmp_path / "bad", origin.url, tokens=local, env={"WEIGHTSYNC_UPSTREAM_TOKEN": "not-a-token-of-the-origin"}
        )
        started.append(bad)
        yield origin, good, bad
    finally:
        for s in reversed(started):
            stop_server(s)


def _get(url: str, token: str | None) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.get(url, headers=headers, timeout=10).status_code


def test_the_relays_auth_matrix(servers: tuple[Server, Server, Server], tmp_path: Path) -> None:
    origin, relay, bad = servers
    wait_head(relay.url, "secured", 1, token=LOCAL["reader"])  # mirrored with the upstream read token
    digest = httpx.get(
        f"{relay.url}/v1/models/secured/versions/1", headers={"Authorization": f"Bearer {LOCAL['reader']}"}
    ).json()["manifest"]

    reads = [
        "/v1/models",
        "/v1/info",
        "/v1/models/secured/versions",
        "/v1/models/secured/versions/1/manifest",
        "/v1/models/secured/plan",
        f"/v1/objects/{digest}",
    ]
    for path in reads:
        assert _get(relay.url + path, None) == 401, path  # no token
        assert _get(relay.url + path, TOKENS["reader"]) == 401, path  # the origin's token is not the relay's
        assert _get(relay.url + path, LOCAL["reader"]) == 200, path
    assert _get(f"{relay.url}/v1/models/secured/versions", LOCAL["other"]) == 403  # not its model
    for path in ("/healthz", "/readyz", "/metrics"):
        assert _get(relay.url + path, None) == 200, path

    # Writes: authenticated first (401), then refused whatever the scope (405 read-only).
    for token, code in [(None, 401), (LOCAL["reader"], 405), (LOCAL["admin"], 405)]:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        r = httpx.post(f"{relay.url}/v1/models/secured/publishes", json={"parent": 1}, headers=headers)
        assert r.status_code == code, (token, r.text)

    got = tree_of(relay.url, LOCAL["reader"], tmp_path / "via-relay")
    assert got == tree_of(origin.url, TOKENS["reader"], tmp_path / "via-origin")
    with pytest.raises(errors.AuthError):
        Subscriber(relay.url, "secured").pull(tmp_path / "anonymous")

    # A relay the upstream refuses serves nothing new and says it is degraded.
    ready = wait_for("the bad relay degraded", lambda: (r := httpx.get(f"{bad.url}/readyz")).json()["degraded"] and r)
    assert ready.status_code == 200 and ready.json()["upstream"] is False
    assert _get(f"{bad.url}/v1/models/secured/versions/latest", LOCAL["reader"]) == 404


def tree_of(url: str, token: str, into: Path) -> dict[str, str]:
    Subscriber(url, "secured", token=token).pull(into)
    return tree(into)


def test_an_anonymous_relay_listens_on_loopback_only(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "weightsync", "relay", "--upstream", "http://127.0.0.1:9", "--data", str(tmp_path)]
    done = subprocess.run([*cmd, "--host", "0.0.0.0"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len([ln for ln in lines if ln.startswith("weightsync: error:")]) == 1
    assert "without tokens" in done.stderr


def test_a_bad_upstream_url_is_one_line(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "weightsync", "relay", "--upstream", "http://127.0.0.1:9/v1", "--data", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().startswith("weightsync: error: invalid setting upstream")
    assert len(done.stderr.strip().splitlines()) == 1


def test_a_relay_runs_one_worker(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "weightsync", "relay", "--upstream", "http://127.0.0.1:9", "--data", str(tmp_path)]
    env = {**clean_env(), "WEIGHTSYNC_WORKERS": "4"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 1
    assert done.stderr.strip().startswith("weightsync: error: invalid setting workers")
