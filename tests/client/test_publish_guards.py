"""Never publish a broken checkpoint (issue 12): the SDK and the CLI refuse every bad input of the issue before
sending a single request, nothing is committed, and a replica holding the previous version is untouched."""

from __future__ import annotations

import logging
import re
import threading
import uuid
from pathlib import Path

import httpx
import pytest
import typer
from _bad_ckpt import BAD, PICKLE, SHARD2, sharded
from _client_util import TinyTrainer, tree_bytes, write_version
from typer.testing import CliRunner

from weightsync import errors
from weightsync.client import Publisher, Subscriber
from weightsync.client.base import snapshot
from weightsync.client.cli import register
from weightsync.codec import Checkpoint

SMALL = {"chunk_bytes": 64 << 10, "object_bytes": 256 << 10}


class Recording(httpx.BaseTransport):
    """Passes every request through to the real server and records (method, path)."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.requests: list[tuple[str, str]] = []
        self._lock = threading.Lock()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        with self._lock:
            self.requests.append((request.method, request.url.path))
        return self.inner.handle_request(request)

    def close(self) -> None:
        self.inner.close()


def _head(url: str, model: str) -> int | None:
    return httpx.get(f"{url}/v1/models/{model}").json()["head"]


@pytest.mark.parametrize("make, message", [(m, msg) for _, m, msg in BAD], ids=[case for case, _, _ in BAD])
def test_a_bad_checkpoint_is_refused_before_any_request(server, model, tmp_path: Path, make, message: str) -> None:
    v1, replica, wire = sharded(tmp_path / "v1"), tmp_path / "replica", Recording()
    with (
        Publisher(server.url, model, transport=wire, **SMALL) as pub,
        Subscriber(server.url, model, name="replica") as sub,
    ):
        pub.publish(v1, step=1)
        sub.pull(replica)
        held = tree_bytes(replica)
        wire.requests.clear()
        bad = make(tmp_path / "bad")
        with pytest.raises(errors.InvalidCheckpoint, match=message) as caught:
            pub.publish(bad, step=2)
        assert "\n" not in str(caught.value)
        assert wire.requests == []  # refused before beginning: nothing uploaded, nothing pending
        assert pub.version == 1 and _head(server.url, model) == 1
        again = sub.pull(replica)
        assert again.version == 1 and again.mode == "current" and tree_bytes(replica) == held == tree_bytes(v1)
        assert pub.publish(v1, step=2).version == 2  # the publisher is still usable


def test_bytes_state_dict_and_async_sources_are_validated(server, model, tmp_path: Path) -> None:
    good = sharded(tmp_path / "good")
    with Publisher(server.url, model, **SMALL) as pub:
        cut = (good / SHARD2).read_bytes()[:300_000]
        with pytest.raises(errors.InvalidCheckpoint, match=r"^model\.safetensors: tensor .* ends at byte \d+"):
            pub.publish(cut)
        with pytest.raises(errors.InvalidCheckpoint, match=r"^model\.safetensors: the file is empty"):
            pub.publish_async(b"").result()
        with pytest.raises(errors.InvalidCheckpoint, match=r"^the checkpoint: no files to publish$"):
            pub.publish(Checkpoint.from_bytes({}))
        assert httpx.get(f"{server.url}/v1/models/{model}").status_code == 404  # not even the model was created
        assert pub.publish((good / SHARD2).read_bytes()).version == 1


def test_an_empty_state_dict_is_refused(server, model) -> None:
    pytest.importorskip("torch")
    with Publisher(server.url, model) as pub, pytest.raises(errors.InvalidCheckpoint, match="hold no tensor"):
        pub.publish({})


def test_pickles_next_to_safetensors_are_published_without_them(
    server, model, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    src = sharded(tmp_path / "src")
    (src / "training_args.bin").write_bytes(PICKLE)
    published = {k: v for k, v in tree_bytes(src).items() if k != "training_args.bin"}
    with Publisher(server.url, model, **SMALL) as pub, Subscriber(server.url, model, name="r") as sub:
        with caplog.at_level(logging.WARNING, logger="weightsync.client"):
            assert pub.publish(src, step=1).version == 1
        (record,) = [r for r in caplog.records if r.name == "weightsync.client"]
        assert record.levelno == logging.WARNING and record.getMessage().endswith(": training_args.bin")
        sub.pull(tmp_path / "replica")
        assert tree_bytes(tmp_path / "replica") == published
        # The base kept for the next delta is what was published: the next publish is a delta on it.
        again = pub.publish(src, step=2)
        assert again.kind == "delta" and again.version == 2
    warnings: list[str] = []
    checkpoint, owned = snapshot(src, warnings=warnings)
    assert [f.layout.path for f in checkpoint.files] == sorted(published) and not owned
    assert len(warnings) == 1 and "training_args.bin" in warnings[0]


@pytest.fixture
def cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Run the client CLI in-process with a clean WEIGHTSYNC_* environment; returns the click Result."""
    for key in ("WEIGHTSYNC_SERVER", "WEIGHTSYNC_TOKEN", "WEIGHTSYNC_CACHE", "WEIGHTSYNC_RETRIES"):
        monkeypatch.delenv(key, raising=False)
    app = typer.Typer(add_completion=False)
    register(app)
    env = {"WEIGHTSYNC_CACHE": str(tmp_path / "push-cache")}
    return lambda *args: CliRunner().invoke(app, [str(a) for a in args], env=env, catch_exceptions=False)


