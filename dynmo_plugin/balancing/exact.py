"""`exact`: the optimal min-max contiguous partition under per-stage memory caps,
moving the fewest bytes (then layers) among optimal partitions.

Problem. n layers with costs c_i >= 0 and memory m_i >= 0, p stages with fixed
extras (cost e_s, memory x_s) and capacity C_s. A layout is 0 = b_0 <= ... <= b_p = n
(b_{s+1} - b_s >= 1 unless empty stages are allowed); stage s's load is
e_s + sum c[b_s:b_{s+1}], its memory x_s + sum m[b_s:b_{s+1}] must be <= C_s.
Minimise the bottleneck B = max_s load_s; among layouts with bottleneck B*, minimise
(bytes moved, layers moved) against the current layout (Megatron's uniform split when
there is none).

Algorithm.
1. Feasibility oracle F(T): "some layout has every load <= T and fits memory". With
   non-negative costs, the admissible starts of a stage-s segment ending at j form a
   window [first_s(j), j - min_layers] (see `segments`), so the set of positions
   reachable after s stages is computed from the previous one by prefix counts:
   O(n) numpy work per stage, O(p n) per call. F is monotone in T.
2. The optimum B* is one stage's load, i.e. an element of the candidate set
   V = {e_s + P[j] - P[i] : s, i <= j} (P = cost prefix sums), |V| <= g n^2 / 2 with
   g = number of distinct extras values (1-3 in practice; stages sharing e_s share
   candidates). Search V without materialising it: keep lo (F false) and hi (F true);
   the candidates in (lo, hi) of each row (s, i) are a contiguous run of j found by
   binary search on P. Test the weighted median of the row medians: at least a quarter
   of the remaining candidates lie on each side of it, so each test discards >= 1/4.
   When <= 65,536 candidates remain, enumerate them, sort, and binary-search with F.
3. Tie-break at T = B*: dynamic programme f_{s+1}(j) = A_s(j) + max over the window of
   (f_s(b) - A_s(b)), where A_s are prefix sums of the packed key (bytes * (n+1) + 1)
   of reference stage s's layers, so maximising kept key = minimising (bytes, layers)
   moved lexicographically. The window maximum is a sparse-table range query:
   O(n log n) numpy work per stage.

Proof of optimality. Invariant: F(lo) is false, F(hi) is true, and every candidate
below hi that is feasible lies in (lo, hi). It holds initially: lo is a lower bound
minus the tolerance (no layout beats the average load, the heaviest layer plus the
smallest extras, or the largest extras; if F(lo) holds anyway, lo = -inf); hi = max e_s + P[n] bounds every load, and if
F(hi) is false no layout fits memory: infeasible.
Testing any t in (lo, hi) keeps it (F monotone). The returned T* is the smallest
feasible candidate of the final range, else hi. The optimal layout's bottleneck B* is
a candidate with F(B*) true, so T* <= B*; and the layout found at T* has every load
<= T* + tol. Hence its bottleneck is optimal up to the tolerance (see `problem`). The
DP enumerates exactly the layouts admissible at T*, i.e. the optimal ones, and its
recurrence is exact because bytes kept by a stage split as A_s(j) - A_s(b); so the
returned layout moves the fewest bytes, then layers, among optimal layouts.

Complexity. O(log(g n^2)) oracle calls of O(p n) each (in numpy), plus per search
step O(g n log n) for the row runs and the weighted median, plus the tie-break
O(p n log n): ~0.1-0.3 s for 1,000 layers x 128 stages on a laptop core.
"""
from __future__ import annotations

import logging

import numpy as np

from dynmo_plugin.balancing.problem import BalanceProblem, InfeasibleError
from dynmo_plugin.balancing.segments import SegmentModel
from dynmo_plugin.layout import Layout

__all__ = ["solve_exact", "optimal_bottleneck", "ENUMERATE_BELOW"]

log = logging.getLogger(__name__)

ENUMERATE_BELOW = 65_536


