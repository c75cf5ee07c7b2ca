"""Crash-point injection for the reliability suite (docs/reliability/crash-and-concurrency.md).

A *crash point* is one state-changing action of an operation: a system call that
changes the filesystem (``os.open`` with O_CREAT/O_WRONLY/O_RDWR, ``os.write``,
``os.fsync``, ``os.link``, ``os.symlink``, ``os.replace``, ``os.rename``, ``os.unlink``,
``os.mkdir``, ``os.rmdir``, ``os.ftruncate``), a write-mode ``open()`` and every
``write``/``truncate`` on the file it returns, ``shutil.copyfile``, a catalog
write transaction (``Catalog.<method>``: "before" dies inside the transaction,
after its changes and before COMMIT; "after" dies once it returned), and, for a
store that is not the filesystem (S3), every ``put``/``put_stream``/``delete``.

:class:`CrashPoints` numbers these actions as the operation performs them and
calls ``os._exit`` just before or just after action ``k``. The driver runs the
operation for k = 1, 2, ... until a run completes without reaching k, so every
action is crashed both ways (exhaustive, not hand-picked).

Process layout: the test starts a *zygote* (``python _crash_util.py zygote``)
that imports everything once and then, per command, forks a child that crashes
(or completes) and then forks a checker that inspects what the crash left. The
zygote itself never opens a database, a store or an event loop, so forking it is
safe. Two zygotes run the "before" and "after" phases side by side.

Scenarios (what runs under the crash and what must hold afterwards) are
:class:`Scenario` subclasses; the parent only drives and collects.
"""

from __future__ import annotations

import asyncio
import builtins
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
for _p in (str(TESTS), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from _serve import SERVE_CLI, ServeProcess, clean_env  # noqa: E402 - tests/ is on sys.path from here on (zygote)

CRASH_EXIT = 77
#: The test clock's start. Far after any file's mtime, so the store's mtime-based grace never hides an
#: orphan (the catalog's unreferenced_since still applies), and fixed, so commit records, digests and
#: therefore the enumerated points are the same on every run.
T0 = "2100-01-01T00:00:00+00:00"
MODEL = "m"
FATAL = frozenset({"missing-object", "bad-manifest", "short-object", "corrupt-object", "unmaterializable"})

# --- the crash points ---------------------------------------------------------------------------------------------

_HEX = re.compile(r"[0-9a-f]{16,}")
_os_write = os.write  # the real one: reports to the zygote must not count as (or die at) crash points


def _short(path: Any, root: str) -> str:
    """A label-friendly path: relative to the work dir, digests and random names folded."""
    try:
        p = os.fsdecode(path)
    except TypeError:
        return "?"
    if root and p.startswith(root):
        p = p[len(root) :].lstrip("/")
    p = re.sub(r"\b[0-9a-f]{2}/[0-9a-f]{2}/", "", p)
    p = _HEX.sub("<h>", p)
    p = re.sub(r"\.\d+\.\d+\.tmp$", ".tmp", p)
    p = re.sub(r"\d+-\d+(\.tmp)?$", r"<range>\1", p)
    return p


class CrashPoints:
    """Numbers state-changing actions and dies with CRASH_EXIT before or after action `k` (k <= 0: never)."""

    def __init__(self, k: int, phase: str, report_fd: int, root: str = "") -> None:
        assert phase in ("before", "after")
        self.k, self.phase, self.fd, self.root = k, phase, report_fd, root
        self.n = 0
        self.labels: list[str] = []
        self._lock = threading.Lock()
        self._tls = threading.local()

    def report(self, doc: dict) -> None:
        data = (json.dumps(doc) + "\n").encode()
        while data:
            data = data[_os_write(self.fd, data) :]

    def _die(self, n: int, when: str) -> None:
        self.report({"crashed": n, "phase": when, "label": self.labels[n - 1], "labels": self.labels})
        os._exit(CRASH_EXIT)

    def before(self, label: str) -> int:
        with self._lock:
            self.n += 1
            n = self.n
            self.labels.append(label)
        if n == self.k and self.phase == "before":
            self._die(n, "before")
        return n

    def after(self, n: int) -> None:
        if n == self.k and self.phase == "after":
            self._die(n, "after")

    def call(self, label: str, fn, *args, **kwargs):
        if getattr(self._tls, "busy", False):  # an action inside an action (e.g. copyfile's writes): one point
            return fn(*args, **kwargs)
        n = self.before(label)
        self._tls.busy = True
        try:
            return fn(*args, **kwargs)
        finally:  # an action that failed (mkdir of an existing directory) is crashed after, too
            self._tls.busy = False
            self.after(n)

    def completed(self) -> None:
        self.report({"completed": True, "points": self.n, "labels": self.labels})


_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


class _File:
    """A file object whose writes are crash points."""

    def __init__(self, f, cp: CrashPoints, name: str) -> None:
        self._f, self._cp, self._name = f, cp, name

    def write(self, data):
        return self._cp.call(f"write {self._name}", self._f.write, data)

    def truncate(self, *args):
        return self._cp.call(f"truncate {self._name}", self._f.truncate, *args)

    def __enter__(self):
        self._f.__enter__()
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)

    def __iter__(self):
        return iter(self._f)

    def __getattr__(self, name):
        return getattr(self._f, name)


