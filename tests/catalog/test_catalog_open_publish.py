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
