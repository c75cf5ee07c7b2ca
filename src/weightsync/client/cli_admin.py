"""Operator commands of the `weightsync` CLI: a model's settings, deletion and pin; the replica ledger; the cache.

``register(app)`` adds ``model show|set|delete|pin|unpin``, ``replicas``, ``relays`` and
``cache [show]|prune``. They follow client/cli.py's conventions: the server from
``--server``/``WEIGHTSYNC_SERVER``, the token from ``WEIGHTSYNC_TOKEN``, ``--json``
prints the server's JSON (one object), errors are one line with the exit codes
of :mod:`weightsync.errors` (6 for an unknown model or version, 2 for bad
arguments), human output never says ``None``, and an empty listing says so.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Annotated

import typer

from weightsync import errors
from weightsync.client import cache as base_cache
from weightsync.client import cli_common as kit
from weightsync.client._http import DEFAULT_SERVER, Api
from weightsync.client.models import Model, Replica, timestamp
from weightsync.common import human_bytes

CacheDirOpt = Annotated[
    Path | None,
    typer.Option(
        "--cache-dir",
        metavar="DIR",
        help="The cache root [default: $WEIGHTSYNC_CACHE, else ~/.cache/weightsync].",
    ),
]


def register(app: typer.Typer) -> None:
    """Add `model …`, `replicas` and `cache …` to `app`."""
    model_app = typer.Typer(
        help="Show or change a model: settings, deletion, the version the fleet holds.", no_args_is_help=True
    )
    _model_commands(model_app)
    app.add_typer(model_app, name="model")
    app.command()(replicas)
    app.command()(relays)
    cache_app = typer.Typer(invoke_without_command=True)  # help: the callback's docstring
    _cache_commands(cache_app)
    app.add_typer(cache_app, name="cache")


def _api(server: str) -> Api:
    return Api(server, kit.token(), retry=kit.retry_policy())


def _model_commands(group: typer.Typer) -> None:
    @group.command("show")
    def show(model: kit.ModelArg, server: kit.ServerOpt = DEFAULT_SERVER, as_json: kit.JsonOpt = False) -> None:
        """Show MODEL's head, pin and chain and retention settings."""
        with kit.one_line_errors(), _api(server) as api:
            found = api.get_model(model)
        _render(found, as_json)

    @group.command("set")
    def set_(
        model: kit.ModelArg,
        keyframe_interval: Annotated[
            int | None,
            typer.Option("--keyframe-interval", metavar="N", min=1, help="A keyframe at least every N versions."),
        ] = None,
        max_chain_ratio: Annotated[
            float | None,
            typer.Option(
                "--max-chain-ratio",
                metavar="X",
                help="A keyframe once the deltas since the last one store more than X times its size (X > 0).",
            ),
        ] = None,
        keep_last: Annotated[
            int | None,
            typer.Option("--keep-last", metavar="N", min=1, help="gc deletes all but the newest N versions."),
        ] = None,
        keep_all: Annotated[bool, typer.Option("--keep-all", help="gc keeps every version.")] = False,
        server: kit.ServerOpt = DEFAULT_SERVER,
        as_json: kit.JsonOpt = False,
    ) -> None:
        """Change MODEL's settings; those not given stay. The chain policy applies from the next push."""
        settings = _settings(keyframe_interval, max_chain_ratio, keep_last, keep_all)
        with kit.one_line_errors(), _api(server) as api:
            found = api.update_model(model, **settings)
        _render(found, as_json)

    @group.command("delete")
    def delete(
        model: kit.ModelArg,
        yes: Annotated[bool, typer.Option("--yes", help="Do not ask for confirmation.")] = False,
        server: kit.ServerOpt = DEFAULT_SERVER,
        as_json: kit.JsonOpt = False,
    ) -> None:
        """Delete MODEL and every version of it (admin; cannot be undone). Asks to type the name unless --yes.

        The objects are reclaimed by `weightsync gc` once its grace period has passed; the name
        can be used again, and its version numbers continue after the deleted ones.
        """
        with kit.one_line_errors(), _api(server) as api:
            found = api.get_model(model)
            if not yes:
                _confirm(found)
            gone = api.delete_model(model)
        if as_json:
            kit.emit(gone.to_dict())
            return
        count = len(gone.versions_deleted)
        typer.echo(
            f"deleted {gone.name}: {count} version{'s' if count != 1 else ''}, "
            f"{gone.publishes_aborted} pending publish{'es' if gone.publishes_aborted != 1 else ''} aborted; "
            "gc reclaims their objects after its grace period"
        )

    @group.command("pin")
    def pin(
        model: kit.ModelArg,
        version: Annotated[int, typer.Argument(metavar="N", min=1, help="A committed version.", show_default=False)],
        server: kit.ServerOpt = DEFAULT_SERVER,
        as_json: kit.JsonOpt = False,
    ) -> None:
        """Make followers (watch, follow, pull without --version) hold version N while the head moves on."""
        with kit.one_line_errors(), _api(server) as api:
            found = api.pin(model, version)
        if as_json:
            kit.emit(found.to_dict())
        else:
            typer.echo(f"{model} pinned to v{version}: followers hold it while the head ({_v(found.head)}) moves on")

    @group.command("unpin")
    def unpin(model: kit.ModelArg, server: kit.ServerOpt = DEFAULT_SERVER, as_json: kit.JsonOpt = False) -> None:
        """Make followers follow MODEL's head again."""
        with kit.one_line_errors(), _api(server) as api:
            found = api.unpin(model)
        if as_json:
            kit.emit(found.to_dict())
        else:
            typer.echo(f"{model} unpinned: followers follow the head ({_v(found.head)})")


