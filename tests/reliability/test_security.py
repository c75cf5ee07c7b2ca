"""Security of the service and the SDK against hostile names, bodies, manifests and callers.

One real ``weightsync serve`` (tokens file, debug logs, small caps: 1 MiB uploads, 64 KiB
JSON) holds two versions of ``policy-sec`` and of ``other-sec``. Requests whose target
must reach the server byte for byte (``..``, ``%2e%2e``) go over a raw socket; the SDK
reaches the server through a loopback proxy that records every request line and can play
a malicious server. Covered:

- path traversal in model names, in file names inside manifests (refused by the server at
  commit and by the SDK at pull; nothing written outside the target directory) and in
  object digests in URLs;
- oversized bodies (413 before the body is read) and oversized or deeply nested JSON;
- decompression bombs in frames and manifests (refused before allocating; peak memory
  measured in a fresh process and in the server);
- tokens never in logs, URLs, answers or error messages;
- the full role x endpoint matrix, generated from ``/openapi.json``.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import _sec_bombs as bombs
import _sec_fuzz as fz
import httpx
import pytest
from _sec_api import CALLERS, REQUIRED_SCOPE, allowed, expected_denial, operations
from _sec_proxy import CorruptingProxy, Fault
from _sec_server import (
    SecServer,
    publish_versions,
    raw_request,
    read_tree,
    start_server,
    stop_server,
    version_files,
)

from weightsync import bundle, errors
from weightsync.client import Retry, Subscriber
from weightsync.codec import Encoder
from weightsync.codec.manifest import Manifest
from weightsync.codec.pack import pack

HERE = Path(__file__).resolve().parent
MODEL = "policy-sec"
OTHER = "other-sec"
UPLOAD_CAP = 1 << 20
JSON_CAP = 64 << 10
FAST = Retry(attempts=2, base=0.01, cap=0.05)


@dataclass
class Sec:
    server: SecServer
    root: Path
    proxy: CorruptingProxy
    versions: list[dict[str, bytes]]
    published: list[dict]
    other: list[dict]
    sentinel: Path
    figures: dict = field(default_factory=dict)

    def client(self, who: str | None = "admin") -> httpx.Client:
        return httpx.Client(base_url=self.server.url, headers=self.server.headers(who), timeout=60)


def _files(n: int, seed: int) -> list[dict[str, bytes]]:
    out = version_files(n, seed=seed)
    for i, files in enumerate(out):
        files["sub/extra.dat"] = bytes([i]) * 1000
    return out


@pytest.fixture(scope="module")
def sec(tmp_path_factory) -> Iterator[Sec]:
    root = tmp_path_factory.mktemp("security")
    server = start_server(
        root / "server",
        log_level="debug",
        env={"WEIGHTSYNC_MAX_UPLOAD_BODY": str(UPLOAD_CAP), "WEIGHTSYNC_MAX_JSON_BODY": str(JSON_CAP)},
    )
    try:
        with CorruptingProxy(server.url) as proxy:
            versions = _files(2, seed=21)
            # The SDK publishes through the recording proxy: its URLs are checked for tokens too.
            published = publish_versions(server, MODEL, versions, root / "src", url=proxy.url)
            other = publish_versions(server, OTHER, _files(2, seed=22), root / "src-other", who="other")
            sentinel = root / "outside"
            sentinel.mkdir()
            yield Sec(server, root, proxy, versions, published, other, sentinel)
    finally:
        stop_server(server)


def _outside_untouched(sec: Sec) -> None:
    """Nothing appeared outside the server's data dir and the pull directories (the sentinel stays empty)."""
    assert not any(sec.sentinel.iterdir()), sorted(p.name for p in sec.sentinel.iterdir())
    allowed_top = {"server", "src", "src-other", "outside", "pulls"}
    assert {p.name for p in sec.root.iterdir()} <= allowed_top, sorted(p.name for p in sec.root.iterdir())
    assert {p.name for p in sec.server.root.iterdir()} <= {"data", "tokens.json", "server.log"}
    assert {p.name for p in sec.server.store_root.iterdir()} <= {"objects", "tmp"}


# --- path traversal: model names -----------------------------------------------------------------------------
# Each decodes to a name breaking the model name rules (DESIGN "Concepts"). ("policy-%2e%2e" is not here:
# it decodes to "policy-..", a legal name — model names are catalog keys, never paths.)

