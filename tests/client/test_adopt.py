"""pull --adopt of a directory weightsync does not manage (issue 12): files already the version's are kept as
they are, and only the frames of the others are downloaded (client/pull.py `fetch_needed`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from _client_util import FaultyTransport, Killed, tree_bytes
from typer.testing import CliRunner

from weightsync import errors
from weightsync.client import Publisher, Subscriber
from weightsync.client.cli import EXIT_CONFLICT, register
from weightsync.client.models import Plan
from weightsync.codec import Checkpoint
from weightsync.codec.manifest import Manifest

SMALL = {"chunk_bytes": 16 << 10, "object_bytes": 48 << 10}  # several frames per tensor, objects holding several files
SHARDS = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
OTHER = SHARDS[2]  # the file a user's directory has wrong


def _versions(n: int) -> list[dict[str, bytes]]:
    """`n` consecutive versions of a 3-shard model: each step flips 2 % of every tensor's bytes (small
    F32 tensors of every shard share delta frames)."""
    from _ckpt import safetensors_file
    from _versions import model_files, next_step

    shards = [model_files(seed) for seed in range(len(SHARDS))]
    out = []
    for step in range(n):
        if step:
            shards = [next_step(files, 100 * step + i) for i, files in enumerate(shards)]
        out.append(
            {name: safetensors_file(files, {"step": str(step)}) for name, files in zip(SHARDS, shards, strict=True)}
        )
    return out


def _publish(url: str, model: str, versions: list[dict[str, bytes]]) -> Publisher:
    """A publisher (its base held: the next version it publishes is a delta) that has published `versions`."""
    pub = Publisher(url, model, **SMALL)
    for files in versions:
        pub.publish(Checkpoint.from_bytes(files))
    return pub


def _write(root: Path, files: dict[str, bytes]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for path, data in files.items():
        (root / path).write_bytes(data)


def _needed_bytes(sub: Subscriber, version: int, path: str) -> tuple[int, int]:
    """(bytes of the frames with a piece of `path` across the full plan to `version`, bytes of its manifests)."""
    plan: Plan = sub.api.get_plan(sub.model, have=None, want=version)
    frames: set[tuple[str | None, int, int]] = set()
    for step in plan.steps:
        manifest = Manifest.decode(sub.api.get_manifest(sub.model, step.number))
        (fi,) = [i for i, f in enumerate(manifest.files) if f.path == path]
        frames |= {(r.object, r.offset, r.length) for r in manifest.frames if any(p.file == fi for p in r.pieces)}
    return sum(n for _, _, n in frames), sum(s.manifest_bytes for s in plan.steps)


def test_adopt_downloads_only_the_file_that_differs(server, model, tmp_path: Path) -> None:
    """Two of three shards there as v3, the third of v2: refused without --adopt; with it, the CLI downloads
    only the third's frames, keeps the two in place (same inode and mtime) and the directory then follows
    the head by ordinary deltas."""
    versions = _versions(4)
    pub = _publish(server.url, model, versions[:3])
    mine = tmp_path / "mine"
    _write(mine, {**versions[2], OTHER: versions[1][OTHER], "notes.txt": b"mine"})
    before = {p: os.stat(mine / p) for p in SHARDS}
    runner = CliRunner()
    app = _app()
    env = {"WEIGHTSYNC_SERVER": server.url, "WEIGHTSYNC_CACHE": str(tmp_path / "push-cache")}

    refused = runner.invoke(app, ["pull", model, str(mine)], env=env)
    assert refused.exit_code == EXIT_CONFLICT and "--adopt" in refused.stderr
    assert tree_bytes(mine) == {**versions[2], OTHER: versions[1][OTHER], "notes.txt": b"mine"}
    assert not (mine / ".weightsync").exists()

    adopted = runner.invoke(app, ["pull", model, str(mine), "--adopt", "--json"], env=env)
    assert adopted.exit_code == 0, adopted.stderr
    result = _json(adopted.stdout)
    with Subscriber(server.url, model, report=False) as sub:
        frames, manifests = _needed_bytes(sub, 3, OTHER)
    assert result["version"] == 3 and result["mode"] == "full" and result["steps"] == 3 and result["adopted"] == 2
    assert frames <= result["bytes"] <= frames + manifests
    assert result["bytes"] < result["plan_bytes"] / 2, "far below what a full pull fetches"
    assert tree_bytes(mine) == {**versions[2], "notes.txt": b"mine"}
    for path in SHARDS[:2]:  # kept where they were: the version holds the same inode, never rewritten
        now = os.stat(mine / path)
        assert (now.st_ino, now.st_dev, now.st_mtime_ns) == (
            before[path].st_ino,
            before[path].st_dev,
            before[path].st_mtime_ns,
        )
    assert os.stat(mine / OTHER).st_ino != before[OTHER].st_ino
    assert all((mine / p).is_symlink() for p in SHARDS) and not (mine / "notes.txt").is_symlink()

    with pub:
        assert pub.publish(Checkpoint.from_bytes(versions[3])).kind == "delta"
    nxt = runner.invoke(app, ["pull", model, str(mine), "--json"], env=env)
    assert nxt.exit_code == 0, nxt.stderr
    assert _json(nxt.stdout)["mode"] == "delta" and _json(nxt.stdout)["version"] == 4
    assert tree_bytes(mine) == {**versions[3], "notes.txt": b"mine"}


def test_adopt_of_a_damaged_file_fetches_that_file_only(server, model, tmp_path: Path) -> None:
    """Every file there, one with a byte changed in a tensor: that one is rebuilt, the others kept."""
    versions = _versions(2)
    _publish(server.url, model, versions).close()
    mine = tmp_path / "mine"
    _write(mine, versions[1])
    with open(mine / SHARDS[0], "r+b") as f:
        f.seek(-100, os.SEEK_END)
        byte = f.read(1)
        f.seek(-100, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x40]))
    inodes = {p: os.stat(mine / p).st_ino for p in SHARDS}
    with Subscriber(server.url, model, report=False) as sub:
        frames, manifests = _needed_bytes(sub, 2, SHARDS[0])
        r = sub.pull(mine, adopt=True)
        assert r.version == 2 and r.mode == "full" and r.adopted == 2
        assert frames <= r.bytes_received <= frames + manifests < r.plan_bytes
        assert tree_bytes(mine) == versions[1]
        assert {p: os.stat(mine / p).st_ino == inodes[p] for p in SHARDS} == {
            SHARDS[0]: False,
            SHARDS[1]: True,
            SHARDS[2]: True,
        }
        again = sub.pull(mine)  # managed now: verified against its state, nothing to fetch
        assert again.mode == "current" and again.bytes_received == 0


def test_adopt_with_every_file_there_downloads_no_frame(server, model, tmp_path: Path) -> None:
    versions = _versions(2)
    _publish(server.url, model, versions).close()
    mine = tmp_path / "mine"
    _write(mine, versions[1])
    with Subscriber(server.url, model, report=False) as sub:
        _, manifests = _needed_bytes(sub, 2, SHARDS[0])
        r = sub.pull(mine, adopt=True)
    assert r.mode == "adopted" and r.steps == 0 and r.bytes_received <= manifests and r.adopted == len(SHARDS)
    assert tree_bytes(mine) == versions[1]


def test_adopt_with_format_1_manifests(server, model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A version 1 delta frame checks its result whole: the files it shares with the one rebuilt are decoded
    along (here every shard: their small tensors share delta frames, so everything is fetched), and the files
    kept still stay in place."""
    monkeypatch.setattr(Publisher, "_format_for", lambda self, base: 1)
    versions = _versions(4)
    pub = _publish(server.url, model, versions[:3])
    mine = tmp_path / "mine"
    _write(mine, {**versions[2], OTHER: versions[0][OTHER]})
    inode = os.stat(mine / SHARDS[0]).st_ino
    with Subscriber(server.url, model, report=False) as sub:
        assert Manifest.decode(sub.api.get_manifest(model, 3)).version == 1
        r = sub.pull(mine, adopt=True)
        assert r.mode == "full" and r.bytes_received <= r.plan_bytes
        assert tree_bytes(mine) == versions[2] and os.stat(mine / SHARDS[0]).st_ino == inode
        with pub:
            assert pub.publish(Checkpoint.from_bytes(versions[3])).kind == "delta"
        assert sub.pull(mine).mode == "delta"
    assert tree_bytes(mine) == versions[3]


