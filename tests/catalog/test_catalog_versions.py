"""Models, the publish life cycle (pending -> committed -> deleted), CAS and idempotency."""

from __future__ import annotations

from datetime import timedelta

import pytest
from _catalog_util import T0, digest, publish

from weightsync import errors
from weightsync.catalog import DEFAULT_SETTINGS, Catalog, VersionTotals

# --- models ---------------------------------------------------------------------------


VALID_NAMES = ["a", "policy-7b", "m.v2_x", "0" * 96, "9lives", "A", "Org/Name-7B"]
INVALID_NAMES = ["", "-x", ".x", "_x", "a/b/c", "a--b", "a b", "0" * 97, "é", "x\n", "a\x00", "Org/plan"]


def test_name_validation(catalog: Catalog) -> None:
    for name in VALID_NAMES:
        assert catalog.create_model(name).name == name
        assert catalog.get_model(name).name == name
    for name in INVALID_NAMES:
        with pytest.raises(errors.InvalidName):
            catalog.create_model(name)
        with pytest.raises(errors.InvalidName):
            catalog.get_model(name)
    assert [m.name for m in catalog.list_models()] == sorted(VALID_NAMES)


def test_create_model_defaults_and_idempotence(catalog: Catalog) -> None:
    m = catalog.create_model("m", now=T0)
    assert (m.head, m.keyframe_interval, m.max_chain_ratio, m.keep_last) == (
        None,
        DEFAULT_SETTINGS["keyframe_interval"],
        DEFAULT_SETTINGS["max_chain_ratio"],
        DEFAULT_SETTINGS["keep_last"],
    )
    assert m.created_at == T0
    assert catalog.create_model("m") == m
    assert catalog.create_model("m", keyframe_interval=20) == m  # same value: still idempotent
    with pytest.raises(errors.Conflict, match="keyframe_interval"):
        catalog.create_model("m", keyframe_interval=5)


def test_settings(catalog: Catalog) -> None:
    catalog.create_model("m", keyframe_interval=10, max_chain_ratio=0.25, keep_last=3)
    m = catalog.update_model_settings("m", keep_last=None)
    assert (m.keyframe_interval, m.max_chain_ratio, m.keep_last) == (10, 0.25, None)
    m = catalog.update_model_settings("m", keyframe_interval=7)
    assert (m.keyframe_interval, m.keep_last) == (7, None)
    assert catalog.get_model("m") == m
    bad_settings = [
        {"keyframe_interval": 0},
        {"max_chain_ratio": -1.0},
        {"keep_last": 0},
        {"max_chain_ratio": float("nan")},
    ]
    for bad in bad_settings:
        with pytest.raises(errors.InvalidArgument):
            catalog.update_model_settings("m", **bad)
    with pytest.raises(errors.ModelNotFound):
        catalog.update_model_settings("nope", keep_last=1)


def test_list_and_missing_models(catalog: Catalog) -> None:
    for n in ("b", "a", "c"):
        catalog.create_model(n)
    assert [m.name for m in catalog.list_models()] == ["a", "b", "c"]
    with pytest.raises(errors.ModelNotFound):
        catalog.get_model("zz")
    with pytest.raises(errors.ModelNotFound):
        catalog.begin_version("zz", parent=None, kind="keyframe")


def test_version_totals_count_committed_versions_only(catalog: Catalog) -> None:
    catalog.create_model("t")
    assert catalog.version_totals("t") == VersionTotals(versions=0, keyframes=0, raw_bytes=0, stored_bytes=0)
    v1 = publish(catalog, "t", parent=None, stored_bytes=500)
    publish(catalog, "t", parent=v1.number, stored_bytes=20, tag="d2")
    publish(catalog, "t", parent=2, kind="keyframe", stored_bytes=400, tag="k3")
    catalog.begin_version("t", parent=3, kind="delta")  # pending: not counted
    assert catalog.version_totals("t") == VersionTotals(versions=3, keyframes=2, raw_bytes=3000, stored_bytes=920)
    catalog.mark_deleted("t", [2], force=True)
    assert catalog.version_totals("t") == VersionTotals(versions=2, keyframes=2, raw_bytes=2000, stored_bytes=900)
    with pytest.raises(errors.ModelNotFound):
        catalog.version_totals("nope")


# --- publish and commit ----------------------------------------------------------------


