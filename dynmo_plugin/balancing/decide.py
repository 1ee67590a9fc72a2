"""The one decision path: after a profile, repack, rebalance or keep the layout.

Live training (`dynmo_plugin.controller.DynMo._decide`, on rank 0) and the simulator
(`dynmo_plugin.sim.planner.decide`) both call `decide`, so a what-if predicts what the
plugin would do:

1. with repack criteria, `plan_repack`: a repack that passes its gate wins (its layout
   is balanced too); interleaved pipelines are not repacked (only rebalanced);
2. else `solve(problem, balancer, gate=gate)`: a plan equal to the current layout is
   "already balanced", otherwise the gate's verdict (margin, noise floor, horizon)
   decides;
3. an infeasible or malformed problem is a decision not to move, never an exception.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from dynmo_plugin.balancing.gate import GateConfig
from dynmo_plugin.balancing.plan import Plan
from dynmo_plugin.balancing.problem import BalanceProblem, InfeasibleError, ProblemError
from dynmo_plugin.balancing.repack import plan_repack
from dynmo_plugin.balancing.repack_plan import RepackCriteria, RepackPlan
from dynmo_plugin.balancing.repack_throughput import IterationModel
from dynmo_plugin.balancing.solve import solve

__all__ = ["Choice", "decide", "repack_considered"]


@dataclass(frozen=True)
class Choice:
    """What to do: `action` is "repack" (to `repack.layout_after`), "rebalance" (to
    `plan.layout`) or "none"; `plan`/`repack` are kept when considered, for the record."""

    apply: bool
    reason: str
    plan: Optional[Plan] = None
    repack: Optional[RepackPlan] = None

    @property
    def action(self) -> str:
        if not self.apply:
            return "none"
        return "repack" if self.repack is not None and self.repack.apply else "rebalance"


def repack_considered(problem: BalanceProblem, repack: Optional[RepackCriteria]) -> bool:
    """Whether a repack is worth planning: criteria given and more pipeline ranks than
    min_stages (ranks, not virtual stages: interleaved, each keeps its chunks). The one
    min_stages guard of every entry point (`decide`, `dynmo plan --from-run`)."""
    return repack is not None and problem.num_ranks > repack.min_stages


def decide(problem: BalanceProblem, balancer: str, gate: GateConfig,
           repack: Optional[RepackCriteria] = None, *,
           iteration_model: Optional[IterationModel] = None) -> Choice:
    """Repack if `repack` criteria are given and a repack passes its gate, else the
    balancer's plan if it moves something and passes the gate, else keep the layout.
    `iteration_model`: how the repack planner predicts iteration times (default the
    flow-shop formula; the simulator and the live controller pass the simulated
    iteration, `repack` module docstring)."""
    repack_plan = None
    try:
        if repack_considered(problem, repack):
            repack_plan = plan_repack(problem, repack, gate, iteration_model=iteration_model)
            if repack_plan.apply:
                return Choice(True, repack_plan.reason, repack=repack_plan)
        plan = solve(problem, balancer, gate=gate)
    except (InfeasibleError, ProblemError) as e:
        return Choice(False, f"no feasible plan: {e}", repack=repack_plan)
    if plan.layout == problem.current:
        return Choice(False, "already balanced", plan, repack_plan)
    return Choice(plan.gate.apply, plan.gate.reason, plan, repack_plan)
