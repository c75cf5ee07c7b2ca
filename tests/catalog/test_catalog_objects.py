"""Object references and GC bookkeeping, retention and deletion, leases, the replica ledger."""

from __future__ import annotations

from datetime import timedelta

import pytest
from _catalog_util import T0, digest, publish

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
    assert catalog.get_object(man).unreferenced_since == T0
    catalog.record_object(a, 10, now=T0 + timedelta(minutes=10))
    assert catalog.get_object(a).unreferenced_since == T0 + timedelta(minutes=10)
    stamp = T0 + timedelta(minutes=11)
    assert catalog.begin_object_deletion(
        [(a, 10, T0), (man, 99, T0)], unreferenced_before=T0 + timedelta(minutes=5), now=stamp
    ) == [man]
    assert catalog.finish_object_deletion([man], stamp=stamp) == 1
    catalog.record_object(man, 99, now=T0)

    publish(catalog, "m", parent=None, tag="v1", objects=[(a, 10), (b, 20)], now=T0 + timedelta(minutes=20))
    assert catalog.get_object(b) is not None and catalog.get_object(b).first_seen == T0 + timedelta(minutes=20)
    assert catalog.get_object(a).unreferenced_since is None
    assert catalog.get_object(man).unreferenced_since is None  # the manifest counts as referenced
    late = T0 + timedelta(days=1)
    # Still referenced (the manifest too): nothing to delete.
    assert (
        catalog.begin_object_deletion([(a, 10, T0), (b, 20, T0), (man, 99, T0)], unreferenced_before=late, now=late)
        == []
    )

    gone = T0 + timedelta(hours=1)
    assert catalog.mark_deleted("m", [1], force=True, now=gone) == [1]
    assert {d: o.unreferenced_since for d, o in catalog.get_objects([a, b, man]).items()} == {
        a: gone,
        b: gone,
        man: gone,
    }
    assert catalog.begin_object_deletion([(a, 10, T0)], unreferenced_before=gone - timedelta(seconds=1), now=late) == []
    assert catalog.begin_object_deletion([(a, 10, T0)], unreferenced_before=gone, now=late) == [a]
    assert catalog.get_object(a).state == "deleting" and catalog.get_object(a).deleting_since == late
    assert catalog.finish_object_deletion([a], stamp=late) == 1
    assert catalog.get_object(a) is None
    assert catalog.finish_object_deletion([a], stamp=late) == 0


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
        "m",
        p.publish_id,
        parent=None,
        manifest_digest=digest("man"),
        objects=[(digest("final"), 2)],
        raw_bytes=2,
        stored_bytes=2,
        kind="keyframe",
        now=T0,
    )
    assert digest("draft") not in catalog.referenced_digests()
    assert catalog.get_object(digest("draft")).unreferenced_since == T0
    assert catalog.get_object(digest("final")).unreferenced_since is None
    assert catalog.dump_committed()["versions"][0]["objects"] == [[digest("final"), 2]]


def test_commit_of_what_check_objects_held(catalog: Catalog) -> None:
    """The usual commit (commit_held): the publish holds every object and the manifest already."""
    catalog.create_model("m")
    p = catalog.begin_version("m", parent=None, kind="keyframe", now=T0)
    held = [(digest("a"), 10), (digest("draft"), 3)]
    catalog.reference_objects("m", p.publish_id, held, now=T0)
    first = dict(parent=None, manifest_digest=digest("man"), objects=[(digest("a"), 10)], raw_bytes=10, stored_bytes=10)
    # The manifest is not referenced yet: nothing changes, the caller references it and checks the store.
    assert catalog.commit_held("m", p.publish_id, kind="keyframe", now=T0, **first) is None  # type: ignore[arg-type]
    assert catalog.get_pending("m", p.publish_id, now=T0).state == "pending" and catalog.head("m") is None
    catalog.reference_objects("m", p.publish_id, [(digest("man"), 5)], now=T0)
    v = catalog.commit_held("m", p.publish_id, kind="keyframe", now=T0 + timedelta(seconds=1), **first)  # type: ignore[arg-type]
    assert v is not None
    assert (v.number, v.chain_base, v.state, v.manifest_digest) == (1, 1, "committed", digest("man"))
    assert catalog.dump_committed()["versions"][0]["objects"] == [[digest("a"), 10]]  # the manifest by its digest
    assert catalog.referenced_digests() == {digest("a"), digest("man")}
    assert catalog.get_object(digest("man")).unreferenced_since is None
    assert catalog.get_object(digest("draft")).unreferenced_since == T0 + timedelta(seconds=1)
    # A delta on it: its chain base comes from the parent; a retry by idempotency key replays.
    q = catalog.begin_version("m", parent=1, kind="delta", now=T0)
    catalog.reference_objects("m", q.publish_id, [(digest("b"), 4), (digest("man2"), 5)], now=T0)
    args = dict(parent=1, manifest_digest=digest("man2"), objects=[(digest("b"), 4)], raw_bytes=10, stored_bytes=4)
    w = catalog.commit_held("m", q.publish_id, kind="delta", idempotency_key="k", now=T0, **args)  # type: ignore[arg-type]
    assert w is not None and (w.number, w.chain_base, w.parent) == (2, 1, 1)
    r = catalog.begin_version("m", parent=2, kind="delta", now=T0)
    again = catalog.commit_version("m", r.publish_id, kind="delta", idempotency_key="k", now=T0, **args)  # type: ignore[arg-type]
    assert again == w and catalog.head("m").number == 2  # type: ignore[union-attr]
    # as_begun: the version is what the publish was begun as (the service's rule; the catalog allows a rebase).
    k = catalog.begin_version("m", parent=2, kind="keyframe", now=T0)
    catalog.reference_objects("m", k.publish_id, [(digest("c"), 4), (digest("man3"), 5)], now=T0)
    third = dict(manifest_digest=digest("man3"), objects=[(digest("c"), 4)], raw_bytes=10, stored_bytes=4)
    with pytest.raises(errors.Conflict, match="requires a keyframe"):
        catalog.commit_held("m", k.publish_id, parent=2, kind="delta", as_begun=True, now=T0, **third)  # type: ignore[arg-type]
    with pytest.raises(errors.Conflict, match="differs from the publish's parent"):
        catalog.commit_version("m", k.publish_id, parent=None, kind="keyframe", as_begun=True, now=T0, **third)  # type: ignore[arg-type]
    assert catalog.get_pending("m", k.publish_id, now=T0).state == "pending"


