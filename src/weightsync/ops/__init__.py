"""Use cases composing codec, store and catalog: publish, commit, plan, materialize, fsck, gc."""

from weightsync.ops.core import BeginResult, Materialized, Ops, OpsSettings, Plan, PlanStep
from weightsync.ops.maintenance import FsckReport, GcReport, Problem, fsck, gc, rebuild_catalog
from weightsync.ops.records import CommitRecord

__all__ = ["BeginResult", "CommitRecord", "FsckReport", "GcReport", "Materialized", "Ops", "OpsSettings", "Plan",
           "PlanStep", "Problem", "fsck", "gc", "rebuild_catalog"]
