"""Typed records of the decision pipeline: profile -> decision (plan + verdict) ->
migration result -> event, and their JSON form in report.json.

The controller builds these objects; only `to_dict` knows the report's field names
(docs/usage.md lists them), and `dynmo_plugin.reporting` reads that JSON back.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from dynmo_plugin.balancing import Plan
from dynmo_plugin.migration.result import MigrationResult

__all__ = ["Decision", "ProfileEvent", "RebalanceEvent"]


@dataclass
class Decision:
    """What rank 0 decided and broadcast: every rank acts on this same object."""

    profile: dict                 # the gathered PipelineProfile, as data
    plan: Optional[Plan] = None   # None when no plan exists (infeasible, balancer failed)
    apply: bool = False
    reason: str = ""
    repack: Any = None            # a balancing.repack.RepackPlan when repacking was considered
    memory: Optional[dict] = None  # the memory calibration and calibrated bytes (controller)


@dataclass
class ProfileEvent:
    """A profiling window closed (or was cancelled before it could)."""

    iteration: int
    trigger: str
    window: list[int]
    layout: str
    overhead_s: dict[str, float]
    profile: Optional[dict] = None
    cancelled: str = ""           # why the window was dropped without a profile
    memory: Optional[dict] = None  # cap and per-stage memory calibration (controller)
    # profile-only windows: the exact solver's plan for the profile, never applied, and why
    plan: Optional[Plan] = None
    reason: str = ""

    kind = "profile"

    def to_dict(self) -> dict[str, Any]:
        out = {"iteration": self.iteration, "kind": self.kind, "trigger": self.trigger,
               "window": self.window, "layout": self.layout, "overhead_s": dict(self.overhead_s),
               "profile": self.profile}
        if self.cancelled:
            out["cancelled"] = self.cancelled
        if self.reason:
            out["reason"] = self.reason
        if self.plan is not None:
            out.update(_plan_fields(self.plan), layout_before=self.layout)
        if self.memory is not None:
            out["memory"] = self.memory
        return out


@dataclass
class RebalanceEvent:
    """A rebalance decision and, if applied or attempted, its migration."""

    iteration: int
    trigger: str
    layout_before: str
    layout_after: str
    applied: bool
    overhead_s: dict[str, float]
    reason: str = ""
    error: Optional[str] = None
    plan: Optional[Plan] = None
    migration: Optional[MigrationResult] = None
    window: Optional[list[int]] = None
    profile: Optional[dict] = None
    measured_iter_s_before: Optional[float] = None
    measured_iter_s_after: Optional[float] = None
    repack: Optional[dict] = None  # what a repack did (megatron.repack); "cluster" is filled later
    profile_source: str = "timed"  # or "estimated": the last timed profile scaled by work
    memory: Optional[dict] = None  # cap, per-stage calibration, calibrated bytes before/after
    # a repack the decision weighed and did not apply: stages, predictions, reason
    repack_considered: Optional[dict] = None

    kind = "rebalance"

    @property
    def moves(self) -> list[dict]:
        return list(self.migration.moves) if self.migration is not None and self.applied else []

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "iteration": self.iteration, "kind": self.kind, "trigger": self.trigger,
            "layout_before": self.layout_before, "layout_after": self.layout_after,
            "applied": self.applied, "reason": self.reason, "moves": self.moves,
            "overhead_s": dict(self.overhead_s),
            "measured_iter_s_before": self.measured_iter_s_before,
            "measured_iter_s_after": self.measured_iter_s_after,
            "profile_source": self.profile_source}
        if self.error is not None:
            out["error"] = self.error
        if self.window is not None:
            out.update(window=self.window, layout=self.layout_before, profile=self.profile)
        if self.plan is not None:
            out.update(_plan_fields(self.plan))
        if self.repack_considered is not None:
            out["repack_considered"] = self.repack_considered
        if self.migration is not None:
            out["migration"] = self.migration.to_dict()
        if self.memory is not None:
            out["memory"] = self.memory
        if self.repack is not None:
            out["repack"] = dict(self.repack)  # a copy: a release thread may fill "cluster"
        return out


def _plan_fields(p: Plan) -> dict[str, Any]:
    """A plan's fields in an event: the plan, and what the report's tables and plots read."""
    return {"plan": p.to_dict(), "stage_loads_before": p.stage_loads_before,
            "stage_loads_after": p.stage_loads_after, "imbalance_before": p.imbalance_before,
            "imbalance_after": p.imbalance_after, "predicted_iter_s_before": p.predicted_iter_s_before,
            "predicted_iter_s_after": p.predicted_iter_s_after, "planned_layout": p.layout.to_megatron()}
