"""Client commands of the `weightsync` CLI: push, pull, watch, log, models, fsck, gc, follow, and the operator ones.

``register(app)`` adds them to the main typer app. Each command parses its
input, calls one SDK function and renders the result: a line of text (with a
progress bar for transfers when stderr is a terminal), or with ``--json``
exactly one JSON object on stdout (push and pull include ``version`` and
``bytes``: object and manifest bytes moved over the network by this call).
Sizes are in binary units (KiB, MiB, GiB: :func:`weightsync.common.human_bytes`),
in summaries, progress and ``--limit-rate`` alike.

The server comes from ``--server`` or ``WEIGHTSYNC_SERVER`` (default
http://127.0.0.1:8400), the token from ``WEIGHTSYNC_TOKEN``; transient
failures are retried ``WEIGHTSYNC_RETRIES`` times in all (default 6). A server
URL with no scheme or with a path is a usage error, before any request. ``push`` keeps
the last version it committed in ``<cache root>/publish/<server id>/<model>`` so
consecutive pushes send deltas (client/cache.py: the root is ``--cache-dir``, else
``WEIGHTSYNC_CACHE``, else ``~/.cache/weightsync``; one base per model and server,
about the model's size; ``weightsync cache`` shows and prunes it). The operator
commands (``model …``, ``replicas``, ``cache …``) live in client/cli_admin.py.

Errors are one line, ``weightsync: error: …``, on stderr, never a traceback.
Ctrl-C stops a push or pull at once (transfers in flight are cancelled, a
pending publish is aborted; running the command again resumes) and exits 130.
Exit codes (each error class's ``exit_code`` in :mod:`weightsync.errors`):

    0  success
    1  any other error (bad input file, corrupt data, fsck found problems, …)
    2  usage error (bad arguments, a server URL that is not a root URL)
    3  conflict: stale parent, another publish won, base mismatch, incomplete publish, directory in use
    4  authentication or authorization failed (HTTP 401/403)
    5  server unavailable (unreachable, or 5xx after retries); for follow, an engine not reached in --engine-wait
    6  not found: unknown model or version
    130  interrupted (Ctrl-C)
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from weightsync import errors
from weightsync.client import cli_common as kit
from weightsync.client._http import DEFAULT_SERVER, Api
from weightsync.client.cache import cache_root, publish_root, server_id
from weightsync.client.cli_admin import holders
from weightsync.client.cli_admin import register as register_admin
from weightsync.client.cli_common import EXIT_INTERRUPTED
from weightsync.client.models import Version, timestamp
from weightsync.common import human_bytes
from weightsync.errors import EXIT_AUTH, EXIT_CONFLICT, EXIT_ERROR, EXIT_NOT_FOUND, EXIT_UNAVAILABLE, EXIT_USAGE

if TYPE_CHECKING:
    from weightsync.engines import SwitchReport

__all__ = [
    "EXIT_AUTH",
    "EXIT_CONFLICT",
    "EXIT_ERROR",
    "EXIT_INTERRUPTED",
    "EXIT_NOT_FOUND",
    "EXIT_UNAVAILABLE",
    "EXIT_USAGE",
    "register",
]


def _part_arg(value: str | None) -> tuple[int, int] | None:
    """``RANK/WORLD`` as (rank, world) with 0 <= rank < world; a usage error otherwise."""
    if value is None:
        return None
    rank, sep, world = value.partition("/")
    if not (sep and rank.isdigit() and world.isdigit() and int(world) >= 1 and int(rank) < int(world)):
        raise typer.BadParameter(
            f"{value!r} is not RANK/WORLD with 0 <= RANK < WORLD (e.g. 0/4)", param_hint="'--part'"
        )
    return int(rank), int(world)


def register(app: typer.Typer) -> None:
    """Add the client commands to `app`."""

    @app.command()
    def push(
        model: kit.ModelArg,
        path: Annotated[
            Path, typer.Argument(metavar="PATH", help="A safetensors file or a directory (sharded checkpoint).")
        ],
        server: kit.ServerOpt = DEFAULT_SERVER,
        keyframe: Annotated[bool, typer.Option("--keyframe", help="Store this version whole.")] = False,
        allow_removals: Annotated[
            bool,
            typer.Option("--allow-removals", help="Publish even if files or tensors of the previous version are gone."),
        ] = False,
        step: Annotated[int | None, typer.Option("--step", metavar="N", min=0, help="Training step.")] = None,
        metadata: Annotated[
            str | None, typer.Option("--metadata", metavar="JSON", help="Metadata, a JSON object.")
        ] = None,
        cache_dir: Annotated[
            Path | None,
            typer.Option(
                "--cache-dir",
                metavar="DIR",
                help="Cache root: the last version pushed is kept in DIR/publish/<server id>/<model> to diff "
                "against, about the model's size [default: $WEIGHTSYNC_CACHE, else ~/.cache/weightsync].",
            ),
        ] = None,
        no_cache: Annotated[
            bool, typer.Option("--no-cache", help="Keep no copy of the pushed version (the next push is a keyframe).")
        ] = False,
        concurrency: kit.ConcurrencyOpt = 8,
        limit_rate: kit.RateOpt = None,
        as_json: kit.JsonOpt = False,
        part: Annotated[
            str | None,
            typer.Option(
                "--part",
                metavar="RANK/WORLD",
                help="Publish PATH as part RANK (0 to WORLD-1) of the version of --step that WORLD ranks publish "
                "together; it commits when the last part arrives.",
            ),
        ] = None,
        no_wait: Annotated[
            bool, typer.Option("--no-wait", help="With --part: return once this part is accepted, not committed.")
        ] = False,
    ) -> None:
        """Publish PATH as the next version of MODEL (a delta against the last push when possible)."""
        from weightsync.client.publisher import Publisher

        ranked = _part_arg(part)
        if ranked is not None and step is None:
            raise typer.BadParameter(
                "--part needs --step: the ranks join one version by its step", param_hint="'--part'"
            )
        if no_wait and ranked is None:
            raise typer.BadParameter("--no-wait is for --part", param_hint="'--no-wait'")
        meta = kit.metadata_arg(metadata)
        rate = kit.rate(limit_rate)
        with kit.one_line_errors():
            if not path.exists():
                raise FileNotFoundError(2, "No such file or directory", str(path))
            cache = None if no_cache else _publish_cache(server, cache_dir)
            with (
                kit.progress_bar(f"push {model}", not as_json) as progress,
                Publisher(
                    server,
                    model,
                    token=kit.token(),
                    retry=kit.retry_policy(),
                    cache_dir=cache,
                    concurrency=concurrency,
                    bandwidth=rate,
                    progress=progress,
                    part=ranked,
                ) as pub,
            ):
                result = pub.publish(
                    path,
                    step=step,
                    metadata=meta,
                    keyframe=keyframe,
                    allow_removals=allow_removals,
                    wait=not no_wait,
                )
        if as_json:
            kit.emit(result.to_dict())
        elif ranked is not None and not result.version:
            typer.echo(
                f"{model} part {ranked[0]}/{ranked[1]} of step {step} accepted: sent {human_bytes(result.bytes_sent)}"
                " (the version commits when every part has arrived)"
            )
        else:
            typer.echo(
                f"{model} v{result.version} ({result.kind}): sent {human_bytes(result.bytes_sent)} for "
                f"{human_bytes(result.raw_bytes)} in {result.seconds:.1f}s "
                f"({result.objects_uploaded}/{result.objects_total} objects uploaded)"
            )

    @app.command()
    def pull(
        model: kit.ModelArg,
        dir: Annotated[
            Path, typer.Argument(metavar="DIR", help="Directory to bring to the version (created if missing).")
        ],
        server: kit.ServerOpt = DEFAULT_SERVER,
        version: Annotated[
            int | None,
            typer.Option(
                "--version",
                metavar="N",
                min=1,
                help="Version [default: the pinned version when the model is pinned, else the head].",
            ),
        ] = None,
        name: Annotated[
            str | None,
            typer.Option("--name", metavar="NAME", help="Subscriber name in the replica ledger [default: host name]."),
        ] = None,
        cache_dir: Annotated[
            Path | None,
            typer.Option("--cache-dir", metavar="DIR", help="Shared object cache [default: DIR/.weightsync/objects]."),
        ] = None,
        adopt: Annotated[
            bool,
            typer.Option(
                "--adopt",
                help="Take over a directory weightsync does not manage: files that already are the version "
                "are kept without a download, the model's other files are replaced.",
            ),
        ] = False,
        include: Annotated[
            list[str] | None,
            typer.Option(
                "--include",
                metavar="GLOB",
                help="Hold only the version's files this glob takes (repeatable; * crosses /), each byte for "
                "byte, fetched from only their frames. DIR remembers it: later pulls keep the slice "
                "[default: DIR's own, else every file].",
            ),
        ] = None,
        concurrency: kit.ConcurrencyOpt = 8,
        limit_rate: kit.RateOpt = None,
        as_json: kit.JsonOpt = False,
    ) -> None:
        """Bring DIR to a version of MODEL byte for byte (default: the pinned one, else the head), incrementally."""
        from weightsync.client.subscriber import Subscriber

        rate = kit.rate(limit_rate)
        with (
            kit.one_line_errors(),
            kit.progress_bar(f"pull {model}", not as_json) as progress,
            Subscriber(
                server,
                model,
                token=kit.token(),
                retry=kit.retry_policy(),
                name=name,
                cache_dir=cache_dir,
                concurrency=concurrency,
                bandwidth=rate,
                progress=progress,
            ) as sub,
        ):
            result = sub.pull(dir, version, adopt=adopt, include=include or None)
        if as_json:
            kit.emit(result.to_dict())
        elif result.mode == "current":
            typer.echo(f"{dir}: already at {model} v{result.version}")
        elif result.mode == "adopted":
            typer.echo(f"{dir}: adopted as {model} v{result.version} (its files were the version)")
        else:
            extra = " (directory had changed: rebuilt)" if result.repaired else ""
            if include:
                extra += f" ({result.files} file{'s' if result.files != 1 else ''} of the version)"
            if result.adopted:
                extra += f" (kept {result.adopted} file{'s' if result.adopted != 1 else ''} already there)"
            typer.echo(
                f"{dir}: {model} v{result.version} ({result.mode}, {result.steps} step"
                f"{'s' if result.steps != 1 else ''}): received {human_bytes(result.bytes_received)} in "
                f"{result.seconds:.1f}s{extra}"
            )

    @app.command()
    def watch(
        model: kit.ModelArg,
        server: kit.ServerOpt = DEFAULT_SERVER,
        after: Annotated[
            int | None,
            typer.Option("--after", metavar="N", min=0, help="Report the versions after N [default: the head]."),
        ] = None,
        pull_dir: Annotated[
            Path | None, typer.Option("--pull", metavar="DIR", help="Pull each version reported into DIR.")
        ] = None,
        count: Annotated[int | None, typer.Option("--count", metavar="N", min=1, help="Stop after N versions.")] = None,
        as_json: Annotated[bool, typer.Option("--json", help="One JSON object per line per version.")] = False,
    ) -> None:
        """Print every version of MODEL committed after --after, in order, as it commits.

        A model that does not exist yet is waited for (a replica may start before the first push).
        """
        from weightsync.client.subscriber import Subscriber
        from weightsync.client.watch import follow

        with kit.one_line_errors(), Subscriber(server, model, token=kit.token(), retry=kit.retry_policy()) as sub:
            start = _watch_start(sub.api, model, after)
            for seen, v in enumerate(follow(sub.api, model, start, every=True), start=1):
                out = v.to_dict()
                step = "" if v.step is None else f" step {v.step}"
                line = f"{model} v{v.number} ({v.kind}){step}: {human_bytes(v.stored_bytes)} stored"
                if pull_dir is not None:
                    pulled = sub.pull(pull_dir, v.number)
                    out["pull"] = pulled.to_dict()
                    line += f"; pulled into {pull_dir} ({human_bytes(pulled.bytes_received)} received)"
                if as_json:
                    kit.emit(out)
                else:
                    typer.echo(line)
                sys.stdout.flush()
                if count is not None and seen >= count:
                    return

    @app.command("log")
    def log_(
        model: kit.ModelArg,
        server: kit.ServerOpt = DEFAULT_SERVER,
        limit: Annotated[
            int | None, typer.Option("--limit", metavar="N", min=1, help="Show the last N versions.")
        ] = None,
        as_json: kit.JsonOpt = False,
    ) -> None:
        """List the committed versions of MODEL, oldest first, with how many replicas hold each now."""
        with kit.one_line_errors(), Api(server, kit.token(), retry=kit.retry_policy()) as api:
            versions = _all_versions(api, model, limit)
            held = {} if as_json or not versions else holders(api.list_replicas(model))
        if as_json:
            kit.emit({"model": model, "versions": [v.to_dict() for v in versions]})
            return
        if not versions:
            typer.echo(f"{model}: no versions")
        for v in versions:
            typer.echo(
                f"v{v.number:<6} {v.kind:<8} parent={kit.shown(v.parent):<6} step={kit.shown(v.step):<8} "
                f"raw={human_bytes(v.raw_bytes):>10} stored={human_bytes(v.stored_bytes):>10} "
                f"replicas={held.get(v.number, 0):<4} {timestamp(v.committed_at)}"
            )

    @app.command()
    def models(server: kit.ServerOpt = DEFAULT_SERVER, as_json: kit.JsonOpt = False) -> None:
        """List the models on the server."""
        with kit.one_line_errors(), Api(server, kit.token(), retry=kit.retry_policy()) as api:
            found = api.list_models()
        if as_json:
            kit.emit({"models": [m.to_dict() for m in found]})
            return
        if not found:
            typer.echo("no models")
        for m in found:
            typer.echo(f"{m.name:<32} head={kit.shown(m.head)}")

    @app.command()
    def fsck(
        server: kit.ServerOpt = DEFAULT_SERVER,
        read_data: Annotated[bool, typer.Option("--read-data", help="Read and hash every object.")] = False,
        repair: Annotated[bool, typer.Option("--repair", help="Fix what is safe to fix.")] = False,
        as_json: kit.JsonOpt = False,
    ) -> None:
        """Check that catalog and store agree (admin); exit 1 when problems remain."""
        with kit.one_line_errors(), Api(server, kit.token(), timeout=3600, retry=kit.retry_policy()) as api:
            report = api.fsck(read_data=read_data, repair=repair)
        if as_json:
            kit.emit(report.to_dict())
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
        server: kit.ServerOpt = DEFAULT_SERVER,
        dry_run: Annotated[bool, typer.Option("--dry-run", help="Report what would be deleted.")] = False,
        grace: Annotated[
            float | None,
            typer.Option("--grace", metavar="SECONDS", min=0, help="Grace period [default: the server's]."),
        ] = None,
        as_json: kit.JsonOpt = False,
    ) -> None:
        """Apply retention and delete unreferenced objects (admin)."""
        with kit.one_line_errors(), Api(server, kit.token(), timeout=3600, retry=kit.retry_policy()) as api:
            report = api.gc(dry_run=dry_run, grace_s=grace)
        if as_json:
            kit.emit(report.to_dict())
            return
        prefix = "would delete" if dry_run else "deleted"
        versions = ", ".join(f"{m} v{','.join(map(str, ns))}" for m, ns in sorted(report.versions_deleted.items()))
        purged = f"; {report.leases_purged} expired leases purged" if report.leases_purged else ""
        typer.echo(
            f"{prefix} {report.objects_deleted} objects ({human_bytes(report.bytes_deleted)}); "
            f"{report.objects_kept_in_grace} kept in grace; versions: {versions or 'none'}{purged}"
        )

    @app.command()
    def follow(
        model: kit.ModelArg,
        engine: Annotated[
            str,
            typer.Option(
                "--engine",
                metavar="ENGINE",
                callback=_engine_kind,
                help="The engine to keep on the newest version: vllm (disk or in-process mode: --mode) or "
                "sglang (disk mode, SGLang 0.5.23 or later). The PyTorch adapter runs inside the serving process "
                "and is SDK only (weightsync.engines.torch.TorchModule).",
            ),
        ],
        engine_url: Annotated[
            str,
            typer.Option(
                "--engine-url",
                metavar="URL",
                callback=_engine_url,
                help="The engine server's root URL (vLLM started with VLLM_SERVER_DEV_MODE=1).",
            ),
        ],
        dir: Annotated[
            Path | None,
            typer.Option(
                "--dir",
                metavar="DIR",
                help="Disk mode: the checkout the engine reloads from, the path the engine reads (same host or "
                "a shared mount). Start the engine on a pull of it.",
            ),
        ] = None,
        mode: Annotated[
            str,
            typer.Option(
                "--mode",
                metavar="MODE",
                help="disk: pull into --dir, reload the engine from it. in-process (vllm): the engine's workers "
                "(started with --worker-extension-cls weightsync.engines.vllm_worker.Worker) download and "
                "decode each version while serving; the pause changes only the changed elements.",
            ),
        ] = "disk",
        host_dir: Annotated[
            Path | None,
            typer.Option(
                "--host-dir",
                metavar="DIR",
                help="In-process mode with tensor parallelism: the directory the engine's workers on each host "
                "share, so that one of them downloads and decodes each version for all (docs/ENGINES.md) "
                "[default: $WEIGHTSYNC_HOST_DIR, else /dev/shm/weightsync].",
            ),
        ] = None,
        server: kit.ServerOpt = DEFAULT_SERVER,
        pause: Annotated[
            str | None,
            typer.Option(
                "--pause",
                metavar="MODE",
                help="Requests in flight during a switch, in the engine's own modes. vllm: keep (frozen, then "
                "go on; the default), wait (finish first), abort. sglang: retract (back to the queue, "
                "recomputed on the new weights; the default), in_place (frozen with their KV cache; SGLang's "
                "prefix cache is then not flushed), abort.",
            ),
        ] = None,
        name: Annotated[
            str | None,
            typer.Option("--name", metavar="NAME", help="Replica name in the ledger [default: host name]."),
        ] = None,
        site: Annotated[str | None, typer.Option("--site", metavar="SITE", help="Site in the ledger.")] = None,
        engine_token: Annotated[
            str | None,
            typer.Option(
                "--engine-token",
                metavar="TOKEN",
                envvar="WEIGHTSYNC_ENGINE_TOKEN",
                show_envvar=True,
                help="Bearer token for the engine's API.",
            ),
        ] = None,
        engine_wait: Annotated[
            int,
            typer.Option(
                "--engine-wait",
                metavar="SECONDS",
                min=0,
                help="How long an engine that cannot be reached at start is waited for (it may be loading "
                "its model) before giving up (exit 5); once reached, a restarting engine is waited for.",
            ),
        ] = 900,
        count: Annotated[int | None, typer.Option("--count", metavar="N", min=1, help="Stop after N switches.")] = None,
        as_json: Annotated[bool, typer.Option("--json", help="One JSON object per line per switch.")] = False,
    ) -> None:
        """Keep a running inference engine on the newest version of MODEL, each switch verified.

        Disk mode pulls each version into DIR while the engine serves, then pauses the engine,
        reloads it from DIR, checks every parameter against the version and resumes (on the
        previous version if the check fails); in-process mode (vLLM) has the engine's workers
        prepare each version and pauses only for the element update and its check. Prints one
        line per switch; reports each to the replica ledger. Ctrl-C stops it (a switch in
        progress finishes first).
        """
        if mode not in ("disk", "in-process"):
            raise typer.BadParameter(f"{mode!r} is not one of disk, in-process", param_hint="'--mode'")
        if mode == "in-process" and engine != "vllm":
            raise typer.BadParameter(f"in-process is for vllm only, not {engine}", param_hint="'--mode'")
        if mode == "disk" and dir is None:
            raise typer.BadParameter("disk mode needs the checkout the engine reloads from", param_hint="'--dir'")
        pause_mode = _pause_mode(engine, pause)
        # weightsync.engines builds on the client SDK: imported here, never when the CLI loads.
        from weightsync.client.subscriber import Subscriber
        from weightsync.engines import Engine
        from weightsync.engines import follow as follow_engine

        with kit.one_line_errors(), _engine_log():
            client: Any
            if engine == "sglang":
                from weightsync.engines.sglang import SglangClient

                client = SglangClient(engine_url, token=engine_token)
            else:
                from weightsync.engines.vllm import VllmClient

                client = VllmClient(engine_url, token=engine_token)
            if engine_wait > 0 and not client.health():
                typer.echo(f"weightsync: waiting for {engine} at {engine_url}", err=True)
            client.wait_ready(engine_wait)
            sub = Subscriber(
                server, model, token=kit.token(), retry=kit.retry_policy(), name=name, site=site, report=False
            )
            adapter: Engine
            if mode == "in-process":
                from weightsync.engines.vllm_inprocess import VllmInProcess

                adapter = VllmInProcess(
                    client,
                    sub,
                    token=kit.token(),
                    pause=pause_mode,  # type: ignore[arg-type]
                    host_dir=str(host_dir) if host_dir is not None else None,
                )
            elif engine == "sglang":
                from weightsync.engines.sglang import SglangDisk

                assert dir is not None
                adapter = SglangDisk(client, sub, dir, pause=pause_mode)  # type: ignore[arg-type]
            else:
                from weightsync.engines.vllm import VllmDisk

                assert dir is not None
                adapter = VllmDisk(client, sub, dir, pause=pause_mode)  # type: ignore[arg-type]
            with sub, adapter:

                def switched(r: SwitchReport) -> None:
                    _print_switch(model, engine, r, as_json)

                follow_engine(adapter, sub, count=count, on_switch=switched)

    register_admin(app)


FOLLOWED_ENGINES = ("vllm", "sglang")
PAUSE_MODES = {"vllm": ("keep", "wait", "abort"), "sglang": ("retract", "in_place", "abort")}
"""Each engine's own pause modes for --pause, the default first (engines/vllm.py, engines/sglang.py)."""


