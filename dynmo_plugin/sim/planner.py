"""The simulator's door to the balancers (dynmo_plugin.balancing); no balancer lives here.

A planner maps a `PlanRequest` (what the profiler would have measured) to a layout and
the simulated seconds the decision takes. `uniform` is Megatron's static split; every
other name is looked up in `dynmo_plugin.balancing.BALANCERS` and run through its
`solve`. The decision time is modelled (`dynmo_plugin.sim.decision`), never the wall
clock of this process, so a campaign's result depends on its configuration alone; the
measured solve time comes along as information only.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

from dynmo_plugin.errors import UserError
from dynmo_plugin.layout import Layout
from dynmo_plugin.sim.decision import DecisionTimeModel

__all__ = ["PlanRequest", "PlanOutcome", "Planner", "make_planner", "available_balancers"]


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """Per-layer seconds (fwd+bwd per micro-batch), per-stage extras, memory model."""

    costs: Sequence[float]
    num_stages: int
    extras_cost: Sequence[float]
    current: Layout | None
    num_microbatches: int
    memory: Sequence[float] | None = None
    extras_memory: Sequence[float] | None = None
    capacity: float | None = None
    move_bytes: Sequence[float] | None = None


@dataclass(frozen=True)
class PlanOutcome:
    """layout: the plan; decision_s: modelled seconds, charged to simulated time;
    measured_s: wall-clock seconds the balancer took here, for information only (it
    varies between runs, so it never enters a simulated result)."""

    layout: Layout
    decision_s: float
    measured_s: float = 0.0


Planner = Callable[[PlanRequest], PlanOutcome]


def _balancing_module():
    try:
        from dynmo_plugin import balancing
    except ImportError as e:  # pragma: no cover - package always present
        raise UserError(f"cannot import dynmo_plugin.balancing: {e}") from e
    if not all(hasattr(balancing, n) for n in ("BalanceProblem", "solve", "BALANCERS")):
        raise UserError("dynmo_plugin.balancing does not export BalanceProblem/solve/BALANCERS "
                        "yet; only --balancer uniform works in this checkout")
    return balancing


def available_balancers() -> list[str]:
    """'uniform' plus whatever dynmo_plugin.balancing offers (nothing if not built)."""
    try:
        return ["uniform"] + [b for b in _balancing_module().BALANCERS if b != "uniform"]
    except UserError:
        return ["uniform"]


def _uniform_planner(decision: DecisionTimeModel) -> Planner:
    """Megatron's static split, without the balancing package (it may be absent)."""
    cost = decision.cost_of("uniform")

    def plan(req: PlanRequest) -> PlanOutcome:
        n = len(req.costs)
        return PlanOutcome(Layout.uniform(n, req.num_stages), cost.seconds(n, req.num_stages))

    return plan


def make_planner(method: str, decision: DecisionTimeModel | None = None) -> Planner:
    """Planner running balancer `method`, its decision time from `decision`
    (default `DecisionTimeModel()`).

    Raises:
        UserError: `method` is unknown or unavailable, or `decision` has no cost for it.
    """
    if decision is None:
        decision = DecisionTimeModel()
    if method == "uniform":
        return _uniform_planner(decision)
    balancing = _balancing_module()
    if method not in balancing.BALANCERS:
        raise UserError(f"unknown balancer {method!r}; choose one of "
                        f"{', '.join(available_balancers())}")
    cost = decision.cost_of(method)

    def plan(req: PlanRequest) -> PlanOutcome:
        problem = balancing.BalanceProblem(
            costs=list(req.costs), num_stages=req.num_stages, extras_cost=list(req.extras_cost),
            memory=req.memory, extras_memory=req.extras_memory, capacity=req.capacity,
            move_bytes=req.move_bytes, current=req.current,
            allow_empty_stages=len(req.costs) < req.num_stages,
            num_microbatches=req.num_microbatches)
        started = time.perf_counter()
        result = balancing.solve(problem, method)
        measured = time.perf_counter() - started
        modelled = cost.seconds(len(req.costs), req.num_stages)
        return PlanOutcome(result.layout, modelled, measured_s=measured)

    return plan
