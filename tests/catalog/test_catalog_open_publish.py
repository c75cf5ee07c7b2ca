"""Catalog.open_publish: beginPublish's head check, keyframe policy, pending row and object holds in one transaction."""

from __future__ import annotations

from datetime import timedelta

import pytest
from _catalog_util import T0, digest, publish

from weightsync import errors
from weightsync.catalog import Catalog


def test_open_on_the_head_decides_the_kind_and_holds_the_encoding(catalog: Catalog) -> None:
    catalog.create_model("m", keyframe_interval=3)
    publish(catalog, "m", parent=None, tag="v1", now=T0)
    frames = (digest("frames"), 50)
    opened = catalog.open_publish("m", parent=1, objects=[frames], now=T0)
    assert (opened.version.kind, opened.version.parent, opened.version.state) == ("delta", 1, "pending")
    assert opened.parent_manifest == catalog.get_version("m", 1).manifest_digest
    assert opened.pinned is not None and opened.pinned.deleting == () and opened.pinned.added == (frames[0],)
    # Held: recorded with its size and referenced, so GC's grace clock does not run for it.
    held = catalog.get_object(frames[0])
    assert held is not None and held.size == 50 and held.unreferenced_since is None
    # Beginning again with the same id returns the same publish, holding what it held.
    again = catalog.open_publish("m", parent=1, publish_id=opened.version.publish_id, objects=[frames], now=T0)
    assert again.version.publish_id == opened.version.publish_id and again.version.kind == "delta"
    catalog.abort_pending("m", opened.version.publish_id, now=T0)
    assert catalog.get_object(frames[0]).unreferenced_since is not None


def test_open_follows_the_keyframe_policy_and_holds_only_an_encoding_of_the_answered_kind(catalog: Catalog) -> None:
    catalog.create_model("m", keyframe_interval=2)
    publish(catalog, "m", parent=None, tag="v1", now=T0)
    publish(catalog, "m", parent=1, tag="v2", now=T0)
    delta_frames = (digest("delta frames"), 10)
    # The chain holds keyframe_interval versions: a keyframe, and objects encoded as a delta are not held.
    opened = catalog.open_publish("m", parent=2, objects=[delta_frames], now=T0)
    assert opened.version.kind == "keyframe" and opened.pinned is None
    assert catalog.get_object(delta_frames[0]) is None
    catalog.abort_pending("m", opened.version.publish_id, now=T0)
    # A forced keyframe with its keyframe encoding: held.
    forced = catalog.open_publish("m", parent=2, keyframe=True, objects=[delta_frames], now=T0)
    assert forced.version.kind == "keyframe" and forced.pinned is not None
    # A first version is a keyframe with no parent manifest.
    catalog.create_model("fresh")
    first = catalog.open_publish("fresh", parent=None, now=T0)
    assert (first.version.kind, first.parent_manifest, first.pinned) == ("keyframe", None, None)


def test_open_refuses_a_stale_parent_and_an_unknown_model_writing_nothing(catalog: Catalog) -> None:
    catalog.create_model("m")
    publish(catalog, "m", parent=None, tag="v1", now=T0)
    publish(catalog, "m", parent=1, tag="v2", now=T0)
    obj = (digest("never held"), 7)
    with pytest.raises(errors.StaleParent) as stale:
        catalog.open_publish("m", parent=1, objects=[obj], now=T0)
    assert stale.value.current_head == 2
    with pytest.raises(errors.ModelNotFound):
        catalog.open_publish("nobody", parent=None, objects=[obj], now=T0)
    with pytest.raises(errors.InvalidDigest):
        catalog.open_publish("m", parent=2, objects=[("xyz", 1)], now=T0)
    assert catalog.list_pending("m") == [] and catalog.get_object(obj[0]) is None


