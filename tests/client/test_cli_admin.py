"""The operator commands (issue 12): `model show|set|delete|pin|unpin` and `replicas`, on a real server."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from _ckpt import safetensors_file
from _versions import model_files, next_step
from typer.testing import CliRunner

from weightsync.cli import app
from weightsync.errors import EXIT_ERROR, EXIT_NOT_FOUND, EXIT_USAGE


@pytest.fixture
def cli(server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Run the top-level `weightsync` app in-process against the session server; returns the click Result."""
    for key in ("WEIGHTSYNC_SERVER", "WEIGHTSYNC_TOKEN", "WEIGHTSYNC_CACHE", "WEIGHTSYNC_RETRIES"):
        monkeypatch.delenv(key, raising=False)
    runner = CliRunner()
    env = {"WEIGHTSYNC_SERVER": server.url, "WEIGHTSYNC_CACHE": str(tmp_path / "cache")}

    def run(*args: object, input: str | None = None):
        return runner.invoke(app, [str(a) for a in args], env=env, input=input, catch_exceptions=False)

    return run


@pytest.fixture
def versions(tmp_path: Path):
    """versions(n): n consecutive checkpoint directories (a safetensors file and a config), oldest first."""

    def make(n: int) -> list[Path]:
        tensors = model_files(seed=7)
        out = []
        for i in range(1, n + 1):
            root = tmp_path / f"v{i}"
            root.mkdir()
            (root / "model.safetensors").write_bytes(safetensors_file(tensors, {"step": str(i)}))
            (root / "config.json").write_bytes(b'{"hidden": 96}')
            out.append(root)
            tensors = next_step(tensors, seed=i)
        return out

    return make


def _push(cli, model: str, paths: list[Path]) -> None:
    for p in paths:
        r = cli("push", model, p, "--json")
        assert r.exit_code == 0, r.stderr


def _json(result) -> dict:
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1, result.stdout
    return json.loads(lines[0])


def _error(result, code: int) -> str:
    """The one stderr line of a failed command, which exited with `code`."""
    assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("weightsync: error: "), result.stderr
    return lines[0]


def _human(result) -> str:
    assert result.exit_code == 0, result.stderr
    assert "None" not in result.stdout, result.stdout
    return result.stdout


def test_model_show_and_set(cli, versions, model: str) -> None:
    _push(cli, model, versions(1))
    shown = _json(cli("model", "show", model, "--json"))
    assert shown["name"] == model and shown["head"] == 1 and shown["pinned"] is None
    text = _human(cli("model", "show", model))
    assert "v1" in text and "every version" in text and "no (followers follow the head)" in text

    changed = _json(
        cli("model", "set", model, "--keyframe-interval", 5, "--max-chain-ratio", 0.25, "--keep-last", 3, "--json")
    )
    assert (changed["keyframe_interval"], changed["max_chain_ratio"], changed["keep_last"]) == (5, 0.25, 3)
    assert _json(cli("model", "set", model, "--keep-all", "--json"))["keep_last"] is None
    kept = _json(cli("model", "show", model, "--json"))
    assert (kept["keyframe_interval"], kept["max_chain_ratio"], kept["keep_last"]) == (5, 0.25, None)
    text = _human(cli("model", "set", model, "--keep-last", 2))
    assert "the newest 2" in text and "keyframe interval: 5" in text


def test_model_set_changes_the_chain_policy_of_the_next_push(cli, versions, model: str) -> None:
    paths = versions(3)
    _push(cli, model, paths[:2])
    assert _json(cli("model", "set", model, "--keyframe-interval", 1, "--json"))["keyframe_interval"] == 1
    assert _json(cli("push", model, paths[2], "--json"))["kind"] == "keyframe"


