"""What a user installs: the wheel carries the package and the catalog's migrations, and runs from anywhere.

The slow test does what docs/DEPLOY.md tells a user to do: build the wheel, install it into a
fresh virtual environment (first without the ``server`` extra, then with it) and run
``weightsync serve`` from a directory outside the source tree until ``/readyz`` answers 200.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import httpx
import pytest
from _serve import clean_env, spawn_serve

from weightsync.catalog import migrate
from weightsync.errors import CatalogError

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "weightsync"
MIGRATIONS = ROOT / "migrations"
INSTALL_HINT = "pip install 'weightsync[server]'"


def _source_files(root: Path, patterns: tuple[str, ...]) -> set[str]:
    return {
        p.relative_to(root).as_posix()
        for pattern in patterns
        for p in root.rglob(pattern)
        if "__pycache__" not in p.parts
    }


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of this checkout, built offline from a copy (the build leaves nothing in the tree)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "*.so")  # built here, not in-place
    for name in ("pyproject.toml", "README.md", "setup.py"):  # setup.py: the codec's C extension, if any
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, src / name)
    for name in ("src", "migrations"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    out = tmp / "dist"
    # No build isolation: setuptools comes from this venv (dev extra), so the build needs no network.
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    (built,) = out.glob("weightsync-*.whl")
    return built


def test_the_wheel_carries_every_module_and_every_migration(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    modules = {f"weightsync/{rel}" for rel in _source_files(PACKAGE, ("*.py", "py.typed"))}
    # The dashboard's templates and static files (package-data): without them /ui cannot render.
    dashboard = {f"weightsync/service/{rel}" for rel in _source_files(PACKAGE / "service", ("templates/*", "static/*"))}
    assert {"weightsync/service/templates/model.html", "weightsync/service/static/ui.js"} <= dashboard
    modules |= dashboard
    # Whatever lands in migrations/versions/ ships too: the mapping is by directory, not by file.
    scripts = {f"weightsync/catalog/migrations/{rel}" for rel in _source_files(MIGRATIONS, ("*.py", "*.mako"))}
    assert "weightsync/catalog/migrations/versions/0001_initial.py" in scripts
    assert not (modules | scripts) - names, "missing from the wheel (a new subpackage? list it in pyproject.toml)"
    # Test helpers and benchmarks never ship.
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/", "_serve", "conftest"))]


def test_migrations_are_found_in_the_source_tree_and_by_override(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(migrate.MIGRATIONS_ENV, raising=False)
    assert migrate.migrations_dir() == MIGRATIONS  # editable install: the package has no copy
    copy = tmp_path / "scripts"
    shutil.copytree(MIGRATIONS, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setenv(migrate.MIGRATIONS_ENV, str(copy))
    assert migrate.migrations_dir() == copy
    monkeypatch.setenv(migrate.MIGRATIONS_ENV, str(tmp_path / "nowhere"))
    with pytest.raises(CatalogError, match="catalog migrations not found"):
        migrate.migrations_dir()


def _run_without(modules: list[str], argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run the CLI with ``modules`` unimportable, as in an install that lacks them."""
    blocked = "; ".join(f"sys.modules[{m!r}] = None" for m in modules)  # makes `import m` fail
    code = f"import sys; {blocked}; sys.argv = {['weightsync', *argv]!r}; from weightsync.cli import main; main()"
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=cwd, env=clean_env()
    )


def _assert_one_line_naming_the_extra(result: subprocess.CompletedProcess[str], *, only: bool = True) -> None:
    """Exit 1, one error line that names the extra, no traceback (``only``: and nothing else on stderr)."""
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("weightsync: error:")]
    assert len(errors) == 1 and INSTALL_HINT in errors[0], result.stderr
    assert not only or lines == errors, result.stderr
    assert "Traceback" not in result.stderr + result.stdout


@pytest.mark.parametrize("missing", ["fastapi", "uvicorn", "sqlalchemy", "alembic", "pydantic_settings"])
def test_serve_without_the_server_extra_says_what_to_install(tmp_path: Path, missing: str) -> None:
    result = _run_without([missing], ["serve", "--data", str(tmp_path / "data")], tmp_path)
    _assert_one_line_naming_the_extra(result)
    assert missing in result.stderr
    assert not (tmp_path / "data").exists()  # nothing was started or created


def test_drivers_loaded_on_demand_name_the_extra_too(tmp_path: Path) -> None:
    """psycopg (a postgresql:// catalog) and aioboto3 (an s3:// store) are imported only when used."""
    pg = _run_without(
        ["psycopg", "psycopg2"],
        ["serve", "--catalog", "postgresql://postgres@127.0.0.1:1/x", "--data", str(tmp_path / "a")],
        tmp_path,
    )
    _assert_one_line_naming_the_extra(pg, only=False)  # after the start-up log lines
    s3 = _run_without(
        ["aioboto3"],
        [
            "serve",
            "--store",
            "s3://bucket/prefix",
            "--s3-endpoint",
            "http://127.0.0.1:1",
            "--data",
            str(tmp_path / "b"),
        ],
        tmp_path,
    )
    _assert_one_line_naming_the_extra(s3, only=False)


def _pip(venv: Path, *args: str, env: dict[str, str]) -> None:
    """``pip install ARGS`` into ``venv`` with this venv's pip (the new one has none: faster to make).

    No byte-compiling: the server's dependencies hold thousands of modules this test never imports.
    """
    result = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q", "--no-compile", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


@pytest.mark.slow
def test_the_wheel_installs_and_serves_from_outside_the_source_tree(wheel: Path, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    assert ROOT not in outside.parents
    env = clean_env()
    for key in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"):  # nothing may lead back to this checkout
        env.pop(key, None)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300, env=env)
    exe = venv / "bin" / "weightsync"

    # The bare install: the SDK and the client commands, no server.
    _pip(venv, str(wheel), env=env)
    bare = subprocess.run(
        [str(exe), "serve", "--data", str(outside / "data")],
        capture_output=True,
        text=True,
        cwd=outside,
        env=env,
        timeout=120,
    )
    _assert_one_line_naming_the_extra(bare)

    # With the server extra: the migrations come from the installed package, not from this tree.
    _pip(venv, f"{wheel}[server]", env=env)
    where = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import weightsync; from weightsync.catalog.migrate import migrations_dir;"
            " print(weightsync.__file__); print(migrations_dir())",
        ],
        capture_output=True,
        text=True,
        cwd=outside,
        env=env,
        timeout=120,
        check=True,
    )
    package_file, scripts = (Path(line) for line in where.stdout.splitlines())
    assert venv in package_file.parents and venv in scripts.parents, where.stdout

    server = spawn_serve(
        ["--data", str(outside / "data"), "--log-level", "warning"],
        log_path=tmp_path / "serve.log",
        command=[str(exe)],
        cwd=outside,
        env=env,
        timeout=120,
        ready_path="/readyz",
    )
    # The dashboard renders from the installed package: templates and static files came along.
    page = httpx.get(server.url + "/ui/", timeout=30)
    assert page.status_code == 200 and "<h1>Models</h1>" in page.text, page.text[:500]
    for name in ("ui.css", "ui.js"):
        assert httpx.get(f"{server.url}/ui/static/{name}", timeout=30).status_code == 200
    code = server.stop()
    # uvicorn re-raises the SIGTERM it handled once it has shut down cleanly: -15 is a clean exit.
    assert code in (0, -signal.SIGTERM), server.log()[-3000:]
    assert "Traceback" not in server.log()
    assert (outside / "data" / "catalog.db").is_file()
    assert os.listdir(outside) == ["data"]
