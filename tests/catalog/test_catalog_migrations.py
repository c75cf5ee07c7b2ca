"""Every migration upgrades a populated database: the data survives and what the migration adds works.

The test walks the revision graph, so each pair of consecutive revisions (previous head → new head)
is tested on SQLite and PostgreSQL. A new migration adds one entry to ``SEEDS`` (rows to insert at
its *down* revision, if that revision has no seed yet) and one to ``CHECKS`` (what must hold after
upgrading to it); ``test_every_migration_has_a_seed_and_a_check`` fails until it does. The generic
part (every row of every table survives, column for column) needs nothing per migration.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from alembic import command
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, MetaData, Table, insert, select, text, update
from sqlalchemy import exc as sa_exc

from weightsync.catalog import Catalog, make_engine
from weightsync.catalog import migrate as migrations
from weightsync.catalog.engine import writer

T = datetime(2030, 1, 1, tzinfo=UTC)
D = {name: (name * 64)[:64] for name in ("a", "b", "c", "d", "e", "f")}


def _chain() -> list[str]:
    """Revisions from the first to the head, in upgrade order."""
    script = ScriptDirectory.from_config(migrations.alembic_config())
    return [r.revision for r in reversed(list(script.walk_revisions("base", "heads")))]


PAIRS = list(zip(_chain(), _chain()[1:], strict=False))


def _upgrade(engine: Engine, revision: str) -> None:
    with writer(engine).begin() as conn:
        migrations.lock_for_migration(conn)
        command.upgrade(migrations.alembic_config(conn), revision)


def _tables(conn: Connection) -> dict[str, Table]:
    meta = MetaData()
    meta.reflect(conn)
    return {name: t for name, t in meta.tables.items() if name != "alembic_version"}


def _snapshot(conn: Connection) -> dict[str, list[dict[str, Any]]]:
    """Every row of every table, as dicts, in primary-key order."""
    out = {}
    for name, table in _tables(conn).items():
        order = list(table.primary_key.columns) or list(table.columns)
        out[name] = [dict(r._mapping) for r in conn.execute(select(table).order_by(*order))]
    return out


# --- seeds: a populated database at a revision ------------------------------------------------


def seed_0001(conn: Connection) -> None:
    """One model: a committed keyframe and delta, a pending and a deleted publish; objects, a lease, the ledger."""
    t = _tables(conn)
    conn.execute(
        insert(t["models"]),
        [dict(id=1, name="m", created_at=T, head=2, keyframe_interval=20, max_chain_ratio=0.5, keep_last=None)],
    )
    common = dict(
        model_id=1,
        step=None,
        metadata={"lr": 0.1},
        idempotency_key=None,
        created_at=T,
        expires_at=None,
        deleted_at=None,
    )
    conn.execute(
        insert(t["versions"]),
        [
            dict(
                common,
                id=1,
                number=1,
                parent=None,
                kind="keyframe",
                chain_base=1,
                state="committed",
                raw_bytes=100,
                stored_bytes=60,
                manifest_digest=D["a"],
                publish_id="p1",
                committed_at=T,
            ),
            dict(
                common,
                id=2,
                number=2,
                parent=1,
                kind="delta",
                chain_base=1,
                state="committed",
                raw_bytes=100,
                stored_bytes=6,
                manifest_digest=D["b"],
                publish_id="p2",
                committed_at=T,
                idempotency_key="k2",
            ),
            dict(
                common,
                id=3,
                number=None,
                parent=2,
                kind="delta",
                chain_base=None,
                state="pending",
                raw_bytes=None,
                stored_bytes=None,
                manifest_digest=None,
                publish_id="p3",
                committed_at=None,
                expires_at=T,
            ),
            dict(
                common,
                id=4,
                number=None,
                parent=2,
                kind="delta",
                chain_base=None,
                state="deleted",
                raw_bytes=None,
                stored_bytes=None,
                manifest_digest=None,
                publish_id="p4",
                committed_at=None,
                expires_at=T,
                deleted_at=T,
            ),
        ],
    )
    conn.execute(
        insert(t["objects"]),
        [
            dict(digest=D[k], size=size, first_seen=T, unreferenced_since=since)
            for k, size, since in (("a", 10, None), ("b", 11, None), ("c", 60, None), ("d", 6, None), ("e", 7, T))
        ],
    )
    conn.execute(
        insert(t["version_objects"]),
        [
            dict(version_id=1, digest=D["c"], size=60),
            dict(version_id=2, digest=D["d"], size=6),
            dict(version_id=3, digest=D["d"], size=6),
        ],
    )
    conn.execute(insert(t["leases"]), [dict(id=1, model_id=1, number=2, holder="reader", acquired_at=T, expires_at=T)])
    conn.execute(
        insert(t["replicas"]),
        [
            dict(
                id=1,
                model_id=1,
                subscriber="host-a",
                number=2,
                applied_at=T,
                pause_ms=1.5,
                bytes_received=6,
                site="us",
                host=None,
                extra={"x": 1},
            )
        ],
    )


def seed_0003(conn: Connection) -> None:
    """Ledger rows as reports wrote them before 0004: health and mode only in ``extra``."""
    t = _tables(conn)
    row = dict(model_id=1, applied_at=T, pause_ms=None, bytes_received=None, site=None, host=None)
    conn.execute(
        insert(t["replicas"]),
        [
            dict(
                row, id=2, subscriber="sidecar", number=2, extra={"engine": "vllm", "status": "serving", "mode": "disk"}
            ),
            dict(row, id=3, subscriber="puller", number=1, extra={"mode": "delta", "dir": "/srv/m"}),
            dict(row, id=4, subscriber="tensors", number=2, extra={"mode": "in-place", "elements": 7}),
        ],
    )


SEEDS: dict[str, Callable[[Connection], None]] = {"0001": seed_0001, "0003": seed_0003}


# --- checks: what holds after upgrading to a revision --------------------------------------


def check_0002(conn: Connection, url: str) -> None:
    """Existing objects are live, not deleting; a tombstone needs its timestamp; the catalog uses both."""
    t = _tables(conn)
    objects = t["objects"]
    rows = conn.execute(select(objects.c.digest, objects.c.state, objects.c.deleting_since)).all()
    assert rows and all(state == "live" and since is None for _, state, since in rows)
    for bad in ({"state": "deleting"}, {"state": "gone", "deleting_since": T}, {"deleting_since": T}):
        with pytest.raises(sa_exc.IntegrityError), conn.begin_nested():
            conn.execute(update(objects).where(objects.c.digest == D["e"]).values(**bad))
    conn.commit()
    # Today's catalog code needs today's schema: the later migrations run first, on this data.
    with Catalog.open(url, migrate=True) as cat:
        assert cat.get_version("m", 2).parent == 1 and cat.get_model("m").head == 2
        # The unreferenced object can be tombstoned, and then no publish may reference it.
        assert cat.begin_object_deletion([(D["e"], 7, T)], unreferenced_before=T, now=T) == [D["e"]]
        assert cat.reference_objects("m", "p3", [(D["e"], 7)], now=datetime(2020, 1, 1, tzinfo=UTC)).deleting == (
            D["e"],
        )
        assert cat.begin_object_deletion([(D["c"], 60, T)], unreferenced_before=T, now=T) == []  # referenced


def check_0003(conn: Connection, url: str) -> None:
    """Models are neither pinned nor deleted; one server id exists; a deleted model has no head or pin."""
    t = _tables(conn)
    models = t["models"]
    assert conn.execute(select(models.c.name, models.c.pinned, models.c.deleted_at)).all() == [("m", None, None)]
    ids = conn.execute(select(t["server_identity"].c.id, t["server_identity"].c.server_id)).all()
    assert len(ids) == 1 and ids[0][0] == 1 and re.fullmatch(r"[0-9a-f]{32}", ids[0][1])
    for bad in ({"deleted_at": T}, {"deleted_at": T, "head": None, "pinned": 1}):  # the seed's head is 2
        with pytest.raises(sa_exc.IntegrityError), conn.begin_nested():
            conn.execute(update(models).where(models.c.name == "m").values(**bad))
    with pytest.raises(sa_exc.IntegrityError), conn.begin_nested():
        conn.execute(insert(t["server_identity"]).values(id=2, server_id="0" * 32, created_at=T))
    if conn.dialect.name == "postgresql":  # the seed gave explicit ids: move the sequence past them
        conn.execute(text("SELECT setval(pg_get_serial_sequence('versions', 'id'), (SELECT max(id) FROM versions))"))
    conn.commit()
    with Catalog.open(url, migrate=True) as cat:
        assert cat.server_id() == ids[0][1]
        assert cat.pin_model("m", 1).pinned == 1 and cat.follow_target("m").version.number == 1  # type: ignore[union-attr]
        gone = cat.delete_model("m", now=T)
        assert [v.number for v in gone.versions] == [1, 2] and [v.publish_id for v in gone.aborted] == ["p3"]
        assert cat.list_models() == [] and cat.create_model("m").head is None
        p = cat.begin_version("m", parent=None, kind="keyframe")
        v = cat.commit_version(
            "m",
            p.publish_id,
            parent=None,
            manifest_digest=D["f"],
            objects=[],
            raw_bytes=1,
            stored_bytes=1,
            kind="keyframe",
        )
        assert v.number == 3  # the numbering continues after a deletion


def check_0004(conn: Connection, url: str) -> None:
    """Old entries read back as applied (serving where extra said so), mode and engine from extra where known;
    an unhealthy entry holds no version and every other one holds one; the catalog reads lag and writes health."""
    t = _tables(conn)
    replicas = t["replicas"]
    cols = (replicas.c.id, replicas.c.number, replicas.c.status, replicas.c.mode, replicas.c.engine)
    assert [tuple(r) for r in conn.execute(select(*cols).order_by(replicas.c.id))] == [
        (1, 2, "applied", None, None),
        (2, 2, "serving", "disk", "vllm"),
        (3, 1, "applied", "pull", None),
        (4, 2, "applied", "in-place", None),
    ]
    row = dict(model_id=1, subscriber="x", applied_at=T, extra={})
    for bad in (
        dict(number=2, status="unhealthy"),  # an unhealthy replica names no version
        dict(number=None, status="applied"),  # every other entry names one
        dict(number=2, status="sleeping"),
    ):
        with pytest.raises(sa_exc.IntegrityError), conn.begin_nested():
            conn.execute(insert(replicas).values(id=90, **row, **bad))
    conn.execute(insert(replicas).values(id=91, **row, number=None, status="unhealthy"))
    if conn.dialect.name == "postgresql":  # the seeds gave explicit ids: move the sequence past them
        conn.execute(text("SELECT setval(pg_get_serial_sequence('replicas', 'id'), (SELECT max(id) FROM replicas))"))
    conn.commit()
    with Catalog.open(url, migrate=True) as cat:
        latest = {r.subscriber: r for r in cat.list_replicas("m")}
        assert {s: (r.number, r.status, r.lag) for s, r in latest.items()} == {
            "host-a": (2, "applied", 0),
            "puller": (1, "applied", 1),
            "sidecar": (2, "serving", 0),
            "tensors": (2, "applied", 0),
            "x": (None, "unhealthy", None),
        }
        assert latest["sidecar"].extra == {"engine": "vllm", "status": "serving", "mode": "disk"}  # kept as written
        gone = cat.record_replica("m", "sidecar", None, status="unhealthy", engine="vllm", extra={"target": 3})
        assert (gone.number, gone.status, gone.engine, gone.lag, gone.extra) == (
            None,
            "unhealthy",
            "vllm",
            None,
            {"target": 3},
        )
        back = cat.record_replica("m", "sidecar", 1, status="serving", mode="disk", engine="vllm", pause_ms=2.0)
        assert (back.number, back.lag, back.mode) == (1, 1, "disk")


def check_0005(conn: Connection, url: str) -> None:
    """version_parts exists, empty, rank within world; the catalog records parts against a pending version."""
    t = _tables(conn)
    parts = t["version_parts"]
    assert conn.execute(select(parts)).all() == []
    if conn.dialect.name == "postgresql":  # the seeds gave explicit ids: move the sequence past them
        conn.execute(text("SELECT setval(pg_get_serial_sequence('versions', 'id'), (SELECT max(id) FROM versions))"))
    conn.commit()
    with Catalog.open(url, migrate=True) as cat:
        head = cat.get_model("m").head
        p = cat.begin_version("m", parent=head, kind="keyframe", publish_id="parts-x", now=T)
        got = cat.record_part("m", p.publish_id, rank=1, world=2, manifest_digest=D["f"], now=T)
        assert got.parts == {1: D["f"]} and got.world == 2
    with pytest.raises(sa_exc.IntegrityError), conn.begin_nested():
        conn.execute(
            insert(parts).values(
                version_id=1, rank=2, world=2, manifest_digest=D["f"], allow_removals=False, created_at=T
            )
        )


def check_0006(conn: Connection, url: str) -> None:
    """relays exists, empty; the catalog records a heartbeat, and a second one replaces it."""
    t = _tables(conn)
    assert conn.execute(select(t["relays"])).all() == []
    conn.commit()
    with Catalog.open(url, migrate=True) as cat:
        cat.record_relay("relay@eu", site="eu", upstream="http://o:8400", state={"models": {}}, now=T)
        later = cat.record_relay("relay@eu", site="eu", degraded=True, now=T + timedelta(seconds=10))
        assert (later.first_seen, later.last_seen, later.degraded) == (T, T + timedelta(seconds=10), True)
        assert [r.name for r in cat.list_relays()] == ["relay@eu"]
        # Fetch claims: one holder at a time; renewed by its holder; taken over once expired; released.
        d, ttl = "a" * 64, timedelta(seconds=60)
        assert conn.execute(select(t["fetch_claims"])).all() == []
        assert cat.claim_fetch(d, "a", ttl=ttl, now=T) is True
        assert cat.claim_fetch(d, "b", ttl=ttl, now=T + timedelta(seconds=30)) is False
        assert cat.claim_fetch(d, "a", ttl=ttl, now=T + timedelta(seconds=30)) is True  # renewed to T+90
        assert cat.claim_fetch(d, "b", ttl=ttl, now=T + timedelta(seconds=80)) is False
        assert cat.claim_fetch(d, "b", ttl=ttl, now=T + timedelta(seconds=91)) is True  # a's lapsed
        assert cat.release_fetch(d, "a") is False and cat.release_fetch(d, "b") is True
        assert cat.claim_fetch(d, "a", ttl=ttl, now=T + timedelta(seconds=92)) is True


def check_0007(conn: Connection, url: str) -> None:
    """gc_fence holds one row, no time yet; forgetting tombstones raises it to that time, never lowers it."""
    fence = _tables(conn)["gc_fence"]
    assert conn.execute(select(fence.c.id, fence.c.deleted_at)).all() == [(1, None)]
    with pytest.raises(sa_exc.IntegrityError), conn.begin_nested():
        conn.execute(insert(fence).values(id=2, deleted_at=T))
    conn.commit()
    day = timedelta(days=1)

    def fenced() -> datetime | None:  # SQLite's rows read back without their zone: UTC, as the catalog writes them
        got = conn.execute(select(fence.c.deleted_at)).scalar_one()
        conn.rollback()
        return got if got is None or got.tzinfo else got.replace(tzinfo=UTC)

    with Catalog.open(url, migrate=True) as cat:
        assert cat.begin_object_deletion([(D["e"], 7, T)], unreferenced_before=T, now=T) == [D["e"]]
        assert fenced() is None  # a tombstone alone: no bytes deleted yet, and no reference can pass it
        assert cat.finish_object_deletion([D["e"]], stamp=T, now=T + day) == 1
        assert fenced() == T + day
        assert cat.finish_object_deletion([], stamp=T, now=T + 2 * day) == 0
        assert fenced() == T + day  # nothing deleted: unmoved
        # A GC whose tombstone another took over deleted bytes all the same: raised, though no row went.
        assert cat.finish_object_deletion(["9" * 64], stamp=T, now=T + 3 * day) == 0
        assert fenced() == T + 3 * day
        assert cat.finish_object_deletion(["9" * 64], stamp=T, now=T + 2 * day) == 0
        assert fenced() == T + 3 * day  # an older time: not lowered
        conn.execute(fence.delete())  # the row removed by hand: the next GC that deletes makes it again
        conn.commit()
        assert cat.finish_object_deletion(["9" * 64], stamp=T, now=T + 4 * day) == 0
        assert fenced() == T + 4 * day


CHECKS: dict[str, Callable[[Connection, str], None]] = {
    "0002": check_0002,
    "0003": check_0003,
    "0004": check_0004,
    "0005": check_0005,
    "0006": check_0006,
    "0007": check_0007,
}


def test_every_migration_has_a_seed_and_a_check() -> None:
    for old, new in PAIRS:
        assert old in SEEDS or any(SEEDS.get(r) for r in _chain()[: _chain().index(old)]), f"no seed for {old}"
        assert new in CHECKS, f"migration {new} has no check in CHECKS"


@pytest.mark.parametrize(("old", "new"), PAIRS, ids=[f"{a}-{b}" for a, b in PAIRS])
def test_upgrade_keeps_the_data(db_url: str, old: str, new: str) -> None:
    engine = make_engine(db_url)
    try:
        # Build the database as the previous head would have, seeding at every revision that has a seed.
        chain = _chain()
        for rev in chain[: chain.index(old) + 1]:
            _upgrade(engine, rev)
            if rev in SEEDS:
                with engine.begin() as conn:
                    SEEDS[rev](conn)
        with engine.connect() as conn:
            before = _snapshot(conn)
        _upgrade(engine, new)
        with engine.connect() as conn:
            assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar() == new
            after = _snapshot(conn)
            for table, rows in before.items():
                kept = [{k: r[k] for k in rows[0]} for r in after[table]] if rows else after[table]
                assert kept == rows, f"rows of {table} changed"
            CHECKS[new](conn, db_url)
    finally:
        engine.dispose()
