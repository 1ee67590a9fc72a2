"""Which contiguous layer ranges a stage may hold under a load threshold, and the
two dynamic programmes over them: "is any layout feasible?" and "which feasible
layout moves the fewest bytes?".

Positions are 0..n (boundaries between 0-based layers); stage s holds [b_s, b_{s+1}).
For a threshold T, segment [b, j) is *admissible* on stage s when

    extras_cost[s] + (P[j] - P[b]) <= T + load_tol   and
    extras_mem[s]  + (M[j] - M[b]) <= cap[s] + mem_tol   and   j - b >= min_layers,

with P, M the cost and memory prefix sums; in floating point exactly: P[j] <= P[b] +
budget_s (and M alike) with budget_s = (T - extras_cost[s]) + load_tol. Costs and memory
are >= 0, so for a fixed start b the admissible ends form a range [b + min_layers,
end_s(b)] and end_s is non-decreasing in b (a later start can reach at least as far).
Hence for a fixed end j the admissible starts are the range [first_s(j), j - min_layers]
with first_s(j) = min{b : end_s(b) >= j}.

`SegmentModel` (used by every solver) works on sets of positions held as Python ints
(bit k = position k). The positions reachable after s + 1 stages are the union over
reachable b of [b + m, end_s(b)], m = min_layers; because end_s is non-decreasing, a
run [a, c] of reachable positions contributes {j in [a + m, c + m] : stage s can hold
[j - m, j)} (one shift and one AND with a per-stage mask) plus [c + m + 1, end_s(c)]
(one `bisect` on P). A feasibility test is therefore O(p (runs log n + n / 64)), with
one run per stage unless a single layer does not fit some stage. The tie-break visits
only the band: positions reachable from 0 that can still reach n (computed the same
way backwards), with a monotone deque for the window maxima, O(sum of band widths).
When the band is so wide that vectorising over all positions is cheaper (many optimal
layouts), the tie-break runs on `NumpySegmentModel`: the same oracle and DP
vectorised over all positions, the implementation before this one and the reference
the tests compare against.
"""
from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from itertools import accumulate
from typing import Iterator

import numpy as np

from dynmo_plugin.balancing.problem import BalanceProblem

__all__ = ["SegmentModel", "NumpySegmentModel"]

_NEG = -(2**62)  # "unreachable" in the int64 tie-break DP


def _ends(prefix: np.ndarray, budget: float) -> np.ndarray:
    """end(b) = max j with prefix[j] <= prefix[b] + budget; b - 1 if budget < 0."""
    idx = np.arange(prefix.size)
    if budget < 0:
        return idx - 1
    return np.searchsorted(prefix, prefix + budget, side="right") - 1


def _bits(mask: np.ndarray) -> int:
    """The boolean array as a bitset: bit k set iff mask[k]."""
    return int.from_bytes(np.packbits(mask, bitorder="little").tobytes(), "little")


def _runs(bits: int) -> Iterator[tuple[int, int]]:
    """Maximal runs [a, c] of set bits, ascending."""
    starts, ends = bits & ~(bits << 1), bits & ~(bits >> 1)
    while starts:
        a, c = (starts & -starts).bit_length() - 1, (ends & -ends).bit_length() - 1
        starts &= starts - 1
        ends &= ends - 1
        yield a, c


def _positions(bits: int) -> list[int]:
    out: list[int] = []
    for a, c in _runs(bits):
        out.extend(range(a, c + 1))
    return out


def _numpy_dp_is_faster(band_size: int, n: int, p: int) -> bool:
    """Whether `NumpySegmentModel.closest` (the same answer) beats the banded DP: on
    this project's 2-core test machine the banded DP costs ~2.5 us per band position,
    the vectorised one ~(40 + 0.3 n) us per stage whatever the band. Wide bands come
    from a bottleneck far above the average load (one very heavy layer): many layouts
    are then optimal and the tie-break has many to choose from."""
    return band_size > p * (16 + n / 8)