def test_publish_life_cycle(catalog: Catalog) -> None:
    catalog.create_model("m")
    p = catalog.begin_version(
        "m", parent=None, kind="keyframe", publish_id="pub-1", step=7, metadata={"lr": 1e-5}, now=T0
    )
    assert (p.state, p.number, p.publish_id, p.step, p.metadata) == ("pending", None, "pub-1", 7, {"lr": 1e-5})
    assert p.expires_at == T0 + timedelta(hours=1)
    assert catalog.head("m") is None
    assert catalog.list_versions("m") == []  # pending is not visible
    assert [v.publish_id for v in catalog.list_pending("m")] == ["pub-1"]
    assert catalog.get_pending("m", "pub-1", now=T0).state == "pending"

    v = catalog.commit_version(
        "m",
        "pub-1",
        parent=None,
        manifest_digest=digest("man1"),
        objects=[(digest("a"), 10), (digest("b"), 20)],
        raw_bytes=1000,
        stored_bytes=30,
        kind="keyframe",
        now=T0 + timedelta(minutes=1),
    )
    assert (v.number, v.state, v.kind, v.chain_base, v.parent) == (1, "committed", "keyframe", 1, None)
    assert (v.step, v.metadata, v.committed_at, v.expires_at) == (7, {"lr": 1e-5}, T0 + timedelta(minutes=1), None)
    assert catalog.head("m") == v
    assert catalog.get_model("m").head == 1
    assert catalog.get_version("m", 1) == v
    assert catalog.list_pending("m") == []

    d = publish(catalog, "m", parent=1, now=T0)
    assert (d.number, d.kind, d.parent, d.chain_base) == (2, "delta", 1, 1)
    assert [x.number for x in catalog.list_versions("m")] == [1, 2]


def test_keyframe_and_delta_rules(catalog: Catalog) -> None:
    catalog.create_model("m")
    with pytest.raises(errors.InvalidArgument):
        catalog.begin_version("m", parent=None, kind="delta")
    with pytest.raises(errors.InvalidArgument):
        catalog.begin_version("m", parent=None, kind="frame")
    with pytest.raises(errors.VersionNotFound):
        catalog.begin_version("m", parent=1, kind="delta")  # parent must be committed
    publish(catalog, "m", parent=None)
    p = catalog.begin_version("m", parent=1, kind="delta")
    common = dict(manifest_digest=digest("x"), objects=[], raw_bytes=1, stored_bytes=1)
    with pytest.raises(errors.InvalidArgument, match="chain_base"):
        catalog.commit_version("m", p.publish_id, parent=1, kind="delta", chain_base=2, **common)
    with pytest.raises(errors.InvalidArgument, match="own chain"):
        catalog.commit_version("m", p.publish_id, parent=1, kind="keyframe", chain_base=1, **common)
    with pytest.raises(errors.InvalidDigest):
        catalog.commit_version("m", p.publish_id, parent=1, kind="delta", **{**common, "manifest_digest": "ABC"})
    # The publisher may decide late that a version is a keyframe (chain too long).
    v = catalog.commit_version("m", p.publish_id, parent=1, kind="keyframe", **common)
    assert (v.number, v.kind, v.chain_base, v.parent) == (2, "keyframe", 2, 1)


def test_stale_parent_conflict_leaves_head(catalog: Catalog) -> None:
    catalog.create_model("m")
    publish(catalog, "m", parent=None)
    late = catalog.begin_version("m", parent=1, kind="delta")
    publish(catalog, "m", parent=1, tag="winner")
    assert catalog.get_model("m").head == 2
    with pytest.raises(errors.StaleParent) as info:
        catalog.commit_version(
            "m",
            late.publish_id,
            parent=1,
            manifest_digest=digest("late"),
            objects=[(digest("late-pack"), 5)],
            raw_bytes=1,
            stored_bytes=5,
            kind="delta",
        )
    assert isinstance(info.value, errors.Conflict)
    assert info.value.current_head == 2 and "head is 2" in str(info.value)
    assert catalog.get_model("m").head == 2
    assert [v.number for v in catalog.list_versions("m")] == [1, 2]
    assert digest("late-pack") not in catalog.referenced_digests()  # the failed commit wrote nothing
    # The loser is still pending: it can rebase on the new head and commit.
    assert catalog.get_pending("m", late.publish_id).state == "pending"
    v = catalog.commit_version(
        "m",
        late.publish_id,
        parent=2,
        manifest_digest=digest("late"),
        objects=[],
        raw_bytes=1,
        stored_bytes=5,
        kind="delta",
    )
    assert v.number == 3


