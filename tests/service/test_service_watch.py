"""Watching for new versions: the long poll and the Server-Sent-Events stream see commits."""

from __future__ import annotations

import re
import threading
import time

import httpx
from _service_http import EventReader, ok, publish, publish_chain


def gauge(service, name: str) -> float:
    text = service.client(None).get("/metrics").text
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def wait_until(pred, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_long_poll_sees_a_commit(service, model, versions):
    pub = service.client("publisher")
    publish_chain(pub, model, versions[:1])
    reader = service.client("reader")
    # Newer than `after` already: answered at once.
    assert ok(reader.get(f"/v1/models/{model}/watch", params={"after": 0, "timeout": 30}), 200)["number"] == 1
    assert ok(reader.get(f"/v1/models/{model}/watch", params={"timeout": 30}), 200)["number"] == 1
    # Nothing newer: 204 when the timeout passes.
    assert reader.get(f"/v1/models/{model}/watch", params={"after": 1, "timeout": 0.2}).status_code == 204
    result: dict = {}

    def watch() -> None:
        result["r"] = reader.get(f"/v1/models/{model}/watch", params={"after": 1, "timeout": 60}, timeout=90)

    t = threading.Thread(target=watch)
    t.start()
    wait_until(lambda: gauge(service, "weightsync_watch_waiting") >= 1)
    publish(pub, model, versions[1], versions[0], 1)
    t.join(90)
    assert result["r"].status_code == 200 and result["r"].json()["number"] == 2
    assert reader.get(f"/v1/models/{model}/watch", params={"timeout": 61}).status_code == 422


def test_event_stream_sees_commits_and_ends_when_the_client_leaves(service, model, versions):
    pub = service.client("publisher")
    publish_chain(pub, model, versions[:1])
    before = gauge(service, "weightsync_event_streams")
    with httpx.Client(base_url=service.url, headers=service.client("reader").headers) as own:
        events = EventReader(own, f"/v1/models/{model}/events")
        assert events.content_type.startswith("text/event-stream")
        assert events.wait_for(lambda v: v["number"] == 1)["model"] == model  # no `after`: the head first
        events.wait_comments(2)  # keep-alive comments flow while nothing happens
        assert gauge(service, "weightsync_event_streams") == before + 1
        publish(pub, model, versions[1], versions[0], 1)
        publish(pub, model, versions[2], versions[1], 2)
        assert events.wait_for(lambda v: v["number"] == 3)["parent"] == 2
        assert [v["number"] for v in events.versions()] == [1, 2, 3]  # every version, in order
        events.close()
    # The server notices the disconnect and ends the stream.
    assert wait_until(lambda: gauge(service, "weightsync_event_streams") == before)


def test_event_stream_resumes_after_a_version(service, model, versions):
    pub = service.client("publisher")
    publish_chain(pub, model, versions[:3])
    with httpx.Client(base_url=service.url, headers=service.client("reader").headers) as own:
        events = EventReader(own, f"/v1/models/{model}/events", params={"after": 1})
        events.wait_for(lambda v: v["number"] == 3)
        assert [v["number"] for v in events.versions()] == [2, 3]
        events.close()
    with httpx.Client(base_url=service.url, headers={**service.client("reader").headers, "Last-Event-ID": "2"}) as own:
        events = EventReader(own, f"/v1/models/{model}/events")
        events.wait_for(lambda v: v["number"] == 3)
        assert [v["number"] for v in events.versions()] == [3]
        events.close()
