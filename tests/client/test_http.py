"""The HTTP edge without a server: retries, problem+json mapping, the token bucket, import hygiene."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
from typing import ClassVar

import httpx
import pytest

from weightsync import errors
from weightsync.client import _http, models
from weightsync.client._http import Api
from weightsync.client.wire import Retry, TokenBucket
from weightsync.common import Backoff

FAST = Retry(attempts=4, base=0.0, cap=0.0)
MODEL = {
    "name": "m",
    "head": 3,
    "created_at": "2025-03-01T00:00:00Z",
    "keyframe_interval": 16,
    "max_chain_ratio": 4.0,
    "keep_last": None,
}
VERSION = {
    "model": "m",
    "number": 3,
    "parent": 2,
    "kind": "delta",
    "chain_base": 1,
    "step": None,
    "metadata": {},
    "raw_bytes": 1000,
    "stored_bytes": 120,
    "manifest": "a" * 64,
    "committed_at": "2025-03-01T12:00:00Z",
}


def _problem(status: int, code: str, detail: str, **extra) -> httpx.Response:
    body = {"type": f"https://weightsync.dev/problems/{code}", "title": code, "status": status, "detail": detail}
    body.update(extra)
    return httpx.Response(status, json=body, headers={"content-type": "application/problem+json"})


def _api(handler) -> Api:
    return Api("http://weightsync.test", "secret-token", retry=FAST, transport=httpx.MockTransport(handler))


def test_transient_failures_are_retried_then_succeed() -> None:
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if len(calls) == 1:
            raise httpx.ConnectError("refused", request=request)
        if len(calls) == 2:
            return _problem(503, "unavailable", "store down")
        return httpx.Response(200, json={"models": [MODEL]})

    api = _api(handler)
    assert api.list_models() == [models.Model.from_json(MODEL)]
    assert len(calls) == 3
    assert calls[0].headers["authorization"] == "Bearer secret-token"


def test_retries_exhausted_raise_server_unavailable() -> None:
    api = _api(lambda request: _problem(503, "unavailable", "store down"))
    with pytest.raises(errors.ServerUnavailable):
        api.list_models()


@pytest.mark.parametrize(
    "status,code,detail,extra,exc",
    [
        (409, "stale-parent", "parent 1 is not the head (3)", {"current_head": 3}, errors.StaleParent),
        (409, "conflict", "idempotency key reused", {}, errors.Conflict),
        (404, "not-found", "no model named 'x'", {"resource": "model"}, errors.ModelNotFound),
        (404, "not-found", "model 'x' has no committed version 9", {"resource": "version"}, errors.VersionNotFound),
        (404, "not-found", "no publish 'p' for model 'x'", {"resource": "publish"}, errors.PublishNotFound),
        (404, "not-found", "no object 'abc'", {"resource": "object"}, errors.ObjectNotFound),
        # The resource decides, never the text: a detail that talks of a model about a missing version.
        (404, "not-found", "no model version 3", {"resource": "version"}, errors.VersionNotFound),
        (404, "not-found", "Not Found", {}, errors.NotFound),  # an unknown route: no resource
        (404, "not-found", "no relay 'r'", {"resource": "relay"}, errors.NotFound),  # a newer server's resource
        (404, "not-supported", "no presigned URLs here", {}, errors.Unsupported),
        (401, "unauthorized", "unknown bearer token", {}, errors.AuthError),
        (403, "forbidden", "token 'r' lacks the 'publish' scope", {}, errors.Forbidden),
        (422, "invalid-name", "bad model name", {}, errors.InvalidName),
        (422, "invalid-digest", "not a digest", {}, errors.InvalidDigest),
        (422, "invalid-argument", "pause_ms must be >= 0", {}, errors.InvalidArgument),
        (422, "digest-mismatch", "bytes hash to something else", {}, errors.DigestMismatch),
        (422, "bad-manifest", "not a manifest", {}, errors.FormatError),
        (409, "base-mismatch", "diffed against other bytes", {}, errors.BaseMismatch),
        (409, "incomplete-publish", "object missing", {}, errors.IncompletePublish),
        (413, "too-large", "over the cap", {}, errors.TooLarge),
        (416, "bad-range", "bytes 9-10 of 4", {}, errors.InvalidRange),
        (422, "validation", "parent: not an int", {}, errors.ClientError),
        (409, "some-future-conflict", "a code this client does not know", {}, errors.Conflict),
        (418, "teapot", "a code and status this client does not know", {}, errors.ClientError),
    ],
)
def test_problems_map_to_named_errors(status, code, detail, extra, exc) -> None:
    api = _api(lambda request: _problem(status, code, detail, **extra))
    with pytest.raises(exc) as info:
        api.get_model("x")
    assert type(info.value) is exc  # exactly the class the table names, not merely a base of it
    assert detail in str(info.value) and "\n" not in str(info.value)
    assert info.value.status == status
    assert info.value.problem is not None and info.value.problem["detail"] == detail
    if exc is errors.StaleParent:
        assert info.value.current_head == 3


def test_every_problem_in_the_table_decodes_to_its_class() -> None:
    for (code, resource), cls in errors.problem_classes().items():
        extra = {"resource": resource} if resource else {}
        if cls is errors.StaleParent:
            extra["current_head"] = 7
        response = _problem(cls.status, code, "detail", **extra)
        api = _api(lambda request, response=response: response)
        with pytest.raises(cls) as info:
            api.get_version("x", 1)
        assert type(info.value) is cls, (code, resource)


def test_a_404_that_is_no_weightsync_problem_is_the_endpoints_default() -> None:
    # The object store or a proxy answers 404 without problem+json: what the endpoint looks up is missing.
    api = _api(
        lambda request: httpx.Response(
            404, text="<Error><Code>NoSuchKey</Code></Error>", headers={"content-type": "application/xml"}
        )
    )
    with pytest.raises(errors.ObjectNotFound):
        api.head_object("a" * 64)
    with pytest.raises(errors.VersionNotFound):
        api.get_manifest("x", 1)
    # A problem whose type is not a weightsync one is not matched by its last path segment.
    api = _api(
        lambda request: httpx.Response(
            404,
            json={"type": "https://example.com/conflict", "detail": "d"},
            headers={"content-type": "application/problem+json"},
        )
    )
    with pytest.raises(errors.VersionNotFound):
        api.get_version("x", 1)


def test_presigned_upload_sends_exactly_its_headers_and_no_token() -> None:
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200)

    api = _api(handler)
    api.put_object(
        "a" * 64,
        b"x" * 1000,
        models.PresignedPut(
            method="PUT", url="http://s3.test/bucket/key?sig=1", headers={"x-amz-checksum-sha256": "abc"}
        ),
    )
    (req,) = seen
    assert req.url.host == "s3.test" and "authorization" not in req.headers
    assert req.headers["x-amz-checksum-sha256"] == "abc" and req.headers["content-length"] == "1000"
    assert req.read() == b"x" * 1000


def test_answers_are_typed_and_a_malformed_one_is_bad_response_without_retries() -> None:
    calls: list[httpx.Request] = []
    answer: dict[str, httpx.Response] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return answer["next"]

    api = _api(handler)
    answer["next"] = httpx.Response(200, json={**VERSION, "shards": 4})  # a newer server's extra field
    head = api.head("m")
    assert isinstance(head, models.Version) and head.number == 3 and head.to_dict() == VERSION
    for bad in (
        httpx.Response(200, json={**VERSION, "number": "3"}),  # a known field mistyped
        httpx.Response(200, json={k: v for k, v in VERSION.items() if k != "kind"}),  # one missing
        httpx.Response(200, text="<html>proxy</html>"),  # not JSON at all
        httpx.Response(200, json=[VERSION]),
    ):  # JSON, but not the object
        answer["next"] = bad
        calls.clear()
        with pytest.raises(errors.BadResponse) as info:
            api.get_version("m", 3)
        assert len(calls) == 1, "a well-formed transfer of a malformed answer is not retried"
        assert "\n" not in str(info.value) and info.value.exit_code == errors.EXIT_ERROR
    answer["next"] = httpx.Response(200, json={"versions": [VERSION, {**VERSION, "number": None}]})
    with pytest.raises(errors.BadResponse, match=r"versions\[1\]\.number"):
        api.list_versions("m")


def test_watch_answers_a_version_or_none_on_timeout() -> None:
    answer: dict[str, httpx.Response] = {"next": httpx.Response(204)}
    api = _api(lambda request: answer["next"])
    assert api.watch("m", after=2, timeout=1) is None
    answer["next"] = httpx.Response(200, json=VERSION)
    assert api.watch("m", after=2, timeout=1) == models.Version.from_json(VERSION)


def test_report_replica_sends_only_the_fields_given() -> None:
    bodies: list[dict] = []
    replica = {
        "model": "m",
        "subscriber": "s",
        "version": 3,
        "applied_at": "2025-03-01T12:00:00Z",
        "pause_ms": None,
        "bytes": 10,
        "site": None,
        "host": "h",
        "extra": {},
    }

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(201, json=replica)

    api = _api(handler)
    got = api.report_replica("m", subscriber="s", version=3, bytes=10, host="h", extra={})
    assert got == models.Replica.from_json(replica) and got.pause_ms is None
    assert bodies == [{"subscriber": "s", "version": 3, "bytes": 10, "host": "h", "extra": {}}]


def test_token_bucket_waits_for_the_debt(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    sleeps: list[float] = []
    monkeypatch.setattr(_http.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(_http.time, "sleep", lambda s: sleeps.append(s))
    bucket = TokenBucket(1000, burst=1000)
    bucket.acquire(1000)  # the burst
    assert sleeps == []
    bucket.acquire(500)  # 500 bytes of debt at 1000 B/s
    assert sleeps == [pytest.approx(0.5)]
    now[0] += 10  # a long idle period refills only up to the burst
    bucket.acquire(1500)
    assert len(sleeps) == 2 and sleeps[-1] == pytest.approx(0.5)  # 1500 - the 1000 burst


def test_client_imports_no_server_layers_and_no_torch() -> None:
    code = (
        "import sys, weightsync.client, weightsync.client.cli; "
        "bad = [m for m in sys.modules if m.split('.')[:2] in (['weightsync','service'], ['weightsync','catalog'],"
        " ['weightsync','store'], ['weightsync','ops'], ['weightsync','relay'])]"
        " + [m for m in ('torch', 'fastapi', 'sqlalchemy') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --- the watch reconnect loop: the client's one backoff policy -----------------------------------


class _CountingBackoff(Backoff):
    """The watch's backoff with no wait, recording which retry number each reconnect asked for."""

    asked: ClassVar[list[int]] = []

    def delay(self, attempt: int, retry_after: str | None = None, *, rng: random.Random | None = None) -> float:
        self.asked.append(attempt)
        return 0.0


