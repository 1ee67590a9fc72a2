"""`partition`: the DynMo paper's centralised balancer, DeepSpeed's partition_balanced.

We call DeepSpeed rather than copy it. Its input is one weight per layer, so the
first and last stages' fixed extras are added to the first and last layer's weight
(exact whenever those stages are non-empty, which partition_balanced guarantees when
there are more layers than stages); extras on middle stages are invisible to it.
partition_balanced knows nothing about memory: when its layout breaks a cap (or
leaves a stage empty when that is not allowed) we say so in the plan's notes and
fall back to the best feasible plan, the `exact` one.

Note: partition_balanced minimises (max part - min part) with an O(n^2 m) pure-Python
DP, which is not the bottleneck objective; it is sometimes suboptimal, and slow.
"""
from __future__ import annotations

import functools
import logging
from typing import Callable, Sequence

from dynmo_plugin.balancing.exact import solve_exact
from dynmo_plugin.balancing.metrics import feasibility_problems
from dynmo_plugin.balancing.plan import Outcome
from dynmo_plugin.balancing.problem import BalanceProblem, ProblemError
from dynmo_plugin.errors import UserError
from dynmo_plugin.layout import Layout

__all__ = ["deepspeed_partition", "load_partition_balanced", "solve_partition"]

log = logging.getLogger(__name__)


@functools.cache
def load_partition_balanced() -> Callable[[list[float], int], list[int]]:
    """Import DeepSpeed's `partition_balanced` (once) and return it.

    Imported lazily: `deepspeed.runtime.utils` imports torch and torch.distributed,
    which the balancing package itself must not. The first import takes seconds, so a
    caller that times the solve (`solve()` reports `solve_seconds`; the simulator
    charges it as decision overhead) calls this first to keep the import out of it.

    Raises:
        UserError: DeepSpeed (or torch under it) cannot be imported.
    """
    try:
        from deepspeed.runtime.utils import partition_balanced
    except (ImportError, OSError) as e:
        raise UserError(f"this balancer needs DeepSpeed, which failed to import ({e}): "
                        "pip install -c constraints.txt deepspeed") from e
    return partition_balanced


def deepspeed_partition(weights: Sequence[float], num_parts: int) -> Layout:
    """DeepSpeed's `partition_balanced(weights, num_parts)` as a Layout."""
    bounds = load_partition_balanced()([float(w) for w in weights], num_parts)
    return Layout.from_boundaries([int(b) for b in bounds])


def _weights(problem: BalanceProblem, weights: Sequence[float] | None) -> list[float]:
    out = [float(w) for w in (problem.costs if weights is None else weights)]
    if len(out) != problem.num_layers or any(not w >= 0 for w in out):
        raise ProblemError(f"partition weights must be {problem.num_layers} values >= 0, got {list(out)}")
    ec = problem.extras_cost_arr
    out[0] += float(ec[0])
    if problem.num_stages > 1:
        out[-1] += float(ec[-1])
    return out


def solve_partition(problem: BalanceProblem, weights: Sequence[float] | None = None) -> Outcome:
    """DeepSpeed's layout for `weights` (default: the costs), else the exact fallback.

    Raises:
        InfeasibleError: no layout at all satisfies the memory caps.
    """
    notes = []
    if problem.num_stages > 2 and problem.extras_cost_arr[1:-1].any():
        notes.append("partition_balanced ignores extras on middle stages")
    layout = deepspeed_partition(_weights(problem, weights), problem.num_stages)
    broken = feasibility_problems(problem, layout)
    if broken:
        notes.append(f"partition_balanced layout {layout} is not allowed ({'; '.join(broken)}); "
                     "fell back to the exact solver's layout")
        log.info("partition: %s", notes[-1])
        layout = solve_exact(problem)
    return Outcome(layout, notes)