def test_parent_none_means_no_head_yet(catalog: Catalog) -> None:
    catalog.create_model("m")
    p = catalog.begin_version("m", parent=None, kind="keyframe")
    publish(catalog, "m", parent=None, tag="first")
    with pytest.raises(errors.StaleParent) as info:
        catalog.commit_version(
            "m",
            p.publish_id,
            parent=None,
            manifest_digest=digest("x"),
            objects=[],
            raw_bytes=1,
            stored_bytes=1,
            kind="keyframe",
        )
    assert info.value.current_head == 1


def test_commit_retry_is_idempotent(catalog: Catalog) -> None:
    catalog.create_model("m")
    p = catalog.begin_version("m", parent=None, kind="keyframe")
    args = dict(
        parent=None,
        manifest_digest=digest("m1"),
        objects=[(digest("o1"), 3)],
        raw_bytes=9,
        stored_bytes=3,
        kind="keyframe",
    )
    first = catalog.commit_version("m", p.publish_id, **args)
    publish(catalog, "m", parent=1)  # the head moves on; a late retry must still not Conflict
    assert catalog.commit_version("m", p.publish_id, **args) == first
    with pytest.raises(errors.Conflict, match="another manifest"):
        catalog.commit_version("m", p.publish_id, **{**args, "manifest_digest": digest("other")})
    assert catalog.get_model("m").head == 2


def test_idempotency_key_returns_original(catalog: Catalog) -> None:
    catalog.create_model("m")
    args = dict(parent=None, manifest_digest=digest("m1"), objects=[], raw_bytes=9, stored_bytes=3, kind="keyframe")
    p1 = catalog.begin_version("m", parent=None, kind="keyframe")
    first = catalog.commit_version("m", p1.publish_id, idempotency_key="req-42", **args)
    assert first.idempotency_key == "req-42"
    # A client that lost the answer may even retry through a new publish: same key, same result.
    p2 = catalog.begin_version("m", parent=None, kind="keyframe")
    assert catalog.commit_version("m", p2.publish_id, idempotency_key="req-42", **args) == first
    assert catalog.get_pending("m", p2.publish_id).state == "pending"
    with pytest.raises(errors.Conflict):
        catalog.commit_version("m", p2.publish_id, idempotency_key="req-42", **{**args, "manifest_digest": digest("z")})
    assert catalog.get_model("m").head == 1


def test_unknown_and_foreign_publish(catalog: Catalog) -> None:
    catalog.create_model("m")
    catalog.create_model("n")
    p = catalog.begin_version("n", parent=None, kind="keyframe")
    common = dict(parent=None, manifest_digest=digest("x"), objects=[], raw_bytes=1, stored_bytes=1, kind="keyframe")
    with pytest.raises(errors.PublishNotFound):
        catalog.commit_version("m", "never-begun", **common)
    with pytest.raises(errors.PublishNotFound):
        catalog.commit_version("m", p.publish_id, **common)  # belongs to another model


def test_begin_is_idempotent_per_publish_id(catalog: Catalog) -> None:
    catalog.create_model("m")
    catalog.create_model("n")
    a = catalog.begin_version("m", parent=None, kind="keyframe", publish_id="p1")
    assert catalog.begin_version("m", parent=None, kind="keyframe", publish_id="p1") == a
    with pytest.raises(errors.Conflict):
        catalog.begin_version("n", parent=None, kind="keyframe", publish_id="p1")


def test_expired_publish_cannot_commit_and_is_swept(catalog: Catalog) -> None:
    catalog.create_model("m")
    pack = digest("pending-pack")
    p = catalog.begin_version("m", parent=None, kind="keyframe", expires_at=T0 + timedelta(minutes=5), now=T0)
    keep = catalog.begin_version("m", parent=None, kind="keyframe", expires_at=T0 + timedelta(hours=5), now=T0)
    catalog.reference_objects("m", p.publish_id, [(pack, 7)], now=T0)
    assert pack in catalog.referenced_digests()
    late = T0 + timedelta(minutes=5)
    with pytest.raises(errors.PublishNotFound, match="expired"):
        catalog.commit_version(
            "m",
            p.publish_id,
            parent=None,
            manifest_digest=digest("x"),
            objects=[],
            raw_bytes=1,
            stored_bytes=1,
            kind="keyframe",
            now=late,
        )
    assert catalog.expire_pending(T0) == []
    expired = catalog.expire_pending(late)
    assert [(v.publish_id, v.state, v.deleted_at) for v in expired] == [(p.publish_id, "deleted", late)]
    assert [v.publish_id for v in catalog.list_pending()] == [keep.publish_id]
    assert pack not in catalog.referenced_digests()
    assert catalog.get_object(pack).unreferenced_since == late
    with pytest.raises(errors.PublishNotFound, match="deleted"):
        catalog.get_pending("m", p.publish_id, now=T0)


