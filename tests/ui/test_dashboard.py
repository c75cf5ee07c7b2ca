"""The fleet dashboard in a real browser: a real `weightsync serve`, real publishes and replica reports.

Debian's chromium is driven by Playwright (conftest.py). Each page is checked for its content,
for axe-core's serious and critical violations (light and dark), and at a narrow width; its
screenshots are kept (conftest.ARTIFACTS; docs/ui/ has copies).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from _ckpt import safetensors_file
from _client_util import TOKENS, Server, start_server, stop_server
from _versions import model_files, next_step

from weightsync import Publisher
from weightsync.client._http import Api

MODEL = "Org/policy-7b"
SMALL = {"chunk_bytes": 16 << 10, "object_bytes": 48 << 10}
SERIOUS = ("serious", "critical")


@dataclass
class Fleet:
    server: Server
    versions: dict[int, dict[str, Any]]  # number -> the API's version
    files: dict[int, dict[str, bytes]]  # number -> the checkpoint's files


def _write(root: Path, tensors: dict, step: int) -> dict[str, bytes]:
    files = {"model.safetensors": safetensors_file(tensors, {"step": str(step)}), "config.json": b'{"hidden": 96}\n'}
    root.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (root / name).write_bytes(data)
    return files


def _publish_versions(url: str, model: str, root: Path, n: int, *, token: str | None = None, keyframes=()) -> dict:
    tensors = model_files(seed=len(model))
    files = {}
    with Publisher(url, model, token=token, **SMALL) as pub:
        for i in range(1, n + 1):
            files[i] = _write(root / model.replace("/", "--") / f"v{i}", tensors, 10 * i)
            result = pub.publish(root / model.replace("/", "--") / f"v{i}", step=10 * i, keyframe=i in keyframes)
            assert result.version == i
            tensors = next_step(tensors, seed=i)
    return files


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """An anonymous server (loopback) with four versions of MODEL in two chains and four replicas in three sites.

    The stale threshold is tiny here, so a replica behind the head is stale as soon as the page is
    read; the token server below keeps the default (5 minutes), where the same lag is not.
    """
    root = tmp_path_factory.mktemp("ui-fleet")
    srv = start_server(root, env={"WEIGHTSYNC_UI_STALE_AFTER_S": "0.01"})
    try:
        files = _publish_versions(srv.url, MODEL, root / "ckpt", 4, keyframes={3})
        _publish_versions(srv.url, "side-model", root / "ckpt", 1)
        with Api(srv.url, None) as api:
            api.report_replica(
                MODEL, subscriber="gpu-a1", version=4, status="serving", site="us-east", host="a1", pause_ms=120.0
            )
            api.report_replica(MODEL, subscriber="gpu-a2", version=2, status="applied", site="us-east", host="a2")
            api.report_replica(MODEL, subscriber="gpu-b1", version=None, status="unhealthy", site="eu-west")
            api.report_replica(MODEL, subscriber="laptop", version=4, status="applied", mode="pull")
            versions = {v.number: v.to_dict() for v in api.list_versions(MODEL)}
        yield Fleet(srv, versions, files)
    finally:
        stop_server(srv)


def serious_violations(page: Any, axe_source: str) -> list[dict]:
    """axe-core's serious and critical violations on the page as it is now."""
    page.evaluate(axe_source)
    found = page.evaluate(
        """async () => (await axe.run(document, {resultTypes: ['violations']})).violations.map(v => (
            {id: v.id, impact: v.impact, help: v.help, nodes: v.nodes.slice(0, 5).map(n => n.target.join(' '))}))"""
    )
    return [v for v in found if v["impact"] in SERIOUS]