def test_referencing_again_what_a_publish_holds_changes_nothing(catalog: Catalog) -> None:
    """A commit re-references what checkObjects referenced: answered without a write, with the same rules."""
    catalog.create_model("m")
    p = catalog.begin_version("m", parent=None, kind="keyframe", now=T0)
    refs = [(digest(f"o{i}"), i + 1) for i in range(700)]  # more than one chunk of rows
    first = catalog.reference_objects("m", p.publish_id, refs, now=T0)
    assert sorted(first.added) == sorted(d for d, _ in refs) and first.deleting == ()
    again = catalog.reference_objects("m", p.publish_id, refs[:5], now=T0 + timedelta(seconds=1))
    assert again.added == () and again.deleting == ()
    assert catalog.get_object(refs[0][0]).unreferenced_since is None
    # One new object among held ones takes the write path and adds just that one.
    more = catalog.reference_objects("m", p.publish_id, [*refs[:3], (digest("new"), 9)], now=T0)
    assert more.added == (digest("new"),)
    # The read path keeps the write path's refusals: another size, a publish that is not pending.
    with pytest.raises(errors.IncompletePublish):
        catalog.reference_objects("m", p.publish_id, [(refs[0][0], 999)], now=T0)
    catalog.commit_version(
        "m",
        p.publish_id,
        parent=None,
        manifest_digest=digest("man"),
        objects=refs,
        raw_bytes=1,
        stored_bytes=1,
        kind="keyframe",
        now=T0,
    )
    with pytest.raises(errors.PublishNotFound):
        catalog.reference_objects("m", p.publish_id, refs[:5], now=T0)
    committed = catalog.dump_committed()["versions"][0]["objects"]
    assert sorted(map(tuple, committed)) == sorted(refs)  # the new one was not in the final list
    assert catalog.get_object(digest("new")).unreferenced_since == T0


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
    with pytest.raises(errors.InvalidArgument):
        catalog.acquire_lease("m", 3, "host-a", 0)


def test_a_lease_holds_its_whole_chain(catalog: Catalog) -> None:
    """Deltas after the leased version too: a follower's lease covers what its next plans fetch."""
    catalog.create_model("m")
    for parent in (None, 1, 2):
        publish(catalog, "m", parent=parent)  # 1 keyframe, 2, 3
    publish(catalog, "m", parent=3, kind="keyframe")  # 4 (head)
    catalog.acquire_lease("m", 2, "reader", 60, now=T0)
    assert catalog.mark_deleted("m", [3], now=T0) == []  # after 2, on its chain
    assert catalog.mark_deleted("m", [1, 2, 3], now=T0 + timedelta(seconds=61)) == [1, 2, 3]  # expired