def install_fs_hooks(cp: CrashPoints) -> None:
    """Make every filesystem-changing call of this process a crash point."""
    root = cp.root
    real_open = builtins.open

    def wrap(name: str, fn, describe=lambda *a, **k: _short(a[0], root) if a else ""):
        def hooked(*args, **kwargs):
            return cp.call(f"{name} {describe(*args, **kwargs)}".strip(), fn, *args, **kwargs)

        hooked.__wrapped__ = fn
        return hooked

    os.write = wrap("os.write", os.write, lambda fd, *_: "fd")
    os.fsync = wrap("os.fsync", os.fsync, lambda fd: "fd")
    os.link = wrap("os.link", os.link, lambda src, dst, **_: _short(dst, root))
    os.symlink = wrap("os.symlink", os.symlink, lambda src, dst, **_: _short(dst, root))
    os.replace = wrap("os.replace", os.replace, lambda src, dst, **_: _short(dst, root))
    os.rename = wrap("os.rename", os.rename, lambda src, dst, **_: _short(dst, root))
    os.unlink = wrap("os.unlink", os.unlink)
    os.remove = os.unlink
    os.mkdir = wrap("os.mkdir", os.mkdir)
    os.rmdir = wrap("os.rmdir", os.rmdir)
    os.ftruncate = wrap("os.ftruncate", os.ftruncate, lambda fd, n: "fd")
    shutil.copyfile = wrap("shutil.copyfile", shutil.copyfile, lambda src, dst, **_: _short(dst, root))
    real_os_open = os.open

    def os_open(path, flags, *args, **kwargs):
        if flags & _WRITE_FLAGS:
            return cp.call(f"os.open(w) {_short(path, root)}", real_os_open, path, flags, *args, **kwargs)
        return real_os_open(path, flags, *args, **kwargs)

    os.open = os_open

    def hooked_open(file, mode="r", *args, **kwargs):
        if isinstance(file, int) or not any(c in mode for c in "wax+"):
            return real_open(file, mode, *args, **kwargs)
        name = _short(file, root)
        f = cp.call(f"open({mode}) {name}", real_open, file, mode, *args, **kwargs)
        return _File(f, cp, name)

    builtins.open = hooked_open
    io.open = hooked_open


CATALOG_WRITES = (
    "create_model",
    "update_model_settings",
    "pin_model",
    "delete_model",
    "begin_version",
    "open_publish",
    "publish_whole",
    "reference_objects",
    "record_part",
    "drop_part",
    "commit_held",
    "commit_version",
    "abort_pending",
    "expire_pending",
    "mark_deleted",
    "record_object",
    "begin_object_deletion",
    "finish_object_deletion",
    "resume_object_deletions",
    "acquire_lease",
    "release_lease",
    "purge_expired_leases",
    "record_replica",
    "import_version",
    "record_relay",
    "claim_fetch",
    "release_fetch",
)


def install_catalog_hooks(cp: CrashPoints, catalog) -> None:
    """Each catalog write transaction is a point: 'before' dies inside it just before COMMIT."""
    from sqlalchemy import event

    tls = threading.local()

    @event.listens_for(catalog.engine, "commit")
    def on_commit(conn):  # noqa: ARG001
        name = getattr(tls, "name", None)
        if name is not None and getattr(tls, "n", None) is None:
            tls.n = cp.before(f"catalog.{name}")

    for name in CATALOG_WRITES:
        orig = getattr(catalog, name)

        def hooked(*args, _orig=orig, _name=name, **kwargs):
            tls.name, tls.n = _name, None
            try:
                return _orig(*args, **kwargs)
            finally:
                tls.name = None
                if tls.n is not None:
                    cp.after(tls.n)

        setattr(catalog, name, hooked)


def install_store_hooks(cp: CrashPoints, store) -> None:
    """Each PUT and DELETE of a (non-filesystem) store is a point."""
    for name in ("put", "put_stream", "delete"):
        orig = getattr(store, name)

        async def hooked(*args, _orig=orig, _name=name, **kwargs):
            n = cp.before(f"store.{_name}")
            try:
                return await _orig(*args, **kwargs)
            finally:
                cp.after(n)

        setattr(store, name, hooked)


# --- test data ----------------------------------------------------------------------------------------------------


def sharded_versions(count: int, *, seed: int = 7, distinct: bool = False):
    """`count` consecutive versions of a two-shard checkpoint (both shards change every step) plus a config.

    ``distinct``: the second shard's tensors are named ``expert.*``, so no name is in both shards (as the
    parts of a multi-part publish must be).
    """
    from _ckpt import safetensors_file
    from _versions import model_files, next_step

    from weightsync.codec import Checkpoint

    a, b = model_files(seed, n=4), model_files(seed + 1, n=2)
    if distinct:
        b = {name.replace("layer.", "expert."): t for name, t in b.items()}
    out = []
    for i in range(count):
        out.append(
            Checkpoint.from_bytes(
                {
                    "shard-1.safetensors": safetensors_file(a, {"step": str(i)}),
                    "shard-2.safetensors": safetensors_file(b, {"step": str(i)}),
                    "config.json": b'{"hidden": 96}',
                }
            )
        )
        a, b = next_step(a, 100 + i), next_step(b, 200 + i)
    return out


RESHAPED = "crash-reshaped"
"""A second model whose versions add, remove and rename files and sub-directories."""


