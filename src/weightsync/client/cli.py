"""Client commands of the `weightsync` CLI: push, pull, watch, log, models, fsck, gc.

``register(app)`` adds them to the main typer app. Each command parses its
input, calls one SDK function and renders the result: a line of text (with a
rich progress bar for transfers when stderr is a terminal), or with ``--json``
exactly one JSON object on stdout (push and pull include ``version`` and
``bytes``: object and manifest bytes moved over the network by this call).

The server comes from ``--server`` or ``WEIGHTSYNC_SERVER`` (default
http://127.0.0.1:8400), the token from ``WEIGHTSYNC_TOKEN``; transient
failures are retried ``WEIGHTSYNC_RETRIES`` times in all (default 6). ``push`` keeps
the last pushed version under ``--cache-dir`` (default ``WEIGHTSYNC_CACHE``,
else ``~/.cache/weightsync``) so consecutive pushes send deltas.

Errors are one line, ``weightsync: error: …``, on stderr, never a traceback.
Exit codes (each error class's ``exit_code`` in :mod:`weightsync.errors`):

    0  success
    1  any other error (bad input file, corrupt data, fsck found problems, …)
    2  usage error (bad arguments)
    3  conflict: stale parent, another publish won, base mismatch, incomplete publish, directory in use
    4  authentication or authorization failed (HTTP 401/403)
    5  server unavailable (unreachable, or 5xx after retries)
    6  not found: unknown model or version
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer

from weightsync import errors
from weightsync.client._http import DEFAULT_SERVER, Api
from weightsync.client.models import Version, timestamp
from weightsync.client.wire import Retry
from weightsync.common import human_bytes
from weightsync.errors import EXIT_AUTH, EXIT_CONFLICT, EXIT_ERROR, EXIT_NOT_FOUND, EXIT_UNAVAILABLE, EXIT_USAGE

__all__ = ["EXIT_AUTH", "EXIT_CONFLICT", "EXIT_ERROR", "EXIT_NOT_FOUND", "EXIT_UNAVAILABLE", "EXIT_USAGE", "register"]

ServerOpt = Annotated[str, typer.Option("--server", envvar="WEIGHTSYNC_SERVER", show_envvar=True, help="Server URL.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]
RateOpt = Annotated[
    str | None, typer.Option("--limit-rate", metavar="RATE", help="Bandwidth cap in bytes/s (suffixes K, M, G).")
]
ConcurrencyOpt = Annotated[int, typer.Option("--concurrency", min=1, max=256, help="Parallel transfers.")]


def _token() -> str | None:
    return os.environ.get("WEIGHTSYNC_TOKEN") or None


def _retry() -> Retry:
    """The retry policy: WEIGHTSYNC_RETRIES attempts in all (default 6) for transient failures."""
    text = os.environ.get("WEIGHTSYNC_RETRIES", "").strip()
    return Retry(attempts=max(1, int(text))) if text.isdigit() else Retry()


def _exit_code(exc: BaseException) -> int:
    """The exit status for ``exc``: its error class's ``exit_code`` (weightsync.errors), 1 for other exceptions."""
    return errors.exit_code_of(exc)


def _describe(exc: BaseException) -> str:
    """``exc`` as the one line after ``weightsync: error:``."""
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.filename}: {exc.strerror}" if exc.filename else exc.strerror
    text = str(exc) or type(exc).__name__
    return " ".join(text.split())  # one line


@contextmanager
def _errors() -> Iterator[None]:
    """Turn every expected failure into one stderr line and an exit code."""
    try:
        yield
    except typer.Exit:
        raise
    except (errors.WeightsyncError, OSError, ValueError, TypeError) as exc:
        typer.echo(f"weightsync: error: {_describe(exc)}", err=True)
        raise typer.Exit(_exit_code(exc)) from None
    except KeyboardInterrupt:
        typer.echo("weightsync: error: interrupted", err=True)
        raise typer.Exit(130) from None