def test_model_set_refuses_bad_values(cli, versions, model: str) -> None:
    _push(cli, model, versions(1))
    assert "nothing to change" in _error(cli("model", "set", model), EXIT_USAGE)
    assert "not both" in _error(cli("model", "set", model, "--keep-last", 2, "--keep-all"), EXIT_USAGE)
    for value in ("0", "-1", "nan", "inf"):
        assert "--max-chain-ratio" in _error(cli("model", "set", model, "--max-chain-ratio", value), EXIT_USAGE)
    assert "--keyframe-interval" in _error(cli("model", "set", model, "--keyframe-interval", 0), EXIT_USAGE)
    assert "--keep-last" in _error(cli("model", "set", model, "--keep-last", "two"), EXIT_USAGE)
    # A value the CLI lets through but the server refuses (keep_last beyond int64): exit 1, nothing changed.
    assert "keep_last" in _error(cli("model", "set", model, "--keep-last", 2**64), EXIT_ERROR)
    assert _json(cli("model", "show", model, "--json"))["keep_last"] is None
    assert "see weightsync model set --help" in _error(cli("model", "set"), EXIT_USAGE)


def test_unknown_models_exit_6(cli) -> None:
    for args in (
        ["model", "show", "no-such-model"],
        ["model", "set", "no-such-model", "--keep-all"],
        ["model", "delete", "no-such-model", "--yes"],
        ["model", "delete", "no-such-model"],  # refused before asking anything
        ["model", "pin", "no-such-model", 1],
        ["model", "unpin", "no-such-model"],
        ["replicas", "no-such-model"],
    ):
        assert "no-such-model" in _error(cli(*args), EXIT_NOT_FOUND)


def test_model_delete_asks_for_the_name(cli, versions, model: str) -> None:
    _push(cli, model, versions(2))
    for answer in (None, "", "something-else\n", f"{model.upper()}\n"):  # no answer (end of input), or a wrong one
        refused = cli("model", "delete", model, input=answer)
        asked, *_, last = refused.stderr.strip().splitlines()
        assert refused.exit_code == EXIT_ERROR and "Traceback" not in refused.stderr
        assert "cannot be undone" in asked and f"Type {model} to confirm" in refused.stderr
        assert last == f"weightsync: error: {model} not deleted: confirm by typing its name, or pass --yes"
    assert _json(cli("model", "show", model, "--json"))["head"] == 2

    r = cli("model", "delete", model, input=f"{model}\n")
    text = _human(r)
    assert f"deleted {model}: 2 versions" in text and "gc" in text and "grace period" in text
    _error(cli("model", "show", model), EXIT_NOT_FOUND)


def test_model_delete_yes_json(cli, versions, model: str) -> None:
    _push(cli, model, versions(3))
    gone = _json(cli("model", "delete", model, "--yes", "--json"))
    assert gone["name"] == model and gone["versions_deleted"] == [1, 2, 3] and gone["publishes_aborted"] == 0
    assert model not in [m["name"] for m in _json(cli("models", "--json"))["models"]]


def test_pin_then_pull_gets_the_pinned_version_and_unpin_the_head(cli, versions, model: str, tmp_path: Path) -> None:
    _push(cli, model, versions(3))
    pinned = _json(cli("model", "pin", model, 2, "--json"))
    assert pinned["pinned"] == 2 and pinned["head"] == 3
    assert "pinned to v2" in _human(cli("model", "pin", model, 2))
    assert "v2 (followers hold it)" in _human(cli("model", "show", model))

    replica = tmp_path / "replica"
    assert _json(cli("pull", model, replica, "--json"))["version"] == 2
    assert (replica / "model.safetensors").read_bytes() == (tmp_path / "v2" / "model.safetensors").read_bytes()
    assert _json(cli("pull", model, tmp_path / "explicit", "--version", 3, "--json"))["version"] == 3

    _error(cli("model", "pin", model, 99), EXIT_NOT_FOUND)
    _error(cli("model", "pin", model, 0), EXIT_USAGE)
    _error(cli("model", "pin", model), EXIT_USAGE)
    assert _json(cli("model", "show", model, "--json"))["pinned"] == 2  # a refused pin changed nothing

    assert "follow the head (v3)" in _human(cli("model", "unpin", model))
    assert _json(cli("model", "unpin", model, "--json"))["pinned"] is None  # idempotent
    pulled = _json(cli("pull", model, replica, "--json"))
    assert pulled["version"] == 3 and pulled["mode"] == "delta"


