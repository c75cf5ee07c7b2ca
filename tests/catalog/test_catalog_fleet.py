"""Fleet administration in the catalog: the server identity, pins, and deleting a model (docs/CATALOG.md)."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from _catalog_util import T0, digest, publish

from weightsync import errors
from weightsync.catalog import DEFAULT_SETTINGS, Catalog

# --- server identity ---------------------------------------------------------------------------


def test_server_id_is_made_once_and_shared(db_url: str) -> None:
    with Catalog.open(db_url) as a, Catalog.open(db_url) as b:
        assert re.fullmatch(r"[0-9a-f]{32}", a.server_id())
        assert a.server_id() == b.server_id()
        first = a.server_id()
    with Catalog.open(db_url, migrate=False) as again:
        assert again.server_id() == first


# --- pins --------------------------------------------------------------------------------------


def test_pin_holds_followers_and_unpin_returns_to_the_head(catalog: Catalog) -> None:
    catalog.create_model("m")
    for parent in (None, 1, 2):
        publish(catalog, "m", parent=parent)
    target = catalog.follow_target("m")
    assert (target.version.number, target.pinned) == (3, False)  # type: ignore[union-attr]
    assert catalog.pin_model("m", 2).pinned == 2 and catalog.get_model("m").pinned == 2
    publish(catalog, "m", parent=3)  # publishing is unaffected: the head moves on
    target = catalog.follow_target("m")
    assert (target.version.number, target.pinned, catalog.get_model("m").head) == (2, True, 4)  # type: ignore[union-attr]
    # A follower must move when it holds anything but the pin (a rollback too), and not when it holds it.
    assert [target.news_for(a) for a in (None, 1, 2, 4)] == [True, True, False, True]
    assert catalog.pin_model("m", None).pinned is None
    target = catalog.follow_target("m")
    assert target.version.number == 4 and not target.pinned  # type: ignore[union-attr]
    assert [target.news_for(a) for a in (None, 2, 4)] == [True, True, False]


def test_pin_needs_a_committed_version(catalog: Catalog) -> None:
    catalog.create_model("empty")
    assert catalog.follow_target("empty").version is None and not catalog.follow_target("empty").news_for(None)
    with pytest.raises(errors.VersionNotFound):
        catalog.pin_model("empty", 1)
    catalog.create_model("m")
    publish(catalog, "m", parent=None)
    publish(catalog, "m", parent=1, kind="keyframe")
    catalog.mark_deleted("m", [1])
    with pytest.raises(errors.VersionNotFound):
        catalog.pin_model("m", 1)  # deleted
    with pytest.raises(errors.VersionNotFound):
        catalog.pin_model("m", 7)  # never committed
    with pytest.raises(errors.ModelNotFound):
        catalog.pin_model("nope", 1)
    with pytest.raises(errors.InvalidArgument):
        catalog.pin_model("m", -1)
    assert catalog.get_model("m").pinned is None


def test_retention_keeps_the_pinned_chain_and_force_drops_the_pin(catalog: Catalog) -> None:
    catalog.create_model("m", keep_last=1)
    publish(catalog, "m", parent=None)
    publish(catalog, "m", parent=1)
    publish(catalog, "m", parent=2, kind="keyframe")
    publish(catalog, "m", parent=3)
    catalog.pin_model("m", 2)
    assert catalog.retention_candidates("m") == [1, 2, 3]
    assert catalog.mark_deleted("m", [1, 2, 3]) == []  # 1 and 2: the pinned chain; 3: the head's
    catalog.pin_model("m", None)
    assert catalog.mark_deleted("m", [1, 2, 3]) == [1, 2]
    catalog.pin_model("m", 3)
    assert catalog.mark_deleted("m", [3], force=True) == [3]
    assert catalog.get_model("m").pinned is None and catalog.follow_target("m").version.number == 4  # type: ignore[union-attr]


# --- deleting a model --------------------------------------------------------------------------


def test_delete_model_releases_everything_and_the_name(catalog: Catalog) -> None:
    shared = (digest("shared"), 50)
    catalog.create_model("m", keyframe_interval=5, keep_last=3)
    publish(catalog, "m", parent=None, objects=[shared, (digest("own"), 10)], now=T0)
    publish(catalog, "m", parent=1, tag="m2", now=T0)
    catalog.create_model("other")
    publish(catalog, "other", parent=None, objects=[shared], now=T0)
    pending = catalog.begin_version("m", parent=2, kind="delta", now=T0)
    catalog.reference_objects("m", pending.publish_id, [(digest("upload"), 5)], now=T0)
    catalog.pin_model("m", 1)
    catalog.acquire_lease("m", 2, "reader", 600, now=T0)
    catalog.record_replica("m", "host-a", 2)

    later = T0 + timedelta(minutes=5)
    gone = catalog.delete_model("m", now=later)
    assert [v.number for v in gone.versions] == [1, 2] and all(v.state == "deleted" for v in gone.versions)
    assert [v.publish_id for v in gone.aborted] == [pending.publish_id] and gone.deleted_at == later
    for lookup in (
        lambda: catalog.get_model("m"),
        lambda: catalog.get_version("m", 1),
        lambda: catalog.follow_target("m"),
        lambda: catalog.list_replicas("m"),
        lambda: catalog.delete_model("m"),
    ):
        with pytest.raises(errors.ModelNotFound):
            lookup()
    with pytest.raises(errors.ModelNotFound):  # the pending publish cannot commit any more
        catalog.commit_version(
            "m",
            pending.publish_id,
            parent=2,
            manifest_digest=digest("late"),
            objects=[],
            raw_bytes=1,
            stored_bytes=1,
            kind="delta",
        )
    assert [m.name for m in catalog.list_models()] == ["other"]
    assert catalog.active_leases(now=later) == [] and "m" not in catalog.dump_committed()["models"]
    # Its objects start their grace period now (GC deletes them only after it); shared ones stay referenced.
    for label in ("own", "pack:m2", "upload"):
        assert catalog.get_object(digest(label)).unreferenced_since == later  # type: ignore[union-attr]
    assert catalog.get_object(shared[0]).unreferenced_since is None  # type: ignore[union-attr]
    assert catalog.get_version("other", 1).state == "committed"

    # The name is free: a new model under it starts empty, with default settings, numbering on.
    revived = catalog.create_model("m", keep_last=2, now=later)
    assert (revived.head, revived.pinned, revived.created_at, revived.keep_last) == (None, None, later, 2)
    assert revived.keyframe_interval == DEFAULT_SETTINGS["keyframe_interval"]
    assert catalog.create_model("m") == revived  # idempotent again
    assert publish(catalog, "m", parent=None, tag="again").number == 3
    assert catalog.list_replicas("m") == [] and [v.number for v in catalog.list_versions("m")] == [3]