def test_abort_pending(catalog: Catalog) -> None:
    catalog.create_model("m")
    p = catalog.begin_version("m", parent=None, kind="keyframe")
    assert catalog.abort_pending("m", p.publish_id).state == "deleted"
    with pytest.raises(errors.PublishNotFound):
        catalog.abort_pending("m", p.publish_id)


def test_numbers_are_never_reused(catalog: Catalog) -> None:
    catalog.create_model("m")
    for parent in (None, 1, 2):
        publish(catalog, "m", parent=parent, tag=f"v{parent}")
    assert catalog.mark_deleted("m", [3], force=True) == [3]
    assert catalog.get_model("m").head == 2  # the head falls back to the newest remaining version
    v = publish(catalog, "m", parent=2, tag="after")
    assert (v.number, v.parent) == (4, 2)


# --- reading ----------------------------------------------------------------------------


def test_get_and_list_versions(catalog: Catalog) -> None:
    catalog.create_model("m")
    for parent in (None, 1, 2, 3, 4):
        publish(catalog, "m", parent=parent, tag=f"v{parent}")
    catalog.begin_version("m", parent=5, kind="delta", publish_id="open")
    nums = lambda vs: [v.number for v in vs]  # noqa: E731
    assert nums(catalog.list_versions("m")) == [1, 2, 3, 4, 5]
    assert nums(catalog.list_versions("m", after=2, limit=2)) == [3, 4]
    assert nums(catalog.list_versions("m", before=3)) == [1, 2]
    assert nums(catalog.list_versions("m", descending=True, limit=2)) == [5, 4]
    assert nums(catalog.list_versions("m", states=("committed", "pending"))) == [1, 2, 3, 4, 5, None]
    assert catalog.mark_deleted("m", [1, 2, 3, 4], force=True) == [1, 2, 3, 4]
    assert nums(catalog.list_versions("m")) == [5]
    assert nums(catalog.list_versions("m", states=("deleted",))) == [1, 2, 3, 4]
    with pytest.raises(errors.VersionNotFound):
        catalog.get_version("m", 2)
    assert catalog.get_version("m", 2, include_deleted=True).state == "deleted"
    with pytest.raises(errors.VersionNotFound):
        catalog.get_version("m", 99)
    with pytest.raises(errors.InvalidArgument):
        catalog.list_versions("m", states=("gone",))


def test_lineage_and_chain_info(catalog: Catalog) -> None:
    catalog.create_model("m")
    assert catalog.chain_info("m") is None
    publish(catalog, "m", parent=None, stored_bytes=1000)  # 1
    publish(catalog, "m", parent=1, stored_bytes=10)  # 2
    publish(catalog, "m", parent=2, stored_bytes=20)  # 3
    publish(catalog, "m", parent=3, kind="keyframe", stored_bytes=900)  # 4
    publish(catalog, "m", parent=4, stored_bytes=30)  # 5
    assert [v.number for v in catalog.lineage("m", 3)] == [1, 2, 3]
    assert [v.number for v in catalog.lineage("m", 5)] == [4, 5]
    assert [v.number for v in catalog.lineage("m", 4)] == [4]
    info = catalog.chain_info("m", 3)
    assert (info.base, info.length, info.keyframe_bytes, info.delta_bytes) == (1, 3, 1000, 30)
    info = catalog.chain_info("m")
    assert (info.base, info.length, info.keyframe_bytes, info.delta_bytes) == (4, 2, 900, 30)
    with pytest.raises(errors.VersionNotFound):
        catalog.lineage("m", 6)
    catalog.mark_deleted("m", [2], force=True)
    with pytest.raises(errors.VersionNotFound, match="needs version 2"):
        catalog.lineage("m", 3)