def _settings(
    keyframe_interval: int | None, max_chain_ratio: float | None, keep_last: int | None, keep_all: bool
) -> dict[str, int | float | None]:
    """The settings `model set` changes (keep_last None: keep all); a usage error when none or a bad one."""
    if keep_all and keep_last is not None:
        raise typer.BadParameter("give --keep-last N or --keep-all, not both", param_hint="'--keep-all'")
    if max_chain_ratio is not None and not (math.isfinite(max_chain_ratio) and max_chain_ratio > 0):
        raise typer.BadParameter(f"must be a number > 0, not {max_chain_ratio}", param_hint="'--max-chain-ratio'")
    settings: dict[str, int | float | None] = {}
    if keyframe_interval is not None:
        settings["keyframe_interval"] = keyframe_interval
    if max_chain_ratio is not None:
        settings["max_chain_ratio"] = max_chain_ratio
    if keep_last is not None or keep_all:
        settings["keep_last"] = keep_last
    if not settings:
        raise typer.BadParameter(
            "nothing to change: give --keyframe-interval, --max-chain-ratio, --keep-last or --keep-all",
            param_hint="MODEL",
        )
    return settings


def _confirm(model: Model) -> None:
    """Ask for the model's name on the terminal (stderr); InvalidArgument (exit 1) unless it is typed."""
    count = "no versions" if model.head is None else f"versions up to v{model.head}"
    typer.echo(f"This deletes {model.name} ({count}) for every reader; it cannot be undone.", err=True)
    try:
        answer = typer.prompt(f"Type {model.name} to confirm", default="", show_default=False, err=True)
    except typer.Abort:  # end of input: no terminal to ask
        answer = ""
    if not sys.stdin.isatty():  # nothing echoed the answer's newline
        typer.echo("", err=True)
    if answer.strip() != model.name:
        raise errors.InvalidArgument(f"{model.name} not deleted: confirm by typing its name, or pass --yes")


def _render(model: Model, as_json: bool) -> None:
    """A model as `model show` prints it."""
    if as_json:
        kit.emit(model.to_dict())
        return
    pinned = "no (followers follow the head)" if model.pinned is None else f"v{model.pinned} (followers hold it)"
    keep = "every version" if model.keep_last is None else f"the newest {model.keep_last}"
    for label, value in (
        ("model", model.name),
        ("head", _v(model.head)),
        ("pinned", pinned),
        ("keyframe interval", str(model.keyframe_interval)),
        ("max chain ratio", f"{model.max_chain_ratio:g}"),
        ("keep", keep),
        ("created", timestamp(model.created_at)),
    ):
        typer.echo(f"{label + ':':<19}{value}")


def _v(number: int | None) -> str:
    return "no versions yet" if number is None else f"v{number}"


def replicas(
    model: kit.ModelArg,
    all_: Annotated[bool, typer.Option("--all", help="Every report, not only each subscriber's newest.")] = False,
    server: kit.ServerOpt = DEFAULT_SERVER,
    as_json: kit.JsonOpt = False,
) -> None:
    """List the replica ledger of MODEL: each replica's site, version held, status, mode, engine, last pause,
    lag behind the head and when it got there.

    Status is serving (an engine serves the version, verified), applied (a subscriber wrote it) or
    unhealthy (the engine holds no verified version). Lag is the head minus the version held.
    """
    with kit.one_line_errors(), _api(server) as api:
        found = api.list_replicas(model, all=all_)
    if as_json:
        kit.emit({"model": model, "replicas": [r.to_dict() for r in found]})
        return
    if not found:
        typer.echo(f"{model}: no replica has reported a version")
        return
    typer.echo(
        f"{'REPLICA':<24} {'SITE':<12} {'VERSION':<8} {'STATUS':<10} {'MODE':<9} {'ENGINE':<7} "
        f"{'PAUSE':>10} {'LAG':>5}  APPLIED"
    )
    for r in found:
        typer.echo(
            f"{r.subscriber:<24} {kit.shown(r.site):<12} {_v_held(r.version):<8} {r.status:<10} "
            f"{kit.shown(r.mode):<9} {kit.shown(r.engine):<7} {_pause(r):>10} {kit.shown(r.lag):>5}  "
            f"{timestamp(r.applied_at)}"
        )