def reshaped_versions(count: int, *, seed: int = 11):
    """Up to 3 versions whose file set changes: v2 adds a file in a new sub-sub-directory; v3 renames
    (and changes) the shard into a sub-directory, drops two files and adds one."""
    from _ckpt import safetensors_file
    from _versions import model_files, next_step

    from weightsync.codec import Checkpoint

    a = model_files(seed, n=3)
    shards = [safetensors_file(a, {"step": "0"})]
    for i in range(1, 3):
        a = next_step(a, 300 + i)
        shards.append(safetensors_file(a, {"step": str(i)}))
    extra = bytes(range(256)) * 9
    layouts = [
        {"shard-1.safetensors": shards[0], "config.json": b'{"hidden": 64}', "sub/tokenizer.json": b'{"v": 1}'},
        {
            "shard-1.safetensors": shards[1],
            "config.json": b'{"hidden": 64}',
            "sub/tokenizer.json": b'{"v": 1}',
            "sub/deep/extra.dat": extra,
        },
        {"shards/shard-1.safetensors": shards[2], "generation.json": b'{"top_p": 0.9}', "sub/deep/extra.dat": extra},
    ]
    return [Checkpoint.from_bytes(files) for files in layouts[:count]]


def files_of(ck) -> dict[str, bytes]:
    return {f.layout.path: f.data.tobytes() for f in ck.files}


def digest_files(files: dict[str, bytes]) -> dict[str, str]:
    return {p: hashlib.sha256(b).hexdigest() for p, b in files.items()}


def checkout_files(root: Path) -> dict[str, bytes]:
    """What a reader opening DIR/<path> gets: every file outside .weightsync, links followed (a dangling
    link opens nothing, like an absent file)."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if rel.parts and rel.parts[0] == ".weightsync":
            continue
        if p.is_file():
            out[str(rel)] = p.read_bytes()
    return out


class Clock:
    """A settable clock (Ops takes it), so TTLs and grace periods pass without sleeping."""

    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now

    def advance(self, **kw) -> None:
        self.now += timedelta(**kw)


# --- scenarios ----------------------------------------------------------------------------------------------------


@dataclass
class Env:
    """What a scenario needs besides its directory (JSON-serializable)."""

    t0: str  # ISO time the baseline was built at (real time)
    catalog: str = "sqlite"  # "sqlite" or a PostgreSQL URL template with {db}
    store: str = "fs"  # "fs" or "s3"
    server: str | None = None  # base URL of a `weightsync serve` (pull scenarios)
    empty_catalog: str | None = None  # a migrated, empty SQLite catalog to copy (rebuild checks)
    s3: dict = field(default_factory=dict)

    @property
    def start(self) -> datetime:
        return datetime.fromisoformat(self.t0)


def _ops_settings():
    from weightsync.ops import OpsSettings

    return OpsSettings(gc_grace=timedelta(minutes=5), pending_ttl=timedelta(hours=1), store_concurrency=1)


def open_ops(work: Path, env: Env, clock: Clock, *, migrate: bool = False, sequential: bool = False):
    """Ops over the case's catalog and store; `sequential` runs catalog calls on the loop thread (a fixed order)."""
    from weightsync.catalog import Catalog
    from weightsync.catalog.engine import make_engine
    from weightsync.ops import Ops

    if env.catalog == "sqlite":
        url = f"sqlite:///{work / 'catalog.db'}"
    else:
        url = (work / "catalog.url").read_text().strip()
    # The baseline was migrated once; later opens skip Alembic (it costs more than a whole check).
    catalog = Catalog.open(url) if migrate else Catalog(make_engine(url))
    if env.store == "fs":
        from weightsync.store.fs import FsStore

        store = FsStore(work / "store")
    else:
        from weightsync.store.s3 import S3Store

        prefix = (work / "store.prefix").read_text().strip()
        s = env.s3
        store = S3Store(
            s["bucket"],
            prefix,
            endpoint_url=s["endpoint"],
            access_key_id=s["access_key"],
            secret_access_key=s["secret_key"],
            region=s["region"],
            create_bucket=True,
        )
    ops = Ops(catalog, store, _ops_settings(), clock=clock)
    if sequential:

        async def inline(fn, *args, **kwargs):
            return fn(*args, **kwargs)

        ops._db = inline
    return ops


async def close_ops(ops) -> None:
    await ops.aclose()
    await ops.store.close()
    ops.catalog.close()


async def materializes(ops, number: int, expected: dict[str, bytes]) -> str | None:
    try:
        got = await ops.materialize(MODEL, number)
    except Exception as exc:  # noqa: BLE001 - any failure is the finding
        return f"v{number} does not materialize: {type(exc).__name__}: {exc}"
    files = {p: a.tobytes() for p, a in got.files.items()}
    if files != expected:
        return f"v{number} materializes to other bytes"
    return None


async def visible(ops) -> tuple[list[int], int | None]:
    from weightsync import errors

    try:
        nums = [v.number for v in await ops.list_versions(MODEL, limit=None)]
        head = (await ops.get_model(MODEL)).head
    except errors.ModelNotFound:
        return [], None
    return nums, head


async def fsck_clean_after_repair(ops, clock: Clock) -> list[str]:
    """Advance past pending TTL and GC grace, repair twice, then fsck must report nothing at all."""
    from weightsync.ops import fsck

    out = []
    clock.advance(hours=3)
    await fsck(ops, repair=True)
    clock.advance(hours=3)
    report = await fsck(ops, repair=True)
    if not report.ok:
        out.append(f"fsck --repair left {[(p.code, p.detail) for p in report.problems if not p.repaired]}")
    report = await fsck(ops, read_data=True)
    if report.problems:
        out.append(f"fsck after repair: {[(p.code, p.detail) for p in report.problems]}")
    return out


