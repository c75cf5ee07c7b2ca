"""The HTTP edge without a server: retries, problem+json mapping, the token bucket, import hygiene."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest

from weightsync import errors
from weightsync.client import _http
from weightsync.client._http import Api, Retry, TokenBucket

FAST = Retry(attempts=4, base=0.0, cap=0.0)


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
        return httpx.Response(200, json={"models": [{"name": "m"}]})

    api = _api(handler)
    assert api.list_models() == [{"name": "m"}]
    assert len(calls) == 3
    assert calls[0].headers["authorization"] == "Bearer secret-token"


def test_retries_exhausted_raise_server_unavailable() -> None:
    api = _api(lambda request: _problem(503, "unavailable", "store down"))
    with pytest.raises(errors.ServerUnavailable):
        api.list_models()


@pytest.mark.parametrize("status,code,detail,extra,exc", [
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
])
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
    api = _api(lambda request: httpx.Response(404, text="<Error><Code>NoSuchKey</Code></Error>",
                                              headers={"content-type": "application/xml"}))
    with pytest.raises(errors.ObjectNotFound):
        api.head_object("a" * 64)
    with pytest.raises(errors.VersionNotFound):
        api.get_manifest("x", 1)
    # A problem whose type is not a weightsync one is not matched by its last path segment.
    api = _api(lambda request: httpx.Response(404, json={"type": "https://example.com/conflict", "detail": "d"},
                                              headers={"content-type": "application/problem+json"}))
    with pytest.raises(errors.VersionNotFound):
        api.get_version("x", 1)


def test_presigned_upload_sends_exactly_its_headers_and_no_token() -> None:
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200)

    api = _api(handler)
    api.put_object("a" * 64, b"x" * 1000, {"method": "PUT", "url": "http://s3.test/bucket/key?sig=1",
                                             "headers": {"x-amz-checksum-sha256": "abc"}})
    (req,) = seen
    assert req.url.host == "s3.test" and "authorization" not in req.headers
    assert req.headers["x-amz-checksum-sha256"] == "abc" and req.headers["content-length"] == "1000"
    assert req.read() == b"x" * 1000


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
    code = ("import sys, weightsync.client, weightsync.client.cli; "
            "bad = [m for m in sys.modules if m.split('.')[:2] in (['weightsync','service'], ['weightsync','catalog'],"
            " ['weightsync','store'], ['weightsync','ops'])] + [m for m in ('torch', 'fastapi', 'sqlalchemy') "
            "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
