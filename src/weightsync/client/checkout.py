"""A checkout: a directory DIR holding one version of a model byte for byte, switched atomically.

Layout (docs/DESIGN.md "Checkouts")::

    DIR/<path>                          symlink → (../)*.weightsync/current/data/<path>
    DIR/.weightsync/current             symlink → versions/<id>        (the one atomic switch)
    DIR/.weightsync/state.json          symlink → current/state.json   (absent: nothing trusted)
    DIR/.weightsync/versions/<id>/      state.json + data/<path>: one complete version
    DIR/.weightsync/tmp/                files being decoded by a pull
    DIR/.weightsync/objects/            the object cache of a pull
    DIR/.weightsync/lock                flock: one writer at a time

Every model file is read through ``current``, so replacing that one symlink
(rename(2) of a new link over it) switches every file of the version at
once: a reader opening ``DIR/<path>`` gets either the old version's bytes or
the new one's, and a process holding an old file open keeps reading the old
bytes (old files are never written, only unlinked). Paths a new version adds
are linked before the switch (they dangle, i.e. are absent, until it) and
paths it drops are unlinked after it (they dangle from it on), so the files
that open are always exactly one version's complete set. Files a version
shares with the previous one are hard links to the same inode. The previous
version stays until the next pull, which removes it first: disk use is at
most the new version plus the old one.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import stat
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from weightsync import errors
from weightsync.client._objects import ObjectCache
from weightsync.client.decode import Tree, map_file
from weightsync.client.state import CheckoutState, FileState, write_atomic
from weightsync.codec.checkpoint import STATE_DIR, Checkpoint, CheckpointFile, layout_of
from weightsync.codec.decoder import sums_of
from weightsync.codec.frame import xxh3_128
from weightsync.codec.manifest import DIGEST_XXH3

DATA = "data"
"""Where a version directory keeps the model files."""


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; the rename order still holds
    finally:
        os.close(fd)


def _link_or_copy(src: Path, dst: Path) -> None:
    """`dst` becomes the same bytes as `src`: a hard link (shared, no copy) where the filesystem has them."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


