"""Object references and GC bookkeeping, retention and deletion, leases, the replica ledger."""

from __future__ import annotations

from datetime import timedelta

import pytest
from _catalog_util import digest, publish
from conftest import T0

from weightsync import errors
from weightsync.catalog import Catalog


def test_referenced_digests(catalog: Catalog) -> None:
    catalog.create_model("m")
    shared, only1, only2, pend = digest("shared"), digest("only1"), digest("only2"), digest("pend")
    v1 = publish(catalog, "m", parent=None, tag="v1", objects=[(shared, 5), (only1, 6)])
    v2 = publish(catalog, "m", parent=1, kind="keyframe", tag="v2", objects=[(shared, 5), (only2, 7)])
    p = catalog.begin_version("m", parent=2, kind="delta")
    catalog.reference_objects("m", p.publish_id, [(pend, 8)])
    manifests = {v1.manifest_digest, v2.manifest_digest}
    assert catalog.referenced_digests() == {shared, only1, only2, pend} | manifests
    # Version 1 is a separate chain and not the head: it can go.
    assert catalog.mark_deleted("m", [1]) == [1]
    assert catalog.referenced_digests() == {shared, only2, pend, v2.manifest_digest}
    catalog.abort_pending("m", p.publish_id)
    assert catalog.referenced_digests() == {shared, only2, v2.manifest_digest}


def test_object_records_and_gc_grace(catalog: Catalog) -> None:
    catalog.create_model("m")
    a, b, man = digest("a"), digest("b"), digest("manifest:v1")
    info = catalog.record_object(a, 10, now=T0)
    assert (info.size, info.first_seen, info.unreferenced_since) == (10, T0, T0)
    catalog.record_object(man, 99, now=T0)
    with pytest.raises(errors.DigestMismatch):
        catalog.record_object(a, 11)
    with pytest.raises(errors.InvalidDigest):
        catalog.record_object("xyz", 1)
    # Unreferenced since T0; recording it again restarts the grace period (a publisher reuses it).
    assert [o.digest for o in catalog.unreferenced_objects(before=T0)] == sorted([a, man])
    catalog.record_object(a, 10, now=T0 + timedelta(minutes=10))
    assert [o.digest for o in catalog.unreferenced_objects(before=T0 + timedelta(minutes=5))] == [man]

    publish(catalog, "m", parent=None, tag="v1", objects=[(a, 10), (b, 20)], now=T0 + timedelta(minutes=20))
    assert catalog.get_object(b) is not None and catalog.get_object(b).first_seen == T0 + timedelta(minutes=20)
    assert catalog.get_object(a).unreferenced_since is None
    assert catalog.get_object(man).unreferenced_since is None  # the manifest counts as referenced
    assert catalog.unreferenced_objects(before=T0 + timedelta(days=1)) == []
    assert catalog.forget_object(a) is False  # still referenced

    gone = T0 + timedelta(hours=1)
    assert catalog.mark_deleted("m", [1], force=True, now=gone) == [1]
    assert catalog.unreferenced_objects(before=gone - timedelta(seconds=1)) == []
    assert {o.digest for o in catalog.unreferenced_objects(before=gone)} == {a, b, man}
    assert catalog.forget_object(a, unreferenced_before=gone - timedelta(seconds=1)) is False
    assert catalog.forget_object(a, unreferenced_before=gone) is True
    assert catalog.get_object(a) is None
    assert catalog.forget_object(a) is False


def test_commit_size_disagreement(catalog: Catalog) -> None:
    catalog.create_model("m")
    catalog.record_object(digest("a"), 10)
    with pytest.raises(errors.IncompletePublish):
        publish(catalog, "m", parent=None, objects=[(digest("a"), 11)])
    with pytest.raises(errors.IncompletePublish):
        publish(catalog, "m", parent=None, objects=[(digest("b"), 1), (digest("b"), 2)])
    assert catalog.get_model("m").head is None


def test_commit_replaces_pending_references(catalog: Catalog) -> None:
    catalog.create_model("m")
    p = catalog.begin_version("m", parent=None, kind="keyframe", now=T0)
    catalog.reference_objects("m", p.publish_id, [(digest("draft"), 1), (digest("final"), 2)], now=T0)
    catalog.commit_version(
        "m", p.publish_id, parent=None, manifest_digest=digest("man"), objects=[(digest("final"), 2)],
        raw_bytes=2, stored_bytes=2, kind="keyframe", now=T0,
    )
    assert digest("draft") not in catalog.referenced_digests()
    assert [o.digest for o in catalog.unreferenced_objects(before=T0)] == [digest("draft")]
    assert catalog.dump_committed()["versions"][0]["objects"] == [[digest("final"), 2]]


