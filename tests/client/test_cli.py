"""The client CLI (registered on a typer app as the lead wires it): JSON output, errors, exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import typer
from _client_util import TOKENS, TinyTrainer, dir_size, free_port, tree_bytes, write_version
from typer.testing import CliRunner

from weightsync import errors
from weightsync.client.cli import (
    EXIT_AUTH,
    EXIT_CONFLICT,
    EXIT_ERROR,
    EXIT_NOT_FOUND,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    register,
)

app = typer.Typer(add_completion=False)
register(app)


@pytest.fixture
def cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Run a command in-process with a clean WEIGHTSYNC_* environment; returns the click Result."""
    for key in ("WEIGHTSYNC_SERVER", "WEIGHTSYNC_TOKEN", "WEIGHTSYNC_CACHE", "WEIGHTSYNC_RETRIES"):
        monkeypatch.delenv(key, raising=False)
    runner = CliRunner()
    base_env = {"WEIGHTSYNC_CACHE": str(tmp_path / "push-cache")}

    def run(*args: str, env: dict[str, str] | None = None):
        return runner.invoke(app, [str(a) for a in args], env={**base_env, **(env or {})}, catch_exceptions=False)

    return run


def _one_json(result) -> dict:
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1, result.stdout
    return json.loads(lines[0])


def _one_error_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("weightsync: error: "), result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


def test_push_pull_json(server, model, cli, tmp_path: Path) -> None:
    trainer = TinyTrainer(seed=31)
    env = {"WEIGHTSYNC_SERVER": server.url}
    follow = tmp_path / "follow"
    for i in range(1, 4):
        trainer.step()
        src = write_version(tmp_path / f"src{i}", trainer.export())
        r = cli("push", model, src, "--step", i, "--json", env=env)
        assert r.exit_code == 0, r.stderr
        pushed = _one_json(r)
        assert pushed["version"] == i and isinstance(pushed["bytes"], int)
        assert pushed["kind"] == ("keyframe" if i == 1 else "delta")
        if i > 1:
            assert pushed["bytes"] < dir_size(src) * 0.3
        r = cli("pull", model, follow, "--json", env=env)
        assert r.exit_code == 0, r.stderr
        pulled = _one_json(r)
        assert pulled["version"] == i and isinstance(pulled["bytes"], int)
        assert tree_bytes(follow) == tree_bytes(src)
        if i > 1:
            assert pulled["mode"] == "delta" and 0 < pulled["bytes"] < dir_size(src) * 0.3
        r = cli("pull", model, tmp_path / f"fresh{i}", "--server", server.url, "--json")
        assert r.exit_code == 0 and _one_json(r)["mode"] == "full"
        assert tree_bytes(tmp_path / f"fresh{i}") == tree_bytes(src)
    r = cli("pull", model, tmp_path / "v2", "--version", 2, "--json", env=env)
    assert _one_json(r)["version"] == 2 and tree_bytes(tmp_path / "v2") == tree_bytes(tmp_path / "src2")
    # Human output: one line each, no JSON.
    r = cli("pull", model, follow, env=env)
    assert r.exit_code == 0 and "already at" in r.stdout
    r = cli("log", model, "--json", env=env)
    log = _one_json(r)
    assert [v["number"] for v in log["versions"]] == [1, 2, 3]
    assert [v["step"] for v in log["versions"]] == [1, 2, 3]
    r = cli("log", model, "--limit", 1, env=env)
    assert r.exit_code == 0 and r.stdout.startswith("v3")
    r = cli("models", "--json", env=env)
    assert model in {m["name"] for m in _one_json(r)["models"]}
    r = cli("watch", model, "--after", 2, "--count", 1, "--json", env=env)
    assert r.exit_code == 0 and _one_json(r)["number"] == 3