def test_reading_answers_the_chain_and_the_holders_lease(catalog: Catalog) -> None:
    catalog.create_model("m")
    for parent in (None, 1, 2):
        publish(catalog, "m", parent=parent)  # 1 keyframe, 2, 3
    publish(catalog, "m", parent=3, kind="keyframe")  # 4 (head)
    chain, lease = catalog.reading("m", 3, now=T0)
    assert [v.number for v in chain] == [1, 2, 3] and lease is None
    held = catalog.acquire_lease("m", 1, "reader", 600, now=T0)
    catalog.acquire_lease("m", 2, "reader", 60, now=T0)  # on the chain too, expiring first
    catalog.acquire_lease("m", 4, "other", 600, now=T0)
    assert catalog.reading("m", 3, holder="reader", now=T0)[1] == held  # any version of the chain
    assert catalog.reading("m", 3, holder="other", now=T0)[1] is None  # another chain's
    assert catalog.reading("m", 3, holder="reader", now=T0 + timedelta(seconds=600))[1] is None  # expired
    chain, lease = catalog.reading("m", holder="other", now=T0)  # what followers hold: the head
    assert [v.number for v in chain] == [4] and lease is not None and lease.number == 4
    catalog.pin_model("m", 2)
    assert [v.number for v in catalog.reading("m", now=T0)[0]] == [1, 2]  # the pin
    with pytest.raises(errors.VersionNotFound):
        catalog.reading("m", 9)
    catalog.create_model("empty")
    with pytest.raises(errors.VersionNotFound):
        catalog.reading("empty")
    with pytest.raises(errors.ModelNotFound):
        catalog.reading("nope")
    with pytest.raises(errors.InvalidArgument):
        catalog.reading("m", 3, holder="")


def test_a_report_releases_the_leases_its_subscriber_needs_no_more(catalog: Catalog) -> None:
    catalog.create_model("m")
    publish(catalog, "m", parent=None)  # 1 keyframe
    publish(catalog, "m", parent=1)  # 2
    catalog.acquire_lease("m", 1, "r", 600, now=T0)
    catalog.acquire_lease("m", 1, "other", 600, now=T0)
    # Applied v2, on the head's chain: the lease that covers the next deltas stays.
    catalog.record_replica("m", "r", 2, applied_at=T0, release_leases=True)
    assert [(x.number, x.holder) for x in catalog.active_leases("m", now=T0)] == [(1, "other"), (1, "r")]
    publish(catalog, "m", parent=2, kind="keyframe")  # 3: a new chain
    catalog.acquire_lease("m", 3, "r", 600, now=T0)
    catalog.record_replica("m", "r", 3, applied_at=T0, release_leases=True)  # chain 1 is done with
    assert [(x.number, x.holder) for x in catalog.active_leases("m", now=T0)] == [(1, "other"), (3, "r")]
    publish(catalog, "m", parent=3, kind="keyframe")  # 4
    catalog.record_replica("m", "r", 3, applied_at=T0, release_leases=True)  # off the head's chain: all go
    assert [(x.number, x.holder) for x in catalog.active_leases("m", now=T0)] == [(1, "other")]
    catalog.record_replica("m", "r", 1, applied_at=T0)  # without the flag: leases untouched
    assert len(catalog.active_leases("m", now=T0)) == 1
    catalog.mark_deleted("m", [1, 2], force=True)
    with pytest.raises(errors.VersionNotFound):  # a subscriber's own report names a committed version
        catalog.record_replica("m", "other", 1, release_leases=True)
    assert len(catalog.active_leases("m", now=T0)) == 1  # nothing changed