BAD_MODEL_TARGETS = [
    "..",
    "%2e%2e",
    "%2E%2E",
    ".",
    "..%2f..%2f..%2fetc%2fpasswd",
    "%2e%2e%2f%2e%2e%2fetc",
    "..%5c..%5cetc",
    "a%00b",
    "%c0%ae%c0%ae",
    "policy--sec",
    "policy%2fsec%2fx",
    "-policy",
    ".policy",
    "_x",
    "a" * 200,
    "policy-sec%2f..%2f..%2fother-sec",
    "policy sec",
    "%ff%fe",
]


@pytest.mark.parametrize("name", BAD_MODEL_TARGETS)
def test_traversal_in_model_names_is_refused(sec: Sec, name: str):
    for method, suffix, body in [
        ("GET", "", b""),
        ("GET", "/versions/latest/manifest", b""),
        ("POST", "/publishes", b'{"parent": null, "keyframe": true}'),
    ]:
        r = raw_request(
            sec.server.url,
            method,
            f"/v1/models/{name}{suffix}",
            headers={**sec.server.headers("admin"), "Content-Type": "application/json"},
            body=body,
        )
        assert 400 <= r.status < 500, (method, name, suffix, r.status, r.body[:200])
    r = raw_request(
        sec.server.url,
        "POST",
        "/v1/models",
        headers={**sec.server.headers("admin"), "Content-Type": "application/json"},
        body=json.dumps({"name": name}).encode(),
    )
    assert r.status == 422, (name, r.status, r.body[:200])
    with sec.client() as c:
        names = {m["name"] for m in c.get("/v1/models").json()["models"]}
    assert names <= {MODEL, OTHER} | {n for n in names if n.startswith(("policy-sec-", "other-sec-"))}, names
    _outside_untouched(sec)


# --- path traversal: file names inside manifests -------------------------------------------------------------

EVIL_PATHS = [
    "../escape.bin",
    "../../etc/passwd",
    "sub/../../escape.bin",
    "/tmp/weightsync-abs.bin",
    ".weightsync/state.json",
    "sub\\..\\..\\escape.bin",
    "./x",
    "a//b",
    "x\x00y",
    "..",
    "a/\x1b[2J",
]


def _evil_manifest(sec: Sec, path: str, *, parent: int | None = None) -> tuple[str, bytes]:
    """v1's keyframe manifest with its first file renamed to ``path``, sealed validly; uploaded; (digest, bytes)."""
    with sec.client() as c:
        doc = Manifest.decode(c.get(f"/v1/objects/{sec.published[0]['manifest']}").content).to_dict()
    doc["files"][0]["path"] = path
    doc["parent"] = parent
    data = fz.reseal_manifest(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode())
    digest = hashlib.sha256(data).hexdigest()
    with sec.client("publisher") as c:
        r = c.put(f"/v1/objects/{digest}", content=data)
        assert r.status_code == 201, r.text
    return digest, data


@pytest.mark.parametrize("path", EVIL_PATHS)
def test_manifest_naming_an_unsafe_path_is_refused_at_commit(sec: Sec, path: str):
    with sec.client("publisher") as c:
        head = c.get(f"/v1/models/{MODEL}").json()["head"]
        begin = c.post(f"/v1/models/{MODEL}/publishes", json={"parent": head, "keyframe": True})
        assert begin.status_code == 201, begin.text
        digest, _ = _evil_manifest(sec, path, parent=head)
        r = c.post(f"/v1/models/{MODEL}/publishes/{begin.json()['publish_id']}/commit", json={"manifest": digest})
        assert r.status_code == 422, (path, r.status_code, r.text)
        assert r.json()["type"].rsplit("/", 1)[1] in ("invalid-name", "bad-manifest"), r.json()
        c.delete(f"/v1/models/{MODEL}/publishes/{begin.json()['publish_id']}")
        assert c.get(f"/v1/models/{MODEL}").json()["head"] == head
    _outside_untouched(sec)