def test_json_output_is_the_servers_answer_byte_for_byte(server, model, cli, tmp_path: Path) -> None:
    """--json of the listing, watch and admin commands prints the server's JSON (sorted keys), not a re-shaping."""
    trainer = TinyTrainer(seed=33)
    env = {"WEIGHTSYNC_SERVER": server.url}
    for i in range(1, 3):
        trainer.step()
        r = cli(
            "push",
            model,
            write_version(tmp_path / f"src{i}", trainer.export()),
            "--step",
            i,
            "--metadata",
            json.dumps({"lr": 1e-6, "tags": ["a", i]}),
            env=env,
        )
        assert r.exit_code == 0, r.stderr

    def printed(obj: object) -> str:
        return json.dumps(obj, sort_keys=True, default=str) + "\n"

    with httpx.Client(base_url=server.url) as http:
        versions = http.get(f"/v1/models/{model}/versions").json()["versions"]
        assert cli("log", model, "--json", env=env).stdout == printed({"model": model, "versions": versions})
        assert cli("log", model, "--limit", 1, "--json", env=env).stdout == printed(
            {"model": model, "versions": versions[-1:]}
        )
        assert cli("watch", model, "--after", 1, "--count", 1, "--json", env=env).stdout == printed(versions[1])
        assert cli("models", "--json", env=env).stdout == printed(http.get("/v1/models").json())
        fsck = http.post("/v1/admin/fsck", json={"read_data": True, "repair": False}).json()
        assert cli("fsck", "--read-data", "--json", env=env).stdout == printed(fsck)
        gc = http.post("/v1/admin/gc", json={"dry_run": True}).json()
        assert cli("gc", "--dry-run", "--json", env=env).stdout == printed(gc)
    assert versions[1]["metadata"] == {"lr": 1e-6, "tags": ["a", 2]} and "leases_purged" in gc
    r = cli("log", model, env=env)  # the human form names every version, its timestamp as the API writes it
    assert [line.split()[0] for line in r.stdout.splitlines()] == ["v1", "v2"]
    assert r.stdout.splitlines()[1].endswith(versions[1]["committed_at"])
    r = cli("fsck", env=env)
    assert r.exit_code == 0 and r.stdout.splitlines()[-1].startswith("ok: ")
    r = cli("gc", "--dry-run", env=env)
    assert r.exit_code == 0 and r.stdout.startswith("would delete ") and "kept in grace" in r.stdout
    r = cli("models", env=env)
    assert any(line.split() == [model, "head=2"] for line in r.stdout.splitlines())


def test_push_single_file(server, model, cli, tmp_path: Path) -> None:
    trainer = TinyTrainer(seed=37)
    trainer.step()
    src = write_version(tmp_path / "src", trainer.export()) / "model.safetensors"
    r = cli("push", model, src, "--json", "--no-cache", "--server", server.url)
    assert r.exit_code == 0, r.stderr
    r = cli("pull", model, tmp_path / "out", "--json", "--server", server.url)
    assert r.exit_code == 0
    assert tree_bytes(tmp_path / "out") == {"model.safetensors": src.read_bytes()}


def test_errors_and_exit_codes(server, auth_server, model, cli, tmp_path: Path) -> None:
    r = cli("pull", model + "-unknown", tmp_path / "x", "--server", server.url)
    assert r.exit_code == EXIT_NOT_FOUND
    assert "no model" in _one_error_line(r)
    r = cli("log", model + "-unknown", "--server", server.url)
    assert r.exit_code == EXIT_NOT_FOUND
    _one_error_line(r)
    dead = f"http://127.0.0.1:{free_port()}"
    r = cli("pull", model, tmp_path / "x", "--server", dead, env={"WEIGHTSYNC_RETRIES": "1"})
    assert r.exit_code == EXIT_UNAVAILABLE
    assert "unavailable" in _one_error_line(r)
    r = cli("models", "--server", auth_server.url, env={"WEIGHTSYNC_TOKEN": "not-a-valid-token-at-all"})
    assert r.exit_code == EXIT_AUTH
    _one_error_line(r)
    r = cli("models", "--server", auth_server.url)  # no token at all
    assert r.exit_code == EXIT_AUTH
    src = tmp_path / "src.safetensors"
    trainer = TinyTrainer(seed=41)
    src.write_bytes(write_version(tmp_path / "s", trainer.export()).joinpath("model.safetensors").read_bytes())
    r = cli("push", model, src, "--server", auth_server.url, env={"WEIGHTSYNC_TOKEN": TOKENS["reader"]})
    assert r.exit_code == EXIT_AUTH  # a read-only token may not publish (403)
    assert "publish" in _one_error_line(r)
    r = cli("push", model, tmp_path / "missing.safetensors", "--server", server.url)
    assert r.exit_code == 1
    _one_error_line(r)
    r = cli("pull", model, tmp_path / "x", "--version", "zero", "--server", server.url)
    assert r.exit_code == EXIT_USAGE
    # Admin endpoints: the admin token works, the reader's does not.
    admin = {"WEIGHTSYNC_TOKEN": TOKENS["admin"]}
    r = cli("push", model, src, "--json", "--server", auth_server.url, env=admin)
    assert r.exit_code == 0 and _one_json(r)["version"] == 1
    r = cli("fsck", "--json", "--server", auth_server.url, env=admin)
    assert r.exit_code == 0 and _one_json(r)["ok"] is True
    r = cli("gc", "--dry-run", "--json", "--server", auth_server.url, env=admin)
    assert r.exit_code == 0 and "objects_deleted" in _one_json(r)
    r = cli("fsck", "--server", auth_server.url, env={"WEIGHTSYNC_TOKEN": TOKENS["reader"]})
    assert r.exit_code == EXIT_AUTH