def test_mark_deleted_keeps_what_is_needed(catalog: Catalog) -> None:
    catalog.create_model("m", keep_last=2)
    publish(catalog, "m", parent=None)  # 1 keyframe
    publish(catalog, "m", parent=1)  # 2
    publish(catalog, "m", parent=2)  # 3
    publish(catalog, "m", parent=3, kind="keyframe")  # 4 keyframe
    publish(catalog, "m", parent=4)  # 5 (head)
    assert catalog.retention_candidates("m") == [1, 2, 3]
    # 2 is needed by 3, which stays: only deleting a whole chain end works.
    assert catalog.mark_deleted("m", [2]) == []
    assert catalog.mark_deleted("m", [3]) == [3]
    assert catalog.mark_deleted("m", [4, 5]) == []  # the head and its chain stay
    with pytest.raises(errors.VersionNotFound):
        catalog.mark_deleted("m", [42])
    assert catalog.mark_deleted("m", [1, 2, 3]) == [1, 2]  # 3 already deleted: ignored
    assert [v.number for v in catalog.list_versions("m")] == [4, 5]
    assert catalog.retention_candidates("m") == []


def test_leases_protect_chains(catalog: Catalog) -> None:
    catalog.create_model("m")
    publish(catalog, "m", parent=None)  # 1
    publish(catalog, "m", parent=1)  # 2
    publish(catalog, "m", parent=2, kind="keyframe")  # 3 (head)
    lease = catalog.acquire_lease("m", 2, "host-a", timedelta(minutes=5), now=T0)
    assert (lease.model, lease.number, lease.holder, lease.expires_at) == ("m", 2, "host-a", T0 + timedelta(minutes=5))
    catalog.acquire_lease("m", 3, "host-b", 60, now=T0)
    assert [(x.number, x.holder) for x in catalog.active_leases("m", now=T0)] == [(2, "host-a"), (3, "host-b")]
    assert catalog.mark_deleted("m", [1, 2], now=T0) == []  # chain 1..2 is being read

    # Re-acquiring extends; expiry is by the clock, release is explicit.
    catalog.acquire_lease("m", 2, "host-a", timedelta(minutes=10), now=T0 + timedelta(minutes=4))
    later = T0 + timedelta(minutes=6)
    assert [(x.number, x.holder) for x in catalog.active_leases(now=later)] == [(2, "host-a")]
    assert catalog.purge_expired_leases(later) == 1
    assert catalog.release_lease("m", 2, "host-a") is True
    assert catalog.release_lease("m", 2, "host-a") is False
    assert catalog.mark_deleted("m", [1, 2], now=later) == [1, 2]
    with pytest.raises(errors.VersionNotFound):
        catalog.acquire_lease("m", 1, "host-a", 60)
    with pytest.raises(ValueError):
        catalog.acquire_lease("m", 3, "host-a", 0)


def test_replica_ledger(catalog: Catalog) -> None:
    catalog.create_model("m")
    for parent in (None, 1, 2):
        publish(catalog, "m", parent=parent)
    catalog.record_replica("m", "host-a", 1, applied_at=T0, pause_ms=12.5, bytes_received=1000, site="us")
    catalog.record_replica("m", "host-b", 1, applied_at=T0 + timedelta(seconds=1), host="10.0.0.2")
    r = catalog.record_replica(
        "m", "host-a", 2, applied_at=T0 + timedelta(minutes=10), pause_ms=3.0, bytes_received=50, site="us",
        extra={"gpu": "h100", "ranks": [0, 1]},
    )
    assert (r.model, r.subscriber, r.number, r.pause_ms) == ("m", "host-a", 2, 3.0)
    assert r.extra == {"gpu": "h100", "ranks": [0, 1]}
    latest = catalog.list_replicas("m")
    assert [(x.subscriber, x.number) for x in latest] == [("host-a", 2), ("host-b", 1)]
    assert latest[1].host == "10.0.0.2" and latest[1].pause_ms is None
    history = catalog.list_replicas("m", "host-a", latest_only=False)
    assert [(x.number, x.applied_at, x.site) for x in history] == [(1, T0, "us"), (2, T0 + timedelta(minutes=10), "us")]
    assert [x.number for x in catalog.list_replicas("m", "host-b")] == [1]
    assert catalog.list_replicas("m", "nobody") == []
    with pytest.raises(errors.VersionNotFound):
        catalog.record_replica("m", "host-a", 9)
    with pytest.raises(ValueError):
        catalog.record_replica("m", "host-a", 1, pause_ms=-1.0)
    catalog.mark_deleted("m", [3], force=True)
    catalog.record_replica("m", "host-c", 3)  # a subscriber may report a version deleted since