@pytest.mark.parametrize("path", EVIL_PATHS)
def test_manifest_naming_an_unsafe_path_is_refused_by_the_sdk(sec: Sec, path: str):
    """A malicious server (the proxy rewrites the plan) hands the SDK a validly hashed manifest naming ``path``."""
    digest, _ = _evil_manifest(sec, path)

    def evil_plan(body: bytes) -> bytes:
        plan = json.loads(body)
        plan["steps"] = plan["steps"][:1]
        plan["steps"][0]["manifest"] = digest
        return json.dumps(plan).encode()

    sec.proxy.set_faults(
        Fault("rewrite", lambda m, p: m == "GET" and p.startswith(f"/v1/models/{MODEL}/plan"), rewrite=evil_plan)
    )
    dest = sec.root / "pulls" / f"evil-{uuid.uuid4().hex[:8]}" / "checkout"
    try:
        with Subscriber(sec.proxy.url, MODEL, token=sec.server.token("reader"), retry=FAST, report=False) as sub:
            with pytest.raises(errors.WeightsyncError) as info:
                sub.pull(dest)
    finally:
        sec.proxy.set_faults()
    assert isinstance(info.value, (errors.InvalidName, errors.FormatError)), repr(info.value)
    assert read_tree(dest) == {}
    # Nothing next to the checkout, nothing at an absolute path.
    assert sorted(p.name for p in dest.parent.iterdir()) == ["checkout"]
    assert not Path("/tmp/weightsync-abs.bin").exists()
    _outside_untouched(sec)


def test_a_symlink_in_the_checkout_does_not_redirect_writes_outside(sec: Sec):
    dest = sec.root / "pulls" / "symlinked"
    outside = sec.sentinel / "redirected"
    outside.mkdir()
    dest.mkdir(parents=True)
    (dest / "sub").symlink_to(outside, target_is_directory=True)
    try:
        with Subscriber(sec.server.url, MODEL, token=sec.server.token("reader"), retry=FAST, report=False) as sub:
            try:
                sub.pull(dest, version=1)
            except errors.WeightsyncError:
                pass
        assert not any(outside.iterdir()), f"the pull wrote {sorted(p.name for p in outside.iterdir())} outside"
    finally:
        shutil.rmtree(outside, ignore_errors=True)
        (dest / "sub").unlink(missing_ok=True)


# --- object keys and digests in URLs --------------------------------------------------------------------------


def _digest_targets(digest: str) -> list[str]:
    return [
        "../../../../etc/passwd",
        "..%2f..%2f..%2f..%2fetc%2fpasswd",
        "%2e%2e%2f%2e%2e%2fetc%2fpasswd",
        "%2e%2e",
        "..",
        ".",
        digest.upper(),
        digest[:63],
        digest + "0",
        digest + "/..",
        digest + "%2f..",
        digest + "%00",
        "0" * 1000,
        "a" * 8000,
        digest[:62] + "%2e%2e",
        "%30" * 64,
        "\uff10".encode().hex() * 16,
        digest + ";x",
        digest.replace(digest[0], "g", 1),
    ]


@pytest.mark.parametrize("method", ["GET", "HEAD", "PUT", "GET /url"])
def test_bad_digests_in_urls_are_refused(sec: Sec, method: str):
    digest = sec.published[0]["objects"][0]
    for target in _digest_targets(digest):
        path = f"/v1/objects/{target}"
        verb = method
        if method == "GET /url":
            verb, path = "GET", path + "/url"
        body = b"x" * 10 if verb == "PUT" else b""
        r = raw_request(sec.server.url, verb, path, headers=sec.server.headers("admin"), body=body)
        assert 400 <= r.status < 500, (method, target[:80], r.status, r.body[:200])
        assert b"root:" not in r.body
    with sec.client() as c:  # the lowercase digest itself is served
        assert c.get(f"/v1/objects/{digest}").status_code == 200
    _outside_untouched(sec)


# --- oversized bodies ------------------------------------------------------------------------------------------


def test_oversized_upload_is_refused_before_the_body_is_read(sec: Sec):
    """Content-Length of 1 GiB against a 1 MiB cap: 413 after only 64 KiB were sent."""
    digest = "ab" * 32
    r = raw_request(
        sec.server.url,
        "PUT",
        f"/v1/objects/{digest}",
        headers={
            **sec.server.headers("publisher"),
            "Content-Length": str(1 << 30),
            "Content-Type": "application/octet-stream",
        },
        body=b"\0" * (64 << 10),
        timeout=30,
    )
    assert r.status == 413, (r.status, r.body[:200])
    sec.figures["upload-413-after-bytes"] = 64 << 10
    # Chunked (no Content-Length): 411, nothing stored.
    r = raw_request(
        sec.server.url,
        "PUT",
        f"/v1/objects/{digest}",
        headers={**sec.server.headers("publisher"), "Transfer-Encoding": "chunked"},
        body=b"5\r\nhello\r\n0\r\n\r\n",
    )
    assert r.status == 411, (r.status, r.body[:200])
    # A declared length that is right but a body over the cap is cut off as it streams.
    data = os.urandom(UPLOAD_CAP + 1)
    with sec.client("publisher") as c:
        r = c.put(f"/v1/objects/{hashlib.sha256(data).hexdigest()}", content=data)
        assert r.status_code == 413, r.text
        assert c.head(f"/v1/objects/{hashlib.sha256(data).hexdigest()}").status_code == 404
        assert c.head(f"/v1/objects/{digest}").status_code == 404