ADMIN_COMMANDS = [
    ["model"],
    ["model", "show"],
    ["model", "set"],
    ["model", "delete"],
    ["model", "pin"],
    ["model", "unpin"],
    ["replicas"],
    ["cache"],
    ["cache", "show"],
    ["cache", "prune"],
]


@pytest.mark.parametrize("command", ADMIN_COMMANDS, ids=" ".join)
def test_help_reads_right(cli, command: list[str]) -> None:
    """The checks tests/client/test_cli_usage.py makes of the other commands' help."""
    r = cli(*command, "--help")
    assert r.exit_code == 0, r.stderr
    text = r.stdout
    options = [line for line in text.splitlines() if line.strip().startswith("-")]
    assert not [line for line in options if re.search(r"<[a-z ]+>", line)], options
    assert not re.search(r"\s[.,;](\s|$)", text), text
    assert "╭" not in text and "None" not in text
    flag_lines = [line.split() for line in text.splitlines() if line.strip().startswith("--json")]
    assert all(len(words) > 1 and words[1] == "Print" for words in flag_lines), flag_lines


def test_pull_help_says_it_gets_the_pinned_version(cli) -> None:
    text = " ".join(cli("pull", "--help").stdout.split())
    assert "the pinned version when the model is pinned, else the head" in text


def test_replicas_lists_the_ledger(cli, versions, model: str, tmp_path: Path) -> None:
    paths = versions(2)
    _push(cli, model, paths[:1])
    assert _json(cli("replicas", model, "--json")) == {"model": model, "replicas": []}
    assert "no replica has reported" in _human(cli("replicas", model))

    _json(cli("pull", model, tmp_path / "a", "--name", "replica-a", "--json"))
    _push(cli, model, paths[1:])
    _json(cli("pull", model, tmp_path / "a", "--name", "replica-a", "--json"))
    _json(cli("pull", model, tmp_path / "b", "--name", "replica-b", "--version", 1, "--json"))

    latest = _json(cli("replicas", model, "--json"))["replicas"]
    assert sorted((r["subscriber"], r["version"]) for r in latest) == [("replica-a", 2), ("replica-b", 1)]
    assert all(r["bytes"] > 0 and r["applied_at"] for r in latest)
    history = _json(cli("replicas", model, "--all", "--json"))["replicas"]
    assert sorted((r["subscriber"], r["version"]) for r in history) == [
        ("replica-a", 1),
        ("replica-a", 2),
        ("replica-b", 1),
    ]
    text = _human(cli("replicas", model))
    lines = text.strip().splitlines()
    assert lines[0].split() == ["REPLICA", "SITE", "VERSION", "STATUS", "MODE", "ENGINE", "PAUSE", "LAG", "APPLIED"]
    rows = sorted(line.split() for line in lines[1:])
    assert [row[:8] for row in rows] == [  # a pull pauses nothing; lag: the head (v2) minus the version held
        ["replica-a", "-", "v2", "applied", "pull", "-", "-", "0"],
        ["replica-b", "-", "v1", "applied", "pull", "-", "-", "1"],
    ]
    assert all(re.fullmatch(r"\d{4}-\d\d-\d\dT[\d:.]+Z", row[8]) for row in rows)
    assert len(_human(cli("replicas", model, "--all")).strip().splitlines()) == 4


def test_hugging_face_style_names(cli, versions, server, tmp_path: Path) -> None:
    name = "Org-Admin/Model.v1"
    _push(cli, name, versions(2))
    assert _json(cli("model", "show", name, "--json"))["name"] == name
    assert _json(cli("model", "pin", name, 1, "--json"))["pinned"] == 1
    assert _json(cli("pull", name, tmp_path / "hf", "--name", "hf-replica", "--json"))["version"] == 1
    assert [r["subscriber"] for r in _json(cli("replicas", name, "--json"))["replicas"]] == ["hf-replica"]
    assert _json(cli("model", "delete", name, "--yes", "--json"))["versions_deleted"] == [1, 2]
