"""The publisher's base cache on disk: where ``weightsync push`` keeps what the next delta needs.

Layout (one base per model and server)::

    <root>/publish/<server id>/<model path name>/     a checkout (client/checkout.py) of one version
    <root>/publish/<server id>/<model path name>/.weightsync/publisher.lock
                                                      flocked by the publisher using it (client/base.py)

``<root>`` is :func:`cache_root`: ``--cache-dir``, else ``$WEIGHTSYNC_CACHE``, else
``$XDG_CACHE_HOME/weightsync``, else ``~/.cache/weightsync``. ``<server id>`` is the id the
server answers at ``GET /v1/info`` (docs/API.md "Fleet administration"): one per catalog, so
every port and every service on one catalog shares one folder, and another catalog gets
another; only a server without that route (404) is keyed by its host and port instead.
``<model path name>`` is :func:`weightsync.common.model_path_name` (``Org/Name`` →
``Org--Name``). Each base holds the last version the publisher committed or caught up with:
about the model's size on disk, per model and server.

:func:`list_bases` shows what is there and :func:`prune` removes bases, never one a running
publisher holds (it keeps an exclusive flock on ``publisher.lock`` from construction to close).
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import stat
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from weightsync import errors
from weightsync.client._http import Api
from weightsync.client.checkout import Checkout
from weightsync.codec.checkpoint import STATE_DIR
from weightsync.common import model_path_name

__all__ = ["CachedBase", "PruneResult", "cache_root", "list_bases", "prune", "publish_root", "server_id"]

PUBLISH = "publish"
"""The folder under the cache root that holds the publishers' bases."""
LOCK = "publisher.lock"
"""The file under a base's ``.weightsync/`` that its publisher holds an exclusive flock on."""
_SAFE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def cache_root(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The cache root: `explicit` (``--cache-dir``), else $WEIGHTSYNC_CACHE, else $XDG_CACHE_HOME/weightsync
    or ~/.cache/weightsync."""
    if explicit is not None:
        return Path(explicit)
    env = os.environ.get("WEIGHTSYNC_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "weightsync"


def server_slug(server: str) -> str:
    """A server URL as a folder name (``http://127.0.0.1:8400`` → ``127.0.0.1_8400``)."""
    return "".join(c if c.isalnum() or c in "-." else "_" for c in server.split("://", 1)[-1]).strip("_.")


def server_id(api: Api) -> str:
    """The folder name that keys `api`'s server: its ``/v1/info`` id, or its host:port slug without that route.

    BadResponse for an id that cannot be a folder name; the other errors of a request as they come.
    """
    try:
        ident = api.info().id
    except errors.NotFound as exc:
        if getattr(exc, "status", None) != 404:
            raise
        return server_slug(api.server)  # a server older than /v1/info
    if not _SAFE_ID.match(ident):
        raise errors.BadResponse(f"bad response from the server: Info.id {ident!r} is not a server id")
    return ident


def publish_root(root: str | os.PathLike[str], server: str) -> Path:
    """Where the bases kept for server id `server` live: the ``cache_dir`` to give a Publisher."""
    return Path(root) / PUBLISH / server


@dataclass(frozen=True)
class CachedBase:
    """One base in the cache: which server and model it is for, the version it holds, its size on disk."""

    server_id: str
    model: str
    path: Path
    version: int | None
    """The version held; None when nothing is trusted (a publish died before its first commit)."""
    bytes: int
    """Bytes of the files under `path` (hard links counted once)."""
    in_use: bool
    """A running publisher holds it."""
    part: str | None = None
    """``RANK/WORLD`` for the base of one part of a multi-part publish (``<model>/part-R-of-W``), else None."""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["path"] = str(self.path)
        return d


@dataclass(frozen=True)
class PruneResult:
    """What :func:`prune` removed, and the bases it left because a running publisher holds them."""

    removed: list[CachedBase] = field(default_factory=list)
    in_use: list[CachedBase] = field(default_factory=list)

    @property
    def bytes_freed(self) -> int:
        return sum(b.bytes for b in self.removed)

    def to_dict(self) -> dict[str, Any]:
        return {
            "removed": [b.to_dict() for b in self.removed],
            "in_use": [b.to_dict() for b in self.in_use],
            "bytes_freed": self.bytes_freed,
        }


def list_bases(root: str | os.PathLike[str]) -> list[CachedBase]:
    """Every base under `root` (a cache root), by server id then model; [] when there is none."""
    out: list[CachedBase] = []
    for folder in _folders(Path(root) / PUBLISH):
        for base in _folders(folder):
            parts = [p for p in _folders(base) if _PART.fullmatch(p.name)]
            if parts and Checkout(base).state() is None:  # a multi-part publisher's: one base per part
                out.extend(_describe(folder.name, p, model_folder=base) for p in parts)
            else:
                out.append(_describe(folder.name, base))
    return out


def prune(root: str | os.PathLike[str], *, model: str | None = None, server: str | None = None) -> PruneResult:
    """Remove the bases under `root` for `model` (any when None) and server id `server` (any when None).

    A base a running publisher holds is left as it is and reported in ``in_use``. Each base
    goes in one rename out of sight, then is deleted: a publisher starting meanwhile finds it
    whole or absent (its next push then downloads the head to diff against). InvalidName
    for a bad model name.
    """
    folder_name = model_path_name(model) if model is not None else None
    result = PruneResult()
    for base in list_bases(root):
        model_folder = base.path.parent if base.part is not None else base.path
        if (folder_name is not None and model_folder.name != folder_name) or (
            server is not None and base.server_id != server
        ):
            continue
        with _unheld(base.path) as free:
            if not free:
                result.in_use.append(base)
                continue
            trash = Path(root) / PUBLISH / f".pruning-{uuid.uuid4().hex}"
            os.replace(base.path, trash)
        shutil.rmtree(trash, ignore_errors=True)
        result.removed.append(base)
        for emptied in (base.path.parent, base.path.parent.parent) if base.part is not None else (base.path.parent,):
            try:
                emptied.rmdir()  # the model's folder of parts, the server's folder, once they hold no base
            except OSError:
                break
    return result


def _folders(parent: Path) -> list[Path]:
    """The sub-folders of `parent` that can be server ids or models, sorted ([] when `parent` is absent)."""
    try:
        entries = list(parent.iterdir())
    except FileNotFoundError:
        return []
    return sorted(p for p in entries if not p.name.startswith(".") and p.is_dir() and not p.is_symlink())


_PART = re.compile(r"part-([0-9]+)-of-([0-9]+)")


def _describe(server: str, path: Path, model_folder: Path | None = None) -> CachedBase:
    state = Checkout(path).state()
    named = (model_folder or path).name.replace("--", "/")  # names never hold "--"
    model = state.model if state is not None else named
    part = None
    if model_folder is not None and (m := _PART.fullmatch(path.name)):
        part = f"{m.group(1)}/{m.group(2)}"
    number = state.number if state is not None else None
    return CachedBase(server, model, path, number, _size(path), _held(path), part)


def _size(path: Path) -> int:
    """Bytes of the regular files under `path`, each inode once (versions share files by hard links)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for dirpath, _, filenames in os.walk(path):
        for name in filenames:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue  # removed while we walk
            if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def _held(path: Path) -> bool:
    """Whether a running publisher holds the base at `path`."""
    with _unheld(path) as free:
        return not free


@contextmanager
def _unheld(path: Path) -> Iterator[bool]:
    """Yield whether no publisher holds the base at `path`; while True, hold its lock so none can start."""
    try:
        fd = os.open(path / STATE_DIR / LOCK, os.O_RDONLY)
    except FileNotFoundError:
        yield True  # never used by a publisher that locks, or one that never got that far
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)