@pytest.mark.parametrize("path", ["/v1/models", f"/v1/models/{MODEL}/publishes", "/v1/admin/fsck"])
def test_oversized_json_is_refused(sec: Sec, path: str):
    hdrs = {**sec.server.headers("admin"), "Content-Type": "application/json"}
    # Declared too large: 413 before the body is read.
    r = raw_request(
        sec.server.url,
        "POST",
        path,
        headers={**hdrs, "Content-Length": str(100 << 20)},
        body=b"{" + b" " * (16 << 10),
        timeout=30,
    )
    assert r.status == 413, (r.status, r.body[:200])
    # Chunked and too large: cut off at the cap.
    big = b'{"name":"' + b"a" * (JSON_CAP + 10) + b'"}'
    chunked = f"{len(big):x}\r\n".encode() + big + b"\r\n0\r\n\r\n"
    r = raw_request(sec.server.url, "POST", path, headers={**hdrs, "Transfer-Encoding": "chunked"}, body=chunked)
    assert r.status == 413, (r.status, r.body[:200])
    # Under the cap but nested 10,000 deep: a 4xx, not a 500.
    r = raw_request(sec.server.url, "POST", path, headers=hdrs, body=b"[" * 10_000 + b"]" * 10_000)
    assert 400 <= r.status < 500, (r.status, r.body[:200])
    assert httpx.get(sec.server.url + "/healthz").status_code == 200


def test_oversized_headers_do_not_break_the_server(sec: Sec):
    r = raw_request(
        sec.server.url, "GET", "/v1/models", headers={**sec.server.headers("admin"), "X-Big": "a" * (256 << 10)}
    )
    assert r.status == 0 or 400 <= r.status < 500, r.status
    assert httpx.get(sec.server.url + "/healthz").status_code == 200


def test_deeply_nested_manifest_is_refused_at_commit(sec: Sec):
    """Found by this suite: a manifest of nested JSON made commit answer 500 (RecursionError); now 422."""
    data = fz.reseal_manifest(b'{"a":' * 100_000 + b"1" + b"}" * 100_000)
    digest = hashlib.sha256(data).hexdigest()
    with sec.client("publisher") as c:
        assert c.put(f"/v1/objects/{digest}", content=data).status_code == 201
        head = c.get(f"/v1/models/{MODEL}").json()["head"]
        begin = c.post(f"/v1/models/{MODEL}/publishes", json={"parent": head}).json()
        r = c.post(f"/v1/models/{MODEL}/publishes/{begin['publish_id']}/commit", json={"manifest": digest})
        assert r.status_code == 422, (r.status_code, r.text[:300])
        c.delete(f"/v1/models/{MODEL}/publishes/{begin['publish_id']}")


# --- numbers out of range (found by the API fuzzer) ------------------------------------------------------------

BIG = 2**70


