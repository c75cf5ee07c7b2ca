"""Fleet administration: the server's identity, deleting a model, pinning the version followers hold.

docs/API.md "Fleet administration". Each function is one use case over :class:`Ops`, reaching the
catalog through its public methods in a worker thread (the catalog is synchronous), like
:mod:`weightsync.ops.maintenance`. Model settings are :meth:`Ops.update_model_settings`.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from weightsync.catalog import DeletedModel, Model
from weightsync.codec.manifest import DIGEST_KINDS
from weightsync.common import VERSION
from weightsync.ops.core import Ops
from weightsync.ops.records import record_of

__all__ = ["ServerInfo", "delete_model", "pin_model", "server_info"]


@dataclass(frozen=True)
class ServerInfo:
    """Who answers: the catalog's server id (the same for every service on it), the release, the formats it reads."""

    id: str
    version: str
    formats: list[int]


async def server_info(ops: Ops) -> ServerInfo:
    """The server's identity: clients key what they cache per server by ``id``, never by host and port."""
    server_id = await asyncio.to_thread(ops.catalog.server_id)
    return ServerInfo(id=server_id, version=VERSION, formats=sorted(DIGEST_KINDS))


async def pin_model(ops: Ops, name: str, number: int | None) -> Model:
    """Make followers of `name` hold committed version `number` (None: follow the head again); the model.

    Watchers, event streams and plans without a target answer the pinned version while the head
    moves on; retention keeps its chain. ModelNotFound, VersionNotFound (never committed, or deleted).
    """
    model = await asyncio.to_thread(ops.catalog.pin_model, name, number)
    ops.wake_followers(name)
    return model


async def delete_model(ops: Ops, name: str) -> DeletedModel:
    """Delete model `name`: its versions, pending publishes, leases and ledger; readers get ModelNotFound after.

    Objects are not deleted here: they become unreferenced now, and GC deletes them once its grace
    period has passed (objects other models' versions use stay). The commit records go at once,
    as retention's do, so that a catalog rebuilt from the store does not bring the model back.
    """
    gone = await asyncio.to_thread(ops.catalog.delete_model, name, now=ops.clock())
    ops.wake_followers(name)
    await ops.drain()  # a record still being written for a commit just before would outlive the deletion
    for v in gone.versions:
        await ops.delete_object(record_of(v).digest)
    return gone