def test_directory_in_use_is_a_conflict(server, model, cli, tmp_path: Path) -> None:
    from weightsync.client.checkout import Checkout

    trainer = TinyTrainer(seed=43)
    src = write_version(tmp_path / "src", trainer.export())
    assert cli("push", model, src, "--server", server.url).exit_code == 0
    dest = tmp_path / "dest"
    with Checkout(dest).locked():
        r = cli("pull", model, dest, "--server", server.url)
    assert r.exit_code == EXIT_CONFLICT
    _one_error_line(r)


def test_real_process_unreachable_server(tmp_path: Path) -> None:
    """In a real process: one stderr line, exit status 5, no traceback."""
    code = "import typer; from weightsync.client.cli import register; app = typer.Typer(); register(app); app()"
    env = {"PATH": "/usr/bin:/bin", "WEIGHTSYNC_RETRIES": "2", "WEIGHTSYNC_CACHE": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-c", code, "pull", "some-model", str(tmp_path / "d"), "--json"],
        env={**env, "WEIGHTSYNC_SERVER": f"http://127.0.0.1:{free_port()}"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == EXIT_UNAVAILABLE
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("weightsync: error: ") and "Traceback" not in proc.stderr


def _raising_app(exc: BaseException) -> typer.Typer:
    """The client commands, plus one that fails with ``exc`` inside the same error handling."""
    from weightsync.client.cli_common import one_line_errors

    raising = typer.Typer(add_completion=False)
    register(raising)

    @raising.command("fail-with")
    def fail_with() -> None:
        with one_line_errors():
            raise exc

    return raising


@pytest.mark.parametrize(
    "exc,code",
    [
        (errors.StaleParent("parent 1 is not the head", current_head=2), EXIT_CONFLICT),
        (errors.Conflict("another weightsync process is updating this directory"), EXIT_CONFLICT),
        (errors.BaseMismatch("other base"), EXIT_CONFLICT),
        (errors.IncompletePublish("object missing"), EXIT_CONFLICT),
        (errors.AuthError("unknown token"), EXIT_AUTH),
        (errors.Forbidden("lacks the publish scope"), EXIT_AUTH),
        (errors.ServerUnavailable("unreachable"), EXIT_UNAVAILABLE),
        (errors.ModelNotFound("no model named 'x'"), EXIT_NOT_FOUND),
        (errors.VersionNotFound("no version 9"), EXIT_NOT_FOUND),
        (errors.PublishNotFound("publish expired"), EXIT_ERROR),
        (errors.ObjectNotFound("object gone"), EXIT_ERROR),
        (errors.InvalidArgument("bad value"), EXIT_ERROR),
        (errors.BadResponse("bad response from the server: Version.number: expected an integer, got str"), EXIT_ERROR),
        (errors.ChecksumMismatch("tensor 'w' does not match"), EXIT_ERROR),
        (FileNotFoundError(2, "No such file or directory", "missing.safetensors"), EXIT_ERROR),
        (ValueError("not a number"), EXIT_ERROR),
    ],
)
def test_exit_codes_come_from_the_error_table(exc: BaseException, code: int) -> None:
    r = CliRunner().invoke(_raising_app(exc), ["fail-with"], catch_exceptions=False)
    assert r.exit_code == code
    line = _one_error_line(r)
    if isinstance(exc, errors.WeightsyncError):
        assert r.exit_code == exc.exit_code and line == f"weightsync: error: {exc}"


def test_top_level_patch_against_the_wrong_base_exits_as_a_conflict(tmp_path: Path) -> None:
    import numpy as np
    from _ckpt import safetensors_file

    from weightsync.cli import app as main_app

    rng = np.random.default_rng(3)

    def tensors() -> dict:
        return {"w": ("F32", (32, 8), rng.integers(0, 256, 32 * 8 * 4, dtype=np.uint8))}

    for name in ("a", "b", "c"):
        (tmp_path / f"{name}.safetensors").write_bytes(safetensors_file(tensors()))
    runner = CliRunner()
    r = runner.invoke(
        main_app,
        ["diff", str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors"), "-o", str(tmp_path / "d.wsd")],
        catch_exceptions=False,
    )
    assert r.exit_code == 0, r.stderr
    r = runner.invoke(
        main_app,
        ["patch", str(tmp_path / "c.safetensors"), str(tmp_path / "d.wsd"), "-o", str(tmp_path / "x.safetensors")],
        catch_exceptions=False,
    )
    assert r.exit_code == EXIT_CONFLICT == errors.BaseMismatch.exit_code
    _one_error_line(r)
    assert not (tmp_path / "x.safetensors").exists()


def test_push_refuses_removals_unless_allowed(server, model, cli, tmp_path: Path) -> None:
    """A version that drops a file or a tensor of the previous one is refused (exit 3, one line) until allowed."""
    import numpy as np
    from safetensors.numpy import save_file

    env = {"WEIGHTSYNC_SERVER": server.url}
    v1 = tmp_path / "v1"
    v1.mkdir()
    save_file({"a": np.ones(64, np.float32), "b": np.zeros(8, np.float32)}, str(v1 / "model.safetensors"))
    (v1 / "config.json").write_text("{}")
    assert cli("push", model, v1, env=env).exit_code == 0
    no_config = tmp_path / "v2"
    no_config.mkdir()
    (no_config / "model.safetensors").write_bytes((v1 / "model.safetensors").read_bytes())
    refused = cli("push", model, no_config, env=env)
    assert refused.exit_code == EXIT_CONFLICT
    assert "config.json" in _one_error_line(refused) and "--allow-removals" in refused.stderr
    no_b = tmp_path / "v3"
    no_b.mkdir()
    save_file({"a": np.ones(64, np.float32)}, str(no_b / "model.safetensors"))
    (no_b / "config.json").write_text("{}")
    refused = cli("push", model, no_b, env=env)
    assert refused.exit_code == EXIT_CONFLICT and "model.safetensors:b" in _one_error_line(refused)
    head = httpx.get(f"{server.url}/v1/models/{model}").json()["head"]
    assert head == 1  # nothing committed
    allowed = cli("push", model, no_b, "--allow-removals", "--json", env=env)
    assert allowed.exit_code == 0 and _one_json(allowed)["version"] == 2
    pulled = cli("pull", model, tmp_path / "replica", env=env)
    assert pulled.exit_code == 0 and tree_bytes(tmp_path / "replica") == tree_bytes(no_b)


def test_pull_refuses_a_users_directory_unless_adopt(server, model, cli, tmp_path: Path) -> None:
    """A directory weightsync does not manage, with files where the version goes: exit 3; --adopt takes over."""
    import shutil

    env = {"WEIGHTSYNC_SERVER": server.url}
    src = write_version(tmp_path / "src", TinyTrainer(seed=41).export())
    assert cli("push", model, src, env=env).exit_code == 0
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text("my own")
    refused = cli("pull", model, mine, env=env)
    assert refused.exit_code == EXIT_CONFLICT and "--adopt" in _one_error_line(refused)
    assert (mine / "config.json").read_text() == "my own" and sorted(p.name for p in mine.iterdir()) == ["config.json"]
    copy = tmp_path / "copy"
    shutil.copytree(src, copy)
    adopted = cli("pull", model, copy, "--adopt", env=env)
    assert adopted.exit_code == 0 and "adopted" in adopted.stdout
    assert tree_bytes(copy) == tree_bytes(src)