def _out_of_range_requests(pid: str) -> list[tuple[str, str, dict]]:
    return [
        ("POST", "/v1/models", {"json": {"name": "policy-sec-big", "keyframe_interval": BIG}}),
        ("POST", "/v1/models", {"json": {"name": "policy-sec-big", "keep_last": 2**63}}),
        (
            "POST",
            "/v1/models",
            {
                "content": b'{"name": "policy-sec-big", "max_chain_ratio": Infinity}',
                "headers": {"Content-Type": "application/json"},
            },
        ),
        ("POST", f"/v1/models/{MODEL}/publishes", {"json": {"parent": 1, "step": 2**63}}),
        ("POST", f"/v1/models/{MODEL}/publishes", {"json": {"parent": BIG}}),
        (
            "POST",
            f"/v1/models/{MODEL}/publishes/{pid}/objects",
            {"json": {"objects": [{"digest": "a" * 64, "size": 2**63}]}},
        ),
        ("POST", f"/v1/models/{MODEL}/replicas", {"json": {"subscriber": "x", "version": BIG}}),
        ("POST", f"/v1/models/{MODEL}/replicas", {"json": {"subscriber": "x", "version": 1, "bytes": 2**63}}),
        (
            "POST",
            f"/v1/models/{MODEL}/replicas",
            {
                "content": b'{"subscriber": "x", "version": 1, "pause_ms": NaN}',
                "headers": {"Content-Type": "application/json"},
            },
        ),
        ("GET", f"/v1/models/{MODEL}/versions", {"params": {"before": BIG}}),
        ("GET", f"/v1/models/{MODEL}/versions", {"params": {"after": -BIG}}),
        ("GET", f"/v1/models/{MODEL}/plan", {"params": {"want": BIG}}),
        ("GET", f"/v1/models/{MODEL}/watch", {"params": {"after": BIG, "timeout": 0}}),
        ("POST", "/v1/admin/gc", {"json": {"dry_run": True, "grace_s": 1e12}}),
        ("POST", "/v1/admin/gc", {"json": {"dry_run": True, "grace_s": 1e300}}),
    ]


def test_numbers_out_of_range_are_422_not_500(sec: Sec):
    """Integers past the catalog's int64, infinite floats and grace periods past datetime's range: 422.

    Before the fix each of these answered 500 (OverflowError in the database driver or in datetime).
    """
    with sec.client() as c:
        pid = c.post(f"/v1/models/{MODEL}/publishes", json={"parent": _head(c, MODEL)}).json()["publish_id"]
        try:
            for method, path, kwargs in _out_of_range_requests(pid):
                r = c.request(method, path, **kwargs)
                assert r.status_code == 422, (method, path, kwargs, r.status_code, r.text[:200])
            with c.stream("GET", f"/v1/models/{MODEL}/events", headers={"Last-Event-ID": "9" * 30}) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("id:"):
                        break  # the huge id was ignored: the stream starts at the head
        finally:
            c.delete(f"/v1/models/{MODEL}/publishes/{pid}")


# --- decompression bombs -------------------------------------------------------------------------------------

REFUSED_BOUND = 16 << 20  # a refused bomb grows peak memory by less than this


@pytest.mark.parametrize("name", bombs.BOMBS)
def test_decompression_bombs_are_refused_before_allocating(sec: Sec, name: str, tmp_path: Path):
    data, kind, declared = bombs.build(name)
    (tmp_path / "bomb").write_bytes(data)
    out = subprocess.run(
        [sys.executable, str(HERE / "_sec_bombs.py"), str(tmp_path / "bomb"), kind],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=HERE,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout)
    sec.figures[f"bomb {name}"] = got
    print(
        f"\nFIGURE bomb {name}: input {got['input_bytes']} B, declares {declared} B, "
        f"peak RSS +{got['rss_growth'] / (1 << 20):.1f} MiB, {got['refused']}"
    )
    assert got["refused"], got
    if name.startswith("manifest-in-cap-"):
        # Within the 256 MiB cap the JSON is decoded: memory follows the declared size (bytes + str copies).
        assert got["rss_growth"] < 3 * declared + (64 << 20), got
    else:
        assert got["rss_growth"] < REFUSED_BOUND, got


def test_manifest_bombs_at_commit(sec: Sec):
    """The server refuses manifest bombs at commit with 422 and stays up; its peak memory is measured."""
    pid = str(sec.server.proc.pid)
    results = {}
    for name in ["manifest-over-cap", "manifest-body-declares-1GiB", "manifest-in-cap-64MiB"]:
        data, _, declared = bombs.build(name)
        digest = hashlib.sha256(data).hexdigest()
        with sec.client("publisher") as c:
            assert c.put(f"/v1/objects/{digest}", content=data).status_code == 201
            head = c.get(f"/v1/models/{MODEL}").json()["head"]
            begin = c.post(f"/v1/models/{MODEL}/publishes", json={"parent": head}).json()
            bombs.reset_peak(pid)
            before = bombs._status_kib("VmRSS", pid)
            r = c.post(f"/v1/models/{MODEL}/publishes/{begin['publish_id']}/commit", json={"manifest": digest})
            growth = bombs.peak_growth(pid, before)
            c.delete(f"/v1/models/{MODEL}/publishes/{begin['publish_id']}")
        assert r.status_code == 422, (name, r.status_code, r.text[:300])
        results[name] = growth
        print(
            f"\nFIGURE server bomb {name}: {len(data)} B upload, declares {declared} B, "
            f"server peak RSS +{growth / (1 << 20):.1f} MiB, {r.status_code} {r.json()['type']}"
        )
        if name.startswith("manifest-in-cap-"):
            assert growth < 3 * declared + (64 << 20)
        else:
            assert growth < REFUSED_BOUND
    assert httpx.get(sec.server.url + "/healthz").status_code == 200