def relays(server: kit.ServerOpt = DEFAULT_SERVER, as_json: kit.JsonOpt = False) -> None:
    """List the relays that report to the server (and those below them): site, what each follows,
    whether it is degraded, how long since it last reported, and the versions it holds."""
    with kit.one_line_errors(), _api(server) as api:
        found = api.list_relays()
    if as_json:
        kit.emit({"relays": [r.to_dict() for r in found]})
        return
    if not found:
        typer.echo("no relay has reported to this server")
        return
    typer.echo(f"{'RELAY':<24} {'SITE':<12} {'STATE':<9} {'SEEN':>8}  {'UPSTREAM':<28} MODELS")
    for r in found:
        held = ", ".join(f"{m} v{h.version}" for m, h in sorted(r.models.items())) or "-"
        state = "degraded" if r.degraded else "ok"
        typer.echo(
            f"{r.name:<24} {kit.shown(r.site):<12} {state:<9} {r.age_s:>7.0f}s  {kit.shown(r.upstream):<28} {held}"
        )


def holders(found: list[Replica]) -> dict[int, int]:
    """How many replicas hold each version now, from each one's latest ledger entry (``Api.list_replicas``).

    An unhealthy replica holds none. (`weightsync log` shows these counts.)
    """
    out: dict[int, int] = {}
    for r in found:
        if r.version is not None:
            out[r.version] = out.get(r.version, 0) + 1
    return out


def _v_held(number: int | None) -> str:
    return "-" if number is None else f"v{number}"


def _pause(r: Replica) -> str:
    return "-" if r.pause_ms is None else f"{r.pause_ms:.1f}ms"


def _cache_commands(group: typer.Typer) -> None:
    @group.callback()
    def cache(ctx: typer.Context, cache_dir: CacheDirOpt = None, as_json: kit.JsonOpt = False) -> None:
        """Show or empty the publisher's cache: one base per model and server, about the model's size.

        `push` keeps the last version it committed in DIR/publish/<server id>/<model> (DIR: the
        cache root) to send the next one as a delta. Without a subcommand: `cache show`.
        """
        if ctx.invoked_subcommand is None:
            _show(cache_dir, as_json)
        ctx.obj = (cache_dir, as_json)  # `cache --cache-dir D --json prune` means what it says

    @group.command("show")
    def show(ctx: typer.Context, cache_dir: CacheDirOpt = None, as_json: kit.JsonOpt = False) -> None:
        """List the bases kept: server id, model, version held, size."""
        _show(cache_dir or ctx.obj[0], as_json or ctx.obj[1])

    @group.command("prune")
    def prune(
        ctx: typer.Context,
        model: Annotated[
            str | None, typer.Option("--model", metavar="MODEL", help="Remove this model's bases.")
        ] = None,
        server_id: Annotated[
            str | None, typer.Option("--server-id", metavar="ID", help="Remove the bases kept for this server.")
        ] = None,
        everything: Annotated[bool, typer.Option("--all", help="Remove every base.")] = False,
        cache_dir: CacheDirOpt = None,
        as_json: kit.JsonOpt = False,
    ) -> None:
        """Remove bases (the next push then downloads the head first); never one a running publisher holds."""
        if everything == (model is not None or server_id is not None):
            raise typer.BadParameter("give --model, --server-id (or both), or --all", param_hint="'--all'")
        root = base_cache.cache_root(cache_dir or ctx.obj[0])
        as_json = as_json or ctx.obj[1]
        with kit.one_line_errors():
            result = base_cache.prune(root, model=model, server=server_id)
        if as_json:
            kit.emit(result.to_dict())
        else:
            count = len(result.removed)
            if count or result.in_use:
                typer.echo(f"removed {count} base{'s' if count != 1 else ''} ({human_bytes(result.bytes_freed)})")
            else:
                typer.echo("nothing removed: no base matched")
        if result.in_use:
            held = ", ".join(f"{b.server_id}/{b.model}" for b in result.in_use)
            typer.echo(f"weightsync: error: kept what a running publisher holds: {held}", err=True)
            raise typer.Exit(errors.EXIT_CONFLICT)


def _show(cache_dir: Path | None, as_json: bool) -> None:
    """`cache show`: every base under the cache root, and their total size."""
    root = base_cache.cache_root(cache_dir)
    with kit.one_line_errors():
        bases = base_cache.list_bases(root)
    total = sum(b.bytes for b in bases)
    if as_json:
        kit.emit({"root": str(root), "bases": [b.to_dict() for b in bases], "bytes": total})
        return
    where = root / base_cache.PUBLISH
    if not bases:
        typer.echo(f"no bases cached under {where}")
        return
    typer.echo(f"{'SERVER ID':<34} {'MODEL':<32} {'VERSION':<8} {'SIZE':>10}")
    for b in bases:
        held = "  (in use)" if b.in_use else ""
        version = "-" if b.version is None else f"v{b.version}"
        name = b.model if b.part is None else f"{b.model} part {b.part}"
        typer.echo(f"{b.server_id:<34} {name:<32} {version:<8} {human_bytes(b.bytes):>10}{held}")
    typer.echo(f"{len(bases)} base{'s' if len(bases) != 1 else ''}, {human_bytes(total)} under {where}")
