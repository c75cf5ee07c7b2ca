"""What every client command of the CLI shares: option types, one-line errors, rates, progress, rendering.

Sizes for people are in binary units (KiB, MiB, GiB: :func:`weightsync.common.human_bytes`)
everywhere: summaries, the progress bar and ``--limit-rate``.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Annotated, Any

import typer

from weightsync import errors
from weightsync.client._http import check_server_url
from weightsync.client.wire import Retry
from weightsync.common import human_bytes

EXIT_INTERRUPTED = 130
"""The exit status after Ctrl-C (128 + SIGINT, as shells report it)."""


def server_url(value: str) -> str:
    """--server's check: a root URL, else a usage error with what to write instead."""
    try:
        return check_server_url(value)
    except errors.InvalidArgument as exc:
        raise typer.BadParameter(str(exc)) from None


ServerOpt = Annotated[
    str,
    typer.Option(
        "--server",
        envvar="WEIGHTSYNC_SERVER",
        show_envvar=True,
        metavar="URL",
        callback=server_url,
        help="The server's root URL.",
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]
RateOpt = Annotated[
    str | None,
    typer.Option("--limit-rate", metavar="RATE", help="Bandwidth cap in bytes/s; K, M, G mean KiB, MiB, GiB."),
]
ConcurrencyOpt = Annotated[int, typer.Option("--concurrency", metavar="N", min=1, max=256, help="Parallel transfers.")]
ModelArg = Annotated[str, typer.Argument(metavar="MODEL", help="Model name.", show_default=False)]


def token() -> str | None:
    """The token from WEIGHTSYNC_TOKEN (None: anonymous)."""
    return os.environ.get("WEIGHTSYNC_TOKEN") or None


def retry_policy() -> Retry:
    """The retry policy: WEIGHTSYNC_RETRIES attempts in all (default 6) for transient failures."""
    text = os.environ.get("WEIGHTSYNC_RETRIES", "").strip()
    return Retry(attempts=max(1, int(text))) if text.isdigit() else Retry()


def describe(exc: BaseException) -> str:
    """``exc`` as the one line after ``weightsync: error:``."""
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.filename}: {exc.strerror}" if exc.filename else exc.strerror
    text = str(exc) or type(exc).__name__
    return " ".join(text.split())  # one line


@contextmanager
def one_line_errors() -> Iterator[None]:
    """Turn every expected failure, and Ctrl-C, into one stderr line and an exit code."""
    try:
        yield
    except typer.Exit:
        raise
    except (errors.WeightsyncError, OSError, ValueError, TypeError) as exc:
        typer.echo(f"weightsync: error: {describe(exc)}", err=True)
        raise typer.Exit(errors.exit_code_of(exc)) from None
    except KeyboardInterrupt:
        typer.echo("weightsync: error: interrupted", err=True)
        raise typer.Exit(EXIT_INTERRUPTED) from None


def rate(text: str | None) -> float | None:
    """--limit-rate in bytes/s: a number with an optional K, M or G (binary: KiB, MiB, GiB)."""
    if not text:
        return None
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("/s").removesuffix("b").removesuffix("i")
    mult = units.get(t[-1:], 1)
    try:
        value = float(t[:-1] if t[-1:] in units else t) * mult
    except ValueError:
        raise typer.BadParameter(f"not a rate: {text!r}", param_hint="'--limit-rate'") from None
    if value <= 0:
        raise typer.BadParameter("the rate must be positive", param_hint="'--limit-rate'")
    return value


@contextmanager
def progress_bar(label: str, enabled: bool) -> Iterator[Callable[[int, int], None] | None]:
    """A transfer bar (bytes, rate, ETA in binary units) on a terminal; nothing on pipes or with --json."""
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, ProgressColumn, Task, TextColumn, TimeRemainingColumn
    from rich.text import Text

    class Speed(ProgressColumn):
        """The transfer rate in the units of every other size the CLI prints."""

        def render(self, task: Task) -> Text:
            speed = task.finished_speed or task.speed
            return Text("" if speed is None else f"{human_bytes(speed)}/s", style="progress.data.speed")

    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        Speed(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
    )
    task = bar.add_task(label, total=None)

    def update(done: int, total: int) -> None:
        bar.update(task, completed=done, total=total or None)

    with bar:
        yield update


def emit(obj: dict[str, Any]) -> None:
    """Print `obj` as the one JSON line of --json (sorted keys, the API's own values)."""
    typer.echo(json.dumps(obj, sort_keys=True, default=str))


def shown(value: object) -> str:
    """A field for people: ``-`` for a missing value, never ``None``."""
    return "-" if value is None else str(value)


def metadata_arg(text: str | None) -> dict[str, Any] | None:
    """--metadata as a dict, else a usage error."""
    if not text:
        return None
    try:
        meta = json.loads(text)
    except ValueError:
        meta = None
    if not isinstance(meta, dict):
        raise typer.BadParameter("must be a JSON object", param_hint="'--metadata'")
    return meta
