"""The same profiled problem over fewer pipeline stages: what every K a repack (or a
data-parallel grow) considers is solved on.

Survivors are the LOWEST ranks, so capacities are the first K; the embedding's extras stay
on the first stage, the head's go to the new last one, the middle stages get the median
of the old middle ones (`shrink_problem`). `with_margin` scales the caps for the memory
margin the repack criteria ask for. Pure: the standard library only.
"""
from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Sequence

from dynmo_plugin.balancing.problem import BalanceProblem, ProblemError

__all__ = ["shrink_problem", "with_margin"]


def _shrink_extras(values: Sequence[float] | None, p: int, k: int) -> list[float] | None:
    """Per-stage extras for k of p stages: first stays first, last goes to the new last,
    middle stages get the median of the old middle ones (0 if there were none)."""
    if values is None or k == p:
        return None if values is None else list(values)
    v = [float(x) for x in values]
    if k == 1:
        return [v[0] + v[-1]]
    middle = float(statistics.median(v[1:-1])) if p > 2 else 0.0
    return [v[0], *([middle] * (k - 2)), v[-1]]


def shrink_problem(problem: BalanceProblem, k: int) -> BalanceProblem:
    """The same profiled layers over the first k <= P stages (interleaved: k of the P
    ranks, each with its `num_chunks` chunks; see `_shrink_interleaved`).

    Extras (cost, memory, rebuild bytes): stage 0 keeps stage 0's (embedding); stage k-1
    gets the old last stage's (output layer + loss); stages 1..k-2 get the MEDIAN of the
    old middle stages' extras (robust to one odd stage; 0 when P <= 2); k == 1 sums the
    first and last; k == P keeps them all unchanged. The calibrated `memory_overhead`
    maps the same way (the head's logits go with the head). Capacity: the first k
    entries (the survivors are the lowest ranks). `current` is dropped (it has P stages).

    Per-layer memory is kept as measured. It includes the activations of the micro-batches
    in flight under 1F1B on P stages (stage s holds up to P - s); on fewer stages fewer
    are in flight, so the estimate is conservative: a repack is never refused for lack
    of memory it would have had, only possibly for memory it would not have needed.

    Raises:
        ProblemError: k not an integer in [1, P].
        InfeasibleError: a surviving stage's extras alone exceed its capacity.
    """
    p = problem.num_ranks
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= p:
        raise ProblemError(f"cannot shrink a {p}-stage problem to {k!r} stages; give 1 <= k <= {p}")
    if problem.num_chunks > 1:
        return _shrink_interleaved(problem, k)
    return replace(
        problem, num_stages=k, current=None,
        capacity=None if problem.capacity is None else tuple(problem.capacity[:k]),
        extras_cost=_shrink_extras(problem.extras_cost, p, k),
        extras_memory=_shrink_extras(problem.extras_memory, p, k),
        extras_rebuild_bytes=_shrink_extras(problem.extras_rebuild_bytes, p, k),
        memory_overhead=_shrink_extras(problem.memory_overhead, p, k))


def _shrink_interleaved(problem: BalanceProblem, k: int) -> BalanceProblem:
    """`shrink_problem` for v > 1 chunks per rank: per-virtual-stage extras shrink from
    P x v to k x v virtual stages (the embedding stays on the first, the head goes to the
    last, the middle ones get the median); capacity and the calibrated overhead are per
    rank, so they shrink from P to k ranks the same way."""
    p, v = problem.num_ranks, problem.num_chunks
    return replace(
        problem, num_stages=k * v, current=None,
        capacity=None if problem.capacity is None else tuple(problem.capacity[:k]),
        extras_cost=_shrink_extras(problem.extras_cost, p * v, k * v),
        extras_memory=_shrink_extras(problem.extras_memory, p * v, k * v),
        extras_rebuild_bytes=_shrink_extras(problem.extras_rebuild_bytes, p * v, k * v),
        memory_overhead=_shrink_extras(problem.memory_overhead, p, k))


def with_margin(problem: BalanceProblem, margin: float) -> BalanceProblem:
    """Caps scaled by 1 / (1 + margin): memory <= that  <=>  memory x (1 + margin) <= cap."""
    if problem.capacity is None or margin == 0:
        return problem
    return replace(problem, capacity=tuple(c / (1 + margin) for c in problem.capacity))