async def fsck_no_dangling(ops) -> list[str]:
    from weightsync.ops import fsck

    report = await fsck(ops, read_data=True)
    return [f"fsck: {p.code} {p.detail} v{p.number} {p.digest}" for p in report.problems if p.code in FATAL]


async def rebuild_matches(
    ops, work: Path, empty_catalog: str | None, *, unrecorded: frozenset[str] = frozenset()
) -> list[str]:
    """The catalog rebuilt from the store alone equals the live one (no resurrected or lost versions).

    `unrecorded`: references the live catalog holds that the store does not record (the part manifests a
    multi-part version keeps: no commit record names them), left out of the comparison.
    """
    from weightsync.catalog import Catalog
    from weightsync.catalog.engine import make_engine
    from weightsync.ops import rebuild_catalog

    path = work / f"rebuilt-{os.getpid()}.db"
    if empty_catalog:
        shutil.copyfile(empty_catalog, path)
        fresh = Catalog(make_engine(f"sqlite:///{path}"))
    else:
        fresh = Catalog.open(f"sqlite:///{path}")
    try:
        await rebuild_catalog(ops.store, fresh)
        live = await ops._db(ops.catalog.dump_committed)
        for v in live["versions"]:
            v["objects"] = [ref for ref in v["objects"] if ref[0] not in unrecorded]
        if fresh.dump_committed() != live:
            return ["catalog rebuilt from the store differs from the live catalog"]
        return []
    finally:
        fresh.close()
        path.unlink(missing_ok=True)


class Scenario:
    """One operation to crash: how to build its baseline, run it, and judge what a crash left."""

    name = ""
    server = False  # needs a running `weightsync serve`

    def setup(self, work: Path, env: Env) -> None:
        raise NotImplementedError

    def run(self, work: Path, env: Env, cp: CrashPoints) -> None:
        raise NotImplementedError

    def check(self, work: Path, env: Env) -> list[str]:
        raise NotImplementedError


async def _publish_versions(ops, versions, numbers: list[int]) -> None:
    from _publish import publish

    for n in numbers:
        base = versions[n - 2] if n > 1 else None
        await publish(
            ops,
            MODEL,
            versions[n - 1],
            base,
            n - 1 if n > 1 else None,
            object_bytes=OBJECT_BYTES,
            chunk_bytes=CHUNK_BYTES,
        )


OBJECT_BYTES = 48 << 10  # a keyframe spans several data objects, so "after some objects" states exist
CHUNK_BYTES = 16 << 10


class PublishScenario(Scenario):
    """Publish version `new` on top of the committed `before` (objects → manifest → commit → commit record)."""

    def __init__(self, before: list[int], *, one_request: bool = False) -> None:
        self.before = before
        self.new = (before[-1] + 1) if before else 1
        self.one_request = one_request  # Ops.publish_version (publishVersion) instead of begin, uploads, commit
        self.name = f"publish-{'one-' if one_request else ''}v{self.new}" + ("-keyframe" if not before else "-delta")

    async def _publish(self, ops, versions, parent: int | None):
        """The version, published as the scenario publishes it (the one-request kind with its idempotency key)."""
        from _publish import publish, publish_one

        base = versions[parent - 1] if parent else None
        if self.one_request:
            return await publish_one(
                ops,
                MODEL,
                versions[self.new - 1],
                base,
                parent,
                idempotency_key=f"one-v{self.new}",
                object_bytes=OBJECT_BYTES,
                chunk_bytes=CHUNK_BYTES,
            )
        v, _, _ = await publish(
            ops, MODEL, versions[self.new - 1], base, parent, object_bytes=OBJECT_BYTES, chunk_bytes=CHUNK_BYTES
        )
        return v

    def setup(self, work: Path, env: Env) -> None:
        async def go():
            ops = open_ops(work, env, Clock(env.start), migrate=True)
            try:
                await _publish_versions(ops, sharded_versions(self.new), self.before)
            finally:
                await close_ops(ops)

        asyncio.run(go())

    def run(self, work: Path, env: Env, cp: CrashPoints) -> None:
        versions = sharded_versions(self.new)

        async def go():
            ops = open_ops(work, env, Clock(env.start + timedelta(minutes=1)), sequential=True)
            install_catalog_hooks(cp, ops.catalog)
            if env.store == "fs":
                install_fs_hooks(cp)
            else:
                install_store_hooks(cp, ops.store)
            await self._publish(ops, versions, self.before[-1] if self.before else None)
            cp.completed()

        asyncio.run(go())

    def check(self, work: Path, env: Env) -> list[str]:
        return asyncio.run(self._check(work, env))

    async def _check(self, work: Path, env: Env) -> list[str]:
        versions = sharded_versions(self.new)
        clock = Clock(env.start + timedelta(minutes=2))
        ops = open_ops(work, env, clock, sequential=True)
        out: list[str] = []
        try:
            nums, head = await visible(ops)
            if nums == self.before and head == (self.before[-1] if self.before else None):
                landed = False
            elif nums == self.before + [self.new] and head == self.new:
                landed = True
            else:
                return [f"partially visible: versions {nums}, head {head} (before {self.before})"]
            for n in nums:
                if msg := await materializes(ops, n, files_of(versions[n - 1])):
                    out.append(msg)
            out += await fsck_no_dangling(ops)
            if landed:  # the publisher died before it saw the reply: its retried commit is idempotent
                v = await ops.get_version(MODEL, self.new)
                try:
                    if self.one_request:  # the whole request again: replayed by its key
                        again = await self._publish(ops, versions, self.before[-1] if self.before else None)
                    else:
                        again = await ops.commit_publish(
                            MODEL, v.publish_id, manifest_digest=v.manifest_digest, idempotency_key=v.idempotency_key
                        )
                    if again.number != self.new or (await visible(ops)) != (nums, head):
                        out.append(f"retried commit answered v{again.number} and moved the catalog")
                except Exception as exc:  # noqa: BLE001
                    out.append(f"retried commit failed: {type(exc).__name__}: {exc}")
            else:  # the publisher restarts and publishes again: nothing may be wedged
                try:
                    v = await self._publish(ops, versions, self.before[-1] if self.before else None)
                    if v.number != self.new:
                        out.append(f"re-run publish landed as v{v.number}, not v{self.new}")
                except Exception as exc:  # noqa: BLE001
                    out.append(f"re-run publish failed: {type(exc).__name__}: {exc}")
                if msg := await materializes(ops, self.new, files_of(versions[self.new - 1])):
                    out.append("after re-run: " + msg)
            out += await fsck_clean_after_repair(ops, clock)
            out += await rebuild_matches(ops, work, env.empty_catalog)
            for n in range(1, self.new + 1):
                if msg := await materializes(ops, n, files_of(versions[n - 1])):
                    out.append("after repair: " + msg)
        finally:
            await close_ops(ops)
        return out