# --- the role x endpoint authorization matrix ----------------------------------------------------------------


@dataclass
class Call:
    method: str
    path: str
    kwargs: dict = field(default_factory=dict)
    ok: tuple[int, ...] = (200,)
    stream: bool = False


def _head(c: httpx.Client, model: str) -> int:
    return c.get(f"/v1/models/{model}").json()["head"]


def _builders(sec: Sec) -> dict[str, Callable[[httpx.Client, str], Call]]:
    """operationId -> a builder of one valid request on ``model`` (setup done with the admin client ``c``)."""
    objs = {MODEL: sec.published, OTHER: sec.other}

    def begin(c: httpx.Client, model: str) -> str:
        r = c.post(f"/v1/models/{model}/publishes", json={"parent": _head(c, model), "keyframe": True})
        assert r.status_code == 201, r.text
        return r.json()["publish_id"]

    def commit(c: httpx.Client, model: str) -> Call:
        head = _head(c, model)
        r = c.post(f"/v1/models/{model}/publishes", json={"parent": head, "keyframe": True})
        assert r.status_code == 201, r.text
        m = Manifest.decode(c.get(f"/v1/objects/{objs[model][0]['manifest']}").content)
        m.parent, m.model = head, model
        data = m.encode()
        digest = hashlib.sha256(data).hexdigest()
        assert c.put(f"/v1/objects/{digest}", content=data).status_code in (200, 201)
        return Call(
            "POST",
            f"/v1/models/{model}/publishes/{r.json()['publish_id']}/commit",
            {"json": {"manifest": digest}},
            (201,),
        )

    def publish_version(c: httpx.Client, model: str) -> Call:
        """A small keyframe of its own on the head (dropping the model's files, so allow_removals), whole in
        one request: under the service's body cap."""
        from _versions import checkpoint, model_files

        head = _head(c, model)
        tiny = checkpoint(model_files(seed=secrets.randbelow(1 << 30), n=1))
        m, objects = pack(Encoder(threads=1).encode(tiny, None))
        m.parent, m.model = head, model
        data = m.encode()
        digest = hashlib.sha256(data).hexdigest()
        blobs = {o.digest: o.data for o in objects}
        blobs[digest] = data
        fields = {
            "parent": head,
            "keyframe": True,
            "objects": [{"digest": d, "size": len(b)} for d, b in blobs.items()],
            "manifest": digest,
            "allow_removals": True,
        }
        body = bundle.encode(json.dumps(fields).encode(), blobs, first=bundle.PUBLISH)
        return Call(
            "POST",
            f"/v1/models/{model}/versions",
            {"content": body, "headers": {"Content-Type": bundle.PUBLISH_MEDIA_TYPE}},
            (201,),
        )

    def put(c: httpx.Client, model: str) -> Call:
        data = secrets.token_bytes(100)
        return Call("PUT", f"/v1/objects/{hashlib.sha256(data).hexdigest()}", {"content": data}, (201,))

    def throwaway(c: httpx.Client, model: str) -> str:
        """A model of its own, named under `model`'s pattern, for a delete to remove."""
        name = f"{model}-{uuid.uuid4().hex[:8]}"
        assert c.post("/v1/models", json={"name": name}).status_code == 201
        return name

    obj = lambda model: objs[model][0]["objects"][0]  # noqa: E731
    return {
        "health": lambda c, m: Call("GET", "/healthz"),
        "ready": lambda c, m: Call("GET", "/readyz"),
        "metrics": lambda c, m: Call("GET", "/metrics"),
        "listModels": lambda c, m: Call("GET", "/v1/models"),
        "createModel": lambda c, m: Call(
            "POST", "/v1/models", {"json": {"name": f"{m}-{uuid.uuid4().hex[:8]}"}}, (201,)
        ),
        "getModel": lambda c, m: Call("GET", f"/v1/models/{m}"),
        "listVersions": lambda c, m: Call("GET", f"/v1/models/{m}/versions"),
        "getVersion": lambda c, m: Call("GET", f"/v1/models/{m}/versions/1"),
        "getLineage": lambda c, m: Call("GET", f"/v1/models/{m}/versions/2/lineage"),
        "getManifest": lambda c, m: Call("GET", f"/v1/models/{m}/versions/2/manifest"),
        "getPlan": lambda c, m: Call("GET", f"/v1/models/{m}/plan", {"params": {"have": 1, "want": 2}}),
        "beginPublish": lambda c, m: Call(
            "POST", f"/v1/models/{m}/publishes", {"json": {"parent": _head(c, m), "keyframe": True}}, (201,)
        ),
        "checkObjects": lambda c, m: Call(
            "POST",
            f"/v1/models/{m}/publishes/{begin(c, m)}/objects",
            {
                "json": {
                    "objects": [
                        {"digest": obj(m), "size": int(c.head(f"/v1/objects/{obj(m)}").headers["content-length"])}
                    ]
                }
            },
        ),
        "commitPublish": commit,
        "publishVersion": publish_version,
        # A part naming a manifest the store lacks: 409 incomplete-publish for an allowed caller.
        "commitPart": lambda c, m: Call(
            "POST",
            f"/v1/models/{m}/publishes/{begin(c, m)}/parts/0",
            {"json": {"world": 1, "manifest": "0" * 64}},
            (409,),
        ),
        "abortPublish": lambda c, m: Call("DELETE", f"/v1/models/{m}/publishes/{begin(c, m)}", ok=(204,)),
        "watchModel": lambda c, m: Call("GET", f"/v1/models/{m}/watch", {"params": {"after": 0, "timeout": 0.1}}),
        "streamEvents": lambda c, m: Call("GET", f"/v1/models/{m}/events", stream=True),
        "putObject": put,
        "getObject": lambda c, m: Call("GET", f"/v1/objects/{obj(m)}"),
        "headObject": lambda c, m: Call("HEAD", f"/v1/objects/{obj(m)}"),
        # The filesystem store does not presign: an allowed caller gets 404 not-supported, a denied one 401/403.
        "presignObject": lambda c, m: Call("GET", f"/v1/objects/{obj(m)}/url", ok=(404,)),
        "reportReplica": lambda c, m: Call(
            "POST", f"/v1/models/{m}/replicas", {"json": {"subscriber": "sec-matrix", "version": 1}}, (201,)
        ),
        "listReplicas": lambda c, m: Call("GET", f"/v1/models/{m}/replicas"),
        "relayHeartbeat": lambda c, m: Call("PUT", "/v1/relays/relay@sec-matrix", {"json": {"site": "sec"}}),
        "listRelays": lambda c, m: Call("GET", "/v1/relays"),
        "fsck": lambda c, m: Call("POST", "/v1/admin/fsck", {"json": {"read_data": False, "repair": False}}),
        "gc": lambda c, m: Call("POST", "/v1/admin/gc", {"json": {"dry_run": True}}),
        "getInfo": lambda c, m: Call("GET", "/v1/info"),
        "updateModel": lambda c, m: Call("PATCH", f"/v1/models/{m}", {"json": {}}),
        "deleteModel": lambda c, m: Call("DELETE", f"/v1/models/{throwaway(c, m)}"),
        "pinModel": lambda c, m: Call("PUT", f"/v1/models/{m}/pin", {"json": {"version": _head(c, m)}}),
        "unpinModel": lambda c, m: Call("DELETE", f"/v1/models/{m}/pin", ok=(200, 204)),
    }