def check_page(browser: Any, url: str, name: str, axe_source: str, artifacts: Path) -> None:
    """No serious axe violation in light and dark, no page-wide horizontal scroll when narrow; screenshots."""
    for scheme in ("light", "dark"):
        context = browser.new_context(viewport={"width": 1280, "height": 800}, color_scheme=scheme)
        page = context.new_page()
        assert page.goto(url).status == 200
        page.locator("body[data-live-state=ready]").wait_for()  # every page is live
        page.screenshot(path=str(artifacts / f"{name}-{scheme}.png"), full_page=True)
        assert serious_violations(page, axe_source) == [], f"{name} ({scheme})"
        context.close()
    context = browser.new_context(viewport={"width": 390, "height": 844})
    page = context.new_page()
    assert page.goto(url).status == 200
    page.screenshot(path=str(artifacts / f"{name}-narrow.png"), full_page=True)
    # Wide tables scroll inside their own region; the page itself never scrolls sideways.
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth"), name
    assert serious_violations(page, axe_source) == [], f"{name} (narrow)"
    context.close()


def _ratio(v: dict) -> str:
    return f"{v['raw_bytes'] / v['stored_bytes']:.1f}×"


def test_root_redirects_browsers_and_models_page_lists_every_model(
    fleet: Fleet, browser: Any, axe_source: str, artifacts: Path
) -> None:
    api_root = httpx.get(fleet.server.url + "/", headers={"accept": "application/json"})
    assert api_root.status_code == 404 and api_root.headers["content-type"] == "application/problem+json"
    page = browser.new_page()
    assert page.goto(fleet.server.url + "/").url == fleet.server.url + "/ui/"
    row = page.locator(f'tr[data-model="{MODEL}"]')
    cells = row.locator("td")
    assert row.locator("th").inner_text().strip() == MODEL
    assert cells.nth(0).inner_text() == "v4"
    assert cells.nth(2).inner_text() == "4"  # versions
    raw = sum(v["raw_bytes"] for v in fleet.versions.values())
    stored = sum(v["stored_bytes"] for v in fleet.versions.values())
    assert row.locator("[data-ratio]").inner_text() == f"{raw / stored:.1f}×"
    assert (cells.nth(6).inner_text(), cells.nth(7).inner_text()) == ("4", "2")  # replicas, current
    assert "1 stale" in cells.nth(8).inner_text() and "1 unhealthy" in cells.nth(8).inner_text()
    assert page.locator('tr[data-model="side-model"]').count() == 1
    page.close()
    check_page(browser, fleet.server.url + "/ui/", "models", axe_source, artifacts)


def test_model_page_shows_the_timeline_the_chart_and_the_replicas_by_site(
    fleet: Fleet, browser: Any, axe_source: str, artifacts: Path
) -> None:
    url = f"{fleet.server.url}/ui/models/{MODEL}"
    page = browser.new_page()
    assert page.goto(url).status == 200
    assert page.locator("h1").inner_text() == MODEL
    rows = page.locator("table.versions tbody tr")
    assert [rows.nth(i).get_attribute("data-version") for i in range(rows.count())] == ["4", "3", "2", "1"]
    for number, v in fleet.versions.items():
        row = page.locator(f'table.versions tr[data-version="{number}"]')
        cells = row.locator("td")
        assert cells.nth(0).inner_text() == str(10 * number)  # step
        assert cells.nth(1).inner_text() == v["kind"]
        assert row.locator("[data-ratio]").inner_text() == _ratio(v)
    assert [fleet.versions[n]["kind"] for n in (1, 2, 3, 4)] == ["keyframe", "delta", "keyframe", "delta"]
    assert page.locator('tr[data-version="4"] td').nth(2).inner_text() == "v3 + 1"
    # The chart: one bar per version, keyframes marked, two chains.
    assert page.locator("figure.chart g.bar").count() == 4
    assert page.locator("figure.chart g.bar.keyframe").count() == 2
    assert "2 chains on this page" in page.locator("figure.chart svg").text_content()

    # Replicas by site: named sites first, each its own row group.
    groups = page.locator("table.replicas tbody")
    assert [groups.nth(i).get_attribute("data-site") for i in range(groups.count())] == [
        "eu-west",
        "us-east",
        "(no site)",
    ]
    us = page.locator('tbody[data-site="us-east"]')
    a1, a2 = us.locator('tr[data-subscriber="gpu-a1"]'), us.locator('tr[data-subscriber="gpu-a2"]')
    assert a1.locator("[data-lag]").inner_text() == "0" and a1.locator("[data-lag-s]").inner_text() == "current"
    assert "120 ms" in a1.inner_text()
    assert a2.locator("[data-lag]").inner_text() == "2"
    assert "stale" in a2.get_attribute("class") and "stale" in a2.inner_text()  # behind > the threshold
    assert "stale" not in (a1.get_attribute("class") or "")
    b1 = page.locator('tbody[data-site="eu-west"] tr[data-subscriber="gpu-b1"]')
    assert "unhealthy" in b1.get_attribute("class") and b1.locator("[data-lag]").inner_text() == "–"
    page.close()
    check_page(browser, url, "model", axe_source, artifacts)