def _engine_kind(value: str) -> str:
    """--engine's check: the engines the CLI can drive from outside their process."""
    if value in FOLLOWED_ENGINES:
        return value
    if value == "torch":
        raise typer.BadParameter(
            "the PyTorch adapter runs inside the serving process: use weightsync.engines.torch.TorchModule (SDK)"
        )
    raise typer.BadParameter(f"{value!r} is not an engine weightsync follows ({', '.join(FOLLOWED_ENGINES)})")


def _engine_url(value: str) -> str:
    """--engine-url's check: a server root with a scheme, else a usage error with what to write instead."""
    from weightsync.engines.http import check_url

    try:
        return check_url(value)
    except errors.InvalidArgument as exc:
        raise typer.BadParameter(str(exc)) from None


def _pause_mode(engine: str, value: str | None) -> str:
    """--pause's check against ``engine``'s own modes (a usage error otherwise); None: its default."""
    modes = PAUSE_MODES[engine]
    if value is None:
        return modes[0]
    if value not in modes:
        raise typer.BadParameter(f"{value!r} is not one of {', '.join(modes)} ({engine})", param_hint="'--pause'")
    return value


@contextmanager
def _engine_log() -> Iterator[None]:
    """The follow loop's log lines (a switch that failed, an engine or server it waits for) on stderr, one line each."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("weightsync: %(message)s"))
    handler.setLevel(logging.WARNING)
    logger = logging.getLogger("weightsync")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)


def _print_switch(model: str, engine: str, r: SwitchReport, as_json: bool) -> None:
    """One verified switch: a line for people, or one JSON object."""
    if as_json:
        kit.emit(
            {
                "model": model,
                "engine": engine,
                "version": r.version,
                "previous": r.previous,
                "pause_ms": round(r.pause_s * 1e3, 3),
                "checked": r.checked,
                "mode": r.mode,
                "bytes": r.bytes_received,
                "prepare_s": round(r.prepare_s, 4),
                "timings": {k: round(v, 4) for k, v in r.timings.items()},
            }
        )
    else:
        phases = ", ".join(f"{k.removesuffix('_s')} {v * 1e3:.0f} ms" for k, v in r.timings.items())
        typer.echo(
            f"{model} v{r.version}: {engine} switched from v{kit.shown(r.previous)}, paused {r.pause_s * 1e3:.0f} ms"
            f"{f' ({phases})' if phases else ''}, {r.checked} parameters checked; prepared in {r.prepare_s:.2f}s, "
            f"{human_bytes(r.bytes_received)} received"
        )
    sys.stdout.flush()


def _publish_cache(server: str, cache_dir: Path | None) -> Path:
    """The cache_dir of push's Publisher: the cache root's folder for this server's id (GET /v1/info)."""
    with Api(server, kit.token(), retry=kit.retry_policy()) as api:
        return publish_root(cache_root(cache_dir), server_id(api))


def _watch_start(api: Api, model: str, after: int | None) -> int:
    """The version a watch reports after: `after`, else the head; a model not created yet is waited for."""
    try:
        head = api.get_model(model).head
    except errors.ModelNotFound:
        typer.echo(f"weightsync: no model {model!r} yet: waiting for its first version", err=True)
        return after or 0
    return after if after is not None else head or 0


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