class GcScenario(Scenario):
    """Retention and GC: v1 K, v2 D, v3 K, v4 D with keep_last=1; an aborted and an abandoned publish.

    The operation is two GC passes (the second after the grace period), so it marks v1, v2
    deleted, deletes their commit records, expires the abandoned publish, and forgets and
    deletes every unreferenced object.
    """

    name = "gc"
    kept = [3, 4]

    def setup(self, work: Path, env: Env) -> None:
        from _publish import Stopped, publish

        async def go():
            ops = open_ops(work, env, Clock(env.start), migrate=True)
            try:
                await ops.create_model(MODEL, keyframe_interval=2)
                versions = sharded_versions(5)
                await _publish_versions(ops, versions, [1, 2, 3, 4])
                # An aborted publish (all its objects and manifest uploaded) and an abandoned one
                # (other bytes, so other objects; stopped after its first object).
                other = sharded_versions(1, seed=99)[0]
                for stop, ck in (("manifest", versions[4]), ("some-objects", other)):
                    try:
                        await publish(
                            ops,
                            MODEL,
                            ck,
                            versions[3],
                            4,
                            stop_after=stop,
                            keyframe=True,
                            object_bytes=OBJECT_BYTES,
                            chunk_bytes=CHUNK_BYTES,
                        )
                        raise AssertionError("the publish was meant to stop")
                    except Stopped as s:
                        if stop == "manifest":
                            await ops.abort_publish(MODEL, s.args[0])
                await ops._db(ops.catalog.update_model_settings, MODEL, keep_last=1)
            finally:
                await close_ops(ops)

        asyncio.run(go())

    def run(self, work: Path, env: Env, cp: CrashPoints) -> None:
        from weightsync.ops import gc

        async def go():
            clock = Clock(env.start + timedelta(hours=2))
            ops = open_ops(work, env, clock, sequential=True)
            install_catalog_hooks(cp, ops.catalog)
            if env.store == "fs":
                install_fs_hooks(cp)
            else:
                install_store_hooks(cp, ops.store)
            await gc(ops)
            clock.advance(hours=1)
            await gc(ops)
            cp.completed()

        asyncio.run(go())

    def check(self, work: Path, env: Env) -> list[str]:
        return asyncio.run(self._check(work, env))

    async def _check(self, work: Path, env: Env) -> list[str]:
        from weightsync.ops import gc

        versions = sharded_versions(5)
        clock = Clock(env.start + timedelta(hours=3, minutes=1))
        ops = open_ops(work, env, clock, sequential=True)
        out: list[str] = []
        try:
            nums, head = await visible(ops)
            if not set(self.kept) <= set(nums) <= {1, 2, 3, 4} or head != 4:
                return [f"gc crash left versions {nums}, head {head}"]
            for n in nums:
                if msg := await materializes(ops, n, files_of(versions[n - 1])):
                    out.append(msg)
            out += await fsck_no_dangling(ops)
            await gc(ops)  # the re-run
            clock.advance(hours=1)
            await gc(ops)
            nums, head = await visible(ops)
            if nums != self.kept:
                out.append(f"after re-run gc: versions {nums}")
            out += await fsck_clean_after_repair(ops, clock)
            out += await rebuild_matches(ops, work, env.empty_catalog)
            for n in self.kept:
                if msg := await materializes(ops, n, files_of(versions[n - 1])):
                    out.append("after repair: " + msg)
        finally:
            await close_ops(ops)
        return out


