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
0. Warm start. In live training the current layout was optimal for slightly different
   costs, so its bottleneck W (computed as e_s + (P[j] - P[i]), i.e. a candidate, see
   2) is a tight upper bound: if F(W) holds, the search starts with hi = W.
1. Feasibility oracle F(T): "some layout has every load <= T and fits memory". With
   non-negative costs, the admissible starts of a stage-s segment ending at j form a
   window [first_s(j), j - min_layers] (see `segments`), so the set of positions
   reachable after s stages follows from the previous one run by run: one bisect per
   run of reachable positions and a few word operations on a bitset, O(p log n) per
   call when every single layer fits every stage. F is monotone in T.
2. The optimum B* is one stage's load, i.e. an element of the candidate set
   V = {e_s + P[j] - P[i] : s, i <= j} (P = cost prefix sums), |V| <= g n^2 / 2 with
   g = number of distinct extras values (1-3 in practice; stages sharing e_s share
   candidates). Search V without materialising it: keep lo (F false) and hi (F true);
   the candidates in (lo, hi) of each row (s, i) are a contiguous run of j found by
   binary search on P. Test the weighted median of the row medians: at least a quarter
   of the remaining candidates lie on each side of it, so each test discards >= 1/4.
   When <= 65,536 candidates remain, enumerate them, sort them and binary-search them
   with F; after a warm start the largest one below hi is tested first, so that one
   test proves a still-optimal current layout optimal.
3. Tie-break at T = B*: dynamic programme f_{s+1}(j) = A_s(j) + max over the window of
   (f_s(b) - A_s(b)), where A_s are prefix sums of the packed key (bytes * (n+1) + 1)
   of reference stage s's layers, so maximising kept key = minimising (bytes, layers)
   moved lexicographically. Only positions reachable from 0 that can still reach n
   are visited, the window maxima by a monotone deque (`segments`).

Proof of optimality. Invariant: F(lo) is false, F(hi) is true, hi is a candidate, and
every candidate below hi that is feasible lies in (lo, hi). It holds initially: lo is
a lower bound minus the tolerance (no layout beats the average load, the heaviest layer
plus the smallest extras, or the largest extras; if F(lo) holds anyway, lo = -inf);
hi = W when F(W) holds, else hi = max e_s + P[n], which bounds every load, and if F(hi)
is false no layout fits memory: infeasible.
Testing any candidate t in (lo, hi) keeps it (F monotone). The returned T* is the
smallest feasible candidate of the final range, else hi: the smallest feasible
candidate overall, whatever the starting bounds, so warm and cold starts return the
same T*. The optimal layout's bottleneck B* is a candidate with F(B*) true, so
T* <= B*; and the layout found at T* has every load <= T* + tol. Hence its bottleneck
is optimal up to the tolerance (see `problem`). The DP enumerates exactly the layouts
admissible at T*, i.e. the optimal ones, and its recurrence is exact because bytes
kept by a stage split as A_s(j) - A_s(b); so the returned layout moves the fewest
bytes, then layers, among optimal layouts.