def _rate(text: str | None) -> float | None:
    if not text:
        return None
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("/s").removesuffix("b").removesuffix("i")
    mult = units.get(t[-1:], 1)
    try:
        value = float(t[:-1] if t[-1:] in units else t) * mult
    except ValueError:
        raise typer.BadParameter(f"not a rate: {text!r}") from None
    if value <= 0:
        raise typer.BadParameter("the rate must be positive")
    return value


@contextmanager
def _progress(label: str, enabled: bool) -> Iterator[Callable[[int, int], None] | None]:
    """A rich transfer bar (bytes, rate, ETA) on a terminal; nothing on pipes or with --json."""
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
    )
    task = bar.add_task(label, total=None)

    def update(done: int, total: int) -> None:
        bar.update(task, completed=done, total=total or None)

    with bar:
        yield update


def _emit(obj: dict[str, Any]) -> None:
    typer.echo(json.dumps(obj, sort_keys=True, default=str))


def _cache_root() -> Path:
    env = os.environ.get("WEIGHTSYNC_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "weightsync"


def _server_slug(server: str) -> str:
    return "".join(c if c.isalnum() or c in "-." else "_" for c in server.split("://", 1)[-1]).strip("_")


def register(app: typer.Typer) -> None:
    """Add the client commands to `app`."""

    @app.command()
    def push(
        model: Annotated[str, typer.Argument(help="Model name.")],
        path: Annotated[Path, typer.Argument(help="A safetensors file or a directory (sharded checkpoint).")],
        server: ServerOpt = DEFAULT_SERVER,
        keyframe: Annotated[bool, typer.Option("--keyframe", help="Store this version whole.")] = False,
        allow_removals: Annotated[
            bool,
            typer.Option("--allow-removals", help="Publish even if files or tensors of the previous version are gone."),
        ] = False,
        step: Annotated[int | None, typer.Option("--step", min=0, help="Training step.")] = None,
        metadata: Annotated[str | None, typer.Option("--metadata", help="Metadata as a JSON object.")] = None,
        cache_dir: Annotated[
            Path | None,
            typer.Option(
                "--cache-dir",
                help="Where the last pushed version is kept to diff against "
                "[default: $WEIGHTSYNC_CACHE or ~/.cache/weightsync].",
            ),
        ] = None,
        no_cache: Annotated[
            bool, typer.Option("--no-cache", help="Keep no copy of the pushed version (the next push is a keyframe).")
        ] = False,
        concurrency: ConcurrencyOpt = 8,
        limit_rate: RateOpt = None,
        as_json: JsonOpt = False,
    ) -> None:
        """Publish PATH as the next version of MODEL (a delta against the last push when possible)."""
        from weightsync.client.publisher import Publisher

        meta = None
        if metadata:
            try:
                meta = json.loads(metadata)
            except ValueError:
                raise typer.BadParameter("--metadata must be a JSON object") from None
            if not isinstance(meta, dict):
                raise typer.BadParameter("--metadata must be a JSON object")
        rate = _rate(limit_rate)
        with _errors():
            if not path.exists():
                raise FileNotFoundError(2, "No such file or directory", str(path))
            cache = None if no_cache else (cache_dir or _cache_root() / "publish" / _server_slug(server))
            with (
                _progress(f"push {model}", not as_json) as progress,
                Publisher(
                    server,
                    model,
                    token=_token(),
                    retry=_retry(),
                    cache_dir=cache,
                    concurrency=concurrency,
                    bandwidth=rate,
                    progress=progress,
                ) as pub,
            ):
                result = pub.publish(path, step=step, metadata=meta, keyframe=keyframe, allow_removals=allow_removals)
        if as_json:
            _emit(result.to_dict())
        else:
            typer.echo(
                f"{model} v{result.version} ({result.kind}): sent {human_bytes(result.bytes_sent)} for "
                f"{human_bytes(result.raw_bytes)} in {result.seconds:.1f}s "
                f"({result.objects_uploaded}/{result.objects_total} objects uploaded)"
            )

    @app.command()
    def pull(
        model: Annotated[str, typer.Argument(help="Model name.")],
        dir: Annotated[Path, typer.Argument(help="Directory to bring to the version (created if missing).")],
        server: ServerOpt = DEFAULT_SERVER,
        version: Annotated[int | None, typer.Option("--version", min=1, help="Version [default: latest].")] = None,
        name: Annotated[
            str | None, typer.Option("--name", help="Subscriber name in the replica ledger [default: host name].")
        ] = None,
        cache_dir: Annotated[
            Path | None, typer.Option("--cache-dir", help="Shared object cache [default: DIR/.weightsync/objects].")
        ] = None,
        concurrency: ConcurrencyOpt = 8,
        limit_rate: RateOpt = None,
        as_json: JsonOpt = False,
    ) -> None:
        """Bring DIR to a version of MODEL byte for byte, incrementally from what it holds."""
        from weightsync.client.subscriber import Subscriber

        rate = _rate(limit_rate)
        with (
            _errors(),
            _progress(f"pull {model}", not as_json) as progress,
            Subscriber(
                server,
                model,
                token=_token(),
                retry=_retry(),
                name=name,
                cache_dir=cache_dir,
                concurrency=concurrency,
                bandwidth=rate,
                progress=progress,
            ) as sub,
        ):
            result = sub.pull(dir, version)
        if as_json:
            _emit(result.to_dict())
        elif result.mode == "current":
            typer.echo(f"{dir}: already at {model} v{result.version}")
        else:
            extra = " (directory had changed: rebuilt)" if result.repaired else ""
            typer.echo(
                f"{dir}: {model} v{result.version} ({result.mode}, {result.steps} step"
                f"{'s' if result.steps != 1 else ''}): received {human_bytes(result.bytes_received)} in "
                f"{result.seconds:.1f}s{extra}"
            )

    @app.command()
    def watch(
        model: Annotated[str, typer.Argument(help="Model name.")],
        server: ServerOpt = DEFAULT_SERVER,
        after: Annotated[
            int | None, typer.Option("--after", min=0, help="Report versions after this one [default: head].")
        ] = None,
        pull_dir: Annotated[
            Path | None, typer.Option("--pull", help="Pull each new version into this directory.")
        ] = None,
        count: Annotated[int | None, typer.Option("--count", min=1, help="Stop after N versions.")] = None,
        as_json: Annotated[bool, typer.Option("--json", help="One JSON object per line per version.")] = False,
    ) -> None:
        """Print each new version of MODEL as it commits (and optionally pull it)."""
        from weightsync.client.subscriber import Subscriber

        with _errors(), Subscriber(server, model, token=_token(), retry=_retry()) as sub:
            sub.api.get_model(model)  # an unknown model is an error here, not an endless wait
            for seen, v in enumerate(sub.watch(after), start=1):
                out = v.to_dict()
                line = f"{model} v{v.number} ({v.kind}) step={v.step} {human_bytes(v.stored_bytes)} stored"
                if pull_dir is not None:
                    pulled = sub.pull(pull_dir, v.number)
                    out["pull"] = pulled.to_dict()
                    line += f"; pulled into {pull_dir} ({human_bytes(pulled.bytes_received)} received)"
                if as_json:
                    _emit(out)
                else:
                    typer.echo(line)
                sys.stdout.flush()
                if count is not None and seen >= count:
                    return

    @app.command("log")
    def log_(
        model: Annotated[str, typer.Argument(help="Model name.")],
        server: ServerOpt = DEFAULT_SERVER,
        limit: Annotated[int | None, typer.Option("--limit", min=1, help="Show the last N versions.")] = None,
        as_json: JsonOpt = False,
    ) -> None:
        """List the committed versions of MODEL, oldest first."""
        with _errors(), Api(server, _token(), retry=_retry()) as api:
            versions = _all_versions(api, model, limit)
        if as_json:
            _emit({"model": model, "versions": [v.to_dict() for v in versions]})
            return
        for v in versions:
            typer.echo(
                f"v{v.number:<6} {v.kind:<8} parent={v.parent!s:<6} step={v.step!s:<8} "
                f"raw={human_bytes(v.raw_bytes):>10} stored={human_bytes(v.stored_bytes):>10} "
                f"{timestamp(v.committed_at)}"
            )

    @app.command()
    def models(server: ServerOpt = DEFAULT_SERVER, as_json: JsonOpt = False) -> None:
        """List the models on the server."""
        with _errors(), Api(server, _token(), retry=_retry()) as api:
            found = api.list_models()
        if as_json:
            _emit({"models": [m.to_dict() for m in found]})
            return
        for m in found:
            typer.echo(f"{m.name:<32} head={m.head}")

    @app.command()
    def fsck(
        server: ServerOpt = DEFAULT_SERVER,
        read_data: Annotated[bool, typer.Option("--read-data", help="Read and hash every object.")] = False,
        repair: Annotated[bool, typer.Option("--repair", help="Fix what is safe to fix.")] = False,
        as_json: JsonOpt = False,
    ) -> None:
        """Check that catalog and store agree (admin). Exit 1 when problems remain."""
        with _errors(), Api(server, _token(), timeout=3600, retry=_retry()) as api:
            report = api.fsck(read_data=read_data, repair=repair)
        if as_json:
            _emit(report.to_dict())
        else:
            for p in report.problems:
                typer.echo(f"{'repaired' if p.repaired else 'problem'}: {p.code}: {p.detail}")
            typer.echo(
                f"{'ok' if report.ok else 'NOT OK'}: {report.versions_checked} versions, "
                f"{report.objects_checked} objects checked"
            )
        if not report.ok:
            raise typer.Exit(EXIT_ERROR)

    @app.command()
    def gc(
        server: ServerOpt = DEFAULT_SERVER,
        dry_run: Annotated[bool, typer.Option("--dry-run", help="Report what would be deleted.")] = False,
        grace: Annotated[
            float | None, typer.Option("--grace", min=0, help="Grace period in seconds [default: the server's].")
        ] = None,
        as_json: JsonOpt = False,
    ) -> None:
        """Apply retention and delete unreferenced objects (admin)."""
        with _errors(), Api(server, _token(), timeout=3600, retry=_retry()) as api:
            report = api.gc(dry_run=dry_run, grace_s=grace)
        if as_json:
            _emit(report.to_dict())
        else:
            prefix = "would delete" if dry_run else "deleted"
            purged = f"; {report.leases_purged} expired leases purged" if report.leases_purged else ""
            typer.echo(
                f"{prefix} {report.objects_deleted} objects ({human_bytes(report.bytes_deleted)}); "
                f"{report.objects_kept_in_grace} kept in grace; versions: {report.versions_deleted}{purged}"
            )


def _all_versions(api: Api, model: str, limit: int | None) -> list[Version]:
    """The committed versions of `model`, oldest first: the last `limit`, else all (in pages of 500)."""
    if limit is not None:
        head = api.head(model)
        if head is None:
            api.get_model(model)  # raises ModelNotFound for an unknown model
            return []
        return api.list_versions(model, after=max(0, head.number - limit))
    out: list[Version] = []
    after = 0
    api.get_model(model)
    while True:
        page = api.list_versions(model, after=after, limit=500)
        out.extend(page)
        if len(page) < 500:
            return out
        after = page[-1].number


def main() -> None:  # pragma: no cover - the lead wires register() into weightsync.cli
    app = typer.Typer(add_completion=False, no_args_is_help=True)
    register(app)
    app()
