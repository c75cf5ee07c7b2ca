"""Fixtures of the dashboard's browser tests: Debian's chromium driven by Playwright, axe-core, real servers.

The browser and axe-core come from the project's set-up (``make browser axe``: apt's ``chromium``,
npm's ``axe-core``), never from Playwright's own download. Where either is missing the tests
skip with the reason, and under ``CI=true`` that skip is a failure.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
AXE = HERE / "vendor" / "axe.min.js"
#: Screenshots of every page, kept after the run (CI keeps them as artifacts; docs/ui/ has copies).
ARTIFACTS = Path(os.environ.get("WEIGHTSYNC_UI_ARTIFACTS", ROOT / "build" / "ui-screenshots"))


def unavailable(reason: str) -> None:
    """Skip with ``reason``; under CI=true a missing browser is a failure, not a skip."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true: {reason}")
    pytest.skip(reason)


def chromium_path() -> str | None:
    """The browser: ``WEIGHTSYNC_CHROMIUM`` if set (and there), else Debian's ``chromium`` on PATH."""
    given = os.environ.get("WEIGHTSYNC_CHROMIUM")
    if given:
        return given if Path(given).is_file() else None
    return shutil.which("chromium") or shutil.which("chromium-browser")


# Module scope, not session: Playwright's sync API runs an event loop on this thread while it is
# open, and tests collected after these (anyio ones) need the thread's loop free.
@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Debian's chromium under Playwright (headless)."""
    exe = chromium_path()
    if exe is None:
        unavailable("chromium is not installed: `make browser` installs Debian's package (apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        unavailable("playwright is not installed: pip install -e '.[dev]'")
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=exe, headless=True)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="session")
def axe_source() -> str:
    """axe-core's browser script, vendored from npm by `make axe`."""
    if not AXE.is_file():
        unavailable(f"{AXE.relative_to(ROOT)} is missing: `make axe` fetches axe-core from npm")
    return AXE.read_text(encoding="utf-8")


@pytest.fixture(scope="session")
def artifacts() -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS
