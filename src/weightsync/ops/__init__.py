"""Use cases composing codec, store and catalog: publish, commit, plan, materialize, fsck, gc."""

from weightsync.ops.core import BeginResult, Materialized, Ops, OpsSettings, Plan, PlanStep, committed
from weightsync.ops.maintenance import FsckReport, GcReport, Problem, Sweep, fsck, gc, rebuild_catalog, sweep
from weightsync.ops.records import CommitRecord

__all__ = [
    "BeginResult",
    "CommitRecord",
    "FsckReport",
    "GcReport",
    "Materialized",
    "Ops",
    "OpsSettings",
    "Plan",
    "PlanStep",
    "Problem",
    "Sweep",
    "committed",
    "fsck",
    "gc",
    "rebuild_catalog",
    "sweep",
]
