"""Which contiguous layer ranges a stage may hold under a load threshold, and the
two dynamic programmes over them: "is any layout feasible?" and "which feasible
layout moves the fewest bytes?".

Positions are 0..n (boundaries between 0-based layers); stage s holds [b_s, b_{s+1}).
For a threshold T, segment [b, j) is *admissible* on stage s when

    extras_cost[s] + (P[j] - P[b]) <= T + load_tol   and
    extras_mem[s]  + (M[j] - M[b]) <= cap[s] + mem_tol   and   j - b >= min_layers,

with P, M the cost and memory prefix sums. Costs and memory are >= 0, so for a fixed
start b the admissible ends form a range [b + min_layers, end_s(b)] and end_s is
non-decreasing in b (a later start can reach at least as far). Hence for a fixed end j
the admissible starts are the range [first_s(j), j - min_layers] with
first_s(j) = min{b : end_s(b) >= j}. Every DP step below is a range query over that
window, vectorised with numpy: O(n) (feasibility) or O(n log n) (sparse-table range
maximum) per stage.
"""
from __future__ import annotations

import numpy as np

from dynmo_plugin.balancing.problem import BalanceProblem

__all__ = ["SegmentModel"]

_NEG = -(2**62)  # "unreachable" in the int64 tie-break DP


def _ends(prefix: np.ndarray, budget: float) -> np.ndarray:
    """end(b) = max j with prefix[j] - prefix[b] <= budget; b - 1 if budget < 0."""
    idx = np.arange(prefix.size)
    if budget < 0:
        return idx - 1
    return np.searchsorted(prefix, prefix + budget, side="right") - 1


class SegmentModel:
    """The admissible-segment structure of one problem (memory limits precomputed)."""

    def __init__(self, problem: BalanceProblem) -> None:
        self.problem = problem
        self.n = problem.num_layers
        self.min_layers = problem.min_layers_per_stage
        self._positions = np.arange(self.n + 1)
        self._mem_ends = self._memory_ends()

    def _memory_ends(self) -> list[np.ndarray]:
        pb = self.problem
        cache: dict[float, np.ndarray] = {}
        for s in range(pb.num_stages):
            budget = float(pb.capacity_arr[s] - pb.extras_memory_arr[s]) + pb.mem_tol
            if budget not in cache:
                cache[budget] = (np.full(self.n + 1, self.n) if np.isinf(budget)
                                 else _ends(pb.memory_prefix, budget))
        return [cache[float(pb.capacity_arr[s] - pb.extras_memory_arr[s]) + pb.mem_tol]
                for s in range(pb.num_stages)]

    def windows(self, threshold: float) -> list[np.ndarray]:
        """first[s][j]: smallest admissible start of a stage-s segment ending at j."""
        pb = self.problem
        cache: dict[tuple[float, int], np.ndarray] = {}
        first = []
        for s in range(pb.num_stages):
            budget = float(threshold - pb.extras_cost_arr[s]) + pb.load_tol
            key = (budget, id(self._mem_ends[s]))
            if key not in cache:
                ends = np.minimum(_ends(pb.cost_prefix, budget), self._mem_ends[s])
                cache[key] = np.searchsorted(ends, self._positions, side="left")
            first.append(cache[key])
        return first

    def _bounds(self, first: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(lo, hi, valid) admissible start range for every end j = 0..n."""
        hi = self._positions - self.min_layers
        return first, hi, (first <= hi) & (hi >= 0)

    def is_feasible(self, threshold: float) -> bool:
        """Whether some layout keeps every stage within `threshold` and its memory cap."""
        n = self.n
        reach = np.zeros(n + 1, dtype=bool)
        reach[0] = True
        count = np.zeros(n + 2, dtype=np.int64)  # count[k] = reachable positions < k
        queries: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        for first in self.windows(threshold):
            if id(first) not in queries:  # stages with equal windows share the indices
                lo, hi, valid = self._bounds(first)
                queries[id(first)] = (np.minimum(lo, n), np.maximum(hi + 1, 0), valid)
            lo, hi1, valid = queries[id(first)]
            np.cumsum(reach, out=count[1:])
            reach = valid & (count[hi1] > count[lo])
            if not reach.any():
                return False
        return bool(reach[n])

    def closest(self, threshold: float, reference: list[int]) -> list[int] | None:
        """Boundaries of the admissible layout that moves the fewest bytes, then the
        fewest layers, away from `reference` (boundaries); None if none is admissible.

        Bytes moved = total - bytes kept in place, and the key stage s keeps from
        reference segment [r_s, r_{s+1}) when it holds [b, j) is A_s(j) - A_s(b). So
        f_{s+1}(j) = A_s(j) + max_{b in window_s(j)} (f_s(b) - A_s(b)): a range maximum.
        Ties between equal keys take the smallest start (deterministic).
        """
        n = self.n
        first = self.windows(threshold)
        kept = self._kept_prefix(reference)
        f = np.full(n + 1, _NEG, dtype=np.int64)
        f[0] = 0
        table = [f]
        for s, fs in enumerate(first):
            lo, hi, valid = self._bounds(fs)
            g = np.where(f > _NEG // 2, f - kept[s], _NEG)
            best = np.full(n + 1, _NEG, dtype=np.int64)
            best[valid] = _range_max(g, lo[valid], hi[valid])
            f = np.where(best > _NEG // 2, kept[s] + best, _NEG)
            table.append(f)
        if table[-1][n] <= _NEG // 2:
            return None
        return self._backtrack(table, kept, first)

    def _kept_prefix(self, reference: list[int]) -> list[np.ndarray]:
        """A_s(x): key of reference stage s's layers before position x."""
        key_prefix = np.concatenate(([0], np.cumsum(self.problem.move_key)))
        return [key_prefix[np.clip(self._positions, reference[s], reference[s + 1])]
                for s in range(self.problem.num_stages)]

    def _backtrack(self, table: list[np.ndarray], kept: list[np.ndarray],
                   first: list[np.ndarray]) -> list[int]:
        bounds = [self.n]
        j = self.n
        for s in range(len(first) - 1, -1, -1):
            lo, hi = int(first[s][j]), j - self.min_layers
            f = table[s][lo:hi + 1]
            g = np.where(f > _NEG // 2, f - kept[s][lo:hi + 1], _NEG)
            j = lo + int(np.argmax(g))
            bounds.append(j)
        return bounds[::-1]


def _range_max(values: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """max(values[lo[k]..hi[k]]) for every k (requires lo <= hi), via a sparse table."""
    levels = [values]
    width = 1
    while 2 * width <= values.size:
        prev = levels[-1]
        levels.append(np.maximum(prev[:-width], prev[width:]))
        width *= 2
    table = np.full((len(levels), values.size), _NEG, dtype=np.int64)
    for k, level in enumerate(levels):
        table[k, :level.size] = level
    length = hi - lo + 1
    k = np.floor(np.log2(np.maximum(length, 1))).astype(np.int64)
    return np.maximum(table[k, lo], table[k, hi - (1 << k) + 1])
