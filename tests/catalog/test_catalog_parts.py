"""version_parts (migration 0005): recording the parts of a multi-part publish, on SQLite and PostgreSQL."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta

import pytest

from weightsync import errors
from weightsync.catalog import Catalog
from weightsync.ops.core import parts_id

T = datetime(2030, 1, 1, tzinfo=UTC)
A, B, C = "a" * 64, "b" * 64, "c" * 64


def _group(catalog: Catalog, step: int, parent: int | None = None, **kw) -> str:
    catalog.create_model("m", now=T)  # idempotent
    pid = parts_id("m", parent, step)
    catalog.open_publish("m", parent=parent, publish_id=pid, step=step, now=T, expires_at=T + timedelta(hours=1), **kw)
    return pid


def test_parts_are_recorded_idempotently_and_conflicts_refused(catalog: Catalog) -> None:
    pid = _group(catalog, 1)
    got = catalog.record_part("m", pid, rank=0, world=2, manifest_digest=A, now=T)
    assert (got.parts, got.complete) == ({0: A}, False)
    assert catalog.record_part("m", pid, rank=0, world=2, manifest_digest=A, now=T).parts == {0: A}  # a retry
    with pytest.raises(errors.PartConflict, match="other content"):
        catalog.record_part("m", pid, rank=0, world=2, manifest_digest=B, now=T)
    with pytest.raises(errors.PartConflict, match="says 3 parts"):
        catalog.record_part("m", pid, rank=1, world=3, manifest_digest=B, now=T)
    with pytest.raises(errors.PartConflict, match="removals"):
        catalog.record_part("m", pid, rank=1, world=2, manifest_digest=B, allow_removals=True, now=T)
    with pytest.raises(errors.InvalidArgument):
        catalog.record_part("m", pid, rank=2, world=2, manifest_digest=B, now=T)
    done = catalog.record_part("m", pid, rank=1, world=2, manifest_digest=B, now=T)
    assert (done.parts, done.complete) == ({0: A, 1: B}, True)
    catalog.drop_part("m", pid, 1, B)
    assert catalog.record_part("m", pid, rank=0, world=2, manifest_digest=A, now=T).parts == {0: A}
    with pytest.raises(errors.PublishNotFound):  # expired
        catalog.record_part("m", pid, rank=1, world=2, manifest_digest=B, now=T + timedelta(hours=2))


def test_the_next_step_waits_while_a_group_is_pending_on_the_parent(catalog: Catalog) -> None:
    _group(catalog, 1)
    with pytest.raises(errors.ParentPending):
        _group(catalog, 2)
    assert _group(catalog, 1)  # the same step joins the same group
    # An expired group no longer blocks the next step.
    catalog.open_publish(
        "m",
        parent=None,
        publish_id=parts_id("m", None, 2),
        step=2,
        now=T + timedelta(hours=2),
        expires_at=T + timedelta(hours=3),
    )


def test_concurrent_last_parts_complete_the_group_once(catalog: Catalog) -> None:
    pid = _group(catalog, 1)
    catalog.record_part("m", pid, rank=0, world=3, manifest_digest=A, now=T)
    seen: list[bool] = []

    def send(rank: int, digest: str) -> None:
        seen.append(catalog.record_part("m", pid, rank=rank, world=3, manifest_digest=digest, now=T).complete)

    threads = [threading.Thread(target=send, args=(r, d)) for r, d in ((1, B), (2, C))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(seen) == [False, True]


def test_a_committed_group_keeps_its_part_manifests_until_it_is_deleted(catalog: Catalog) -> None:
    """The part manifests stay referenced by the version (fsck finds no orphan, a late retry is answered)."""
    merged, obj = "d" * 64, "e" * 64
    pid = _group(catalog, 1)
    catalog.reference_objects("m", pid, [(A, 10), (B, 10), (obj, 100)], now=T)  # checkObjects of both parts
    catalog.record_part("m", pid, rank=0, world=2, manifest_digest=A, now=T)
    assert catalog.record_part("m", pid, rank=1, world=2, manifest_digest=B, now=T).complete
    catalog.record_object(merged, 20, now=T)
    v = catalog.commit_version(
        "m",
        pid,
        parent=None,
        manifest_digest=merged,
        objects=[(obj, 100)],
        raw_bytes=1,
        stored_bytes=1,
        kind="keyframe",
    )
    assert {A, B, merged, obj} <= catalog.referenced_digests()
    assert all(catalog.get_object(d).unreferenced_since is None for d in (A, B, obj))
    again = catalog.record_part("m", pid, rank=1, world=2, manifest_digest=B, now=T + timedelta(days=1))
    assert again.version.number == v.number and again.version.state == "committed"
    # The next version on top; deleting v1 then releases its part manifests to GC like its other objects.
    pid2 = _group(catalog, 2, parent=1)
    catalog.commit_version(
        "m", pid2, parent=1, manifest_digest=C, objects=[], raw_bytes=1, stored_bytes=1, kind="keyframe"
    )
    assert catalog.mark_deleted("m", [1], now=T + timedelta(hours=1)) == [1]
    assert not {A, B, merged, obj} & catalog.referenced_digests()
    assert all(catalog.get_object(d).unreferenced_since is not None for d in (A, B, merged, obj))