Complexity. O(log(g n^2)) oracle calls (one or two after a warm start whose layout is
still optimal) of O(p log n) each in the common case, plus per search step O(g n log n)
numpy work for the row runs, plus the tie-break O(sum of band widths) (bounded by the
numpy DP's O(p n log n), which takes over for wide bands). Measured on this project's
2-core machine (scripts/bench_balancers.py --decision, docs/balancing.md "Deciding
fast"): about a millisecond or less per decision (solve + plan + gate) at 48 or 256
layers on 16 stages.

Interleaved pipelines (`problem.num_chunks` = v > 1; `solve_interleaved`). The gate
scores a layout by Megatron's interleaved iteration, m x the busiest rank's chunks +
(p - 1) x the busiest virtual stage; minimising that is NP-hard, so the solver first
finds the optimal bottleneck over virtual stages (`bottleneck_layout`, below), then
descends on the iteration time from that layout and from the current one
(balancing/interleaved.py), and says in its notes whether the result is proven optimal.
The first step: virtual stages are contiguous segments like stages, so steps 0-3 apply
unchanged; only two things differ. (a) Moves: a layer that changes chunk
but stays on its rank costs nothing, so the tie-break keeps layers on their RANK (the
DP's A_s sums the reference segments of s's rank: still prefix sums). (b) Memory: a
rank's cap bounds the SUM of its v chunks, which couples non-adjacent segments and
breaks the segment DP. What is done, precisely:
  1. relaxation: every chunk alone may use its rank's whole capacity. Its optimum T_r
     is a lower bound on the true optimum. If the layout found at T_r fits every rank,
     its bottleneck is optimal (and it moves the fewest bytes among the relaxation's
     optima that the tie-break saw): note "exact: optimal over virtual stages".
  2. otherwise, a restriction: each rank's free capacity (cap minus its chunks' fixed
     extras) split evenly over its chunks, each chunk capped at its extras plus its
     share. Every layout admissible there fits every rank, so the layout returned is
     sound, with bottleneck T_s >= optimum >= T_r; the plan's notes give both bounds.
     If the restriction has no layout, InfeasibleError, although a layout with uneven
     chunks may exist (say so: the caller keeps the current layout).
Without memory caps, step 1 always succeeds: the start's bottleneck is optimal.

`solve_exact_reference` keeps the implementation before the warm start and the bitset
oracle (cold bounds, plain binary search, `NumpySegmentModel`); it returns the same
layout and is what the tests and the benchmark compare against.
"""
from __future__ import annotations

import dataclasses
import logging

import numpy as np

from dynmo_plugin.balancing.interleaved import descend
from dynmo_plugin.balancing.metrics import feasibility_problems, memory_violations
from dynmo_plugin.balancing.problem import BalanceProblem, InfeasibleError
from dynmo_plugin.balancing.segments import NumpySegmentModel, SegmentModel
from dynmo_plugin.layout import Layout

__all__ = ["solve_exact", "solve_exact_reference", "solve_interleaved", "bottleneck_layout",
           "optimal_bottleneck", "ENUMERATE_BELOW", "BOTTLENECK_OPTIMAL"]

log = logging.getLogger(__name__)

ENUMERATE_BELOW = 65_536
BOTTLENECK_OPTIMAL = "exact: optimal over virtual stages"


class _Candidates:
    """The candidate set V = {e + (P[j] - P[i])}, row by row: one row per distinct
    extras value e and start i, its values non-decreasing in j (module docstring, step 2)."""

    def __init__(self, problem: BalanceProblem) -> None:
        pre = problem.cost_prefix
        ecs = np.array(sorted(set(problem.extras_cost_arr.tolist())))  # np.unique, cheaper
        self.pre = pre
        self.extras = np.repeat(ecs, pre.size)
        self.base = np.tile(pre, ecs.size)
        self.i = np.tile(np.arange(pre.size), ecs.size)

    def runs(self, lo: float, hi: float) -> tuple[np.ndarray, np.ndarray]:
        """Per row, the run [jlo, jhi) of j whose values lie in (lo, hi) (up to rounding)."""
        pre = self.pre
        jlo = np.maximum(np.searchsorted(pre, self.base + (lo - self.extras), side="right"), self.i)
        jhi = np.maximum(np.searchsorted(pre, self.base + (hi - self.extras), side="left"), jlo)
        return jlo, jhi

    def pivot(self, jlo: np.ndarray, jhi: np.ndarray) -> float:
        """Weighted median (by run length) of the row medians."""
        width = jhi - jlo
        keep = width > 0
        mid = (jlo + jhi - 1)[keep] // 2
        values = self.extras[keep] + (self.pre[mid] - self.pre[self.i[keep]])
        order = np.argsort(values, kind="stable")
        cum = np.cumsum(width[keep][order])
        return float(values[order][np.searchsorted(cum, cum[-1] / 2.0)])

    def between(self, lo: float, hi: float, jlo: np.ndarray, jhi: np.ndarray) -> list[float]:
        """All candidate values in (lo, hi), sorted and unique (runs widened by one for
        rounding)."""
        pre, n = self.pre, self.pre.size - 1
        jlo = np.maximum(jlo - 1, self.i)
        width = np.minimum(jhi + 1, n + 1) - jlo
        keep = np.flatnonzero(width > 0)
        jlo, width = jlo[keep], width[keep]
        row = np.repeat(keep, width)
        j = np.repeat(jlo - (np.cumsum(width) - width), width) + np.arange(row.size)
        values = self.extras[row] + (pre[j] - pre[self.i[row]])
        return np.unique(values[(values > lo) & (values < hi)]).tolist()


def optimal_bottleneck(problem: BalanceProblem, model: SegmentModel | None = None) -> float:
    """Smallest threshold T for which a layout exists (module docstring, steps 1-2),
    warm-started from the current layout when it is admissible (step 0).

    Raises:
        InfeasibleError: no layout fits the memory caps at any load.
    """
    model = model or SegmentModel(problem)
    hi = float(problem.extras_cost_arr.max() + problem.cost_prefix[-1])
    warm = _current_bottleneck(problem)
    if warm is not None and warm < hi and model.is_feasible(warm):
        hi = warm  # F(warm) implies F(cold hi): no need to test it
    elif not model.is_feasible(hi):
        raise InfeasibleError(_infeasible_message(problem))
    lo = _lower_bound(problem)
    if lo >= hi or model.is_feasible(lo):  # only with zero tolerance (all loads 0): keep F(lo) false
        lo = -np.inf
    return _search(problem, model, lo, hi, warm=hi == warm)


def _search(problem: BalanceProblem, model, lo: float, hi: float, warm: bool) -> float:
    """The smallest feasible candidate in (lo, hi), else hi; F(lo) false, F(hi) true.

    With `warm` (hi is the current layout's bottleneck), the largest candidate below hi
    is tested first: when the costs have not changed enough to beat the current
    layout, that one test proves it optimal. Then binary search.
    """
    rows = _Candidates(problem)
    while True:
        jlo, jhi = rows.runs(lo, hi)
        if int((jhi - jlo).sum()) <= ENUMERATE_BELOW:
            break
        t = rows.pivot(jlo, jhi)
        if not lo < t < hi:
            break
        if model.is_feasible(t):
            hi = t
        else:
            lo = t
    values = rows.between(lo, hi, jlo, jhi)
    left, right = 0, len(values)  # smallest feasible value index; len(values) -> hi
    if warm and values:
        if not model.is_feasible(values[-1]):
            return hi
        right -= 1
    while left < right:
        mid = (left + right) // 2
        if model.is_feasible(values[mid]):
            right = mid
        else:
            left = mid + 1
    return values[left] if left < len(values) else hi


def _current_bottleneck(problem: BalanceProblem) -> float | None:
    """The current layout's bottleneck, a candidate value (same formula), or None."""
    if problem.current is None:
        return None
    b = problem.current.boundaries
    pre, ec = problem.cost_prefix.tolist(), problem.extras_cost_arr.tolist()
    return max(e + (pre[j] - pre[i]) for e, i, j in zip(ec, b, b[1:]))


def _reference_bottleneck(problem: BalanceProblem, model: NumpySegmentModel) -> float:
    """The search before the warm start (cold bounds, plain binary search)."""
    hi = float(problem.extras_cost_arr.max() + problem.cost_prefix[-1])
    if not model.is_feasible(hi):
        raise InfeasibleError(_infeasible_message(problem))
    lo = _lower_bound(problem)
    if model.is_feasible(lo):
        lo = -np.inf
    return _search(problem, model, lo, hi, warm=False)


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

    Interleaved problems go to `solve_interleaved` (optimal unless per-rank memory
    caps bind; see there).

    Raises:
        InfeasibleError: no layout satisfies the memory caps.
    """
    if problem.num_chunks > 1:
        return solve_interleaved(problem)[0]
    model = SegmentModel(problem)
    best = optimal_bottleneck(problem, model)
    bounds = model.closest(best, reference_boundaries(problem))
    if bounds is None:  # cannot happen: F(best) is true
        raise RuntimeError(f"exact: no layout at the optimal bottleneck {best!r}")
    log.debug("exact: bottleneck %.6g, boundaries %s", best, bounds)
    return Layout.from_boundaries(bounds)


def solve_exact_reference(problem: BalanceProblem) -> Layout:
    """`solve_exact` as it was before the warm start and the bitset oracle: cold bounds,
    plain binary search, `NumpySegmentModel`. Returns the same layout; kept as the
    reference that tests compare against and scripts/bench_balancers.py times.

    Raises:
        InfeasibleError: no layout satisfies the memory caps.
    """
    model = NumpySegmentModel(problem)
    best = _reference_bottleneck(problem, model)
    bounds = model.closest(best, reference_boundaries(problem))
    if bounds is None:
        raise RuntimeError(f"exact: no layout at the optimal bottleneck {best!r}")
    return Layout.from_boundaries(bounds)


def _flat(problem: BalanceProblem, capacity) -> BalanceProblem:
    """The problem over its virtual stages as plain stages, with per-stage `capacity`
    (net of the rank's calibrated overhead, which is therefore dropped)."""
    current = problem.current.with_chunks(1) if problem.current is not None else None
    tiny = np.finfo(float).tiny  # a capacity must be > 0; a full rank's chunks get the smallest
    cap = None if capacity is None else [max(float(c), tiny) for c in capacity]
    return dataclasses.replace(problem, num_chunks=1, capacity=cap, current=current,
                               memory_overhead=None)


def _at_optimum(flat: BalanceProblem, problem: BalanceProblem) -> tuple[float, Layout]:
    """Optimal bottleneck of `flat` and its layout closest to the current one by rank."""
    best = optimal_bottleneck(flat)
    groups = problem.stage_rank.tolist()
    bounds = NumpySegmentModel(flat).closest(best, reference_boundaries(problem), groups)
    if bounds is None:  # cannot happen: F(best) is true
        raise RuntimeError(f"exact: no layout at the optimal bottleneck {best!r}")
    return best, Layout.from_boundaries(bounds, problem.num_chunks)


def _even_split(problem: BalanceProblem) -> np.ndarray:
    """Per virtual stage: its extras plus an even share of its rank's free capacity."""
    extras = problem.extras_memory_arr
    free = np.maximum(problem.rank_capacity_arr - problem.per_rank(extras), 0.0)
    return extras + free[problem.stage_rank] / problem.num_chunks


def bottleneck_layout(problem: BalanceProblem) -> tuple[Layout, float, list[str]]:
    """Interleaved: the layout with the smallest bottleneck over virtual stages (fewest
    bytes leaving their rank among them), the relaxation's optimum T_r (a lower bound on
    every layout's bottleneck) and notes saying whether the layout's bottleneck is
    optimal; module docstring, "Interleaved".

    Raises:
        InfeasibleError: the relaxation has no layout (then none exists), or the
            per-rank caps bind and the even split has none.
    """
    relaxed = _flat(problem, None if problem.capacity is None else problem.capacity_arr)
    lower, layout = _at_optimum(relaxed, problem)
    if not memory_violations(problem, layout):
        return layout, lower, [BOTTLENECK_OPTIMAL]
    try:
        upper, layout = _at_optimum(_flat(problem, _even_split(problem)), problem)
    except InfeasibleError as e:
        raise InfeasibleError(
            f"per-rank memory caps bind and no layout fits an even split of each rank's "
            f"capacity over its {problem.num_chunks} chunks ({e}); a layout with uneven chunks "
            "may exist but this solver does not search for it: raise the capacity") from e
    return layout, lower, [f"exact: per-rank memory caps bind; bottleneck {upper:.6g} is within "
                           f"[{lower:.6g}, {upper:.6g}] (relaxation bound, even split of each rank's "
                           "capacity over its chunks): not proven optimal"]


def solve_interleaved(problem: BalanceProblem) -> tuple[Layout, list[str]]:
    """Interleaved: the layout of least predicted iteration time that descent reaches
    from `bottleneck_layout`'s and the current one (`interleaved`), with notes saying
    what is proven. Never predicted slower than the current layout when that fits.

    Raises:
        InfeasibleError: as `bottleneck_layout`.
    """
    start, lower, notes = bottleneck_layout(problem)
    current = problem.current
    starts = [start] if current is None or feasibility_problems(problem, current) else [start, current]
    found = descend(problem, starts, lower)
    said = (f"exact: interleaved iteration {found.iteration_s:.6g} s is optimal (meets the lower "
            f"bound)" if found.proven else
            f"exact: interleaved iteration {found.iteration_s:.6g} s by descent is within "
            f"[{found.bound:.6g}, {found.iteration_s:.6g}]: not proven optimal")
    start_note = ("from the optimal bottleneck over virtual stages" if notes == [BOTTLENECK_OPTIMAL]
                  else notes[0])
    return found.layout, [said, start_note]
