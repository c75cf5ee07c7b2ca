"""The CLI as an operator meets it (issue 12): URL mistakes, one-line usage errors, help, output, watch."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from _client_util import TinyTrainer, free_port, start_server, stop_server, write_version
from _metrics import requests_seen
from _serve import clean_env
from typer.testing import CliRunner

from weightsync import errors
from weightsync.cli import app
from weightsync.client import Publisher, Subscriber
from weightsync.client._http import Api
from weightsync.client.cli import EXIT_NOT_FOUND, EXIT_USAGE
from weightsync.common import VERSION

COMMANDS = [["push"], ["pull"], ["watch"], ["log"], ["models"], ["fsck"], ["gc"], ["serve"], ["diff"], ["patch"], []]
SIZE = re.compile(r"\d+(\.\d)? (B|KiB|MiB|GiB)\b")


@pytest.fixture
def cli(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Run the real top-level `weightsync` app in-process with a clean WEIGHTSYNC_* environment."""
    for key in ("WEIGHTSYNC_SERVER", "WEIGHTSYNC_TOKEN", "WEIGHTSYNC_CACHE", "WEIGHTSYNC_RETRIES"):
        monkeypatch.delenv(key, raising=False)
    runner = CliRunner()

    def run(*args: object, env: dict[str, str] | None = None):
        env = {"WEIGHTSYNC_CACHE": str(tmp_path / "push-cache"), **(env or {})}
        return runner.invoke(app, [str(a) for a in args], env=env, catch_exceptions=False)

    return run


def _usage_error(result, command: str) -> str:
    """The one stderr line of a usage error, which says where the command's help is."""
    assert result.exit_code == EXIT_USAGE, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("weightsync: error: "), result.stderr
    assert lines[0].endswith(f"(see weightsync {command} --help)".replace("  ", " ")), lines[0]
    return lines[0]


def _checkpoint(root: Path, seed: int) -> Path:
    trainer = TinyTrainer(seed=seed)
    trainer.step()
    return write_version(root, trainer.export())


# --- server URLs ----------------------------------------------------------------------


def test_a_server_url_without_scheme_or_with_a_path_is_a_usage_error(server, model, cli, tmp_path: Path) -> None:
    src = _checkpoint(tmp_path / "src", 51)
    hostport = server.url.removeprefix("http://")
    line = _usage_error(cli("push", model, src, "--server", hostport), "push")
    assert f"use {server.url}" in line and "--server" in line
    line = _usage_error(cli("push", model, src, "--server", server.url + "/v1"), "push")
    assert f"use the server's root, {server.url}" in line
    line = _usage_error(cli("models", env={"WEIGHTSYNC_SERVER": hostport}), "models")
    assert "WEIGHTSYNC_SERVER" in line
    for command in (["pull", model, tmp_path / "d"], ["watch", model], ["log", model], ["fsck"], ["gc"]):
        _usage_error(cli(*command, "--server", server.url + "/v1/"), command[0])
    # Refused before any request: the push did not even create the model.
    assert httpx.get(f"{server.url}/v1/models/{model}").status_code == 404
    assert not (tmp_path / "d").exists()
    # The root URL, with or without a trailing slash, works.
    assert cli("push", model, src, "--server", server.url + "/").exit_code == 0


@pytest.mark.parametrize(
    "url", ["127.0.0.1:8400", "localhost:8400", "http://127.0.0.1:8400/v1", "ftp://host", "http://"]
)
def test_the_sdk_refuses_the_same_urls_with_a_named_error(url: str) -> None:
    for make in (lambda: Publisher(url, "m"), lambda: Subscriber(url, "m"), lambda: Api(url)):
        with pytest.raises(errors.InvalidArgument, match="not a server URL"):
            make()


