"""One prepared update per host: the first worker to take the host's lock downloads and decodes a version
once, the others read their slices from it (docs/ENGINES.md "One download per host").

A host store is a directory on the host's own disk or in ``/dev/shm`` that every
worker of one engine on that host names alike (``weightsync_attach``'s
``host_dir``). Per model it holds, for a few recent versions, a directory
``v<N>/`` made once and never changed:

- ``data.bin``: every tensor of version N, raw, at the offsets ``index.json``
  gives (each 64-byte aligned), checked against the version's manifest digests
  when it was made;
- ``changes.bin``: for each tensor that changed from ``base`` (the version the
  store held before, named in ``index.json``), the flat indices of the changed
  elements (int64) then their new values (the tensor's element bytes);
- ``index.json``: ``version``, ``base`` (None: made from nothing, no changes),
  ``digest_kind``, ``bytes`` (received over the network to make it) and per
  tensor ``dtype``, ``shape``, ``digest``, ``offset``, and where its changes are.

How a version gets there (:meth:`HostStore.get`): a worker takes the host's
lock (``fcntl.flock`` on ``<model>/lock``: released by the kernel if the holder
dies); if ``v<N>/`` is there it is read; else this worker prepares it with its
own Subscriber from the newest version the store holds (a delta: one download
of the frames that change, per host), applies the update into a copy of that
version's ``data.bin`` (``Subscriber.apply``: every changed tensor's base checked
before and its result after, against the manifests), records the changed
elements, and renames the directory into place. Workers that come after find it
ready. A worker that finds a version bad (:meth:`HostStore.drop`) removes it, so
the next one to need it makes it again.

The store keeps :data:`KEEP` versions (newest first); older ones are removed
when a new one is made (a worker still reading one keeps its memory map).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from weightsync.client.subscriber import Subscriber
from weightsync.codec.dtypes import UINT, by_name

KEEP = 3
"""Versions a host store keeps: the newest, the one it was made from, and one more for a lagging worker."""
ALIGN = 64


@dataclass(frozen=True)
class Stored:
    """One tensor of a stored version: dtype name, shape, digest, and where its bytes and changes lie."""

    dtype: str
    shape: tuple[int, ...]
    digest: str
    offset: int
    changes: tuple[int, int] | None
    """``(offset in changes.bin, count)`` of its changed elements; None: not changed from ``base`` or unknown."""

    @property
    def width(self) -> int:
        return by_name(self.dtype).width

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.width


class HostVersion:
    """A version in a host store, read-only: its tensors as memory-mapped arrays of unsigned integers."""

    def __init__(self, path: Path) -> None:
        self.path = path
        doc = json.loads((path / "index.json").read_text())
        self.version: int = doc["version"]
        self.base: int | None = doc["base"]
        self.digest_kind: str = doc["digest_kind"]
        self.bytes: int = doc["bytes"]
        self.seconds: float = doc["seconds"]
        self.tensors = {
            name: Stored(t["dtype"], tuple(t["shape"]), t["digest"], t["offset"], _pair(t.get("changes")))
            for name, t in doc["tensors"].items()
        }
        self._data = _map(path / "data.bin")
        self._changes = _map(path / "changes.bin")

    def array(self, name: str) -> np.ndarray:
        """Tensor ``name`` of this version: its elements as unsigned integers of its width, in its shape."""
        t = self.tensors[name]
        return self._data[t.offset : t.offset + t.nbytes].view(UINT[t.width]).reshape(t.shape)

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: self.array(name) for name in self.tensors}

    def changes(self, name: str) -> tuple[np.ndarray, np.ndarray] | None:
        """``(flat indices, new values)`` of the elements of ``name`` that changed from :attr:`base`;
        None when the store does not know them (made from nothing, or a tensor new in this version)."""
        t = self.tensors[name]
        if t.changes is None:
            return None
        at, count = t.changes
        positions = self._changes[at : at + 8 * count].view(np.int64)
        values = self._changes[at + 8 * count : at + 8 * count + t.width * count].view(UINT[t.width])
        return positions, values

    def changed(self, name: str) -> bool:
        """Whether the store knows the changes of ``name`` from :attr:`base` (possibly none)."""
        return self.tensors[name].changes is not None


def _pair(value: Any) -> tuple[int, int] | None:
    return None if value is None else (int(value[0]), int(value[1]))


def _map(path: Path) -> np.ndarray:
    if path.stat().st_size == 0:
        return np.zeros(0, np.uint8)
    return np.memmap(path, dtype=np.uint8, mode="r")


class HostStore:
    """The host store of one model under ``root`` (module docstring). Thread- and process-safe."""

    def __init__(self, root: str | os.PathLike[str], model: str) -> None:
        self.dir = Path(root) / model
        # Only the engine's user may write here: its workers trust what the store holds (each slice is checked
        # against a checksum computed from the same store).
        Path(root).mkdir(mode=0o700, parents=True, exist_ok=True)
        self.dir.mkdir(mode=0o700, exist_ok=True)

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """The host's lock for this model: one worker at a time makes or drops a version."""
        with open(self.dir / "lock", "a+b") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def versions(self) -> list[int]:
        """The versions the store holds, newest first."""
        out = []
        for p in self.dir.glob("v*"):
            if p.is_dir() and p.name[1:].isdigit() and (p / "index.json").exists():
                out.append(int(p.name[1:]))
        return sorted(out, reverse=True)

    def get(self, sub: Subscriber, version: int) -> tuple[HostVersion, bool]:
        """Version ``version`` from the store, made by ``sub`` when absent; and whether this call made it.

        Raises what the subscriber raises (the version is then absent: the next
        caller tries again).
        """
        with self.lock():
            path = self.dir / f"v{version}"
            if (path / "index.json").exists():
                return HostVersion(path), False
            self._make(sub, version)
            return HostVersion(path), True

    def drop(self, version: int) -> None:
        """Remove ``version`` (found bad): the next :meth:`get` makes it again."""
        with self.lock():
            shutil.rmtree(self.dir / f"v{version}", ignore_errors=True)

    def _make(self, sub: Subscriber, version: int) -> None:
        import torch

        from weightsync.client.tensors import torch_dtype

        for stale in self.dir.glob(".v*-*"):  # left by a maker that died: none can be running (the lock is ours)
            shutil.rmtree(stale, ignore_errors=True)
        held = [v for v in self.versions() if v != version]
        prev = HostVersion(self.dir / f"v{held[0]}") if held else None
        sub.version = prev.version if prev is not None else None
        prepared = sub.prepare(version)
        tmp = Path(tempfile.mkdtemp(prefix=f".v{version}-", dir=self.dir))
        try:
            layout: dict[str, tuple[str, tuple[int, ...], str, int]] = {}
            total = 0
            for name, (dtype, shape, digest) in prepared.specs.items():
                layout[name] = (dtype.name, tuple(shape), digest, total)
                total += -(-int(np.prod(shape, dtype=np.int64)) * dtype.width // ALIGN) * ALIGN
            with open(tmp / "data.bin", "wb") as f:
                f.truncate(total)
            data = np.memmap(tmp / "data.bin", dtype=np.uint8, mode="r+") if total else np.zeros(0, np.uint8)
            arrays: dict[str, np.ndarray] = {}
            kept: set[str] = set()
            for name, (dname, shape, _, offset) in layout.items():
                width = by_name(dname).width
                n = int(np.prod(shape, dtype=np.int64)) * width
                arrays[name] = data[offset : offset + n].view(UINT[width]).reshape(shape)
                old = prev.tensors.get(name) if prev is not None else None
                if prev is not None and old is not None and (old.dtype, old.shape) == (dname, shape):
                    arrays[name][...] = prev.array(name)
                    kept.add(name)
            tensors = {name: torch.from_numpy(a).view(torch_dtype(layout[name][0])) for name, a in arrays.items()}
            sub.apply(tensors, prepared)  # base and result of every changed tensor checked against the manifests
            index: dict[str, Any] = {}
            at = 0
            with open(tmp / "changes.bin", "wb") as out:
                for name, (dname, shape, digest, offset) in layout.items():
                    entry: dict[str, Any] = {"dtype": dname, "shape": list(shape), "digest": digest, "offset": offset}
                    if name in kept:
                        assert prev is not None
                        new = arrays[name].reshape(-1)
                        if name in prepared.updates:
                            positions = np.flatnonzero(prev.array(name).reshape(-1) != new).astype(np.int64)
                        else:
                            positions = np.zeros(0, np.int64)
                        values = np.ascontiguousarray(new[positions])
                        out.write(positions.tobytes())
                        out.write(values.tobytes())
                        entry["changes"] = [at, len(positions)]
                        at += positions.nbytes + values.nbytes
                    index[name] = entry
            if isinstance(data, np.memmap):
                data.flush()
            del data, arrays, tensors
            doc = {
                "version": version,
                "base": prev.version if prev is not None else None,
                "digest_kind": prepared.digest_kind,
                "bytes": prepared.bytes_received,
                "seconds": prepared.seconds,
                "tensors": index,
            }
            (tmp / "index.json").write_text(json.dumps(doc))
            for p in tmp.iterdir():
                with open(p, "rb") as f:
                    os.fsync(f.fileno())
            os.rename(tmp, self.dir / f"v{version}")
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        for old_version in self.versions()[KEEP:]:
            shutil.rmtree(self.dir / f"v{old_version}", ignore_errors=True)


def default_root() -> Path:
    """``$WEIGHTSYNC_HOST_DIR``, else ``/dev/shm/weightsync`` when ``/dev/shm`` exists, else the temp dir's."""
    env = os.environ.get("WEIGHTSYNC_HOST_DIR")
    if env:
        return Path(env)
    if Path("/dev/shm").is_dir():
        return Path("/dev/shm/weightsync")
    return Path(tempfile.gettempdir()) / "weightsync-host"


__all__ = ["KEEP", "HostStore", "HostVersion", "Stored", "default_root"]