def _rows(problem: BalanceProblem, lo: float, hi: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row (distinct extras e, start i): candidate run [jlo, jhi) with values in (lo, hi)."""
    pre = problem.cost_prefix
    starts = np.arange(pre.size)
    ecs = np.unique(problem.extras_cost_arr)
    extras = np.repeat(ecs, pre.size)
    base = np.tile(pre, ecs.size)
    i = np.tile(starts, ecs.size)
    jlo = np.maximum(np.searchsorted(pre, base + (lo - extras), side="right"), i)
    jhi = np.maximum(np.searchsorted(pre, base + (hi - extras), side="left"), jlo)
    return extras, i, np.stack([jlo, jhi])


def _pivot(problem: BalanceProblem, extras: np.ndarray, i: np.ndarray, run: np.ndarray) -> float:
    """Weighted median (by run length) of the row medians."""
    pre = problem.cost_prefix
    jlo, jhi = run
    width = jhi - jlo
    keep = width > 0
    mid = (jlo + jhi - 1)[keep] // 2
    values = extras[keep] + (pre[mid] - pre[i[keep]])
    order = np.argsort(values, kind="stable")
    cum = np.cumsum(width[keep][order])
    return float(values[order][np.searchsorted(cum, cum[-1] / 2.0)])


def _enumerate(problem: BalanceProblem, lo: float, hi: float,
               extras: np.ndarray, i: np.ndarray, run: np.ndarray) -> np.ndarray:
    """All candidate values in (lo, hi), sorted and unique (runs widened by one for rounding)."""
    pre = problem.cost_prefix
    n = pre.size - 1
    jlo = np.maximum(run[0] - 1, i)
    jhi = np.minimum(run[1] + 1, n + 1)
    width = np.maximum(jhi - jlo, 0)
    row = np.repeat(np.arange(width.size), width)
    offset = np.arange(row.size) - np.repeat(np.cumsum(width) - width, width)
    j = jlo[row] + offset
    values = extras[row] + (pre[j] - pre[i[row]])
    values = values[(values > lo) & (values < hi)]
    return np.unique(values)


def optimal_bottleneck(problem: BalanceProblem, model: SegmentModel | None = None) -> float:
    """Smallest threshold T for which a layout exists (module docstring, steps 1-2).

    Raises:
        InfeasibleError: no layout fits the memory caps at any load.
    """
    model = model or SegmentModel(problem)
    hi = float(problem.extras_cost_arr.max() + problem.cost_prefix[-1])
    if not model.is_feasible(hi):
        raise InfeasibleError(_infeasible_message(problem))
    lo = _lower_bound(problem)
    if model.is_feasible(lo):  # only with zero tolerance (all loads 0): keep F(lo) false
        lo = -np.inf
    while True:
        extras, i, run = _rows(problem, lo, hi)
        if int((run[1] - run[0]).sum()) <= ENUMERATE_BELOW:
            break
        t = _pivot(problem, extras, i, run)
        if not lo < t < hi:
            break
        if model.is_feasible(t):
            hi = t
        else:
            lo = t
    values = _enumerate(problem, lo, hi, extras, i, run)
    left, right = 0, values.size  # smallest feasible value index; values.size -> hi
    while left < right:
        mid = (left + right) // 2
        if model.is_feasible(float(values[mid])):
            right = mid
        else:
            left = mid + 1
    return float(values[left]) if left < values.size else hi


def _lower_bound(problem: BalanceProblem) -> float:
    """A threshold no layout meets: below the average load, or below the heaviest
    layer on the cheapest stage (minus the tolerance, so F is surely false)."""
    ec = problem.extras_cost_arr
    average = (problem.cost_prefix[-1] + ec.sum()) / problem.num_stages
    heaviest = problem.cost_arr.max() + ec.min()
    return float(max(average, heaviest, ec.max())) - 3 * problem.load_tol


def _infeasible_message(problem: BalanceProblem) -> str:
    mem = problem.memory_prefix[-1] + problem.extras_memory_arr.sum()
    cap = problem.capacity_arr
    biggest = float(problem.memory_arr.max()) if problem.num_layers else 0.0
    return (f"no layout of {problem.num_layers} layers on {problem.num_stages} stages fits the "
            f"memory caps (total {mem:.4g} bytes vs total capacity {cap.sum():.4g}; largest layer "
            f"{biggest:.4g} bytes, largest free capacity "
            f"{float((cap - problem.extras_memory_arr).max()):.4g}); raise --capacity, add stages "
            "or allow empty stages")


def reference_boundaries(problem: BalanceProblem) -> list[int]:
    """The layout to stay close to: the current one, else Megatron's uniform split."""
    ref = problem.current or Layout.uniform(problem.num_layers, problem.num_stages)
    return ref.boundaries


def solve_exact(problem: BalanceProblem) -> Layout:
    """Optimal layout (min bottleneck, then min bytes/layers moved); see module docstring.

    Raises:
        InfeasibleError: no layout satisfies the memory caps.
    """
    model = SegmentModel(problem)
    best = optimal_bottleneck(problem, model)
    bounds = model.closest(best, reference_boundaries(problem))
    if bounds is None:  # cannot happen: F(best) is true
        raise RuntimeError(f"exact: no layout at the optimal bottleneck {best!r}")
    log.debug("exact: bottleneck %.6g, boundaries %s", best, bounds)
    return Layout.from_boundaries(bounds)