class Workspace:
    """Temporary files of a pull, under DIR/.weightsync/tmp (same filesystem as the versions: renames)."""

    def __init__(self, root: Path) -> None:
        self.dir = root / STATE_DIR / "tmp"
        shutil.rmtree(self.dir, ignore_errors=True)  # leftovers of a killed pull
        self.dir.mkdir(parents=True, exist_ok=True)

    def new(self) -> Path:
        return self.dir / uuid.uuid4().hex

    def owns(self, path: Path) -> bool:
        return path.parent == self.dir

    def clear(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


class Checkout:
    """One checkout directory: its lock, trusted state, versions, workspace and object cache.

    Every method that changes the directory must run inside :meth:`locked`.
    Not thread-safe; the lock serializes processes.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.meta = self.root / STATE_DIR
        self.versions = self.meta / "versions"
        self.current = self.meta / "current"

    def __repr__(self) -> str:
        return f"Checkout({str(self.root)!r})"

    @contextmanager
    def locked(self) -> Iterator[Checkout]:
        """Exclusive lock on the checkout (Conflict when another process holds it): one writer at a time."""
        self.meta.mkdir(parents=True, exist_ok=True)
        with open(self.meta / "lock", "a+b") as f:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise errors.Conflict(f"{self.root}: another weightsync process is updating this directory") from None
            try:
                yield self
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    # --- what it holds ------------------------------------------------------------------

    def state(self) -> CheckoutState | None:
        """The trusted state (DIR/.weightsync/state.json), or None."""
        return CheckoutState.read(self.meta / "state.json")

    def installed(self) -> CheckoutState | None:
        """The state of the version `current` names, trusted or not (None: no version installed)."""
        return CheckoutState.read(self.current / "state.json")

    def forget(self) -> None:
        """Stop trusting what the checkout holds (the files stay readable): the next pull is a full one."""
        (self.meta / "state.json").unlink(missing_ok=True)

    def objects(self) -> ObjectCache:
        """The checkout's own object cache (DIR/.weightsync/objects)."""
        return ObjectCache(self.meta / "objects")

    def workspace(self) -> Workspace:
        return Workspace(self.root)

    def _target(self, path: str) -> str:
        """What the symlink DIR/`path` holds: relative, so a checkout can be moved or copied whole."""
        depth = len(Path(path).parts) - 1
        return "../" * depth + f"{STATE_DIR}/current/{DATA}/{path}"

    def _is_ours(self, path: str) -> bool:
        try:
            return os.readlink(self.root / path) == self._target(path)
        except OSError:
            return False

    def locate(self, state: CheckoutState) -> dict[str, Path] | None:
        """Where each file of `state` lives (its version directory, or a plain file in DIR); None if one is gone.

        A plain file at DIR/<path> is what weightsync before atomic checkouts
        wrote (or a half-adopted checkout): `adopt` moves it into a version.
        """
        out: dict[str, Path] = {}
        for f in state.files:
            where = self._locate(f.path)
            if where is None:
                return None
            out[f.path] = where
        return out

    def _locate(self, path: str) -> Path | None:
        """Where the file at DIR/`path` lives: through our link, a plain file there, or None (absent, or
        something else: a directory, someone's symlink, a symlinked directory on the way)."""
        link = self.root / path
        if self._symlinked_parent(path) is not None:
            return None
        if self._is_ours(path):
            return self.current / DATA / path
        if link.is_file() and not link.is_symlink():
            return link
        return None

    def verify(self, state: CheckoutState, pool: ThreadPoolExecutor, *, deep: bool = True) -> bool:
        """Whether the checkout still holds `state`'s version: every file there with its size and,
        if `deep`, every segment's digest (of the state's kind: xxh3-128, or the tensor checksum
        with large segments summed in parts on `pool`)."""
        return len(self._matching(state, pool, deep=deep, every=True)) == len(state.files)

    def matching(self, state: CheckoutState, pool: ThreadPoolExecutor) -> dict[str, Path]:
        """The files of `state` the checkout already holds as they are in `state`, by path → where they live.

        `verify` file by file (size and every segment's digest): a directory that holds
        some of a version's files (pull --adopt) keeps those and gets only the others.
        """
        return self._matching(state, pool, deep=True, every=False)

    def _matching(self, state: CheckoutState, pool: ThreadPoolExecutor, *, deep: bool, every: bool) -> dict[str, Path]:
        """The files of `state` that are there with their size and (`deep`) digests; `every`: stop at the
        first one that is not (then what is returned is short of `state`'s files)."""
        found: dict[str, tuple[FileState, Path]] = {}
        for f in state.files:
            where = self._locate(f.path)
            try:
                st = os.lstat(where) if where is not None else None
            except OSError:
                st = None
            if where is None or st is None or not stat.S_ISREG(st.st_mode) or st.st_size != f.size:
                if every:
                    return {}
                continue
            found[f.path] = (f, where)
        if not deep:
            return {path: where for path, (_, where) in found.items()}
        maps = {path: map_file(where, f.size) for path, (f, where) in found.items()}
        # (path, bytes, digest, element width) of every segment, all hashed at once on `pool`
        segments = [(path, maps[path][o : o + n], h, w) for path, (f, _) in found.items() for o, n, h, w in f.segments]
        if state.digest_kind != DIGEST_XXH3:
            sums = sums_of(pool, [(data, w) for _, data, _, w in segments])
            ok = [s.hex() == h for s, (_, _, h, _) in zip(sums, segments, strict=True)]
        else:
            jobs = [pool.submit(lambda d: xxh3_128(d).hex(), data) for _, data, _, _ in segments]
            ok = [fut.result() == h for fut, (_, _, h, _) in zip(jobs, segments, strict=True)]
        bad = {path for (path, _, _, _), good in zip(segments, ok, strict=True) if not good}
        return {path: where for path, (_, where) in found.items() if path not in bad}

    def _current_data(self) -> Path:
        """The current version's data directory, resolved (stays valid when `current` is switched)."""
        return self.meta / os.readlink(self.current) / DATA

    def tree(self, state: CheckoutState) -> Tree:
        """The files of `state` as the base of a pull (call after `verify` and `adopt`)."""
        return state.tree(self._current_data())

    def checkpoint(self, state: CheckoutState) -> Checkpoint:
        """The held version as a codec Checkpoint (read-only maps of its files)."""
        files = []
        data_dir = self._current_data()
        for f in state.files:
            data = map_file(data_dir / f.path, f.size)
            files.append(CheckpointFile(layout_of(f.path, data), data))
        return Checkpoint(files, single_file=state.single_file)

    # --- changing it ----------------------------------------------------------------------

    def sweep(self) -> None:
        """Remove what is not the current version: the previous one, a half-made next one, crash leftovers."""
        keep = os.readlink(self.current) if self.current.is_symlink() else None
        if self.versions.is_dir():
            for v in self.versions.iterdir():
                if f"versions/{v.name}" != keep:
                    shutil.rmtree(v, ignore_errors=True)
        for stale in self.meta.glob(".*.tmp"):  # a crash inside write_atomic or a link swap
            stale.unlink(missing_ok=True)
        shutil.rmtree(self.meta / "tmp", ignore_errors=True)
        installed = self.installed()
        self._drop_links(keep={f.path for f in installed.files} if installed else set())

    def adopt(self, state: CheckoutState) -> None:
        """Move a verified checkout whose files are (partly) plain files into a version directory.

        Each step leaves every path reading `state`'s bytes: the version is
        made of hard links to the plain files, then each plain file is
        replaced by a link to the same bytes.
        """
        where = self.locate(state)
        assert where is not None, "adopt a verified checkout"
        if all(self._is_ours(p) for p in where) and (self.meta / "state.json").is_symlink():
            return
        vdir = self._new_version(state)
        for path, loc in where.items():
            dst = vdir / DATA / path
            dst.parent.mkdir(parents=True, exist_ok=True)
            _link_or_copy(loc, dst)
        self._seal(vdir, state)
        self._switch(vdir)
        for path in where:
            self._link(path)
        self._trust()
        _fsync_dir(self.root)

    def install(self, tree: Tree, state: CheckoutState, work: Workspace) -> None:
        """Make `tree` (decoded into `work`, or shared with the current version) the checkout's version, atomically.

        Every destination is checked before anything changes (InvalidName for a
        symlinked directory on the way, Conflict for a directory where a file
        goes), so a refused install leaves the checkout as it was. A file of `tree`
        that is the plain file at its own path (one a pull --adopt kept) joins the
        version as a hard link to the same inode, and its path becomes our link
        only after the switch: it reads the same bytes all along.
        """
        for path in tree.files:
            parent = self._symlinked_parent(path)
            if parent is not None:
                raise errors.InvalidName(
                    f"{path}: {parent} is a symlink inside the checkout; refusing to write through it"
                )
            if (self.root / path).is_dir() and not (self.root / path).is_symlink():
                raise errors.Conflict(
                    f"{self.root / path} is a directory where v{state.number} has a file: move it away"
                )
        vdir = self._new_version(state)
        for path, held in tree.files.items():
            dst = vdir / DATA / path
            dst.parent.mkdir(parents=True, exist_ok=True)
            if work.owns(held.location):
                with open(held.location, "rb+") as fh:
                    os.fsync(fh.fileno())
                os.replace(held.location, dst)
            else:  # unchanged since the current version, or kept by an adopt: share its inode
                _link_or_copy(held.location, dst)
        self._seal(vdir, state)
        kept = {path for path, held in tree.files.items() if held.location == self.root / path}
        for path in tree.files:  # new paths dangle (are absent) until the switch
            if path not in kept:
                self._link(path)
        self._switch(vdir)
        for path in tree.files:
            if path in kept:
                self._link(path)
        self._trust()
        self._drop_links(keep=set(tree.files))  # dropped paths dangle (are absent) from the switch on
        _fsync_dir(self.root)

    def _new_version(self, state: CheckoutState) -> Path:
        vdir = self.versions / f"v{state.number}-{uuid.uuid4().hex[:8]}"
        (vdir / DATA).mkdir(parents=True)
        return vdir

    def _seal(self, vdir: Path, state: CheckoutState) -> None:
        """Write the version's state and make its directory entries durable before anything points at it."""
        write_atomic(vdir / "state.json", state.to_json())
        dirs = {vdir / DATA}
        for f in state.files:
            dirs.update(d for d in (vdir / DATA / f.path).parents if d.is_relative_to(vdir / DATA))
        for d in sorted(dirs, key=lambda d: -len(d.parts)) + [vdir, self.versions]:
            _fsync_dir(d)

    def _swap_link(self, link: Path, target: str) -> None:
        """Point `link` at `target` in one rename(2): a reader sees the old target or the new one."""
        # Made inside .weightsync (the sweep removes it after a crash) and renamed into place: relative
        # targets resolve from where the link ends up, and DIR never shows a temporary name.
        tmp = self.meta / f".link.{uuid.uuid4().hex[:8]}.tmp"
        os.symlink(target, tmp)
        os.replace(tmp, link)

    def _switch(self, vdir: Path) -> None:
        self._swap_link(self.current, f"versions/{vdir.name}")
        _fsync_dir(self.meta)

    def _trust(self) -> None:
        link = self.meta / "state.json"
        if not (link.is_symlink() and os.readlink(link) == "current/state.json"):
            self._swap_link(link, "current/state.json")

    def _link(self, path: str) -> None:
        if self._is_ours(path):
            return
        link = self.root / path
        link.parent.mkdir(parents=True, exist_ok=True)
        self._swap_link(link, self._target(path))

    def _symlinked_parent(self, path: str) -> Path | None:
        """A directory symlink on the way to DIR/`path` (it would redirect writes outside the checkout)."""
        current = self.root
        for part in Path(path).parts[:-1]:
            current = current / part
            if current.is_symlink():
                return current
        return None

    def _drop_links(self, keep: set[str]) -> None:
        """Unlink our links to paths outside `keep`, and the directories that leaves empty."""
        for dirpath, dirnames, filenames in os.walk(self.root):
            here = Path(dirpath)
            if here == self.root:
                dirnames[:] = [d for d in dirnames if d != STATE_DIR]
            for name in filenames + [d for d in dirnames if (here / d).is_symlink()]:
                rel = (here / name).relative_to(self.root).as_posix()
                if rel not in keep and self._is_ours(rel):
                    (here / name).unlink()
                    self._prune(here)

    def _prune(self, d: Path) -> None:
        while d != self.root:
            try:
                d.rmdir()
            except OSError:
                return  # not empty: someone's files, or the version's
            d = d.parent