def test_watch_reconnects_with_backoff_reset_by_a_success(monkeypatch: pytest.MonkeyPatch) -> None:
    from weightsync.client import subscriber

    monkeypatch.setattr(subscriber, "WATCH_RECONNECT", _CountingBackoff(attempts=1, base=0.5, cap=10.0))
    monkeypatch.setattr(_CountingBackoff, "asked", [])
    script = [
        httpx.ConnectError("refused"),
        _problem(503, "unavailable", "restarting"),
        httpx.Response(204),
        _problem(404, "not-found", "no model", resource="model"),
        httpx.Response(200, json=VERSION),
        httpx.Response(200, json={**VERSION, "number": 3}),  # the version already yielded: skipped
        httpx.Response(200, json={**VERSION, "number": 5}),
    ]

    def handler(request: httpx.Request) -> httpx.Response:
        step = script.pop(0)
        if isinstance(step, Exception):
            raise step
        return step

    with subscriber.Subscriber(
        "http://weightsync.test", "m", retry=Retry(attempts=1), report=False, transport=httpx.MockTransport(handler)
    ) as sub:
        got = sub.watch(after=1, timeout=1)
        assert [next(got).number, next(got).number] == [3, 5]
    assert script == []
    # Two failures in a row back off further (0, 1); the 204 is a success and starts over (0).
    assert _CountingBackoff.asked == [0, 1, 0]
    assert subscriber.WATCH_RECONNECT.ceiling(0) == 0.5 and subscriber.WATCH_RECONNECT.ceiling(9) == 10.0


