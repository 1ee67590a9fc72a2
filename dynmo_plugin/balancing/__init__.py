"""Balancing: decide which decoder layers each pipeline stage holds (pure: numpy only).

Start with `solve(BalanceProblem(...), "exact")`; `plan_repack` decides whether the
pipeline can shrink onto fewer stages. See docs/balancing.md. This package
never imports torch, torch.distributed or megatron; the DeepSpeed-backed balancers
import DeepSpeed lazily, inside the call.
"""
from dynmo_plugin.balancing.diffusion import solve_diffusion
from dynmo_plugin.balancing.exact import optimal_bottleneck, solve_exact
from dynmo_plugin.balancing.gate import GateConfig, attach_gate, evaluate_gate
from dynmo_plugin.balancing.metrics import (imbalance, migration_peak_memory,
                                            predicted_iteration_s, stage_loads, stage_memory)
from dynmo_plugin.balancing.plan import GateVerdict, Move, Outcome, Plan, make_plan
from dynmo_plugin.balancing.problem import (REL_TOL, BalanceProblem, InfeasibleError,
                                            ProblemError)
from dynmo_plugin.balancing.repack import first_fit_repack, plan_repack
from dynmo_plugin.balancing.repack_plan import RepackCandidate, RepackCriteria, RepackPlan
from dynmo_plugin.balancing.shrink import shrink_problem
from dynmo_plugin.balancing.solve import BALANCERS, solve

__all__ = [
    "BALANCERS", "BalanceProblem", "GateConfig", "GateVerdict", "InfeasibleError", "Move",
    "Outcome", "Plan", "ProblemError", "REL_TOL", "RepackCandidate", "RepackCriteria", "RepackPlan",
    "attach_gate", "evaluate_gate", "first_fit_repack", "imbalance", "make_plan",
    "migration_peak_memory", "optimal_bottleneck", "plan_repack", "predicted_iteration_s",
    "shrink_problem", "solve", "solve_diffusion", "solve_exact", "stage_loads", "stage_memory",
]