@pytest.mark.parametrize("case", ["shard-cut-to-300000-bytes", "empty-directory", "model-pt-alone"])
def test_push_refuses_in_one_line_with_exit_1(server, model, cli, tmp_path: Path, case: str) -> None:
    make, message = next((m, msg) for c, m, msg in BAD if c == case)
    assert cli("push", model, sharded(tmp_path / "v1"), "--server", server.url).exit_code == 0
    r = cli("push", model, make(tmp_path / "bad"), "--server", server.url)
    assert r.exit_code == errors.EXIT_ERROR == errors.InvalidCheckpoint.exit_code
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("weightsync: error: ") and re.search(message.lstrip("^"), line), line
    assert _head(server.url, model) == 1


def test_a_replica_never_installs_a_safetensors_file_that_does_not_parse(server, tmp_path: Path) -> None:
    """A publisher that skipped the checks (raw API, layout right, header bytes wrong): the replica refuses it."""
    import hashlib

    import httpx
    import numpy as np

    from weightsync.client import Subscriber
    from weightsync.codec import Encoder
    from weightsync.codec.checkpoint import Checkpoint, CheckpointFile
    from weightsync.codec.pack import pack

    model = f"guard-raw-{uuid.uuid4().hex[:8]}"
    good = write_version(tmp_path / "good", TinyTrainer(seed=43).export())
    with Publisher(server.url, model) as pub:
        pub.publish(good)
    with Subscriber(server.url, model, name="careful") as sub:
        sub.pull(tmp_path / "replica")
        ck = Checkpoint.open(good)
        files = []
        for f in ck.files:
            data = np.array(f.data)
            if f.layout.path.endswith(".safetensors"):
                data[8:40] = np.frombuffer(b"x" * 32, np.uint8)  # the JSON header is garbage; the layout claims tensors
            files.append(CheckpointFile(f.layout, data))
        encoded = Encoder().encode(Checkpoint(files), None)
        manifest, objects = pack(encoded)
        manifest.model, manifest.parent = model, 1
        mbytes = manifest.encode()
        digest = hashlib.sha256(mbytes).hexdigest()
        with httpx.Client(base_url=server.url) as c:
            begin = c.post(f"/v1/models/{model}/publishes", json={"parent": 1, "keyframe": True}).json()
            for o in objects:
                c.put(f"/v1/objects/{o.digest}", content=o.data).raise_for_status()
            c.put(f"/v1/objects/{digest}", content=mbytes).raise_for_status()
            c.post(
                f"/v1/models/{model}/publishes/{begin['publish_id']}/commit", json={"manifest": digest}
            ).raise_for_status()
        with pytest.raises(errors.InvalidCheckpoint, match="model.safetensors"):
            sub.pull(tmp_path / "replica")
        assert sub.version == 1
    assert tree_bytes(tmp_path / "replica") == tree_bytes(good)