class SegmentModel:
    """The admissible-segment structure of one problem, with the feasibility test and
    the tie-break on bitsets of positions (see the module docstring)."""

    def __init__(self, problem: BalanceProblem) -> None:
        pb = problem
        self.problem = pb
        self.n = pb.num_layers
        self.min_layers = pb.min_layers_per_stage
        self._pre = pb.cost_prefix.tolist()
        self._extras = pb.extras_cost_arr.tolist()
        self._tol = pb.load_tol
        self._mem_budgets = [(cap - extra) + pb.mem_tol for cap, extra in
                             zip(pb.capacity_arr.tolist(), pb.extras_memory_arr.tolist())]
        # a stage whose extras alone break its cap (by rounding only: the problem checks it)
        self._dead = min(self._mem_budgets) < 0
        unlimited = all(b == math.inf for b in self._mem_budgets)
        self._mpre = None if unlimited else pb.memory_prefix.tolist()
        self._masks: dict[tuple[bool, float], int] = {}
        self._widest_layer: dict[bool, float] = {}
        self._mem_fits: list[int] | None = None
        self._key_prefix: list[int] | None = None

    # ---- the feasibility oracle -----------------------------------------------------------
    def _budgets(self, threshold: float) -> list[float] | None:
        """Per-stage load budget, or None when a stage's extras alone exceed `threshold`."""
        tol = self._tol
        budgets = [(threshold - e) + tol for e in self._extras]
        return None if self._dead or min(budgets) < 0 else budgets

    def _fit_mask(self, memory: bool, budget: float) -> int:
        """Bit l+1 set iff layer l alone stays within `budget` (of cost, or of memory)."""
        mask = self._masks.get((memory, budget))
        if mask is not None:
            return mask
        prefix = self.problem.memory_prefix if memory else self.problem.cost_prefix
        if budget >= self._widest(memory):
            mask = (1 << (self.n + 1)) - 2
        else:
            mask = _bits(prefix[1:] <= prefix[:-1] + budget) << 1
        if len(self._masks) < 256:
            self._masks[(memory, budget)] = mask
        return mask

    def _widest(self, memory: bool) -> float:
        """A budget that every single layer fits: the largest layer, rounded up."""
        widest = self._widest_layer.get(memory)
        if widest is None:
            prefix = self.problem.memory_prefix if memory else self.problem.cost_prefix
            widest = float(np.nextafter(np.diff(prefix).max(), np.inf)) if self.n else 0.0
            self._widest_layer[memory] = widest
        return widest

    def _fits(self, budgets: list[float]) -> list[int] | None:
        """Per stage, the layers that fit it alone (`_fit_mask`); None without min_layers."""
        if not self.min_layers:
            return None
        if self._mem_fits is None:
            self._mem_fits = [self._fit_mask(True, mb) for mb in self._mem_budgets]
        widest = self._widest(False)
        return [mem if b >= widest else self._fit_mask(False, b) & mem
                for b, mem in zip(budgets, self._mem_fits)]

    def _forward(self, budgets: list[float], fits: list[int] | None) -> list[int]:
        """Reachable positions after 0, 1, ... stages (stops after an empty set)."""
        pre, mpre, m = self._pre, self._mpre, self.min_layers
        r = 1
        out = [r]
        for s, (budget, mb) in enumerate(zip(budgets, self._mem_budgets)):
            nxt = r if fits is None else (r << 1) & fits[s]
            last = r & ~(r >> 1)  # the last position c of every run: add [c + m + 1, end(c)]
            while last:
                low = last & -last
                last ^= low
                c = low.bit_length() - 1
                end = bisect_right(pre, pre[c] + budget) - 1
                if mpre is not None:
                    mend = bisect_right(mpre, mpre[c] + mb) - 1
                    end = mend if mend < end else end
                if end > c + m:
                    nxt |= (1 << (end + 1)) - (1 << (c + m + 1))
            r = nxt
            out.append(r)
            if not r:
                break
        return out

    def is_feasible(self, threshold: float) -> bool:
        """Whether some layout keeps every stage within `threshold` and its memory cap."""
        budgets = self._budgets(threshold)
        if budgets is None:
            return False
        reach = self._forward(budgets, self._fits(budgets))
        return len(reach) > len(budgets) and bool(reach[-1] >> self.n & 1)

    # ---- the tie-break --------------------------------------------------------------------
    def _first(self, s: int, j: int, budget: float) -> int:
        """first_s(j) = min{b : end_s(b) >= j}, i.e. the smallest b with P[j] <= P[b] +
        budget and M[j] <= M[b] + memory budget (j itself when the budgets are >= 0)."""
        pj = self._pre[j]
        b = bisect_left(self._pre, True, 0, j, key=lambda x: x + budget >= pj)
        if self._mpre is not None:
            mj, mb = self._mpre[j], self._mem_budgets[s]
            b = max(b, bisect_left(self._mpre, True, 0, j, key=lambda x: x + mb >= mj))
        return b

    def _backward(self, budgets: list[float], fits: list[int] | None) -> list[int]:
        """Positions from which stages s, s+1, ... can hold the remaining layers, s = 0..p."""
        m = self.min_layers
        q = 1 << self.n
        out = [q]
        for s in range(len(budgets) - 1, -1, -1):
            prev = q if fits is None else (q & fits[s]) >> 1
            starts = q & ~(q << 1)  # the first position a of every run: add [first(a), a-1-m]
            while starts:
                low = starts & -starts
                starts ^= low
                a = low.bit_length() - 1
                lo, top = self._first(s, a, budgets[s]), a - 1 - m
                if lo <= top:
                    prev |= (1 << (top + 1)) - (1 << lo)
            q = prev
            out.append(q)
        return out[::-1]

    def closest(self, threshold: float, reference: list[int]) -> list[int] | None:
        """Boundaries of the admissible layout that moves the fewest bytes, then the
        fewest layers, away from `reference` (boundaries); None if none is admissible.

        Bytes moved = total - bytes kept in place, and the key stage s keeps from
        reference segment [r_s, r_{s+1}) when it holds [b, j) is A_s(j) - A_s(b). So
        f_{s+1}(j) = A_s(j) + max_{b in window_s(j)} (f_s(b) - A_s(b)): a window maximum;
        window_s(j) = {b : end_s(b) >= j, b <= j - min_layers} and both its ends are
        non-decreasing in j, so a monotone deque finds it. Only positions in the band
        (reachable from 0 and able to reach n) are visited: the window of a band
        position always holds one, and no admissible layout passes outside it. Ties
        between equal keys take the smallest start (the layout
        `NumpySegmentModel.closest` returns).
        """
        n, m = self.n, self.min_layers
        budgets = self._budgets(threshold)
        if budgets is None:
            return None
        fits = self._fits(budgets)
        reach = self._forward(budgets, fits)
        if len(reach) <= len(budgets) or not reach[-1] >> n & 1:
            return None
        band = [r & q for r, q in zip(reach, self._backward(budgets, fits))]
        if _numpy_dp_is_faster(sum(map(int.bit_count, band)), n, len(budgets)):
            return NumpySegmentModel(self.problem).closest(threshold, reference)
        pre, mpre, key = self._pre, self._mpre, self._keys()
        positions, f = [0], [0]
        parents: list[dict[int, int]] = []
        for s, budget in enumerate(budgets):
            r0, r1 = reference[s], reference[s + 1]
            g = [v - key[r0 if b < r0 else r1 if b > r1 else b] for b, v in zip(positions, f)]
            ends = [bisect_right(pre, pre[b] + budget) - 1 for b in positions]
            if mpre is not None:
                mb = self._mem_budgets[s]
                ends = [min(e, bisect_right(mpre, mpre[b] + mb) - 1) for b, e in zip(positions, ends)]
            targets = _positions(band[s + 1])
            size, i, head = len(positions), 0, 0
            window: list[int] = []  # indices into positions, g decreasing (ties: the first)
            f_next, parent = [], []
            for j in targets:
                while i < size and positions[i] <= j - m:
                    gi = g[i]
                    while len(window) > head and g[window[-1]] < gi:
                        window.pop()
                    window.append(i)
                    i += 1
                while ends[window[head]] < j:
                    head += 1
                k = window[head]
                f_next.append(key[r0 if j < r0 else r1 if j > r1 else j] + g[k])
                parent.append(positions[k])
            parents.append(dict(zip(targets, parent)))
            positions, f = targets, f_next
        bounds = [n]
        for parent in reversed(parents):
            bounds.append(parent[bounds[-1]])
        return bounds[::-1]

    def _keys(self) -> list[int]:
        """A(x): prefix sums of the packed move keys (Python ints: exact)."""
        if self._key_prefix is None:
            self._key_prefix = [0, *accumulate(self.problem.move_key.tolist())]
        return self._key_prefix


