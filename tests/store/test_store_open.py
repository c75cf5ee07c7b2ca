"""`ObjectStore.open()`: on the ABC, forwarded by every wrapper, retried by RetryingStore (docs/STORE.md)."""

from __future__ import annotations

import os

import pytest

from weightsync import errors
from weightsync.store import ForwardingStore, RetryingStore
from weightsync.store.faulty import FaultyStore
from weightsync.store.fs import FsStore

pytestmark = pytest.mark.anyio


class OpeningFsStore(FsStore):
    """A filesystem store whose open() fails transiently `failures` times, then counts successful opens."""

    def __init__(self, root: str | os.PathLike[str], failures: int = 0) -> None:
        super().__init__(root)
        self.failures = failures
        self.opened = 0

    async def open(self) -> None:
        if self.failures:
            self.failures -= 1
            raise errors.StoreUnavailable("not yet")
        self.opened += 1


async def test_fs_open_is_a_harmless_no_op(tmp_path):
    store = FsStore(tmp_path)
    await store.open()
    await store.open()
    put = await store.put(b"x")
    assert await store.get(put.digest) == b"x"
    await store.close()


async def test_wrappers_open_the_backend_through_every_layer(tmp_path):
    backend = OpeningFsStore(tmp_path)
    store = RetryingStore(FaultyStore(ForwardingStore(backend), seed=1), base_delay=0)
    await store.open()
    assert backend.opened == 1


async def test_retrying_store_retries_a_transient_open(tmp_path):
    backend = OpeningFsStore(tmp_path, failures=2)
    await RetryingStore(backend, attempts=3, base_delay=0).open()
    assert backend.opened == 1 and backend.failures == 0
    stubborn = OpeningFsStore(tmp_path, failures=5)
    with pytest.raises(errors.StoreUnavailable):
        await RetryingStore(stubborn, attempts=2, base_delay=0).open()
    assert stubborn.opened == 0
