"""The dashboard's server side over HTTP (no browser: tests/ui drives one): sign-in, cookie, scoping, live stream.

Runs on every backend (the version totals are one SQL aggregate on SQLite and PostgreSQL).
"""

from __future__ import annotations

import uuid

import httpx
import pytest
from _service_http import EventReader, ok, problem, publish, publish_chain
from _service_util import TOKENS

from weightsync.service import Settings, create_app


def _signed_in(service, who: str) -> httpx.Client:
    """A client that signed in through the form, holding the cookie it was given (and nothing else)."""
    c = httpx.Client(base_url=service.url, timeout=60)
    service.clients.append(c)
    r = c.post("/ui/login", data={"token": TOKENS[who][0], "next": "/ui/"})
    assert r.status_code == 303 and r.headers["location"] == "/ui/", r.text
    return c


def test_pages_need_a_read_token_from_a_strict_httponly_cookie(service, versions):
    name = f"Acme/Fleet-{uuid.uuid4().hex[:8]}"
    publish_chain(service.client("org"), name, versions[:2])
    anonymous = httpx.Client(base_url=service.url, timeout=60)
    service.clients.append(anonymous)
    first = anonymous.get("/ui/")
    assert first.status_code == 401 and 'name="token"' in first.text and "<h1>Sign in</h1>" in first.text
    assert first.headers["content-type"].startswith("text/html")
    refused = anonymous.post("/ui/login", data={"token": "x" * 40})
    assert refused.status_code == 401 and "unknown bearer token" in refused.text
    assert "set-cookie" not in refused.headers

    r = anonymous.post("/ui/login", data={"token": TOKENS["org"][0], "next": "https://elsewhere.example/"})
    assert r.status_code == 303 and r.headers["location"] == "/ui/"  # never off the dashboard
    cookie = r.headers["set-cookie"]
    flags = {part.strip().split("=")[0].lower(): part.strip() for part in cookie.split(";")}
    assert cookie.startswith("weightsync_ui=") and TOKENS["org"][0] in cookie
    assert {"httponly", "path", "samesite"} <= set(flags)
    assert flags["path"] == "Path=/ui" and flags["samesite"].lower() == "samesite=strict"

    org = _signed_in(service, "org")
    listing = org.get("/ui/")
    assert listing.status_code == 200 and name in listing.text
    assert "content-security-policy" in listing.headers and listing.headers["cache-control"] == "no-store"
    page = org.get(f"/ui/models/{name}")
    assert page.status_code == 200 and f"<h1>{name}</h1>" in page.text and 'data-version="2"' in page.text
    version = org.get(f"/ui/models/{name}/versions/2")
    assert version.status_code == 200 and f"weightsync pull {name} ./Acme--Fleet-" in version.text

    # A model the token may not read is "not found", as one that does not exist; so is a bad number.
    hidden = f"policy-{uuid.uuid4().hex[:8]}"
    publish_chain(service.client("publisher"), hidden, versions[:1])
    assert org.get(f"/ui/models/{hidden}").status_code == 404
    assert org.get(f"/ui/models/{hidden}/versions/1").status_code == 404
    assert hidden not in org.get("/ui/").text
    absent = f"policy-{uuid.uuid4().hex[:8]}"  # the 404 page says nothing more about a hidden model
    assert org.get(f"/ui/models/{hidden}").text.replace(hidden, "M") == org.get(f"/ui/models/{absent}").text.replace(
        absent, "M"
    )
    assert org.get(f"/ui/models/{name}/versions/99").status_code == 404
    assert org.get(f"/ui/models/{name}/versions/x").status_code == 404

    # The cookie is the dashboard's only: the API answers 401 to it.
    problem(org.get("/v1/models"), 401, "unauthorized")
    ok(service.client("org").get("/v1/models"), 200)

    out = org.post("/ui/logout")
    assert out.status_code == 303 and "weightsync_ui=" in out.headers["set-cookie"]
    assert org.get("/ui/").status_code == 401


def test_the_live_stream_says_when_a_version_commits_or_a_replica_reports(service, versions):
    name = f"Acme/Live-{uuid.uuid4().hex[:8]}"
    publisher = service.client("org")
    publish_chain(publisher, name, versions[:1])
    assert httpx.get(service.url + "/ui/events").status_code == 401
    reader = EventReader(_signed_in(service, "org"), "/ui/events", params={"model": name})
    assert reader.content_type.startswith("text/event-stream")
    # "ready" once the stream has read the state it counts changes from: later ones are news.
    assert reader.wait_event("ready", lambda d: True) == {"models": 1}
    assert publish(publisher, name, versions[1], versions[0], 1).version["number"] == 2
    changed = reader.wait_event("change", lambda d: d["what"] == "version")
    assert changed == {"model": name, "what": "version"}
    ok(publisher.post(f"/v1/models/{name}/replicas", json={"subscriber": "r1", "version": 2}), 201)
    assert reader.wait_event("change", lambda d: d["what"] == "replica") == {"model": name, "what": "replica"}
    reader.close()


@pytest.mark.anyio
async def test_without_tokens_the_dashboard_answers_on_loopback_only(tmp_path):
    """Anonymous mode as for the API: a request that came in on another address gets the 401 page."""
    app = create_app(Settings(data=tmp_path / "data"))  # no lifespan: refused before the catalog is asked
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://10.1.2.3:8400") as client:
        for path in ("/ui/", "/ui/models/m", "/ui/models/Org/m/versions/1", "/ui/events"):
            r = await client.get(path)
            assert r.status_code == 401, path
        page = await client.get("/ui/")
        assert "no tokens configured" in page.text and 'name="token"' not in page.text


def test_the_models_page_shows_each_relay_with_only_the_models_the_reader_may_read(service, versions):
    """A relay's heartbeat (as `weightsync relay` sends it) on the Models page: site, upstream, degraded,
    what it holds and how far behind; the models a token may not read are left out, here and in /v1/relays."""
    name = f"Acme/Relayed-{uuid.uuid4().hex[:8]}"
    publish_chain(service.client("org"), name, versions[:2])
    hidden = f"policy-{uuid.uuid4().hex[:8]}"
    publish_chain(service.client("publisher"), hidden, versions[:1])
    relay = f"relay@eu-{uuid.uuid4().hex[:8]}"
    held = {name: {"version": 1, "prefetch_lag_s": 0.25}, hidden: {"version": 1}}
    body = {"site": "eu-west", "upstream": "http://origin.example:8400", "degraded": True, "models": held}
    ok(service.client("admin").put(f"/v1/relays/{relay}", json=body), 200)

    page = _signed_in(service, "org").get("/ui/")
    assert page.status_code == 200
    row = page.text[page.text.index(f'data-relay="{relay}"') :]
    row = row[: row.index("</tr>")]
    assert 'class="unhealthy"' in page.text[: page.text.index(f'data-relay="{relay}"') + 80]
    assert "eu-west" in row and "http://origin.example:8400" in row and ">degraded<" in row
    assert f'data-held="{name}"' in row and f"{name} v1 (1 behind), prefetched 0.25 s after commit" in row
    assert hidden not in page.text  # nor its name in the relay's row
    listed = {r["name"]: r for r in ok(service.client("org").get("/v1/relays"), 200)["relays"]}
    assert set(listed[relay]["models"]) == {name}
    everything = {r["name"]: r for r in ok(service.client("admin").get("/v1/relays"), 200)["relays"]}
    assert set(everything[relay]["models"]) == {name, hidden}
