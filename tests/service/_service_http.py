"""The publish and pull protocols of docs/API.md, spoken over HTTP with httpx (what the SDK will do).

Like tests/_publish.py, but every step is a request: beginPublish → encode + pack →
checkObjects → upload the missing objects (proxied PUT, or the presigned request) →
upload the manifest → commitPublish; and getPlan → getManifest → ranged getObject →
decode.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import numpy as np

from weightsync.codec import Checkpoint, CheckpointFile, Decoder, Encoder, FrameRef, Manifest
from weightsync.codec.pack import pack


@dataclass
class Published:
    version: dict
    begin: dict
    manifest: str
    uploaded: list[str] = field(default_factory=list)
    presigned: int = 0


def ok(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    return r.json() if r.content else {}


def problem(r: httpx.Response, status: int, code: str) -> dict:
    """Assert ``r`` is an application/problem+json answer with ``status`` and problem type ``code``."""
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/problem+json"), r.headers
    body = r.json()
    assert body["type"] == f"https://weightsync.dev/problems/{code}", body
    assert body["status"] == status and body["title"] and "detail" in body
    return body


def upload(client: httpx.Client, digest: str, data: bytes, uploads: dict | None, *, via: str) -> bool:
    """Upload one object; returns True if it went through a presigned URL."""
    if via != "proxy" and uploads and digest in uploads:
        req = uploads[digest]
        # Exactly the signed headers, and no bearer token: S3 does not want it.
        r = httpx.request(req["method"], req["url"], headers=req["headers"], content=data, timeout=60)
        assert r.status_code in (200, 201), (r.status_code, r.text[:300])
        return True
    ok(client.put(f"/v1/objects/{digest}", content=data), 201)
    return False


def publish(
    client: httpx.Client,
    model: str,
    ck: Checkpoint,
    base: Checkpoint | None,
    parent: int | None,
    *,
    via: str = "auto",
    keyframe: bool = False,
    step: int | None = None,
    commit: bool = True,
    format_version: int | None = None,
) -> Published:
    begin = ok(
        client.post(
            f"/v1/models/{model}/publishes",
            json={"parent": parent, "keyframe": keyframe, "step": step, "metadata": {"by": "test"}},
        ),
        201,
    )
    fmt = {} if format_version is None else {"format_version": format_version}
    encoded = Encoder(chunk_bytes=1 << 16, threads=2, **fmt).encode(ck, base if begin["kind"] == "delta" else None)
    manifest, objects = pack(encoded, target_bytes=1 << 17)
    manifest.model, manifest.parent, manifest.step = model, parent, step
    manifest.metadata = {"by": "test"}
    mbytes = manifest.encode()
    mdigest = hashlib.sha256(mbytes).hexdigest()
    blobs = {o.digest: o.data for o in objects}
    blobs[mdigest] = mbytes
    check = ok(
        client.post(
            f"/v1/models/{model}/publishes/{begin['publish_id']}/objects",
            json={"objects": [{"digest": d, "size": len(b)} for d, b in blobs.items()]},
        ),
        200,
    )
    out = Published({}, begin, mdigest)
    for d in check["missing"]:
        out.presigned += upload(client, d, blobs[d], check.get("uploads"), via=via)
        out.uploaded.append(d)
    if commit:
        out.version = ok(
            client.post(f"/v1/models/{model}/publishes/{begin['publish_id']}/commit", json={"manifest": mdigest}), 201
        )
    return out


def publish_chain(client: httpx.Client, model: str, versions: list[Checkpoint], **kw) -> list[Published]:
    out, base, parent = [], None, None
    for ck in versions:
        p = publish(client, model, ck, base, parent, **kw)
        out.append(p)
        base, parent = ck, p.version["number"]
    return out


def files_of(ck: Checkpoint) -> dict[str, bytes]:
    return {f.layout.path: f.data.tobytes() for f in ck.files}


@dataclass
class Pulled:
    number: int
    manifest: Manifest
    files: dict[str, np.ndarray]
    bytes: int


def pull(
    client: httpx.Client,
    model: str,
    *,
    have: Pulled | None = None,
    want: int | None = None,
    holder: str = "test-subscriber",
) -> Pulled:
    """Bring a state to version ``want`` (head by default) the way the plan says, with ranged reads."""
    params: dict = {"holder": holder}
    if have is not None:
        params["have"] = have.number
    if want is not None:
        params["want"] = want
    plan = ok(client.get(f"/v1/models/{model}/plan", params=params), 200)
    current = have if plan["steps"] and plan["steps"][0]["kind"] == "delta" else None
    received = 0
    for step in plan["steps"]:
        r = client.get(f"/v1/models/{model}/versions/{step['number']}/manifest")
        assert r.status_code == 200 and r.headers["etag"] == f'"{step["manifest"]}"'
        assert hashlib.sha256(r.content).hexdigest() == step["manifest"]
        manifest = Manifest.decode(r.content)
        blobs = {}
        for obj in step["objects"]:
            rr = client.get(f"/v1/objects/{obj['digest']}", headers={"Range": f"bytes=0-{obj['size'] - 1}"})
            assert rr.status_code in (200, 206), rr.text
            assert len(rr.content) == obj["size"]
            blobs[obj["digest"]] = rr.content
            received += len(rr.content)
        received += len(r.content)
        base = None
        if current is not None:
            base = Checkpoint(
                [CheckpointFile(f.layout, current.files[f.path]) for f in current.manifest.files],
                single_file=current.manifest.single_file,
            )
        outputs = [np.empty(f.size, dtype=np.uint8) for f in manifest.files]

        def read(ref: FrameRef, blobs: dict = blobs) -> memoryview:
            return memoryview(blobs[ref.object])[ref.offset : ref.offset + ref.length]

        Decoder(threads=2).decode(manifest, read, outputs, base, verify_segments=True)
        current = Pulled(
            step["number"], manifest, {f.path: o for f, o in zip(manifest.files, outputs, strict=True)}, received
        )
    assert current is not None and current.number == plan["target"]
    return current


class EventReader:
    """Reads a Server-Sent-Events stream in a thread; ``wait_for(pred)`` returns the first matching event."""

    def __init__(self, client: httpx.Client, path: str, params: dict | None = None) -> None:
        self.events: list[dict] = []
        self.comments = 0
        self.status: int | None = None
        self.error: BaseException | None = None
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(client, path, params), daemon=True)
        self._thread.start()
        assert self._ready.wait(30), "event stream did not open"
        assert self.status == 200, self.status

    def _run(self, client: httpx.Client, path: str, params: dict | None) -> None:
        try:
            with client.stream("GET", path, params=params, timeout=httpx.Timeout(30, read=60)) as r:
                self.status = r.status_code
                self.content_type = r.headers.get("content-type", "")
                self._ready.set()
                event: dict = {}
                for line in self._lines(r):
                    if self._stop.is_set():
                        return
                    if line == "":
                        if event:
                            with self._cond:
                                self.events.append(event)
                                self._cond.notify_all()
                        event = {}
                    elif line.startswith(":"):
                        with self._cond:
                            self.comments += 1
                            self._cond.notify_all()
                    else:
                        key, _, value = line.partition(":")
                        event[key] = value[1:] if value.startswith(" ") else value
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            self.error = exc
        finally:
            self._ready.set()

    @staticmethod
    def _lines(r: httpx.Response) -> Iterator[str]:
        yield from r.iter_lines()

    def versions(self) -> list[dict]:
        with self._cond:
            return [json.loads(e["data"]) for e in self.events if e.get("event") == "version"]

    def wait_for(self, pred, timeout: float = 30.0) -> dict:
        with self._cond:
            ok_ = self._cond.wait_for(
                lambda: (
                    any(pred(json.loads(e["data"])) for e in self.events if e.get("event") == "version")
                    or self.error is not None
                ),
                timeout,
            )
        assert ok_ and self.error is None, (self.error, self.events)
        return next(v for v in self.versions() if pred(v))

    def wait_event(self, name: str, pred, timeout: float = 30.0) -> dict:
        """The data (JSON) of the first ``event: name`` matching ``pred``, waiting up to ``timeout`` for it."""

        def matching() -> list[dict]:
            return [json.loads(e["data"]) for e in self.events if e.get("event") == name]

        with self._cond:
            ok_ = self._cond.wait_for(lambda: any(pred(d) for d in matching()) or self.error is not None, timeout)
        assert ok_ and self.error is None, (self.error, self.events)
        return next(d for d in matching() if pred(d))

    def wait_comments(self, n: int, timeout: float = 30.0) -> None:
        with self._cond:
            assert self._cond.wait_for(lambda: self.comments >= n or self.error is not None, timeout)

    def ended(self) -> bool:
        """Whether the stream has ended (the server closed it, or :meth:`close`)."""
        return not self._thread.is_alive()

    def close(self) -> None:
        """Stop reading: the stream is closed at the next line (keep-alives come often)."""
        self._stop.set()
        self._thread.join(30)
