"""`solve(problem, method)`: run one balancer by name and return a scored Plan."""
from __future__ import annotations

import inspect
import logging
import time
from typing import Any, Callable

from dynmo_plugin.balancing.baselines import solve_parameters, solve_uniform
from dynmo_plugin.balancing.diffusion import solve_diffusion
from dynmo_plugin.balancing.exact import solve_exact
from dynmo_plugin.balancing.gate import GateConfig, attach_gate
from dynmo_plugin.balancing.partition import solve_partition
from dynmo_plugin.balancing.plan import Outcome, Plan, make_plan
from dynmo_plugin.balancing.problem import BalanceProblem, ProblemError

__all__ = ["solve", "BALANCERS"]

log = logging.getLogger(__name__)


def _exact(problem: BalanceProblem) -> Outcome:
    return Outcome(solve_exact(problem))


_REGISTRY: dict[str, Callable[..., Outcome]] = {
    "exact": _exact,
    "partition": solve_partition,
    "diffusion": solve_diffusion,
    "uniform": solve_uniform,
    "parameters": solve_parameters,
}
BALANCERS: tuple[str, ...] = tuple(_REGISTRY)
# the options each balancer takes (inspect.signature costs ~20 us: not on every decision)
_OPTIONS: dict[str, frozenset[str]] = {
    name: frozenset(inspect.signature(fn).parameters) - {"problem"} for name, fn in _REGISTRY.items()}


def solve(problem: BalanceProblem, method: str, *, gate: GateConfig | None = None,
          **options: Any) -> Plan:
    """Balance `problem` with `method` (one of BALANCERS) and score the result.

    Options by method: partition: `weights` (per-layer, default the costs);
    diffusion: `max_rounds`, `max_moves_per_exchange`; parameters: `param_counts`
    (default `problem.param_counts`). With `gate`, the verdict is attached.

    Raises:
        ProblemError: unknown method or option.
        InfeasibleError: no plan satisfies the memory caps / non-empty stages.
    """
    fn = _REGISTRY.get(method)
    if fn is None:
        raise ProblemError(f"unknown balancing method {method!r}; choose one of {', '.join(BALANCERS)}")
    accepted = _OPTIONS[method]
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise ProblemError(f"method {method!r} does not take option(s) {unknown}; "
                           f"it takes {sorted(accepted) or 'none'}")
    start = time.perf_counter()
    outcome = fn(problem, **options)
    seconds = time.perf_counter() - start
    plan = make_plan(problem, outcome.layout, method, seconds, outcome.rounds, outcome.notes)
    log.info("balancing %s: %s -> %s in %.3f s", method, problem.current, plan.layout, seconds)
    return attach_gate(plan, gate) if gate is not None else plan
