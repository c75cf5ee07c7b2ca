"""The `weightsync` command line. Each command parses input, calls one function, renders the result.

Usage errors are one line (weightsync/cliapp.py); ``weightsync --version`` prints the version.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Annotated

import typer

from weightsync.cliapp import new_app
from weightsync.client.cli import register as register_client
from weightsync.common import VERSION, human_bytes
from weightsync.errors import WeightsyncError, exit_code_of
from weightsync.relay.cli import register as register_relay
from weightsync.service.cli import register as register_service

app = new_app("weightsync")


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"weightsync {VERSION}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", is_eager=True, callback=_print_version, help="Print the version and exit.")
    ] = False,
) -> None:
    """Store and replicate model weights as exact compressed deltas."""


# Both modules import their heavy dependencies inside the commands, so the client-only
# install (no server extra, no torch) can run every client command.
register_service(app)
register_relay(app)
register_client(app)


def fail(message: str, code: int = 1) -> None:
    """Print a one-line error to stderr and exit with ``code`` (no traceback); README "Exit codes"."""
    typer.echo(f"weightsync: error: {message}", err=True)
    raise typer.Exit(code)


@app.command()
def diff(
    base: Annotated[Path, typer.Argument(metavar="BASE", help="Base version: a safetensors file or a directory.")],
    new: Annotated[Path, typer.Argument(metavar="NEW", help="New version, of the same shape (file or directory).")],
    output: Annotated[Path, typer.Option("-o", "--output", metavar="DELTA", help="Delta file to write.")],
    threads: Annotated[int, typer.Option(metavar="N", help="Encoder threads (0 = all cores).")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Write the delta that turns BASE into NEW (like bsdiff, for checkpoints)."""
    from weightsync.codec import Encoder
    from weightsync.codec import diff as run_diff

    try:
        stats = run_diff(base, new, output, encoder=Encoder(threads=threads or None))
    except (WeightsyncError, OSError, ValueError) as exc:
        fail(_describe(exc), exit_code_of(exc))
    ratio = stats.raw_bytes / max(stats.delta_bytes, 1)
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "raw_bytes": stats.raw_bytes,
                    "bytes": stats.delta_bytes,
                    "ratio": ratio,
                    "frames": stats.frames,
                    "delta_frames": stats.delta_frames,
                }
            )
        )
    else:
        typer.echo(f"{output}: {human_bytes(stats.delta_bytes)} for {human_bytes(stats.raw_bytes)} ({ratio:.1f}x)")


@app.command()
def patch(
    base: Annotated[Path, typer.Argument(metavar="BASE", help="The base the delta was made against.")],
    delta: Annotated[Path, typer.Argument(metavar="DELTA", help="Delta file written by `weightsync diff`.")],
    output: Annotated[Path, typer.Option("-o", "--output", metavar="OUT", help="Where to write the result.")],
    threads: Annotated[int, typer.Option(metavar="N", help="Decoder threads (0 = all cores).")] = 0,
) -> None:
    """Apply DELTA to BASE; OUT is byte-identical to the diffed NEW, or nothing is written."""
    from weightsync.codec import Decoder
    from weightsync.codec import patch as run_patch

    try:
        run_patch(base, delta, output, decoder=Decoder(threads=threads or None))
    except (WeightsyncError, OSError, ValueError) as exc:
        fail(_describe(exc), exit_code_of(exc))


bench_app = typer.Typer(
    help="Benchmarks against baselines (needs a source checkout: benchmarks/).", no_args_is_help=True
)
app.add_typer(bench_app, name="bench")
_PASSTHROUGH = {"allow_extra_args": True, "ignore_unknown_options": True, "help_option_names": []}


def _benchmarks(module: str) -> ModuleType:
    """Import benchmarks.<module> from the checkout this package is installed from (editable install)."""
    import importlib

    root = Path(__file__).resolve().parents[2]
    if not (root / "benchmarks" / "__init__.py").exists():
        fail("benchmarks need a source checkout of weightsync (pip install -e .)")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return importlib.import_module(f"benchmarks.{module}")


@bench_app.command("codec", context_settings=_PASSTHROUGH)
def bench_codec(ctx: typer.Context) -> None:
    """Compression ratio and throughput vs XOR+zstd-1 and the entropy bound (--help for options)."""
    raise typer.Exit(_benchmarks("codec_bench").main(list(ctx.args)))


@bench_app.command("sync", context_settings=_PASSTHROUGH)
def bench_sync(ctx: typer.Context) -> None:
    """Publish → all subscribers applied, deltas vs full snapshots over capped links (--help for options)."""
    raise typer.Exit(_benchmarks("sync_bench").main(list(ctx.args)))


@bench_app.command("e2e", context_settings=_PASSTHROUGH)
def bench_e2e(ctx: typer.Context) -> None:
    """One version end to end in one process, delta vs keyframe, with its split and commit latency."""
    raise typer.Exit(_benchmarks("e2e_bench").main(list(ctx.args)))


@bench_app.command("scale", context_settings=_PASSTHROUGH)
def bench_scale(ctx: typer.Context) -> None:
    """weightsync vs a full reload from disk vs XOR + zstd-1, on a corpus case or a generated model."""
    raise typer.Exit(_benchmarks("scale_bench").main(list(ctx.args)))


def _describe(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.filename}: {exc.strerror}" if exc.filename else exc.strerror
    return f"{type(exc).__name__}: {exc}" if isinstance(exc, WeightsyncError) else str(exc)


def main() -> None:
    """Console-script entry point."""
    try:
        app()
    except KeyboardInterrupt:  # before a command runs (imports); commands report it themselves
        typer.echo("weightsync: error: interrupted", err=True)
        sys.exit(130)
