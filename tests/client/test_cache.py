"""The publisher's cache (issue 12): keyed by server identity, one base per model, shown and pruned.

Real servers throughout: two on one catalog (same id, one folder), one on another (another
folder), and a plain HTTP server for a server without ``/v1/info``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from _ckpt import safetensors_file
from _client_util import free_port
from _serve import SERVICE_CLI, clean_env, serving
from _versions import model_files, next_step
from typer.testing import CliRunner

from weightsync.cli import app
from weightsync.client import Publisher
from weightsync.client._http import Api
from weightsync.client.cache import cache_root, list_bases, prune, publish_root, server_id, server_slug
from weightsync.errors import EXIT_CONFLICT, EXIT_USAGE, InvalidName


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "cache"


@pytest.fixture
def cli(root: Path, monkeypatch: pytest.MonkeyPatch):
    """Run the top-level `weightsync` app in-process with WEIGHTSYNC_CACHE=`root`; returns the click Result."""
    for key in ("WEIGHTSYNC_SERVER", "WEIGHTSYNC_TOKEN", "WEIGHTSYNC_CACHE", "WEIGHTSYNC_RETRIES", "XDG_CACHE_HOME"):
        monkeypatch.delenv(key, raising=False)
    runner = CliRunner()

    def run(*args: object):
        return runner.invoke(app, [str(a) for a in args], env={"WEIGHTSYNC_CACHE": str(root)}, catch_exceptions=False)

    return run


@pytest.fixture
def versions(tmp_path: Path):
    """versions(n): n consecutive checkpoint directories, oldest first, and the bytes of one."""

    def make(n: int, seed: int = 3) -> tuple[list[Path], int]:
        tensors = model_files(seed=seed)
        out = []
        for i in range(1, n + 1):
            d = tmp_path / f"src-{seed}-{i}"
            d.mkdir()
            (d / "model.safetensors").write_bytes(safetensors_file(tensors))
            (d / "config.json").write_bytes(b'{"hidden": 96}')
            out.append(d)
            tensors = next_step(tensors, seed=i)
        return out, sum(f.stat().st_size for f in out[0].iterdir())

    return make


def _push(cli, model: str, path: Path, url: str) -> dict:
    r = cli("push", model, path, "--server", url, "--json")
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)


def _json(result) -> dict:
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def _info_id(url: str) -> str:
    with Api(url) as api:
        return api.info().id


def test_the_cache_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WEIGHTSYNC_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "weightsync"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "weightsync"
    monkeypatch.setenv("WEIGHTSYNC_CACHE", str(tmp_path / "env"))
    assert cache_root() == tmp_path / "env"
    assert cache_root(tmp_path / "flag") == tmp_path / "flag"


def test_many_pushes_keep_one_bounded_base(cli, versions, server, model: str, root: Path) -> None:
    paths, size = versions(6)
    folder = root / "publish" / _info_id(server.url) / model
    sizes = []
    for i, path in enumerate(paths, start=1):
        pushed = _push(cli, model, path, server.url)
        assert pushed["version"] == i and pushed["kind"] == ("keyframe" if i == 1 else "delta")
        (base,) = list_bases(root)
        assert (base.path, base.model, base.version, base.in_use) == (folder, model, i, False)
        sizes.append(base.bytes)
    # Bounded: the cache does not grow with the number of pushes (the last committed version, plus at
    # most the one before it, which base.py keeps until the next push: see test_one_base_at_rest).
    assert max(sizes) == sizes[-1] <= 2 * size + (64 << 10)
    assert sizes[2:] == [sizes[2]] * len(sizes[2:])
    assert [p.name for p in (root / "publish").iterdir()] == [folder.parent.name]


def test_one_base_at_rest(cli, versions, server, model: str, root: Path) -> None:
    paths, size = versions(3)
    for path in paths:
        _push(cli, model, path, server.url)
    (base,) = list_bases(root)
    assert base.bytes <= size + (64 << 10)


def test_servers_on_one_catalog_share_a_folder_and_another_catalog_gets_another(
    cli, versions, model: str, root: Path, tmp_path: Path
) -> None:
    paths, _ = versions(4)
    data = tmp_path / "data"
    args = ["--data", str(data), "--host", "127.0.0.1", "--log-level", "warning"]
    with (
        serving(args, log_path=tmp_path / "a.log", command=SERVICE_CLI, env=clean_env()) as a,
        serving(args, log_path=tmp_path / "b.log", command=SERVICE_CLI, env=clean_env()) as b,
    ):
        assert a.port != b.port and _info_id(a.url) == _info_id(b.url)
        assert _push(cli, model, paths[0], a.url)["kind"] == "keyframe"
        assert _push(cli, model, paths[1], b.url)["kind"] == "delta"  # the base pushed through a serves b
        assert _push(cli, model, paths[2], a.url)["kind"] == "delta"
        (base,) = list_bases(root)
        assert base.server_id == _info_id(a.url) and base.version == 3
    # The id lives in the catalog: a restart on another port is still the same server.
    with serving(args, log_path=tmp_path / "c.log", command=SERVICE_CLI, env=clean_env()) as c:
        assert _push(cli, model, paths[3], c.url)["kind"] == "delta"
        assert [(x.server_id, x.version) for x in list_bases(root)] == [(base.server_id, 4)]
    other_args = ["--data", str(tmp_path / "other"), "--host", "127.0.0.1", "--log-level", "warning"]
    with serving(other_args, log_path=tmp_path / "d.log", command=SERVICE_CLI, env=clean_env()) as d:
        other = _info_id(d.url)
        assert other != base.server_id
        assert _push(cli, model, paths[0], d.url)["kind"] == "keyframe"
    shown = _json(cli("cache", "--json"))
    assert shown["root"] == str(root)
    assert sorted((x["server_id"], x["model"], x["version"]) for x in shown["bases"]) == sorted(
        [(base.server_id, model, 4), (other, model, 1)]
    )
    assert shown["bytes"] == sum(x["bytes"] for x in shown["bases"])
    assert sorted(p.name for p in (root / "publish").iterdir()) == sorted([base.server_id, other])

    pruned = _json(cli("cache", "prune", "--server-id", other, "--json"))
    assert [x["server_id"] for x in pruned["removed"]] == [other] and pruned["in_use"] == []
    assert pruned["bytes_freed"] == pruned["removed"][0]["bytes"] > 0
    assert [x.server_id for x in list_bases(root)] == [base.server_id]
    assert [p.name for p in (root / "publish").iterdir()] == [base.server_id]  # the emptied folder went too


def test_hugging_face_names_map_to_org_dash_dash_name(cli, versions, server, root: Path) -> None:
    paths, _ = versions(3)
    name = "Some-Org/Cache.Model_1"
    for path in paths[:2]:
        _push(cli, name, path, server.url)
    (base,) = list_bases(root)
    assert base.path == root / "publish" / _info_id(server.url) / "Some-Org--Cache.Model_1"
    assert (base.model, base.version) == (name, 2)
    text = cli("cache", "show").stdout
    assert name in text and "v2" in text and "None" not in text
    assert "removed 1 base" in cli("cache", "prune", "--model", name).stdout
    assert list_bases(root) == []
    again = _push(cli, name, paths[2], server.url)  # no base: it downloads the head, then sends a delta
    assert again["kind"] == "delta" and again["bytes_received"] > 0
    assert [(b.model, b.version) for b in list_bases(root)] == [(name, 3)]
    with pytest.raises(InvalidName):
        prune(root, model="bad--name")


def test_a_base_a_running_publisher_holds_is_never_pruned(cli, versions, server, model: str, root: Path) -> None:
    paths, _ = versions(2)
    _push(cli, model, paths[0], server.url)
    held_root = publish_root(root, _info_id(server.url))
    with Publisher(server.url, model, cache_dir=held_root) as pub:
        assert cli("cache").stdout.count("(in use)") == 1
        r = cli("cache", "prune", "--all")
        assert r.exit_code == EXIT_CONFLICT and "removed 0 bases" in r.stdout
        assert r.stderr.strip() == f"weightsync: error: kept what a running publisher holds: {held_root.name}/{model}"
        result = prune(root, model=model)
        assert result.removed == [] and [b.model for b in result.in_use] == [model]
        assert pub.publish(paths[1]).kind == "delta"  # untouched: still the base of a delta
    (base,) = list_bases(root)
    assert base.version == 2 and not base.in_use
    assert [b.version for b in prune(root).removed] == [2]
    assert _json(cli("cache", "show", "--json"))["bases"] == []


def test_leftovers_of_the_old_host_port_layout_are_listed_and_pruned(cli, versions, server, root: Path) -> None:
    """Bases from before server ids (``publish/127.0.0.1_8400/<model>``) show up and can be removed."""
    paths, _ = versions(1)
    stale = root / "publish" / "127.0.0.1_8400"
    with Publisher(server.url, "old-layout", cache_dir=stale) as pub:
        pub.publish(paths[0])
    (base,) = list_bases(root)
    assert (base.server_id, base.model, base.version) == ("127.0.0.1_8400", "old-layout", 1)
    (stale / "half-made").mkdir()  # a base whose first publish never committed: no version
    assert [(b.model, b.version) for b in list_bases(root)] == [("half-made", None), ("old-layout", 1)]
    assert " - " in cli("cache").stdout
    assert len(_json(cli("cache", "prune", "--server-id", "127.0.0.1_8400", "--json"))["removed"]) == 2
    assert not stale.exists()


def test_empty_cache_and_usage(cli, root: Path, tmp_path: Path) -> None:
    assert cli("cache").stdout.strip() == f"no bases cached under {root / 'publish'}"
    assert _json(cli("cache", "show", "--json")) == {"root": str(root), "bases": [], "bytes": 0}
    flag = tmp_path / "flag"
    for args in (
        ["--cache-dir", flag, "--json"],
        ["--cache-dir", flag, "--json", "show"],
        ["show", "--cache-dir", flag, "--json"],
    ):
        assert _json(cli("cache", *args))["root"] == str(flag)  # --cache-dir beats $WEIGHTSYNC_CACHE
    assert _json(cli("cache", "--cache-dir", flag, "--json", "prune", "--all"))["removed"] == []
    assert cli("cache", "prune", "--all").stdout.strip() == "nothing removed: no base matched"
    for args in (["cache", "prune"], ["cache", "prune", "--all", "--model", "m"]):
        r = cli(*args)
        assert r.exit_code == EXIT_USAGE and r.stderr.count("\n") == 1
        assert "give --model, --server-id (or both), or --all" in r.stderr


def test_no_cache_keeps_nothing(cli, versions, server, model: str, root: Path) -> None:
    paths, _ = versions(1)
    r = cli("push", model, paths[0], "--server", server.url, "--no-cache", "--json")
    assert r.exit_code == 0, r.stderr
    assert list_bases(root) == []


def test_a_server_without_v1_info_is_keyed_by_host_and_port(tmp_path: Path) -> None:
    """A server older than /v1/info answers 404 there (here: a plain HTTP server, which does the same)."""
    port = free_port()
    (tmp_path / "empty").mkdir()
    other = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(tmp_path / "empty")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(200):
            try:
                httpx.get(url)
                break
            except httpx.TransportError:
                time.sleep(0.05)
        with Api(url) as api:
            assert server_id(api) == f"127.0.0.1_{port}" == server_slug(url)
    finally:
        other.terminate()
        other.wait(10)


def test_each_part_of_a_multi_part_publisher_is_a_base_of_its_own(cli, server, model: str, root: Path) -> None:
    """`Publisher(part=(rank, world))` keeps its base in `<model>/part-R-of-W`: listed, held and pruned part by part."""
    import threading

    held_root = publish_root(root, _info_id(server.url))
    sources = []
    for rank in range(2):
        d = root.parent / f"rank-{rank}"
        d.mkdir()
        tensors = {f"layers.{rank}.{k}": v for k, v in model_files(seed=rank).items()}
        (d / f"model-{rank}.safetensors").write_bytes(safetensors_file(tensors))
        sources.append(d)
    pubs = [Publisher(server.url, model, cache_dir=held_root, part=(r, 2)) for r in range(2)]
    try:
        done: list[int] = []
        threads = [
            threading.Thread(target=lambda r=r: done.append(pubs[r].publish(sources[r], step=1).version))
            for r in range(2)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert done == [1, 1]
        pubs[1].close()
        bases = list_bases(root)
        assert sorted((b.model, b.part, b.version) for b in bases) == [(model, "0/2", 1), (model, "1/2", 1)]
        assert cli("cache").stdout.count(f"{model} part ") == 2
        result = prune(root, model=model)  # part 0's publisher is still open: its base stays
        assert [b.part for b in result.removed] == ["1/2"] and [b.part for b in result.in_use] == ["0/2"]
    finally:
        for p in pubs:
            p.close()
    assert [b.part for b in prune(root, model=model).removed] == ["0/2"]
    assert list_bases(root) == [] and not (held_root / model).exists()
