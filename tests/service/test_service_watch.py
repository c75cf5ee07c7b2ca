"""Watching for new versions: the long poll and the Server-Sent-Events stream see commits."""

from __future__ import annotations

import re
import threading
import time

import httpx
from _service_http import EventReader, ok, problem, publish, publish_chain

from weightsync.client._http import Api
from weightsync.client.watch import follow


def gauge(service, name: str) -> float:
    text = service.client(None).get("/metrics").text
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def in_background(fn) -> tuple[threading.Thread, dict]:
    """Run ``fn`` in a thread; its result lands in ``result["r"]``."""
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(r=fn()), daemon=True)
    t.start()
    return t, result


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


# --- a model that does not exist yet (a replica may start before the trainer's first push) ---------------


def test_long_poll_waits_for_a_model_that_does_not_exist_yet(service, model, versions):
    reader, pub = service.client("reader"), service.client("publisher")
    # Nothing to hold yet: the timeout passes (204), not a 404 that would make a replica poll.
    assert reader.get(f"/v1/models/{model}/watch", params={"timeout": 0.2}).status_code == 204
    before = gauge(service, "weightsync_watch_waiting")
    waiting, result = in_background(lambda: reader.get(f"/v1/models/{model}/watch", params={"timeout": 60}, timeout=90))
    assert wait_until(lambda: gauge(service, "weightsync_watch_waiting") >= before + 1)
    publish_chain(pub, model, versions[:1])
    waiting.join(90)
    # The first push answers the watch at once (a 200 before its 60 s timeout, which would be a 204).
    assert ok(result["r"], 200)["number"] == 1


def test_client_follow_started_before_the_first_push_sees_it(service, model, versions):
    """The client's follow (client/watch.py) against the waiting server: every version, in order."""
    reader, pub = service.client("reader"), service.client("publisher")
    stop, seen = threading.Event(), []
    before = gauge(service, "weightsync_watch_waiting")
    with Api(service.url, token=reader.headers["Authorization"].removeprefix("Bearer ")) as api:

        def run() -> None:
            for v in follow(api, model, 0, timeout=30, stop=stop, every=True):
                seen.append(v.number)
                if len(seen) == 2:
                    return

        t = threading.Thread(target=run, daemon=True)
        t.start()
        assert wait_until(lambda: gauge(service, "weightsync_watch_waiting") >= before + 1)
        publish_chain(pub, model, versions[:2])
        t.join(60)
        stop.set()
    assert seen == [1, 2]


def test_event_stream_waits_for_a_model_that_does_not_exist_yet_and_ends_when_it_goes(service, model, versions):
    pub, admin = service.client("publisher"), service.client("admin")
    with httpx.Client(base_url=service.url, headers=service.client("reader").headers) as own:
        events = EventReader(own, f"/v1/models/{model}/events")
        events.wait_comments(2)  # open and waiting: keep-alives flow, no 404
        publish_chain(pub, model, versions[:2])
        events.wait_for(lambda v: v["number"] == 2)
        assert [v["number"] for v in events.versions()] == [1, 2]
        ok(admin.delete(f"/v1/models/{model}"), 200)
        assert wait_until(events.ended)  # a model the stream has seen goes: the stream ends
    problem(service.client("reader").get("/v1/models/policy-bad..name/events"), 422, "invalid-name")
