"""The ledger's health columns in the catalog: checked values, unhealthy entries without a version, their leases."""

from __future__ import annotations

import pytest
from _catalog_util import T0, publish

from weightsync import errors
from weightsync.catalog import Catalog


def test_unknown_values_and_versions_that_disagree_with_the_status_are_refused(catalog: Catalog) -> None:
    catalog.create_model("m")
    publish(catalog, "m", parent=None)
    for number, fields, named in (
        (1, {"status": "sleeping"}, "status must be one of serving, applied, unhealthy"),
        (1, {"mode": "rsync"}, "mode must be one of disk, in-place, reload, pull"),
        (1, {"engine": "tgi"}, "engine must be one of vllm, sglang, torch"),
        (1, {"status": "unhealthy"}, "holds no verified version"),
        (None, {"status": "serving"}, "a replica reported serving holds a version"),
        (None, {}, "a replica reported applied holds a version"),
    ):
        with pytest.raises(errors.InvalidArgument, match=named):
            catalog.record_replica("m", "r", number, **fields)  # type: ignore[arg-type]
    assert catalog.list_replicas("m", latest_only=False) == []


def test_an_unhealthy_entry_keeps_the_leases_and_a_serving_one_releases_them(catalog: Catalog) -> None:
    catalog.create_model("m")
    publish(catalog, "m", parent=None)
    publish(catalog, "m", parent=1, kind="keyframe")  # v2 starts a new chain: a lease on v1's is not the head's
    catalog.acquire_lease("m", 1, "r", 600, now=T0)
    sick = catalog.record_replica("m", "r", None, status="unhealthy", engine="vllm", applied_at=T0, release_leases=True)
    assert (sick.number, sick.lag, sick.engine) == (None, None, "vllm")
    assert [(lease.number, lease.holder) for lease in catalog.active_leases("m", now=T0)] == [(1, "r")]
    well = catalog.record_replica("m", "r", 1, status="serving", mode="disk", applied_at=T0, release_leases=True)
    assert (well.number, well.lag, well.status, well.mode) == (1, 1, "serving", "disk")
    assert catalog.active_leases("m", now=T0) == []


def test_an_unhealthy_report_needs_no_version_to_exist(catalog: Catalog) -> None:
    catalog.create_model("empty")  # an engine can fail before the model has a version it could hold
    (entry,) = [catalog.record_replica("empty", "r", None, status="unhealthy")]
    assert (entry.number, entry.lag) == (None, None)
    with pytest.raises(errors.VersionNotFound):
        catalog.record_replica("empty", "r", 1, status="serving")
    assert [(r.subscriber, r.number, r.status) for r in catalog.list_replicas("empty")] == [("r", None, "unhealthy")]