def test_version_page_summarizes_the_manifest_and_its_pull_command_works(
    fleet: Fleet, browser: Any, axe_source: str, artifacts: Path, tmp_path: Path
) -> None:
    url = f"{fleet.server.url}/ui/models/{MODEL}/versions/4"
    page = browser.new_page()
    assert page.goto(url).status == 200
    text = page.locator("main").inner_text()
    assert "2 files, 6 tensors" in text and "6 tensors changed since v3" in text
    dtypes = page.locator("table.dtypes tbody")
    assert dtypes.locator("th").all_inner_texts() == ["BF16", "F32"]
    assert page.locator("table.files tbody th").all_inner_texts() == ["config.json", "model.safetensors"]
    assert page.locator("ol.lineage li a").all_inner_texts() == ["v3", "v4"]
    assert page.locator('table.replicas tr[data-subscriber="gpu-a1"]').count() == 1
    command = page.locator("#pull-command").inner_text()
    page.close()
    assert command == f"weightsync pull {MODEL} ./Org--policy-7b --version 4 --server {fleet.server.url}"

    # The command shown is the exact one: run it, and the directory holds version 4 byte for byte.
    argv = command.split()
    run = subprocess.run(
        [sys.executable, "-m", "weightsync", *argv[1:], "--json"], cwd=tmp_path, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["version"] == 4
    for name, data in fleet.files[4].items():
        assert (tmp_path / "Org--policy-7b" / name).read_bytes() == data
    check_page(browser, url, "version", axe_source, artifacts)


def test_missing_models_and_versions_answer_404_pages(fleet: Fleet, browser: Any) -> None:
    page = browser.new_page()
    assert page.goto(f"{fleet.server.url}/ui/models/no-such-model").status == 404
    assert page.locator("h1").inner_text() == "Not found"
    assert page.goto(f"{fleet.server.url}/ui/models/{MODEL}/versions/99").status == 404
    page.close()


def test_a_new_version_and_a_replica_report_appear_without_a_reload(fleet: Fleet, browser: Any, tmp_path: Path) -> None:
    model = "live-model"
    _publish_versions(fleet.server.url, model, tmp_path, 1)
    page = browser.new_page()
    page.goto(f"{fleet.server.url}/ui/models/{model}")
    assert page.locator("table.versions tbody tr").count() == 1
    page.locator("body[data-live-state=ready]").wait_for()
    page.evaluate("window.__sentinel = 'still the same page'")

    # v2 commits: the timeline gains its row in place.
    tensors = next_step(model_files(seed=len(model)), seed=1)
    _write(tmp_path / "v2", tensors, 20)
    with Publisher(fleet.server.url, model, **SMALL) as pub:
        assert pub.publish(tmp_path / "v2", step=20).version == 2
    page.locator('table.versions tr[data-version="2"]').wait_for(timeout=30_000)
    assert page.evaluate("window.__sentinel") == "still the same page"
    assert page.locator("table.versions tbody tr").count() == 2

    # A replica reports: the replica table appears in place too.
    with Api(fleet.server.url, None) as api:
        api.report_replica(model, subscriber="late-gpu", version=1, status="serving", site="ap-south")
    row = page.locator('tbody[data-site="ap-south"] tr[data-subscriber="late-gpu"]')
    row.wait_for(timeout=30_000)
    assert row.locator("[data-lag]").inner_text() == "1"
    assert page.evaluate("window.__sentinel") == "still the same page"
    assert page.evaluate("window.weightsyncUi.updates") >= 2
    page.close()


# --- tokens ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server with tokens: admin, and a reader limited to the models of ``Org``. Default stale threshold."""
    root = tmp_path_factory.mktemp("ui-tokens")
    tokens = [
        {"name": "admin", "token": TOKENS["admin"], "scopes": ["admin"]},
        {"name": "reader", "token": TOKENS["reader"], "scopes": ["read"], "models": ["Org/*"]},
    ]
    srv = start_server(root, tokens=tokens)
    try:
        _publish_versions(srv.url, "Org/visible", root / "ckpt", 2, token=TOKENS["admin"])
        _publish_versions(srv.url, "secret", root / "ckpt", 1, token=TOKENS["admin"])
        with Api(srv.url, TOKENS["admin"]) as api:
            api.report_replica("Org/visible", subscriber="behind", version=1, status="applied", site="s1")
        yield srv
    finally:
        stop_server(srv)


def test_the_dashboard_needs_a_read_token_kept_in_a_strict_httponly_cookie(
    guarded: Server, browser: Any, axe_source: str, artifacts: Path
) -> None:
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    page = context.new_page()
    first = page.goto(guarded.url + "/ui/")
    assert first.status == 401
    assert page.locator("h1").inner_text() == "Sign in"
    page.screenshot(path=str(artifacts / "login-light.png"), full_page=True)
    assert serious_violations(page, axe_source) == []

    page.fill("#token", "not-a-token-of-this-server")
    with page.expect_navigation():
        page.click("button[type=submit]")
    assert page.locator("[role=alert]").inner_text() == "unknown bearer token"
    assert context.cookies() == []

    page.fill("#token", TOKENS["reader"])
    with page.expect_navigation():
        page.click("button[type=submit]")
    assert page.url == guarded.url + "/ui/"
    (cookie,) = context.cookies()
    assert (cookie["name"], cookie["path"], cookie["httpOnly"], cookie["sameSite"]) == (
        "weightsync_ui",
        "/ui",
        True,
        "Strict",
    )
    assert page.evaluate("document.cookie") == ""  # scripts never see it
    # Only the models the token may read are listed; another one is "not found", as one that does not exist.
    assert page.locator("tbody tr[data-model]").evaluate_all("rows => rows.map(r => r.dataset.model)") == [
        "Org/visible"
    ]
    assert page.goto(guarded.url + "/ui/models/secret").status == 404
    assert page.goto(guarded.url + "/ui/models/Org/visible").status == 200
    # The default threshold (5 minutes): a replica a version behind since seconds ago is not stale.
    behind = page.locator('tr[data-subscriber="behind"]')
    assert behind.locator("[data-lag]").inner_text() == "1" and "stale" not in (behind.get_attribute("class") or "")
    page.locator("body[data-live-state=ready]").wait_for()  # the cookie opens the stream

    # The cookie is the dashboard's alone: the API takes the Authorization header only.
    jar = {"weightsync_ui": TOKENS["reader"]}
    assert httpx.get(guarded.url + "/v1/models", cookies=jar).status_code == 401
    assert httpx.get(guarded.url + "/v1/models", headers={"authorization": f"Bearer {TOKENS['reader']}"}).is_success
    assert httpx.get(guarded.url + "/ui/events").status_code == 401
    with httpx.stream("GET", guarded.url + "/ui/events", cookies=jar, params={"model": "secret"}) as stream:
        assert stream.status_code == 200 and stream.headers["content-type"].startswith("text/event-stream")

    with page.expect_navigation():
        page.click("form.logout button")
    assert context.cookies() == []
    assert page.goto(guarded.url + "/ui/").status == 401
    context.close()


# --- many versions -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server whose catalog holds a model of 5,000 versions (a keyframe every 50).

    Publishing 5,000 versions (through HTTP, or one catalog transaction each) takes minutes on a
    busy machine, so the first version is committed through the catalog and the other 4,999
    committed rows are written in one transaction of the same shape, the head moved to the last.
    Their manifests are not in the store, which the timeline, reading the catalog only, never needs.
    """
    from datetime import UTC, datetime, timedelta

    from sqlalchemy import insert, update

    from weightsync.catalog import Catalog
    from weightsync.catalog.schema import ModelRow, VersionRow

    root = tmp_path_factory.mktemp("ui-big")
    (root / "data").mkdir()
    catalog = Catalog.open(f"sqlite:///{root / 'data' / 'catalog.db'}")
    try:
        catalog.create_model("big")
        t0 = datetime.now(UTC)
        begun = catalog.begin_version("big", parent=None, kind="keyframe", now=t0 - timedelta(seconds=5000))
        catalog.commit_version(
            "big", begun.publish_id, parent=None, manifest_digest="0" * 64, objects=[], raw_bytes=10_000,
            stored_bytes=9_000, kind="keyframe", now=t0 - timedelta(seconds=5000),
        )  # fmt: skip
        rows, base = [], 1
        for n in range(2, 5001):
            key = n % 50 == 1
            base = n if key else base
            at = t0 - timedelta(seconds=5000 - n)  # in the past, in order
            rows.append(
                {
                    "number": n, "parent": n - 1, "kind": "keyframe" if key else "delta", "chain_base": base,
                    "state": "committed", "step": n, "metadata": {}, "raw_bytes": 10_000,
                    "stored_bytes": 9_000 if key else 100 + n % 7, "manifest_digest": f"{n:064x}",
                    "publish_id": f"bulk-{n}", "created_at": at, "committed_at": at,
                }
            )  # fmt: skip
        with catalog.engine.begin() as conn:
            (model_id,) = conn.execute(ModelRow.__table__.select().where(ModelRow.name == "big")).one()[:1]
            conn.execute(insert(VersionRow), [{**r, "model_id": model_id} for r in rows])
            conn.execute(update(ModelRow).where(ModelRow.id == model_id).values(head=5000))
        assert catalog.version_totals("big").versions == 5000
    finally:
        catalog.close()
    srv = start_server(root)
    try:
        yield srv
    finally:
        stop_server(srv)


def test_a_model_of_5000_versions_pages_through_its_timeline(big: Server, browser: Any, artifacts: Path) -> None:
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    page.goto(big.url + "/ui/models/big")
    page.screenshot(path=str(artifacts / "model-5000-versions.png"))

    def shown() -> list[int]:
        return [
            int(n) for n in page.locator("table.versions tbody tr").evaluate_all("r => r.map(x => x.dataset.version)")
        ]

    assert shown() == list(range(5000, 4900, -1))
    assert "Showing v4901–v5000 of 5000 versions" in page.locator("nav.pager").inner_text()
    assert page.locator("figure.chart g.bar").count() == 100
    assert page.locator("nav.pager a[rel=prev]").count() == 0  # the newest page
    page.click("nav.pager a[rel=next]")
    page.wait_for_url("**before=4901")
    assert shown() == list(range(4900, 4800, -1))
    page.click("nav.pager a[rel=last]")
    page.wait_for_url("**after=0")
    assert shown() == list(range(100, 0, -1))
    assert page.locator("nav.pager a[rel=next]").count() == 0  # the oldest page
    page.click("nav.pager a[rel=prev]")
    page.wait_for_url("**after=100")
    assert shown() == list(range(200, 100, -1))
    page.click("nav.pager a[rel=first]")
    assert shown()[0] == 5000
    # These versions' manifests are not in the store: the Version page says so and shows the rest.
    assert page.goto(big.url + "/ui/models/big/versions/5000").status == 200
    assert "The manifest could not be read" in page.locator("[role=alert]").inner_text()
    assert page.locator("ol.lineage li").count() == 50  # v4951 (keyframe) to v5000
    page.close()