class NumpySegmentModel:
    """The same oracle and tie-break vectorised with numpy over all n + 1 positions
    per stage: O(p n) per feasibility test, O(p n log n) per tie-break. The
    implementation before `SegmentModel`; kept as an independent reference (tests check
    the two agree exactly, scripts/bench_balancers.py times both)."""

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

    def closest(self, threshold: float, reference: list[int],
                groups: list[int] | None = None) -> list[int] | None:
        """Boundaries of the admissible layout that moves the fewest bytes, then the
        fewest layers, away from `reference` (boundaries); None if none is admissible.

        Bytes moved = total - bytes kept in place, and the key stage s keeps from
        reference segment [r_s, r_{s+1}) when it holds [b, j) is A_s(j) - A_s(b). So
        f_{s+1}(j) = A_s(j) + max_{b in window_s(j)} (f_s(b) - A_s(b)): a range maximum.
        Ties between equal keys take the smallest start (deterministic).

        `groups` (stage -> rank, interleaved pipelines): a layer is kept when it stays on
        its rank, whichever chunk; A_s then sums the reference segments of s's rank,
        still a prefix sum, so the recurrence is unchanged.
        """
        n = self.n
        first = self.windows(threshold)
        kept = self._kept_prefix(reference, groups)
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

    def _kept_prefix(self, reference: list[int], groups: list[int] | None = None) -> list[np.ndarray]:
        """A_s(x): key of reference stage s's layers (with `groups`: of the reference
        stages in s's group) before position x."""
        key_prefix = np.concatenate(([0], np.cumsum(self.problem.move_key)))
        p = self.problem.num_stages
        own = [key_prefix[np.clip(self._positions, reference[s], reference[s + 1])]
               for s in range(p)]
        if groups is None:
            return own
        summed = {g: sum(own[s] for s in range(p) if groups[s] == g) for g in set(groups)}
        return [summed[groups[s]] for s in range(p)]

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