class PullScenario(Scenario):
    """A Subscriber pull into a checkout: from nothing, or incrementally from `have`, to `want`.

    The server (a `weightsync serve` the test started) holds versions 1..3 of the sharded
    model (and of the reshaped one, whose file set changes); the baseline checkout holds
    `have` (pulled in setup).
    """

    server = True

    def __init__(self, have: int | None, want: int, *, reshaped: bool = False) -> None:
        self.have, self.want = have, want
        self.model = RESHAPED if reshaped else MODEL
        self.versions = reshaped_versions if reshaped else sharded_versions
        self.name = f"pull-{'reshaped-' if reshaped else ''}v{have or 0}-to-v{want}"

    def _subscriber(self, env: Env, work: Path):
        from weightsync.client import Subscriber

        # One connection and one decode thread: the actions happen in one order on every run.
        return Subscriber(
            env.server, self.model, name="crash-puller", concurrency=1, decode_threads=1, report=False, timeout=30.0
        )

    def setup(self, work: Path, env: Env) -> None:
        (work / "checkout").mkdir(parents=True)
        if self.have is not None:
            with self._subscriber(env, work) as sub:
                sub.pull(work / "checkout", self.have)

    def run(self, work: Path, env: Env, cp: CrashPoints) -> None:
        with self._subscriber(env, work) as sub:
            install_fs_hooks(cp)
            sub.pull(work / "checkout", self.want)
            cp.completed()

    def check(self, work: Path, env: Env) -> list[str]:
        versions = self.versions(self.want)
        old = files_of(versions[self.have - 1]) if self.have else {}
        new = files_of(versions[self.want - 1])
        root = work / "checkout"
        out = reader_violations(root, old, new)
        try:
            with self._subscriber(env, work) as sub:
                result = sub.pull(root, self.want)
            if result.version != self.want:
                out.append(f"re-run pull got v{result.version}")
        except Exception as exc:  # noqa: BLE001
            return out + [f"re-run pull failed: {type(exc).__name__}: {exc}"]
        if checkout_files(root) != new:
            out.append("after re-run pull the checkout is not the new version")
        state = json.loads((root / ".weightsync" / "state.json").read_bytes())
        if state.get("number") != self.want:
            out.append(f"state file says v{state.get('number')}")
        return out + checkout_leftovers(root, old, new)


def reader_violations(root: Path, old: dict[str, bytes], new: dict[str, bytes]) -> list[str]:
    """What a reader of DIR may see: exactly one version's complete file set, byte for byte, every
    file read through the one current version (client/checkout.py)."""
    held = checkout_files(root)
    if held != old and held != new:
        mixed = {p: ("new" if new.get(p) == b else "old" if old.get(p) == b else "other") for p, b in held.items()}
        return [f"checkout is a mix of versions: {mixed}, absent {sorted((old.keys() | new.keys()) - held.keys())}"]
    current = root / ".weightsync" / "current"
    if held and not current.is_symlink():
        return ["model files but no current version"]
    outside = [p for p in held if not (root / p).resolve().is_relative_to(current.resolve())]
    return [f"files read from outside the current version: {outside}"] if outside else []


def checkout_leftovers(root: Path, old: dict[str, bytes], new: dict[str, bytes]) -> list[str]:
    """After a completed pull: only the current version and at most the previous one (kept until the
    next pull), no temporaries, no dangling links, and disk use at most new + old."""
    meta = root / ".weightsync"
    out = []
    current = os.readlink(meta / "current")
    others = [v for v in (meta / "versions").iterdir() if f"versions/{v.name}" != current]
    for v in others:
        kept = {str(p.relative_to(v / "data")): p.read_bytes() for p in (v / "data").rglob("*") if p.is_file()}
        if kept != old or len(others) > 1:
            out.append(f"leftover version directory after re-run pull: {v.name}")
    stray = [
        str(p.relative_to(root))
        for p in meta.rglob("*")
        if (p.is_file() or p.is_symlink())
        and not p.is_relative_to(meta / "versions")
        and p.name not in ("state.json", "lock", "current")
    ]
    if stray:
        out.append(f"leftover files after re-run pull: {stray}")
    dangling = [str(p.relative_to(root)) for p in root.rglob("*") if p.is_symlink() and not p.exists()]
    if dangling:
        out.append(f"dangling links after re-run pull: {dangling}")
    inodes = {}
    for p in (meta / "versions").rglob("*"):
        if p.is_file() and "data" in p.relative_to(meta / "versions").parts[1:2]:
            st = p.stat()
            inodes[(st.st_dev, st.st_ino)] = st.st_size
    limit = sum(len(b) for b in new.values()) + sum(len(b) for b in old.values())
    if sum(inodes.values()) > limit:
        out.append(f"versions use {sum(inodes.values())} bytes, more than new + old = {limit}")
    return out


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        PublishScenario([]),
        PublishScenario([1, 2]),
        PublishScenario([1, 2], one_request=True),
        GcScenario(),
        PullScenario(2, 3),
        PullScenario(1, 3),
        PullScenario(None, 3),
        PullScenario(2, 3, reshaped=True),
        PullScenario(1, 3, reshaped=True),
    )
}


# --- the zygote (child side) --------------------------------------------------------------------------------------


