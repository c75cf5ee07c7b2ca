"""Multi-part publish (issue 14, publisher side), over a real server and real processes.

N ranks publish one version together by (model, parent, step); it commits when the last part
arrives and is an ordinary version: a pull is byte-identical to the union of the parts.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from _ckpt import mutate, safetensors_file
from _client_util import Server, server_on, start_server, stop_server, tree_bytes

from weightsync import errors
from weightsync.client import Publisher, Subscriber
from weightsync.client._http import Api
from weightsync.codec import Manifest


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server with an SQLite catalog (the default), or one on a fresh PostgreSQL database."""
    with server_on(request.param, tmp_path_factory.mktemp(f"parts-{request.param}")) as srv:
        yield srv


SMALL = {"chunk_bytes": 64 << 10, "object_bytes": 256 << 10}
CONFIG = b'{"model_type": "moe", "experts": 6}\n'


def shards(seed: int, n: int = 6, prior: dict[str, bytes] | None = None) -> dict[str, bytes]:
    """`n` safetensors files of distinct tensors plus a config; with `prior`, the same tensors a step later."""
    rng = np.random.default_rng(seed)
    out = {"config.json": CONFIG}
    for j in range(n):
        tensors = {}
        for i in range(2):
            data = np.random.default_rng(j * 10 + i).integers(0, 256, 40_000, dtype=np.uint8)
            if prior is not None:
                data = mutate(rng, data, 2, 400)
            tensors[f"experts.{j}.w{i}"] = ("BF16", (20_000,), data)
        out[f"experts-{j}.safetensors"] = safetensors_file(tensors)
    return out