def test_watch_stops_during_a_reconnect_wait() -> None:
    from weightsync.client import subscriber

    stop = threading.Event()
    polls: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        polls.append(1)
        if len(polls) == 3:
            stop.set()  # the server stays down; the caller gives up while the watch waits to reconnect
        return _problem(503, "unavailable", "down")

    with subscriber.Subscriber(
        "http://weightsync.test", "m", retry=Retry(attempts=1), report=False, transport=httpx.MockTransport(handler)
    ) as sub:
        assert list(sub.watch(after=0, timeout=1, stop=stop)) == []
    assert len(polls) == 3


def test_clients_load_the_certificate_store_once_per_process_and_never_for_plain_http(monkeypatch) -> None:
    """Building an Api used to load the CA store twice (its client and the presigned-URL client): ~90 ms each
    time on the 2-core box. Plain HTTP needs none; HTTPS and presigned URLs share one context per process."""
    import httpx

    from weightsync.client import _http

    made: list[int] = []
    real = httpx.create_ssl_context

    def counting(*args, **kwargs):
        made.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(httpx, "create_ssl_context", counting)
    _http._tls_context.cache_clear()
    try:
        plain = Api("http://127.0.0.1:9")
        assert made == []  # no store loaded for a plain-HTTP server, and the presigned-URL client not made yet
        bare = plain._bare
        assert made == [1] and bare is plain._bare  # made on first use, with the process's one context
        secure = [Api("https://127.0.0.1:9") for _ in range(3)]
        assert made == [1]  # every HTTPS client shares it
        for a in (plain, *secure):
            a.close()
    finally:
        _http._tls_context.cache_clear()


