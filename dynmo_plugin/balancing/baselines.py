"""Static baselines: Megatron's uniform split and DeepSpeed's 'parameters' method.

Baselines are what runs without a rebalancer, so they do not repair themselves: when
their layout breaks a memory cap or leaves a stage empty, there is no plan
(`InfeasibleError`), never a silently broken one.
"""
from __future__ import annotations

from typing import Sequence

from dynmo_plugin.balancing.metrics import feasibility_problems
from dynmo_plugin.balancing.partition import deepspeed_partition
from dynmo_plugin.balancing.plan import Outcome
from dynmo_plugin.balancing.problem import BalanceProblem, InfeasibleError, ProblemError
from dynmo_plugin.layout import Layout

__all__ = ["solve_uniform", "solve_parameters"]


def _checked(problem: BalanceProblem, layout: Layout, method: str) -> Outcome:
    broken = feasibility_problems(problem, layout)
    if broken:
        raise InfeasibleError(f"{method} layout {layout} is not allowed: {'; '.join(broken)}; "
                              "use --method exact")
    return Outcome(layout)


def solve_uniform(problem: BalanceProblem) -> Outcome:
    """Megatron's static split (remainder to the first stages), ignoring costs."""
    return _checked(problem, Layout.uniform(problem.num_layers, problem.num_stages), "uniform")


def solve_parameters(problem: BalanceProblem, param_counts: Sequence[float] | None = None) -> Outcome:
    """DeepSpeed's static 'parameters' method: partition_balanced on parameter counts.

    The counts come from the `param_counts` option, else `problem.param_counts`
    (DeepSpeed counts only trainable parameters, so frozen layers weigh 0).

    Raises:
        ProblemError: no parameter counts were given.
        InfeasibleError: the layout breaks a memory cap or leaves a stage empty.
    """
    counts = param_counts if param_counts is not None else problem.param_counts
    if counts is None:
        raise ProblemError("method 'parameters' needs per-layer parameter counts: pass "
                           "param_counts= or a 'params' list in costs.json")
    counts = [float(c) for c in counts]
    if len(counts) != problem.num_layers or any(not c >= 0 for c in counts):
        raise ProblemError(f"param_counts must be {problem.num_layers} values >= 0, got {counts}")
    return _checked(problem, deepspeed_partition(counts, problem.num_stages), "parameters")