def test_replica_ledger(catalog: Catalog) -> None:
    catalog.create_model("m")
    for parent in (None, 1, 2):
        publish(catalog, "m", parent=parent)
    catalog.record_replica("m", "host-a", 1, applied_at=T0, pause_ms=12.5, bytes_received=1000, site="us")
    catalog.record_replica("m", "host-b", 1, applied_at=T0 + timedelta(seconds=1), host="10.0.0.2")
    r = catalog.record_replica(
        "m",
        "host-a",
        2,
        applied_at=T0 + timedelta(minutes=10),
        pause_ms=3.0,
        bytes_received=50,
        site="us",
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
    with pytest.raises(errors.InvalidArgument):
        catalog.record_replica("m", "host-a", 1, pause_ms=-1.0)
    catalog.mark_deleted("m", [3], force=True)
    catalog.record_replica("m", "host-c", 3)  # a subscriber may report a version deleted since


def test_a_deleting_object_is_never_referenced(catalog: Catalog) -> None:
    """DESIGN invariant 7: between GC's tombstone and its removal, no publish can take the object."""
    catalog.create_model("m")
    x, man = digest("x"), digest("manifest:x")
    catalog.record_object(x, 10, now=T0)
    catalog.record_object(man, 5, now=T0)
    late = T0 + timedelta(hours=1)
    marked = catalog.begin_object_deletion([(x, 10, T0), (man, 5, T0)], unreferenced_before=T0, now=late)
    assert marked == sorted([man, x])
    # A second GC (or a second pass) does not take over a fresh tombstone.
    assert catalog.begin_object_deletion([(x, 10, T0)], unreferenced_before=late, now=late) == []

    p = catalog.begin_version("m", parent=None, kind="keyframe", now=late)
    pinned = catalog.reference_objects("m", p.publish_id, [(x, 10), (digest("y"), 3)], now=late)
    assert pinned.deleting == (x,) and pinned.added == (digest("y"),)
    assert x not in catalog.referenced_digests()
    assert catalog.record_object(x, 10, now=late).state == "deleting"  # recording does not revive it
    commit = dict(parent=None, objects=[(x, 10)], raw_bytes=10, stored_bytes=10, kind="keyframe", now=late)
    with pytest.raises(errors.IncompletePublish, match="being deleted"):
        catalog.commit_version("m", p.publish_id, manifest_digest=digest("other-manifest"), **commit)
    with pytest.raises(errors.IncompletePublish, match="being deleted"):  # the manifest is checked too
        catalog.commit_version("m", p.publish_id, manifest_digest=man, **{**commit, "objects": []})
    assert catalog.get_model("m").head is None and catalog.get_object(x).state == "deleting"

    # Once GC has deleted the bytes and removed the row, the publisher's re-upload is a new object.
    assert catalog.finish_object_deletion([x, man], stamp=late) == 2
    assert catalog.reference_objects("m", p.publish_id, [(x, 10)], now=late).added == (x,)
    v = catalog.commit_version("m", p.publish_id, manifest_digest=digest("other-manifest"), **commit)
    assert v.number == 1 and catalog.get_object(x).state == "live"


def test_gc_tombstones_unrecorded_objects_and_resumes_stale_ones(catalog: Catalog) -> None:
    catalog.create_model("m")
    orphan, young, held = digest("orphan"), digest("young"), digest("held")
    p = catalog.begin_version("m", parent=None, kind="keyframe", now=T0)
    catalog.reference_objects("m", p.publish_id, [(held, 1)], now=T0)
    cutoff = T0 + timedelta(minutes=5)
    # Objects the catalog never recorded count from when the store wrote them.
    turned = catalog.begin_object_deletion(
        [(orphan, 1, T0), (young, 2, cutoff + timedelta(seconds=1)), (held, 1, T0)],
        unreferenced_before=cutoff,
        now=cutoff,
    )
    assert turned == [orphan]
    assert catalog.get_object(young).state == "live"  # recorded now, in its grace period
    assert catalog.get_object(held).unreferenced_since is None

    # A GC that died after its tombstone: a later GC takes it over once it is older than the grace period.
    assert catalog.resume_object_deletions(before=cutoff - timedelta(seconds=1), now=cutoff) == []
    later = cutoff + timedelta(hours=1)
    assert catalog.resume_object_deletions(before=cutoff, now=later) == [(orphan, 1)]
    assert catalog.finish_object_deletion([orphan], stamp=cutoff) == 0  # the dead GC's stamp no longer owns it
    assert catalog.finish_object_deletion([orphan], stamp=later) == 1
    assert catalog.get_object(orphan) is None


def test_recording_an_object_the_store_just_created_gives_what_recording_it_otherwise_gives(catalog: Catalog) -> None:
    """record_object(new=True) (the store created the bytes: skip the read that spares known objects the write
    lock) answers and writes exactly what the plain call does, in every state an object can be in."""
    catalog.create_model("m")
    fresh, live, held, gone = digest("n:fresh"), digest("n:live"), digest("n:held"), digest("n:gone")
    man = digest("n:manifest")
    for new in (True, False):
        assert catalog.record_object(fresh, 7, now=T0, new=new) == catalog.get_object(fresh)  # unknown: recorded
    catalog.record_object(live, 3, now=T0)
    later = T0 + timedelta(minutes=3)
    got = catalog.record_object(live, 3, now=later, new=True)  # unreferenced: its grace restarts
    assert got.unreferenced_since == later == catalog.get_object(live).unreferenced_since
    publish(catalog, "m", parent=None, tag="h", objects=[(held, 4)], now=T0)
    for new in (False, True):  # referenced: unchanged
        got = catalog.record_object(held, 4, now=later, new=new)
        assert got.unreferenced_since is None and got == catalog.get_object(held)
        with pytest.raises(errors.DigestMismatch):
            catalog.record_object(held, 5, now=later, new=new)
    catalog.record_object(gone, 2, now=T0)
    catalog.record_object(man, 1, now=T0)
    late = T0 + timedelta(hours=1)
    assert gone in catalog.begin_object_deletion([(gone, 2, T0)], unreferenced_before=T0, now=late)
    for new in (False, True):  # being deleted: returned as it is, not revived
        assert catalog.record_object(gone, 2, now=late, new=new).state == "deleting"