def _fork_run(fn) -> tuple[int, list[dict]]:
    """Run fn(report_fd) in a forked child; return (exit status, the JSON lines it reported)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        code = 0
        try:
            fn(w)
        except BaseException as exc:  # noqa: BLE001
            import traceback

            doc = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-3000:]}
            _os_write(w, (json.dumps(doc) + "\n").encode())
            code = 3
        os._exit(code)
    os.close(w)
    chunks = []
    while True:
        b = os.read(r, 65536)
        if not b:
            break
        chunks.append(b)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    lines = [json.loads(line) for line in b"".join(chunks).decode().splitlines() if line.strip()]
    return code, lines


def _deterministic_names(seed: int) -> None:
    """Random names (publish ids, temp files) from a seeded generator, so equal runs leave equal states."""
    import base64
    import random
    import secrets
    import uuid

    rng = random.Random(seed)
    secrets.token_hex = lambda n=32: rng.randbytes(n).hex()
    secrets.token_urlsafe = lambda n=32: base64.urlsafe_b64encode(rng.randbytes(n)).rstrip(b"=").decode()
    uuid.uuid4 = lambda: uuid.UUID(int=rng.getrandbits(128), version=4)


def _crash(cmd: dict) -> dict:
    """Run the scenario's operation in a forked child that dies at point k (or completes)."""
    scen = SCENARIOS[cmd["scenario"]]
    env = Env(**cmd["env"])
    work = Path(cmd["work"])

    def crash(fd: int) -> None:
        _deterministic_names(0)
        cp = CrashPoints(cmd["k"], cmd["phase"], fd, root=str(work))
        scen.run(work, env, cp)

    code, lines = _fork_run(crash)
    run = lines[-1] if lines else {}
    if code not in (0, CRASH_EXIT) or "error" in run or not ("completed" in run or "crashed" in run):
        return {"exit": code, "run": run, "error": f"crash run failed (exit {code}): {run}"}
    return {"exit": code, "run": run}


def _check(cmd: dict) -> dict:
    """Judge, in a forked child, what the crash left in the case directory."""
    scen = SCENARIOS[cmd["scenario"]]

    def check(fd: int) -> None:
        violations = scen.check(Path(cmd["work"]), Env(**cmd["env"]))
        _os_write(fd, (json.dumps({"violations": violations}) + "\n").encode())

    code, lines = _fork_run(check)
    doc = lines[-1] if lines else {}
    if code != 0 or "violations" not in doc:
        return {"violations": [f"checker failed (exit {code}): {doc}"]}
    return doc


def _setup(cmd: dict) -> dict:
    scen = SCENARIOS[cmd["scenario"]]

    def go(fd: int) -> None:
        scen.setup(Path(cmd["work"]), Env(**cmd["env"]))
        _os_write(fd, b'{"ok": true}\n')

    code, lines = _fork_run(go)
    return {"exit": code, "result": lines[-1] if lines else {}}


def zygote_main() -> None:
    """Serve JSON commands on stdin, one reply line each on stdout."""
    # Warm the imports every scenario needs, so forked children start at once.
    import _crash_parts  # noqa: F401 - registers the multi-part publish scenarios
    import _publish  # noqa: F401
    import numpy  # noqa: F401

    import weightsync.catalog  # noqa: F401
    import weightsync.client  # noqa: F401
    import weightsync.ops  # noqa: F401
    import weightsync.store.fs  # noqa: F401
    import weightsync.store.s3  # noqa: F401
    from weightsync.codec import Checkpoint  # noqa: F401

    # Run a publish once here too (lazy imports, mapper configuration, codec tables): every
    # forked child then starts warm. Nothing may outlive it: forking copies only this thread.
    if len(sys.argv) > 2:
        warm = Path(sys.argv[2])
        warm.mkdir(parents=True, exist_ok=True)
        try:
            SCENARIOS["publish-v3-delta"].setup(warm, Env(t0=T0))
        finally:
            shutil.rmtree(warm, ignore_errors=True)
        if threading.active_count() != 1:
            raise SystemExit(f"threads left after warm-up: {threading.enumerate()}")

    out = sys.stdout
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "crash":
            reply = _crash(cmd)
        elif cmd["op"] == "check":
            reply = _check(cmd)
        elif cmd["op"] == "setup":
            reply = _setup(cmd)
        else:
            reply = {"error": f"unknown op {cmd['op']}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()


# --- the driver (test side) ---------------------------------------------------------------------------------------


class Zygote:
    """A forking helper process; `call` sends one command and waits for its reply."""

    def __init__(self, log_path: Path, warm_dir: Path | None = None) -> None:
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
        self._log = open(log_path, "ab")  # noqa: SIM115
        args = [sys.executable, str(Path(__file__).resolve()), "zygote"] + ([str(warm_dir)] if warm_dir else [])
        self.proc = subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=env, text=True, bufsize=1
        )

    def call(self, cmd: dict) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"crash zygote died (exit {self.proc.poll()})")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


_WALL_TIME = re.compile(r"'(?!" + T0[:5] + r")\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(\.\d+)?([+-]\d\d:\d\d)?'")


def fingerprint(work: Path) -> str | None:
    """A digest of everything a crash left in `work` (catalog rows, files and their bytes); None if not local.

    Names that are random by nature (temp files, digests) are folded as in the labels, and
    their bytes are hashed, so two crashes that left the same state get the same digest.
    """
    import sqlite3

    if (work / "catalog.url").exists() or (work / "store.prefix").exists():
        return None
    h = hashlib.sha256()
    db = work / "catalog.db"
    if db.exists():
        con = sqlite3.connect(db)
        try:
            for line in con.iterdump():
                # Any row stamped with the wall clock rather than the test clock must not split states.
                line = _WALL_TIME.sub("<wall-time>", line)
                h.update(line.encode() + b"\n")
        finally:
            con.close()
    entries = []
    for p in work.rglob("*"):
        if p.name.startswith("catalog.db"):
            continue
        rel = _short(str(p), str(work))
        if p.is_symlink():
            entries.append(f"l {rel} {os.readlink(p)}")
        elif p.is_dir():
            entries.append(f"d {rel}")
        else:
            entries.append(f"f {rel} {hashlib.sha256(p.read_bytes()).hexdigest()}")
    for e in sorted(entries):
        h.update(e.encode() + b"\n")
    return h.hexdigest()