def _send(sec: Sec, call: Call, caller: str) -> httpx.Response:
    headers = {} if caller == "none" else {"Authorization": f"Bearer {sec.server.token(caller)}"}
    with httpx.Client(base_url=sec.server.url, headers=headers, timeout=60) as c:
        if call.stream:
            with c.stream(call.method, call.path, **call.kwargs) as r:
                return r
        return c.request(call.method, call.path, **call.kwargs)


def test_authorization_matrix(sec: Sec):
    """Every operationId of /openapi.json x every caller, on an allowed and a forbidden model pattern."""
    schema = httpx.get(sec.server.url + "/openapi.json", timeout=30).json()
    ops = operations(schema)
    ids = {op_id for op_id, _, _ in ops}
    builders = _builders(sec)
    assert not ids - set(REQUIRED_SCOPE), f"no authorization decision for {sorted(ids - set(REQUIRED_SCOPE))}"
    assert not ids - set(builders), f"no matrix request for {sorted(ids - set(builders))}"
    cells = wrong = 0
    failures = []
    with sec.client("admin") as admin:
        for op_id, method, _ in ops:
            for model in (MODEL, OTHER):
                for caller in CALLERS:
                    call = builders[op_id](admin, model)
                    assert call.method == method, (op_id, call.method, method)
                    model_checked = op_id == "createModel" and call.kwargs["json"]["name"] or model
                    r = _send(sec, call, caller)
                    cells += 1
                    denial = expected_denial(op_id, caller, model_checked)
                    if denial is None:
                        good = r.status_code in call.ok
                    else:
                        good = r.status_code == denial
                    if not good:
                        wrong += 1
                        failures.append(
                            f"{op_id} {model} as {caller}: {r.status_code} (expected "
                            f"{denial or call.ok}) {r.text[:150] if not call.stream else ''}"
                        )
                    if denial is not None and op_id == "createModel":
                        assert admin.get(f"/v1/models/{call.kwargs['json']['name']}").status_code == 404
                    if denial is not None and op_id == "putObject":
                        assert admin.head(call.path).status_code == 404
    sec.figures["matrix"] = (cells, wrong)
    print(
        f"\nFIGURE authz-matrix: {len(ids)} operations x {len(CALLERS)} callers x 2 model patterns = {cells} "
        f"cells, {wrong} wrong"
    )
    assert not failures, "\n".join(failures)