def write_part(root: Path, files: dict[str, bytes], paths: list[str]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for p in paths:
        (root / p).write_bytes(files[p])
    return root


def groups(files: dict[str, bytes], world: int) -> list[list[str]]:
    """Weight files dealt to `world` ranks in order; every rank carries the config."""
    weights = sorted(p for p in files if p.endswith(".safetensors"))
    return [[*weights[r::world], "config.json"] for r in range(world)]


def push(server: str, model: str, path: Path, step: int, part: str, *extra: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "WEIGHTSYNC_CACHE": str(path.parent / f"cache-{part.replace('/', '-')}")}
    cmd = [sys.executable, "-m", "weightsync", "push", model, str(path), "--server", server]
    return subprocess.Popen(
        [*cmd, "--step", str(step), "--part", part, *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


def pulled(server: str, model: str, dest: Path) -> dict[str, bytes]:
    with Subscriber(server, model) as sub:
        sub.pull(dest)
    return tree_bytes(dest)


def test_three_part_processes_commit_one_version(server, model, tmp_path: Path) -> None:
    v1 = shards(1)
    v2 = shards(2, prior=v1)
    for step, files in ((1, v1), (2, v2)):
        procs = [
            push(server.url, model, write_part(tmp_path / f"s{step}-r{r}", files, g), step, f"{r}/3")
            for r, g in enumerate(groups(files, 3))
        ]
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err.decode()
            assert f"{model} v{step} (" in out.decode()  # each rank waited for the commit
        assert pulled(server.url, model, tmp_path / "pull") == files
        with Api(server.url) as api:
            # Nothing left over: the part manifests stay referenced by the version (no orphans).
            report = api.fsck(read_data=True, repair=False)
            assert report.problems == [] and report.ok, report.problems
    with Api(server.url) as api:
        versions = api.list_versions(model)
    assert [(v.number, v.step, v.kind) for v in versions] == [(1, 1, "keyframe"), (2, 2, "delta")]


def test_parts_across_world_sizes_and_retries(server, model, tmp_path: Path) -> None:
    """1 → 3 → 1 parts across versions; a retried part is idempotent; the config is stored once."""
    files = shards(3)
    with Publisher(server.url, model, **SMALL) as one:
        assert one.publish(write_part(tmp_path / "v1", files, list(files)), step=1).version == 1
    v2 = shards(4, prior=files)
    g = groups(v2, 3)
    with Publisher(server.url, model, part=(0, 3), **SMALL) as pub:
        for _ in range(2):  # a part sent twice (a retry) is accepted twice
            assert pub.publish(write_part(tmp_path / "v2-0", v2, g[0]), step=2, wait=False).version == 0
    results = {}

    def rank(r: int) -> None:
        with Publisher(server.url, model, part=(r, 3), **SMALL) as pub:
            results[r] = pub.publish(write_part(tmp_path / f"v2-{r}", v2, g[r]), step=2)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert {r.version for r in results.values()} == {2}
    assert pulled(server.url, model, tmp_path / "pull") == v2
    with Api(server.url) as api:
        manifest = Manifest.decode(api.get_manifest(model, 2))
    assert sorted(f.path for f in manifest.files) == sorted(v2)  # config.json once
    v3 = shards(5, prior=v2)
    with Publisher(server.url, model, **SMALL) as one:
        assert one.publish(write_part(tmp_path / "v3", v3, list(v3)), step=3).version == 3
    assert pulled(server.url, model, tmp_path / "pull") == v3


def test_missing_rank_expires_and_next_step_commits(tmp_path: Path) -> None:
    srv = start_server(tmp_path / "srv", env={"WEIGHTSYNC_PENDING_TTL_S": "2"})
    try:
        model = "m-expiry"
        files = shards(6)
        g = groups(files, 2)
        with Publisher(srv.url, model, part=(0, 2), **SMALL) as pub:
            accepted = pub.publish(write_part(tmp_path / "r0", files, g[0]), step=1, wait=False)
        assert accepted.version == 0
        with Api(srv.url) as api:
            assert api.head(model) is None  # nothing visible
        time.sleep(2.5)
        with Publisher(srv.url, model, part=(1, 2), **SMALL) as pub, pytest.raises(errors.PublishNotFound):
            pub.publish(write_part(tmp_path / "r1", files, g[1]), step=1)
        done = {}

        def rank(r: int) -> None:
            with Publisher(srv.url, model, part=(r, 2), **SMALL) as pub:
                done[r] = pub.publish(write_part(tmp_path / f"n{r}", files, g[r]), step=2).version

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert done == {0: 1, 1: 1}
        assert pulled(srv.url, model, tmp_path / "pull") == files
        with Api(srv.url) as api:
            # The expired group is reported like any expired publish, and repaired (dropped).
            report = api.fsck(read_data=True, repair=True)
            assert {p.code for p in report.problems} <= {"expired-pending", "orphan"}  # orphans: in grace
            assert "expired-pending" in {p.code for p in report.problems}
            api.gc(dry_run=False, grace_s=0)  # the lost group's objects go; the version's stay
            assert api.fsck(read_data=True, repair=False).ok
        assert pulled(srv.url, model, tmp_path / "pull2") == files  # gc kept everything the version needs
    finally:
        stop_server(srv)


def test_conflicting_parts_are_refused(server, model, tmp_path: Path) -> None:
    files = shards(7)
    g = groups(files, 2)
    with Publisher(server.url, model, part=(0, 2), **SMALL) as pub:
        assert pub.publish(write_part(tmp_path / "r0", files, g[0]), step=1, wait=False).version == 0
    # Rank 1 claims a tensor rank 0 holds (another file carrying experts.0.*).
    clash = dict(files)
    clash["other.safetensors"] = safetensors_file({"experts.0.w0": ("BF16", (2,), np.zeros(4, np.uint8))})
    with (
        Publisher(server.url, model, part=(1, 2), **SMALL) as pub,
        pytest.raises(errors.PartConflict, match="experts.0.w0"),
    ):
        pub.publish(write_part(tmp_path / "r1", clash, [*g[1], "other.safetensors"]), step=1)
    # Another world size for the same step.
    with Publisher(server.url, model, part=(1, 3), **SMALL) as pub, pytest.raises(errors.PartConflict, match="parts"):
        pub.publish(write_part(tmp_path / "r1b", files, g[1]), step=1)
    # The same rank again with other content.
    with (
        Publisher(server.url, model, part=(0, 2), **SMALL) as pub,
        pytest.raises(errors.PartConflict, match="other content"),
    ):
        pub.publish(write_part(tmp_path / "r0b", files, g[0][1:]), step=1)
    with Api(server.url) as api:
        assert api.head(model) is None  # nothing committed
    # The right rank 1 completes the version.
    with Publisher(server.url, model, part=(1, 2), **SMALL) as pub:
        assert pub.publish(write_part(tmp_path / "r1c", files, g[1]), step=1).version == 1
    assert pulled(server.url, model, tmp_path / "pull") == files


def test_a_restarted_rank_resending_a_committed_step_blocks_nothing(server, model, tmp_path: Path) -> None:
    """Regression: a rank restarted after its step committed (its answer lost) used to begin that step again
    on the new head, a group no other rank joins, and the next step got parent-pending until it expired."""
    files = shards(11)
    g = groups(files, 2)
    with Publisher(server.url, model, part=(0, 2), **SMALL) as pub:
        assert pub.publish(write_part(tmp_path / "r0", files, g[0]), step=1, wait=False).version == 0
    with Publisher(server.url, model, part=(1, 2), **SMALL) as pub:
        assert pub.publish(write_part(tmp_path / "r1", files, g[1]), step=1).version == 1
    with (
        Publisher(server.url, model, part=(1, 2), **SMALL) as restarted,
        pytest.raises(errors.PartConflict, match="step 1 is already committed as v1"),
    ):
        restarted.publish(write_part(tmp_path / "r1", files, g[1]), step=1, wait=False)
    v2 = shards(12, prior=files)
    with Publisher(server.url, model, part=(0, 2), parent_wait_s=0, **SMALL) as pub:
        assert pub.publish(write_part(tmp_path / "s0", v2, g[0]), step=2, wait=False).parent == 1
    with Publisher(server.url, model, part=(1, 2), **SMALL) as pub:
        assert pub.publish(write_part(tmp_path / "s1", v2, g[1]), step=2).version == 2
    assert pulled(server.url, model, tmp_path / "pull") == v2


def test_next_step_waits_for_the_pending_parent(server, model, tmp_path: Path) -> None:
    files = shards(8)
    g = groups(files, 2)
    with Publisher(server.url, model, part=(0, 2), **SMALL) as pub:
        pub.publish(write_part(tmp_path / "a0", files, g[0]), step=1, wait=False)
    with Api(server.url) as api, pytest.raises(errors.ParentPending):
        api.begin_publish(model, parent=None, step=2, metadata=None, keyframe=True, part=(0, 2))
    # A rank of step 2 retries parent-pending until step 1 commits, then joins step 2 on v1.
    v2 = shards(9, prior=files)
    later = {}

    def step2() -> None:
        with Publisher(server.url, model, part=(0, 2), parent_wait_s=60, **SMALL) as pub:
            later["r"] = pub.publish(write_part(tmp_path / "b0", v2, g[0]), step=2, wait=False)

    t = threading.Thread(target=step2)
    t.start()
    with Publisher(server.url, model, part=(1, 2), **SMALL) as pub:
        assert pub.publish(write_part(tmp_path / "a1", files, g[1]), step=1).version == 1
    t.join(60)
    assert later["r"].parent == 1
    with Publisher(server.url, model, part=(1, 2), **SMALL) as pub:
        assert pub.publish(write_part(tmp_path / "b1", v2, g[1]), step=2).version == 2
    assert pulled(server.url, model, tmp_path / "pull") == v2


def test_cli_part_usage_and_no_wait(server, model, tmp_path: Path) -> None:
    files = shards(10)
    g = groups(files, 2)
    for bad in ("2/2", "x/2", "1", "0/0", "-1/2"):
        p = push(server.url, model, write_part(tmp_path / "u", files, g[0]), 1, bad)
        _, err = p.communicate(timeout=60)
        assert p.returncode == 2, (bad, err.decode())
    p = push(server.url, model, write_part(tmp_path / "n0", files, g[0]), 1, "0/2", "--no-wait")
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0 and "accepted" in out.decode(), err.decode()
    p = push(server.url, model, write_part(tmp_path / "n1", files, g[1]), 1, "1/2")
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0 and f"{model} v1" in out.decode(), err.decode()