class _Verdict:
    """The checker's findings for one distinct state (others that left the same state wait for it)."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.violations: list[str] = ["checker did not run"]


@dataclass
class Tally:
    """What an enumeration found: points per phase, their labels, and violations by case."""

    scenario: str
    points: dict[str, int] = field(default_factory=dict)
    labels: dict[str, list[str]] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    runs: int = 0
    states: int = 0  # distinct states the crashes left (each checked once)
    crash_s: float = 0.0
    check_s: float = 0.0

    @property
    def n(self) -> int:
        return self.points.get("before", 0)

    def kinds(self) -> dict[str, int]:
        """Points per kind of action ("os.replace", "catalog.commit_version", "write", ...)."""
        out: dict[str, int] = {}
        for label in self.labels.get("before", []):
            kind = label.split(" ", 1)[0]
            out[kind] = out.get(kind, 0) + 1
        return dict(sorted(out.items()))

    def line(self) -> str:
        return (
            f"{self.scenario}: {self.n} crash points x 2 = {self.runs} crash runs, {self.states} checker "
            f"runs (crashes that left identical states share one) -> {len(self.violations)} violations"
        )


def enumerate_crashes(
    zygotes: list[Zygote],
    scenario: str,
    base: Path,
    scratch: Path,
    env: Env,
    prepare=None,
    cleanup=None,
    max_points: int = 400,
) -> Tally:
    """Crash `scenario` before and after every action, k = 1.. until a run completes; check each outcome.

    Each case starts from a copy of the baseline `base` (``prepare(base, work)`` makes it; default
    a directory copy). The phases run on separate zygotes in parallel. A crash that leaves a state
    identical to one already checked (same :func:`fingerprint`) shares its verdict; the run that
    completes is checked too.
    """
    tally = Tally(scenario)
    lock = threading.Lock()
    failures: list[BaseException] = []
    verdicts: dict[str, _Verdict] = {}
    prepare = prepare or (lambda b, w: shutil.copytree(b, w, symlinks=True))

    def phase_loop(zyg: Zygote, phase: str) -> None:
        try:
            for k in range(1, max_points + 1):
                work = scratch / f"{scenario}-{phase}-{k}"
                prepare(base, work)
                cmd = {"scenario": scenario, "k": k, "phase": phase, "work": str(work), "env": env.__dict__}
                try:
                    t = time.monotonic()
                    res = zyg.call({"op": "crash", **cmd})
                    with lock:
                        tally.crash_s += time.monotonic() - t
                    run = res.get("run", {})
                    where = f"{scenario} {phase} #{k} {run.get('label', '(completed run)')}"
                    if "error" in res:
                        with lock:
                            tally.violations.append(f"{where}: {res['error']}")
                        return
                    fp = fingerprint(work) or f"{phase}-{k}"
                    with lock:
                        slot = verdicts.get(fp)
                        mine = slot is None
                        if mine:
                            slot = verdicts[fp] = _Verdict()
                            tally.states += 1
                    if mine:
                        t = time.monotonic()
                        try:
                            slot.violations = zyg.call({"op": "check", **cmd})["violations"]
                        finally:
                            slot.done.set()
                            with lock:
                                tally.check_s += time.monotonic() - t
                    slot.done.wait()
                    known = slot.violations
                finally:
                    if cleanup:
                        cleanup(work)
                    shutil.rmtree(work, ignore_errors=True)
                with lock:
                    tally.violations.extend(f"{where}: {v}" for v in known)
                    if run.get("completed"):
                        tally.points[phase] = run["points"]
                        tally.labels[phase] = run["labels"]
                        return
                    tally.runs += 1
            with lock:
                tally.violations.append(f"{scenario} {phase}: more than {max_points} points")
        except BaseException as exc:  # noqa: BLE001
            failures.append(exc)

    threads = [
        threading.Thread(target=phase_loop, args=(zygotes[i % len(zygotes)], phase))
        for i, phase in enumerate(("before", "after"))
    ]
    for t in threads:
        t.start()
        if len(zygotes) == 1:
            t.join()
    for t in threads:
        t.join()
    if failures:
        raise failures[0]
    if tally.points.get("before") != tally.points.get("after") or tally.labels.get("before") != tally.labels.get(
        "after"
    ):
        tally.violations.append(
            f"{scenario}: the two phases saw different actions "
            f"({tally.points.get('before')} vs {tally.points.get('after')}): not deterministic"
        )
    return tally


# --- a `weightsync serve` subprocess (shared with test_concurrency.py) --------------------------------------------


class Served(ServeProcess):
    """`weightsync serve` in a subprocess on a free loopback port (the shared helper, preset for these suites)."""

    def __init__(
        self,
        data: Path,
        *,
        catalog: str | None = None,
        log_path: Path,
        extra: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        exe = Path(sys.executable).with_name("weightsync")
        cmd = (str(exe),) if exe.exists() else SERVE_CLI
        args = ["--data", str(data), "--log-level", "warning"]
        if catalog:
            args += ["--catalog", catalog]
        args += extra or []
        super().__init__(args, log_path=log_path, command=cmd, env=clean_env(env))


if __name__ == "__main__":
    # Modules that build on this one (_crash_parts) import it as `_crash_util`: the same module, not a copy.
    sys.modules.setdefault("_crash_util", sys.modules["__main__"])
    if sys.argv[1:2] == ["zygote"]:
        zygote_main()
    else:
        sys.exit("usage: _crash_util.py zygote")