@pytest.mark.parametrize(
    ("header", "want"),
    [
        ("begin;dur=5.25, store;dur=0.5, commit;dur=3", {"begin": 5.25, "store": 0.5, "commit": 3.0}),
        ('plan;desc="the read";dur="2.5"', {"plan": 2.5}),
        ("", {}),
        ("cache, miss;desc=x", {}),  # no duration: nothing to time
        (
            "ok;dur=1, Bad;dur=2, x y;dur=3, neg;dur=-1, nan;dur=nan, word;dur=abc, long" + "x" * 40 + ";dur=1",
            {"ok": 1.0},
        ),
    ],
)
def test_server_timing_keeps_the_phases_it_can_read(header, want) -> None:
    """Server-Timing is informative: what parses becomes server_<name>_s seconds, the rest is left out."""
    got = _http.server_timing(httpx.Headers({"server-timing": header} if header else {}))
    assert got == {f"server_{k}_s": v / 1e3 for k, v in want.items()}


def test_answers_are_read_a_mebibyte_at_a_time_and_a_larger_setting_is_kept() -> None:
    """httpcore reads 64 KiB per receive unless told otherwise (a class constant): an Api raises it to
    READ_BYTES for the process, and never lowers what someone else set higher."""
    code = (
        "from httpcore._sync.http11 import HTTP11Connection as C\n"
        "before = C.READ_NUM_BYTES\n"
        "from weightsync.client._http import Api, READ_BYTES\n"
        "Api('http://127.0.0.1:9').close()\n"
        "assert before == 64 << 10 and C.READ_NUM_BYTES == READ_BYTES == 1 << 20, (before, C.READ_NUM_BYTES)\n"
        "C.READ_NUM_BYTES = 8 << 20\n"
        "Api('http://127.0.0.1:9').close()\n"
        "assert C.READ_NUM_BYTES == 8 << 20\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