def test_a_404_from_something_that_is_not_a_weightsync_server_says_the_url_is_probably_wrong(
    server, cli, tmp_path: Path
) -> None:
    """A URL that points at another web server (here Python's own) gets a 404 whose message says so."""
    port = free_port()
    other = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            try:
                httpx.get(url)
                break
            except httpx.TransportError:
                time.sleep(0.05)
        r = cli("models", "--server", url)
        assert r.exit_code == EXIT_NOT_FOUND
        line = r.stderr.strip()
        assert "\n" not in line and "(HTTP 404) from GET /v1/models" in line
        assert line.endswith(f"is {url} the root URL of a weightsync server?")
    finally:
        other.terminate()
        other.wait(10)
    # A weightsync server without that route (an older server) says the same; a missing model does not.
    with Api(server.url) as api, pytest.raises(errors.NotFound, match="root URL of a weightsync server"):
        api.request("GET", "/v1/no-such-route")
    r = cli("log", "no-such-model-here", "--server", server.url)
    assert r.exit_code == EXIT_NOT_FOUND and "root URL" not in r.stderr and "no-such-model-here" in r.stderr


# --- usage errors, --version, help ----------------------------------------------------


def test_usage_errors_are_one_line_that_says_where_help_is(cli, tmp_path: Path) -> None:
    assert "No such option: --bogus" in _usage_error(cli("push", "m", tmp_path, "--bogus"), "push")
    assert "Missing argument 'MODEL'" in _usage_error(cli("push"), "push")
    assert "'--version'" in _usage_error(cli("pull", "m", tmp_path, "--version", "zero"), "pull")
    assert "JSON object" in _usage_error(cli("push", "m", tmp_path, "--metadata", "[1]"), "push")
    assert "not a rate" in _usage_error(cli("pull", "m", tmp_path, "--limit-rate", "fast"), "pull")
    assert "'--count'" in _usage_error(cli("watch", "m", "--count", "0"), "watch")
    assert "'--port'" in _usage_error(cli("serve", "--port", "eighty"), "serve")
    assert "No such command 'frob'" in _usage_error(cli("frob"), "")


def test_usage_errors_are_one_line_in_a_real_process(tmp_path: Path) -> None:
    script = Path(sys.executable).with_name("weightsync")  # the console script an operator runs
    assert script.is_file()
    for command, args in (("", ["--bogus"]), ("push", ["push", "m"]), ("serve", ["serve", "--workers", "x"])):
        proc = subprocess.run([script, *args], env=clean_env(), capture_output=True, text=True, timeout=60)
        assert proc.returncode == EXIT_USAGE and proc.stdout == ""
        assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("weightsync: error: ")
        assert proc.stderr.rstrip().endswith(f"(see weightsync {command} --help)".replace("  ", " "))
    proc = subprocess.run(
        [sys.executable, "-m", "weightsync.service", "serve", "--bogus"],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == EXIT_USAGE and proc.stderr.count("\n") == 1
    assert proc.stderr.startswith("weightsync: error: No such option: --bogus")


def test_version(cli) -> None:
    r = cli("--version")
    assert r.exit_code == 0 and r.stdout == f"weightsync {VERSION}\n"


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "weightsync")
def test_help_reads_right(cli, command: list[str]) -> None:
    r = cli(*command, "--help", env={"COLUMNS": "100"})
    assert r.exit_code == 0, r.stderr
    text = r.stdout
    options = [line for line in text.splitlines() if line.strip().startswith("-")]
    assert not [line for line in options if re.search(r"<[a-z ]+>", line)], options  # no <bool>, <str>, …
    assert "[default: (" not in text
    assert not re.search(r"\s[.,;](\s|$)", text), text  # no stray punctuation left by markup
    assert "╭" not in text  # plain help: no boxes
    flag_lines = [line.split() for line in text.splitlines() if line.strip().startswith("--json")]
    assert all(len(words) > 1 and words[1] in ("Print", "One") for words in flag_lines), flag_lines


# --- human output -----------------------------------------------------------------------