def test_adopt_resumes_and_fetches_damaged_ranges_again(server, model, tmp_path: Path) -> None:
    """A partial adopt killed half way keeps the ranges it got; a range damaged on disk fails the decode with a
    named error and is fetched again by the next run, which ends byte-identical."""
    versions = _versions(2)
    _publish(server.url, model, versions).close()
    mine = tmp_path / "mine"
    _write(mine, {**versions[1], OTHER: b"not a shard"})
    faulty = FaultyTransport("GET", "/v1/objects/", limit=4)  # the 2 manifests, then 2 ranges
    with (
        Subscriber(server.url, model, transport=faulty, concurrency=1, range_bytes=8 << 10, report=False) as sub,
        pytest.raises(Killed),
    ):
        sub.pull(mine, adopt=True)
    assert (mine / OTHER).read_bytes() == b"not a shard" and not (mine / SHARDS[0]).is_symlink()
    parts = sorted((mine / ".weightsync" / "objects").glob("*.parts/*-*"))
    assert parts, "the ranges received before the crash are kept"
    parts[0].write_bytes(b"\xff" * parts[0].stat().st_size)
    with Subscriber(server.url, model, range_bytes=8 << 10, report=False) as sub:
        with pytest.raises(errors.FormatError):
            sub.pull(mine, adopt=True)
        assert not list((mine / ".weightsync" / "objects").glob("*.parts/*-*")), "unchecked ranges are dropped"
        assert (mine / OTHER).read_bytes() == b"not a shard"
        frames, manifests = _needed_bytes(sub, 2, OTHER)
        r = sub.pull(mine, adopt=True)
    assert r.mode == "full" and frames <= r.bytes_received <= frames + manifests
    assert tree_bytes(mine) == versions[1]
    assert not (mine / ".weightsync" / "objects").exists() or not any((mine / ".weightsync" / "objects").iterdir())


def test_adopt_into_a_shared_object_cache(server, model, tmp_path: Path) -> None:
    """With a shared cache the ranges live there; a full pull of the same version later reuses them."""
    versions = _versions(2)
    _publish(server.url, model, versions).close()
    mine = tmp_path / "mine"
    _write(mine, {SHARDS[0]: versions[1][SHARDS[0]]})
    cache = tmp_path / "cache"
    with Subscriber(server.url, model, cache_dir=cache, report=False) as sub:
        r = sub.pull(mine, adopt=True)
        assert r.mode == "full" and r.bytes_received < r.plan_bytes
        assert tree_bytes(mine) == versions[1]
        fresh = sub.pull(tmp_path / "fresh")
        assert fresh.bytes_received < fresh.plan_bytes, "the ranges fetched for the adopt are reused"
    assert tree_bytes(tmp_path / "fresh") == versions[1]


def _app():
    import typer

    app = typer.Typer(add_completion=False)
    register(app)
    return app


def _json(stdout: str) -> dict:
    import json

    lines = stdout.strip().splitlines()
    assert len(lines) == 1, stdout
    return json.loads(lines[0])
