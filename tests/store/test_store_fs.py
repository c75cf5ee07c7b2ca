"""Filesystem-backend specifics: layout, durability steps, temp cleanup, no-hard-link fallback."""

from __future__ import annotations

import errno
import hashlib
import os
import stat
import time
from pathlib import Path

import pytest

from weightsync import errors
from weightsync.store.fs import FsStore

pytestmark = pytest.mark.anyio


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


async def test_layout_is_objects_ab_cd_digest(tmp_path: Path) -> None:
    st = FsStore(tmp_path)
    digest = (await st.put(b"layout")).digest
    path = tmp_path / "objects" / digest[:2] / digest[2:4] / digest
    assert st.path_of(digest) == path
    assert path.read_bytes() == b"layout"
    # Objects are immutable on disk too.
    assert stat.S_IMODE(path.stat().st_mode) & 0o222 == 0
    assert list((tmp_path / "tmp").iterdir()) == []


async def test_put_does_not_rewrite_an_existing_file(tmp_path: Path) -> None:
    st = FsStore(tmp_path)
    digest = (await st.put(b"first")).digest
    inode = st.path_of(digest).stat().st_ino
    assert (await st.put(b"first")).created is False
    assert st.path_of(digest).stat().st_ino == inode


async def test_paths_never_leave_the_root(tmp_path: Path) -> None:
    st = FsStore(tmp_path / "root")
    (tmp_path / "secret").write_bytes(b"do not touch")
    for bad in ["../secret", "../" * 20 + "etc/passwd", str(tmp_path / "secret")]:
        with pytest.raises(errors.InvalidDigest):
            st.path_of(bad)
        with pytest.raises(errors.InvalidDigest):
            await st.delete(bad)
    assert (tmp_path / "secret").read_bytes() == b"do not touch"


async def test_list_ignores_foreign_files(tmp_path: Path) -> None:
    st = FsStore(tmp_path)
    digest = (await st.put(b"real")).digest
    leaf = st.path_of(digest).parent
    (leaf / "README").write_text("not an object")
    (leaf / ("f" * 64)).write_bytes(b"a digest in the wrong fan-out directory")
    (tmp_path / "objects" / "zz").mkdir()
    assert [i.digest async for i in st.list()] == [digest]


async def test_cleanup_temp_removes_only_old_files(tmp_path: Path) -> None:
    st = FsStore(tmp_path)
    old = tmp_path / "tmp" / "crashed-writer.tmp"
    fresh = tmp_path / "tmp" / "live-writer.tmp"
    old.write_bytes(b"partial")
    fresh.write_bytes(b"partial")
    past = time.time() - 7200
    os.utime(old, (past, past))
    assert await st.cleanup_temp(older_than_s=3600) == 1
    assert not old.exists() and fresh.exists()
    assert [i async for i in st.list()] == []


async def test_without_hard_links_writes_still_land(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_links(src: object, dst: object) -> None:
        raise OSError(errno.EPERM, "hard links not supported here")

    monkeypatch.setattr(os, "link", no_links)
    st = FsStore(tmp_path)
    first = await st.put(b"no links")
    second = await st.put(b"no links")
    assert (first.created, second.created) == (True, False)
    assert await st.get(first.digest) == b"no links"
    assert st.capabilities.atomic_create is False
    assert list((tmp_path / "tmp").iterdir()) == []


async def test_open_without_create_requires_a_store(tmp_path: Path) -> None:
    with pytest.raises(errors.StoreError):
        FsStore(tmp_path / "missing", create=False)
    FsStore(tmp_path / "made")
    FsStore(tmp_path / "made", create=False)


async def test_two_instances_share_one_root(tmp_path: Path) -> None:
    a, b = FsStore(tmp_path), FsStore(tmp_path)
    digest = (await a.put(b"shared")).digest
    assert await b.get(digest) == b"shared"
    assert (await b.put(b"shared")).created is False
