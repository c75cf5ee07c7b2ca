"""`serve` and `migrate`: refusing bad configuration in one line, anonymous mode on loopback, migrations."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import typer
from _service_util import run_cli, spawn_service
from typer.testing import CliRunner

from weightsync.catalog import Catalog


def one_line_error(result: subprocess.CompletedProcess, *needles: str) -> str:
    assert result.returncode == 1, (result.returncode, result.stdout, result.stderr)
    errors = [line for line in result.stderr.splitlines() if not line.startswith("{")]  # JSON lines are logs
    assert len(errors) == 1 and errors[0].startswith("weightsync: error: "), result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]
    return errors[0]


def test_cli_module_does_not_import_server_dependencies():
    code = (
        "import sys, typer; from weightsync.service.cli import register; app = typer.Typer(); register(app); "
        "heavy = [m for m in ('fastapi', 'uvicorn', 'sqlalchemy', 'starlette', 'aioboto3', 'pydantic') "
        "if m in sys.modules]; print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_register_adds_serve_with_its_flags():
    app = typer.Typer()
    register_target = __import__("weightsync.service.cli", fromlist=["register"])
    register_target.register(app)

    @app.command()
    def other() -> None:  # a second command, so typer keeps `serve` as a subcommand
        pass

    result = CliRunner().invoke(app, ["serve", "--help"])
    assert result.exit_code == 0, result.output
    for flag in ("--data", "--host", "--port", "--catalog", "--store", "--s3-endpoint", "--workers", "--tokens"):
        assert flag in result.output


def test_non_loopback_without_tokens_is_refused(tmp_path):
    one_line_error(run_cli(["serve", "--host", "0.0.0.0", "--data", str(tmp_path)]), "without tokens", "0.0.0.0")


def test_bad_configuration_is_one_line(tmp_path):
    one_line_error(run_cli(["serve", "--port", "70000", "--data", str(tmp_path)]), "port")
    one_line_error(run_cli(["serve", "--data", str(tmp_path)], env={"WEIGHTSYNC_WORKERS": "many"}), "workers")
    one_line_error(run_cli(["serve", "--tokens", str(tmp_path / "absent.json"), "--data", str(tmp_path)]), "token file")
    secret = "super-secret-token-value-1234"
    one_line_error(
        run_cli(
            ["serve", "--data", str(tmp_path)], env={"WEIGHTSYNC_TOKENS": json.dumps([{"name": "x", "token": secret}])}
        ),
        "scopes",
    )
    one_line_error(run_cli(["serve", "--data", str(tmp_path), "--catalog", "mysql://nowhere/db"]), "catalog")
    r = run_cli(["serve", "--data", str(tmp_path), "--catalog", "postgresql://u:hunter2@127.0.0.1:1/x"])
    assert "hunter2" not in one_line_error(r, "unreachable")


def test_usage_errors_are_one_line_and_exit_2(tmp_path):
    """A flag that does not parse is a usage error (2), one line that says where help is; bad values are 1."""
    for args, needle in (
        (["serve", "--port", "eighty"], "'--port'"),
        (["serve", "--bogus"], "No such option: --bogus"),
        (["migrate", "--data"], "'--data'"),
    ):
        r = run_cli(args)
        assert r.returncode == 2 and r.stdout == "", (r.returncode, r.stderr)
        lines = r.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("weightsync: error: ") and needle in lines[0]
        assert lines[0].endswith(f"(see python -m weightsync.service {args[0]} --help)")
    r = run_cli(["serve", "--help"])
    assert r.returncode == 0 and "--port PORT" in r.stdout and "[default: 8400]" in r.stdout
    assert "<str>" not in r.stdout and "<int>" not in r.stdout and "╭" not in r.stdout


def test_a_catalog_newer_than_the_code_is_refused(tmp_path):
    db = tmp_path / "catalog.db"
    Catalog.open(f"sqlite:///{db}").close()
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE alembic_version SET version_num = '9999'")
    one_line_error(run_cli(["serve", "--data", str(tmp_path)]), "9999", "upgrade")
    one_line_error(run_cli(["migrate", "--data", str(tmp_path)]), "9999")


def test_migrate_command(tmp_path):
    r = run_cli(["migrate", "--catalog", f"sqlite:///{tmp_path / 'c.db'}"])
    assert r.returncode == 0 and "revision" in r.stdout, r.stderr
    Catalog.open(f"sqlite:///{tmp_path / 'c.db'}", migrate=False).close()  # at head


def test_anonymous_mode_serves_on_loopback_and_says_so(tmp_path):
    s = spawn_service(["--data", str(tmp_path / "data")], tmp_path / "serve.log")
    try:
        assert httpx.post(s.url + "/v1/models", json={"name": "dev"}).status_code == 201
        assert httpx.get(s.url + "/v1/models/dev").json()["name"] == "dev"
    finally:
        s.stop()
    assert (tmp_path / "data" / "catalog.db").is_file() and (tmp_path / "data" / "store").is_dir()
    assert "anonymous development mode" in s.log()


def test_serve_runs_on_uvloop_and_parses_http_with_h11(tmp_path):
    """The server extra brings uvloop, which `serve` runs on; HTTP stays h11 even where httptools is installed
    (its header limit is what tests/reliability's oversized-header test relies on)."""
    pytest.importorskip("uvloop")
    s = spawn_service(["--data", str(tmp_path / "data")], tmp_path / "serve.log")
    try:
        assert httpx.get(s.url + "/healthz").status_code == 200
        maps = Path(f"/proc/{s.proc.pid}/maps").read_text()
    finally:
        s.stop()
    assert "uvloop/loop." in maps
    assert "httptools" not in maps