def test_human_output_has_no_none_and_one_unit_family(server, model, cli, tmp_path: Path) -> None:
    env = {"WEIGHTSYNC_SERVER": server.url}
    pushed = cli("push", model, _checkpoint(tmp_path / "src", 53), env=env)  # no --step: step is unknown
    pulled = cli("pull", model, tmp_path / "out", env=env)
    logged = cli("log", model, env=env)
    watched = cli("watch", model, "--after", 0, "--count", 1, env=env)
    httpx.post(f"{server.url}/v1/models", json={"name": model + "-empty"}).raise_for_status()
    listed = cli("models", env=env)
    gc = cli("gc", "--dry-run", env=env)
    for r in (pushed, pulled, logged, watched, listed, gc):
        assert r.exit_code == 0, r.stderr
        assert "None" not in r.stdout and " MB" not in r.stdout and "{" not in r.stdout, r.stdout
    for r in (pushed, pulled, logged, watched):
        assert SIZE.search(r.stdout), r.stdout
    assert logged.stdout.split()[:4] == ["v1", "keyframe", "parent=-", "step=-"]
    assert watched.stdout.startswith(f"{model} v1 (keyframe): ") and "step" not in watched.stdout
    assert any(line.split() == [model + "-empty", "head=-"] for line in listed.stdout.splitlines())


def test_empty_listings_say_so(tmp_path: Path, cli) -> None:
    empty = start_server(tmp_path / "empty-server")
    try:
        env = {"WEIGHTSYNC_SERVER": empty.url}
        r = cli("models", env=env)
        assert r.exit_code == 0 and r.stdout == "no models\n"
        assert json.loads(cli("models", "--json", env=env).stdout) == {"models": []}
        httpx.post(f"{empty.url}/v1/models", json={"name": "fresh"}).raise_for_status()
        r = cli("log", "fresh", env=env)
        assert r.exit_code == 0 and r.stdout == "fresh: no versions\n"
        r = cli("log", "fresh", "--limit", 3, env=env)
        assert r.exit_code == 0 and r.stdout == "fresh: no versions\n"
    finally:
        stop_server(empty)


# --- watch ------------------------------------------------------------------------------


def test_watch_after_n_prints_every_later_version_in_order(server, model, cli, tmp_path: Path) -> None:
    env = {"WEIGHTSYNC_SERVER": server.url}
    trainer = TinyTrainer(seed=57)
    for i in range(1, 6):
        trainer.step()
        assert (
            cli("push", model, write_version(tmp_path / f"v{i}", trainer.export()), "--step", i, env=env).exit_code == 0
        )
    r = cli("watch", model, "--after", 2, "--count", 2, "--json", env=env)
    assert r.exit_code == 0 and [json.loads(line)["number"] for line in r.stdout.splitlines()] == [3, 4]
    r = cli("watch", model, "--after", 1, "--count", 4, env=env)
    assert [line.split()[1] for line in r.stdout.splitlines()] == ["v2", "v3", "v4", "v5"]
    assert "step 5:" in r.stdout.splitlines()[-1]


def test_watch_waits_for_a_model_that_does_not_exist_yet(server, model, cli, tmp_path: Path) -> None:
    """A replica may start before the trainer's first push: `watch` waits, then reports v1 and v2 in order."""
    lookups = requests_seen(server.url, "GET", "/v1/models/{model}", "404")
    watcher = subprocess.Popen(
        [sys.executable, "-m", "weightsync", "watch", model, "--count", "2", "--json", "--server", server.url],
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while requests_seen(server.url, "GET", "/v1/models/{model}", "404") == lookups:
            assert watcher.poll() is None and time.monotonic() < deadline, "the watcher never looked the model up"
            time.sleep(0.1)  # until the watcher has found that the model does not exist
        trainer = TinyTrainer(seed=59)
        for i in (1, 2):
            trainer.step()
            pushed = cli("push", model, write_version(tmp_path / f"v{i}", trainer.export()), "--server", server.url)
            assert pushed.exit_code == 0, pushed.stderr
        out, err = watcher.communicate(timeout=120)
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.wait()
    assert watcher.returncode == 0, err
    assert [json.loads(line)["number"] for line in out.splitlines()] == [1, 2]
    assert f"no model '{model}' yet" in err
