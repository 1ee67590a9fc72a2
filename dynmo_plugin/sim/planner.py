"""The simulator's decisions go through the live plugin's decision path, not a copy.

A simulated rebalance builds the `BalanceProblem` the live controller builds from a
profile (`dynmo_plugin.controller.problem_from_profile`: per-layer cost; memory =
training state + activations of min(p, m) micro-batches in flight; move bytes = state;
rebuilt gradient buffers; stage extras; the current layout; micro-batches; parameter
counts) and decides with the function `DynMo._decide` calls,
`dynmo_plugin.balancing.decide.decide` (repack if one passes its gate, else the
balancer's plan if it passes the gate, else keep the layout; infeasible means keep).

The gate settings default to the live ones (`config.RebalanceConfig`,
`config.RepackConfig`). Two differences, both stated: the live plugin considers a
repack only after dynamism events (trigger "event") while the simulator does at every
rebalance point; and the horizon defaults to the iterations until the run's next
rebalance point (a plugin configured with the true event gap), not a fixed 100.
The repack planner predicts iteration times with the simulator's own iteration model
(`decide`'s `iteration_model`: p2p transfers on the critical path, the DP all-reduce,
the 1F1B order), so an applied repack never simulates slower than `max_slowdown`
allows; the live plugin runs the same iteration on its profiled problem
(`sim.problem_model`, via `controller.repack_iteration_model`).
Decision time is modelled (`decision.DecisionTimeModel`): the balancer's formula, plus
`exact`'s for every stage count the repack planner solved. No balancer lives here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from dynmo_plugin.balancing import BALANCERS, BalanceProblem, GateConfig, Plan, RepackCriteria, RepackPlan
from dynmo_plugin.balancing.repack_throughput import IterationModel
from dynmo_plugin.balancing.decide import decide as decide_live
from dynmo_plugin.config import RebalanceConfig, RepackConfig
from dynmo_plugin.errors import UserError
from dynmo_plugin.layout import Layout
from dynmo_plugin.sim.decision import DecisionTimeModel
from dynmo_plugin.sim.gpt import GPTShape, Hardware, LayerCosts, LayerLoad

__all__ = ["GateSettings", "SimDecision", "available_balancers", "build_problem", "decide",
           "live_repack_criteria"]

_LIVE = RebalanceConfig()


def live_repack_criteria() -> RepackCriteria:
    """The live plugin's default repack criteria (`config.RepackConfig`)."""
    return RepackCriteria.from_config(RepackConfig())


@dataclass(frozen=True, kw_only=True)
class GateSettings:
    """The gate of a simulated plugin.

    margin, min_gain: as --dynmo-gate-margin and --dynmo-min-gain (live defaults).
    horizon: iterations a new layout is expected to last (--dynmo-event-gap); None =
        until the run's next rebalance point.

    Raises:
        UserError: a negative margin, min_gain outside [0, 1) or horizon < 1.
    """

    margin: float = _LIVE.margin
    min_gain: float = _LIVE.min_gain
    horizon: int | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.margin) and self.margin >= 0) or not 0 <= self.min_gain < 1:
            raise UserError(f"gate: need margin >= 0 and 0 <= min_gain < 1, got {self.margin}, "
                            f"{self.min_gain}")
        if self.horizon is not None and self.horizon < 1:
            raise UserError(f"gate horizon must be >= 1 iteration, got {self.horizon}")

    def config(self, iterations_left: int, bandwidth_Bps: float) -> GateConfig:
        horizon = self.horizon if self.horizon is not None else max(int(iterations_left), 0)
        return GateConfig(iterations_until_next_event=horizon, bandwidth_bytes_per_s=bandwidth_Bps,
                          margin=self.margin, min_relative_gain=self.min_gain)


@dataclass(frozen=True)
class SimDecision:
    """layout: in force after the decision (the current one when nothing applied);
    kind: "rebalance", "repack" or "none"; decision_s: modelled seconds."""

    layout: Layout
    applied: bool
    reason: str
    kind: str
    decision_s: float
    plan: Plan | None = None
    repack: RepackPlan | None = None


def available_balancers() -> list[str]:
    """Balancer names `decide` accepts."""
    return list(BALANCERS)


def build_problem(*, costs: LayerCosts, load: LayerLoad, shape: GPTShape, hw: Hardware,
                  current: Layout, num_microbatches: int) -> BalanceProblem:
    """The problem the live controller would build from a profile of these layers."""
    p = current.num_stages
    state = shape.layer_params * hw.state_bytes_per_param
    act = 34.0 * shape.seq * shape.micro_batch * shape.hidden
    in_flight = min(p, num_microbatches)
    emb = shape.vocab * shape.hidden
    extras_mem, extras_grad = [0.0] * p, [0.0] * p
    for s in {0, p - 1}:  # tied embedding: a copy on the first and the last stage
        extras_mem[s] += emb * hw.state_bytes_per_param
        extras_grad[s] += emb * hw.grad_bytes_per_param
    n = shape.num_layers
    return BalanceProblem(
        costs=costs.total_s.tolist(), num_stages=p, memory=[state + in_flight * act] * n,
        move_bytes=[state] * n, capacity=hw.memory_bytes, extras_cost=costs.extras_s(p),
        extras_memory=extras_mem, current=current, num_microbatches=num_microbatches,
        param_counts=(load.param_share * shape.layer_params).tolist(),
        rebuild_bytes=[shape.layer_params * hw.grad_bytes_per_param] * n,
        extras_rebuild_bytes=extras_grad,
        tokens_per_iteration=float(num_microbatches * shape.tokens_per_microbatch))


def decide(problem: BalanceProblem, balancer: str, gate: GateConfig,
           repack: RepackCriteria | None, decision_time: DecisionTimeModel,
           iteration_model: IterationModel | None = None) -> SimDecision:
    """The live decision (`balancing.decide`, which `DynMo._decide` calls) on a simulated
    problem, with modelled decision time; `iteration_model` prices the repack candidates
    (the campaign passes its simulated iteration, module docstring).

    Raises:
        UserError: `balancer` has no decision-time model.
    """
    n, p = problem.num_layers, problem.num_stages
    seconds = decision_time.seconds(balancer, n, p)
    choice = decide_live(problem, balancer, gate, repack, iteration_model=iteration_model)
    if choice.repack is not None:
        seconds += sum(decision_time.seconds("exact", n, c.stages)
                       for c in choice.repack.candidates if c.layout is not None)
    layout = problem.current
    if choice.action == "repack":
        layout = choice.repack.layout_after
    elif choice.action == "rebalance":
        layout = choice.plan.layout
    return SimDecision(layout, choice.apply, choice.reason, choice.action, seconds, choice.plan,
                       choice.repack)
