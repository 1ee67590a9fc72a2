"""`solve(problem, method)`: run one balancer by name and return a scored Plan."""
from __future__ import annotations

import inspect
import logging
import time
from typing import Any, Callable

from dynmo_plugin.balancing.baselines import solve_parameters, solve_uniform
from dynmo_plugin.balancing.blocks import block_sums, coarsen, refine
from dynmo_plugin.balancing.diffusion import solve_diffusion
from dynmo_plugin.balancing.exact import solve_exact, solve_interleaved
from dynmo_plugin.balancing.gate import GateConfig, attach_gate
from dynmo_plugin.balancing.metrics import feasibility_problems
from dynmo_plugin.balancing.mtp import (LAST_STAGE_NOTE, fold_mtp_last, kept_mtp_stage,
                                        solve_exact_mtp)
from dynmo_plugin.layout import LayoutError
from dynmo_plugin.balancing.partition import solve_partition
from dynmo_plugin.balancing.plan import Outcome, Plan, make_plan
from dynmo_plugin.balancing.problem import BalanceProblem, InfeasibleError, ProblemError
from dynmo_plugin.layout import Layout

__all__ = ["solve", "BALANCERS"]

log = logging.getLogger(__name__)


def _exact(problem: BalanceProblem) -> Outcome:
    if problem.num_chunks > 1:
        return Outcome(*solve_interleaved(problem))
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
    outcome = _with_mtp(coarsen(problem), method, fn, _in_blocks(options, problem))
    seconds = time.perf_counter() - start
    # balancers see plain stages, and blocks of layers where the problem has them (`blocks`)
    layout = refine(outcome.layout, problem.layer_block).with_chunks(problem.num_chunks)
    if problem.num_chunks > 1:
        _check_rank_memory(problem, layout, method)
    notes = outcome.notes if problem.layer_block == 1 else [
        f"whole blocks of {problem.layer_block} layers (layer_block; the notes' layouts count blocks)",
        *outcome.notes]
    plan = make_plan(problem, layout, method, seconds, outcome.rounds, notes)
    log.info("balancing %s: %s -> %s in %.3f s", method, problem.current, plan.layout, seconds)
    return attach_gate(plan, gate) if gate is not None else plan


def _in_blocks(options: dict[str, Any], problem: BalanceProblem) -> dict[str, Any]:
    """The per-layer options (partition's `weights`, parameters' `param_counts`) summed
    per block of `layer_block` layers, as `blocks.coarsen` sums the problem's."""
    q, n = problem.layer_block, problem.num_layers
    if q == 1:
        return options
    out = dict(options)
    for key in ("weights", "param_counts"):
        values = options.get(key)
        if values is not None:
            if len(values) != n:
                raise ProblemError(f"{key} must be {n} values, one per layer, got {len(values)}")
            out[key] = block_sums(values, q)
    return out


def _with_mtp(problem: BalanceProblem, method: str, fn: Callable[..., Outcome],
              options: dict[str, Any]) -> Outcome:
    """Run the balancer; with MTP layers, the exact one places the block
    (`mtp.solve_exact_mtp`), the others see it on the last stage (`mtp.fold_mtp_last`)."""
    if not problem.mtp_layers:
        return fn(problem, **options)
    if method == "exact" and problem.num_chunks == 1:
        return solve_exact_mtp(problem)
    out = fn(fold_mtp_last(problem), **options)
    stage = kept_mtp_stage(problem)
    try:
        layout = Layout(out.layout.counts, problem.num_chunks, problem.mtp_layers, stage)
    except LayoutError as e:
        raise InfeasibleError(f"{method} put decoder layers where the MTP block (kept on stage "
                              f"{stage}) forbids them ({e}); use the exact balancer") from None
    note = LAST_STAGE_NOTE if stage == problem.num_stages - 1 else f"MTP block kept on stage {stage}"
    return Outcome(layout, [*out.notes, note], out.rounds)


def _check_rank_memory(problem: BalanceProblem, layout: Layout, method: str) -> None:
    """Interleaved: the balancers other than exact see each chunk capped by its rank's
    whole capacity (a relaxation, see `problem`); a layout whose chunks together break a
    rank's cap is no plan."""
    broken = feasibility_problems(problem, layout)
    if broken:
        raise InfeasibleError(f"{method} layout {layout} is not allowed on an interleaved "
                              f"pipeline: {'; '.join(broken)}; use the exact balancer or raise "
                              "the capacity")