def test_recording_a_held_object_again_changes_nothing_and_an_unheld_one_restarts_its_grace(catalog: Catalog) -> None:
    catalog.create_model("m")
    publish(catalog, "m", parent=None, tag="v1", now=T0)
    held = (digest("held"), 30)
    opened = catalog.open_publish("m", parent=1, objects=[held], now=T0)
    before = catalog.get_object(held[0])
    assert catalog.record_object(*held, now=T0 + timedelta(minutes=5)) == before
    with pytest.raises(errors.DigestMismatch):
        catalog.record_object(held[0], 31)
    catalog.abort_pending("m", opened.version.publish_id, now=T0 + timedelta(minutes=6))
    later = T0 + timedelta(minutes=9)
    assert catalog.record_object(*held, now=later).unreferenced_since == later


def test_the_answered_publish_is_the_stored_row(catalog: Catalog) -> None:
    catalog.create_model("m")
    publish(catalog, "m", parent=None, tag="v1", now=T0)
    expires = T0 + timedelta(minutes=30)
    meta = {"by": "test", "lr": 1e-6, "tags": ["a", "b"]}
    opened = catalog.open_publish(
        "m", parent=1, step=7, metadata=meta, objects=[(digest("o"), 5)], expires_at=expires, now=T0
    )
    assert opened.version == catalog.get_pending("m", opened.version.publish_id, now=T0)
    assert (opened.version.step, opened.version.metadata, opened.version.expires_at) == (7, meta, expires)
    assert opened.version.number is None and opened.version.created_at == T0
    begun = catalog.begin_version("m", parent=1, kind="keyframe", step=8, metadata={"k": 1}, now=T0)
    assert begun == catalog.get_pending("m", begun.publish_id, now=T0)


def test_a_publish_begun_again_holds_what_it_lacked_unless_it_expired(catalog: Catalog) -> None:
    catalog.create_model("m")
    publish(catalog, "m", parent=None, tag="v1", now=T0)
    a, b = (digest("a"), 1), (digest("b"), 2)
    first = catalog.open_publish("m", parent=1, objects=[a], expires_at=T0 + timedelta(minutes=10), now=T0)
    pid = first.version.publish_id
    again = catalog.open_publish("m", parent=1, publish_id=pid, objects=[a, b], now=T0 + timedelta(minutes=1))
    assert again.version == first.version  # the publish as begun, not a new expiry
    assert again.pinned is not None and again.pinned.added == (b[0],)
    with pytest.raises(errors.PublishNotFound, match="expired"):
        catalog.open_publish("m", parent=1, publish_id=pid, objects=[(digest("c"), 3)], now=T0 + timedelta(minutes=10))
    assert catalog.get_object(digest("c")) is None  # the failed begin wrote nothing
    # A publish id is one publish's: another model (or a committed publish) cannot take it.
    catalog.create_model("n")
    with pytest.raises(errors.Conflict):
        catalog.open_publish("n", parent=None, publish_id=pid, now=T0)


def test_open_leaves_out_objects_gc_is_deleting_and_refuses_another_size(catalog: Catalog) -> None:
    """DESIGN invariant 7 at begin: a tombstoned object is not held, so the publisher uploads it again."""
    catalog.create_model("m")
    publish(catalog, "m", parent=None, tag="v1", now=T0)
    doomed, fine = (digest("doomed"), 10), (digest("fine"), 4)
    catalog.record_object(*doomed, now=T0)
    late = T0 + timedelta(hours=1)
    assert catalog.begin_object_deletion([(*doomed, T0)], unreferenced_before=T0, now=late) == [doomed[0]]
    opened = catalog.open_publish("m", parent=1, objects=[doomed, fine], now=late)
    assert opened.pinned is not None and opened.pinned.deleting == (doomed[0],) and opened.pinned.added == (fine[0],)
    assert doomed[0] not in catalog.referenced_digests() and catalog.get_object(doomed[0]).state == "deleting"
    catalog.abort_pending("m", opened.version.publish_id, now=late)
    with pytest.raises(errors.IncompletePublish):
        catalog.open_publish("m", parent=1, objects=[(fine[0], 5)], now=late)
    assert catalog.list_pending("m") == []  # nothing of the refused begin stays
