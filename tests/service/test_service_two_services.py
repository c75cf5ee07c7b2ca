"""Two service processes on one PostgreSQL catalog and one SeaweedFS bucket behave as one service.

They are real ``python -m weightsync.service serve`` processes (the second with two
workers), started together on a fresh database and a bucket that does not exist yet.
"""

from __future__ import annotations

import hashlib
import json
import signal
import threading
import uuid

import httpx
import pytest
from _pg import fresh_database
from _service_http import EventReader, files_of, ok, publish, publish_chain, pull
from _service_util import TOKENS, Spawned, spawn_service, token_entries

pytestmark = [pytest.mark.postgres, pytest.mark.s3]

BUCKET = f"weightsync-pair-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def pair(seaweed, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pair")
    tokens = tmp / "tokens.json"
    tokens.write_text(json.dumps(token_entries()))
    env = {
        "AWS_ACCESS_KEY_ID": seaweed.access_key,
        "AWS_SECRET_ACCESS_KEY": seaweed.secret_key,
        "AWS_REGION": seaweed.region,
        "WEIGHTSYNC_WATCH_POLL_S": "0.05",
        "WEIGHTSYNC_SSE_KEEPALIVE_S": "0.5",
    }
    with fresh_database("ws_pair") as url:
        common = [
            "--catalog",
            url,
            "--store",
            f"s3://{BUCKET}/weights",
            "--s3-endpoint",
            seaweed.endpoint_url,
            "--tokens",
            str(tokens),
            "--log-level",
            "debug",
        ]
        a = spawn_service([*common, "--data", str(tmp / "a")], tmp / "a.log", env=env, wait=False)
        b = spawn_service([*common, "--data", str(tmp / "b"), "--workers", "2"], tmp / "b.log", env=env, wait=False)
        try:
            a.wait_ready()
            b.wait_ready()
            yield a, b
        finally:
            codes = [s.stop() for s in (a, b)]
        # uvicorn re-raises the SIGTERM it handled once it has shut down cleanly: -15 is a clean exit.
        assert set(codes) <= {0, -signal.SIGTERM}, (codes, a.log()[-2000:], b.log()[-2000:])


def client(s: Spawned, who: str) -> httpx.Client:
    return httpx.Client(base_url=s.url, headers={"Authorization": f"Bearer {TOKENS[who][0]}"}, timeout=60)


def test_bucket_was_created_and_both_are_ready(pair, seaweed):
    seaweed.boto3_client().head_bucket(Bucket=BUCKET)
    for s in pair:
        assert ok(httpx.get(s.url + "/readyz"), 200) == {"catalog": True, "store": True}


def test_published_through_one_is_listed_and_downloadable_through_the_other(pair, versions):
    a, b = pair
    model = f"policy-pair-{uuid.uuid4().hex[:8]}"
    with client(a, "publisher") as pa, client(b, "reader") as rb:
        published = publish_chain(pa, model, versions[:2], via="proxy")  # through the service, not presigned
        assert [v["number"] for v in ok(rb.get(f"/v1/models/{model}/versions"), 200)["versions"]] == [1, 2]
        assert ok(rb.get(f"/v1/models/{model}/versions/latest"), 200)["manifest"] == published[-1].manifest
        got = pull(rb, model)
        assert {p: x.tobytes() for p, x in got.files.items()} == files_of(versions[1])
        digest = published[0].uploaded[0]
        whole = rb.get(f"/v1/objects/{digest}")
        assert whole.status_code == 200 and hashlib.sha256(whole.content).hexdigest() == digest
        part = rb.get(f"/v1/objects/{digest}", headers={"Range": "bytes=1-8"})
        assert part.status_code == 206 and part.content == whole.content[1:9]
        url = ok(rb.get(f"/v1/objects/{digest}/url"), 200)["url"]
        assert httpx.get(url).content == whole.content


def test_watchers_on_one_see_a_commit_through_the_other(pair, versions):
    a, b = pair
    model = f"policy-watch-{uuid.uuid4().hex[:8]}"
    with client(a, "publisher") as pa, client(b, "reader") as rb, client(b, "reader") as sse:
        publish_chain(pa, model, versions[:1])
        events = EventReader(sse, f"/v1/models/{model}/events", params={"after": 1})
        result: dict = {}

        def watch() -> None:
            result["r"] = rb.get(f"/v1/models/{model}/watch", params={"after": 1, "timeout": 60}, timeout=90)

        t = threading.Thread(target=watch)
        t.start()
        events.wait_comments(1)
        publish(pa, model, versions[1], versions[0], 1)
        t.join(90)
        assert result["r"].status_code == 200 and result["r"].json()["number"] == 2
        assert events.wait_for(lambda v: v["number"] == 2)["model"] == model
        events.close()


def test_metrics_of_all_workers_and_tokens_never_logged(pair, versions):
    a, b = pair
    wrong = "wrong-" + uuid.uuid4().hex
    for s in pair:
        for who in TOKENS:
            with client(s, who) as c:
                c.get("/v1/models")
                c.post("/v1/admin/gc", json={"dry_run": True})
        httpx.get(s.url + "/v1/models", headers={"Authorization": f"Bearer {wrong}"})
        httpx.get(s.url + "/v1/models", headers={"Authorization": wrong})
    text = httpx.get(b.url + "/metrics").text
    assert 'weightsync_http_requests_total{method="GET",route="/v1/models"' in text
    logs = a.log() + b.log()
    lines = [json.loads(line) for line in logs.splitlines() if line.startswith("{")]
    access = [x for x in lines if x.get("logger") == "weightsync.access"]
    assert access and all(x.get("request_id") for x in access)
    assert any(x.get("principal") == "admin" for x in access)
    for token, *_ in TOKENS.values():
        assert token not in logs
    assert wrong not in logs