def test_allowed_matches_the_documented_scopes():
    """The table agrees with docs/API.md's scope column for a few spot checks of each kind."""
    assert allowed("getObject", "other", None) is True  # objects are not model-scoped
    assert allowed("getVersion", "other", MODEL) is False and allowed("getVersion", "other", OTHER) is True
    assert allowed("fsck", "publisher", None) is False and allowed("fsck", "admin", None) is True
    assert allowed("beginPublish", "reader", MODEL) is False


# --- tokens never in logs, URLs, answers or messages -----------------------------------------------------------


def test_tokens_never_in_logs_urls_or_answers(sec: Sec):
    tokens = sec.server.tokens
    answers = []
    # Tokens presented in odd places: no answer echoes them.
    for header in [
        f"Bearer {tokens['bad']}",
        f"Basic {tokens['reader']}",
        tokens["publisher"],
        f"Bearer {tokens['reader']} {tokens['admin']}",
        f"bearer  {tokens['other']}",
    ]:
        for method, path in [("GET", f"/v1/models/{MODEL}"), ("POST", "/v1/admin/gc"), ("GET", "/v1/nope")]:
            r = raw_request(
                sec.server.url,
                method,
                path,
                headers={"Authorization": header, "Content-Type": "application/json"},
                body=b"{}" if method == "POST" else b"",
            )
            answers.append(r.body.decode("latin-1") + json.dumps(r.headers))
    # The SDK's errors name no token.
    with Subscriber(sec.server.url, MODEL, token=tokens["bad"], retry=FAST, report=False) as sub:
        with pytest.raises(errors.AuthError) as info:
            sub.pull(sec.root / "pulls" / "bad-token")
    answers.append(str(info.value) + repr(info.value))
    # A token in the query string is not logged either (the access log records the route, not the URL).
    raw_request(
        sec.server.url, "GET", f"/v1/models?access_token={tokens['reader']}", headers=sec.server.headers("reader")
    )
    log = sec.server.log()
    assert "weightsync.access" in log, "debug/access logging did not run"
    for name, token in tokens.items():
        assert token not in log, f"the {name} token is in the server log"
        assert all(token not in a for a in answers if name != "reader" or "access_token" not in a), name
        for method, path in sec.proxy.requests:
            assert token not in path, f"the {name} token is in a URL the SDK sent: {method} {path[:80]}"
    assert sec.proxy.requests, "the SDK's requests were not recorded"
    sec.figures["token-grep"] = (len(log.splitlines()), len(sec.proxy.requests))
    print(
        f"\nFIGURE tokens: 0 of {len(tokens)} tokens in {len(log.splitlines())} server log lines "
        f"(debug level) and in {len(sec.proxy.requests)} SDK request URLs"
    )
