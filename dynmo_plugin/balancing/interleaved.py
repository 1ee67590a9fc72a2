"""Interleaved pipelines: lower the iteration time the gate predicts, not only the bottleneck.

With v > 1 chunks per rank the gate scores a layout by Megatron's interleaved iteration
(`metrics.predicted_iteration_s`): F = m * max over ranks of the sum of its chunks' loads
+ (p - 1) * max over virtual stages of its load. The exact solver's first step
(`exact.bottleneck_layout`, a contiguous min-max problem) minimises the second term's
max and leaves the first, m times heavier, to chance: among the layouts at the optimal
bottleneck it keeps the one closest to the current layout, whose ranks may be far
apart, and nothing kept its plan from being predicted slower than the layout it left.

Minimising F itself is NP-hard (with p = 2 ranks and free-cost separator layers it
encodes PARTITION), so this is a descent, not a proof: from each start (the min-max
layout, the current layout when it fits) it repeatedly applies the best move that
lowers F (`Moves`: a run of 1 to p consecutive boundaries shifted by up to
`MAX_SHIFT` layers, a run of length p carrying load between any two ranks while the
stages in between keep their sizes; a longer run shifted by one layer, as tight
layouts need), within every rank's cap. On a plateau of F (ties at the max) it takes a
move that lowers the sum of squared rank and stage loads instead, so ties spread out
before they block. It stops when no move lowers either, or after `MAX_ROUNDS`.
The best of the starts and their ends by (F, bytes leaving their rank, layers) wins,
so the returned layout is never predicted slower than any start, in particular the
current layout. Against brute force on small problems (scripts/bench_interleaved.py,
docs/interleaved.md): optimal in 92-96%, mean gap 0.05-0.23%, worst 8%.

Proof of optimality when it happens: F >= m * R_lb + (p - 1) * T*, with T* the optimal
bottleneck over virtual stages (a lower bound with or without caps, from the relaxation)
and R_lb = max(total load / p, the largest rank's fixed extras). A result that meets
this bound is optimal and says so.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from dynmo_plugin.balancing.problem import BalanceProblem
from dynmo_plugin.layout import Layout

__all__ = ["MAX_SHIFT", "MAX_ROUNDS", "Descent", "Moves", "descend", "evaluate", "lower_bound", "scores"]

MAX_SHIFT = 2
MAX_ROUNDS = 10_000


@dataclass(frozen=True)
class Descent:
    """The best layout found, its predicted iteration time, and `lower_bound`'s bound:
    the layout is proven optimal when it meets it (`proven`)."""

    layout: Layout
    iteration_s: float
    bound: float
    tol: float

    @property
    def proven(self) -> bool:
        return self.iteration_s <= self.bound + self.tol


def lower_bound(problem: BalanceProblem, bottleneck: float) -> float:
    """m * R_lb + (p - 1) * T* (module docstring); `bottleneck` is T*."""
    p, m = problem.num_ranks, problem.num_microbatches
    total = float(problem.cost_prefix[-1] + problem.extras_cost_arr.sum())
    r_lb = max(total / p, float(problem.per_rank(problem.extras_cost_arr).max()))
    return m * r_lb + (p - 1) * bottleneck


def descend(problem: BalanceProblem, starts: list[Layout], bottleneck: float) -> Descent:
    """The best layout reached by descent on F from each start (module docstring);
    `starts` must fit the problem (memory, empty stages); `bottleneck` is T*."""
    moves = Moves.all(problem.num_stages, problem.num_ranks)
    reference = np.asarray((problem.current or starts[0]).boundaries)
    begun = [np.asarray(s.boundaries) for s in starts]
    ends = begun + [_descend_from(problem, b, moves) for b in begun]  # a start may be best
    scored = [(scores(problem, b[None, :])[0][0], _moved(problem, b, reference), tuple(b))
              for b in ends]
    tol = _tol(problem)
    best_f = min(f for f, _, _ in scored)
    f, _, bounds = min((s for s in scored if s[0] <= best_f + tol), key=lambda s: (s[1], s[2]))
    layout = Layout.from_boundaries(list(bounds), problem.num_chunks)
    return Descent(layout, float(f), lower_bound(problem, bottleneck), tol)


def _tol(problem: BalanceProblem) -> float:
    return (problem.num_microbatches + problem.num_ranks) * problem.load_tol


@dataclass(frozen=True)
class Moves:
    """Moves as arrays: boundaries first..last (1 <= first <= last <= K - 1) shift by d,
    so stage first - 1 and stage last change size and the stages between keep theirs."""

    first: np.ndarray
    last: np.ndarray
    d: np.ndarray

    @classmethod
    def all(cls, stages: int, ranks: int) -> "Moves":
        """Runs of 1..p boundaries shifted by 0 < |d| <= MAX_SHIFT, longer runs by |d| = 1
        (one layer carried across many stages, as tight layouts need)."""
        shifts = [*range(-MAX_SHIFT, 0), *range(1, MAX_SHIFT + 1)]
        runs = np.array([(first, first + length - 1, d) for first, length, d
                         in itertools.product(range(1, stages), range(1, stages), shifts)
                         if first + length <= stages and (length <= ranks or abs(d) == 1)],
                        dtype=np.int64).reshape(-1, 3)
        return cls(runs[:, 0], runs[:, 1], runs[:, 2])

    def apply(self, bounds: np.ndarray, i: int) -> np.ndarray:
        out = bounds.copy()
        out[self.first[i]:self.last[i] + 1] += self.d[i]
        return out


def _descend_from(problem: BalanceProblem, bounds: np.ndarray, moves: Moves) -> np.ndarray:
    """Best-improvement descent on (F, spread) from `bounds`; see the module docstring."""
    tol = _tol(problem)
    f, spread = (x[0] for x in scores(problem, bounds[None, :]))
    for _ in range(MAX_ROUNDS):
        ok, fs, spreads = evaluate(problem, bounds, moves)
        lower = ok & (fs < f - tol)
        if lower.any():
            key = np.where(lower, fs, np.inf)
        else:
            flat = ok & (fs <= f + tol) & (spreads < spread * (1 - 1e-12) - problem.load_tol ** 2)
            if not flat.any():
                break
            key = np.where(flat, spreads, np.inf)
        i = int(np.argmin(key))
        bounds, f, spread = moves.apply(bounds, i), fs[i], spreads[i]
    return bounds


def scores(problem: BalanceProblem, cand: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row of boundaries: F (the interleaved iteration time, as `metrics`) and the
    spread (sum of squared rank and stage loads)."""
    loads = problem.extras_cost_arr + np.diff(problem.cost_prefix[cand], axis=1)
    ranks = loads.reshape(len(cand), problem.num_chunks, problem.num_ranks).sum(axis=1)
    f = problem.num_microbatches * ranks.max(axis=1) + (problem.num_ranks - 1) * loads.max(axis=1)
    return f, (ranks ** 2).sum(axis=1) + (loads ** 2).sum(axis=1)


def evaluate(problem: BalanceProblem, bounds: np.ndarray, moves: Moves
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every move from `bounds` at once: (admissible, F, spread), equal to `scores` of the
    moved boundaries, in O(moves x ranks) instead of O(moves x stages): only the two end
    stages change size; the stages between shift by d, whose loads `_Shifted` tabulates."""
    f, l, d = moves.first, moves.last, moves.d
    widths = np.diff(bounds)
    ok = (widths[f - 1] + d >= problem.min_layers_per_stage) & (widths[l] - d >= problem.min_layers_per_stage)
    cost = _Shifted(problem, bounds, problem.cost_prefix, problem.extras_cost_arr, moves)
    ranks, loads = cost.ranks, cost.loads
    if np.isfinite(problem.rank_capacity_arr).any():
        mem = _Shifted(problem, bounds, problem.memory_prefix, problem.extras_memory_arr, moves).ranks
        ok &= (mem <= problem.rank_capacity_arr + problem.mem_tol).all(axis=1)
    biggest = np.maximum.reduce([cost.outside_max, cost.between_max, cost.head, cost.tail])
    fs = problem.num_microbatches * ranks.max(axis=1) + (problem.num_ranks - 1) * biggest
    spreads = (ranks ** 2).sum(axis=1) + (loads ** 2).sum() + cost.squares_delta
    return ok, fs, spreads


class _Shifted:
    """Per move, from one prefix array (costs or memory) and its extras: the new loads of
    the two end stages (`head` = stage first - 1, `tail` = stage last), every rank's new
    sum (`ranks`, moves x p), the largest load outside the run's stages and between its
    ends, and the change of the sum of squared stage loads."""

    def __init__(self, problem: BalanceProblem, bounds: np.ndarray, prefix: np.ndarray,
                 extras: np.ndarray, moves: Moves) -> None:
        f, l, d = moves.first, moves.last, moves.d
        k, n = problem.num_stages, problem.num_layers
        stage_rank = problem.stage_rank
        self.loads = loads = extras + np.diff(prefix[bounds])
        shifts = np.unique(d)
        which = np.searchsorted(shifts, d)
        # each stage's load were its two boundaries shifted by s (stages between the ends)
        moved = extras + prefix[np.clip(bounds[1:] + shifts[:, None], 0, n)] \
            - prefix[np.clip(bounds[:-1] + shifts[:, None], 0, n)]
        change = moved - loads                                            # (shifts, k)
        one_hot = np.eye(problem.num_ranks)[stage_rank]                   # (k, p)
        by_rank = np.concatenate([np.zeros((shifts.size, 1, problem.num_ranks)),
                                  np.cumsum(change[:, :, None] * one_hot, axis=1)], axis=1)
        squares = np.concatenate([np.zeros((shifts.size, 1)),
                                  np.cumsum(moved ** 2 - loads ** 2, axis=1)], axis=1)
        self.head = extras[f - 1] + prefix[np.clip(bounds[f] + d, 0, n)] - prefix[bounds[f - 1]]
        self.tail = extras[l] + prefix[bounds[l + 1]] - prefix[np.clip(bounds[l] + d, 0, n)]
        rows = np.arange(f.size)
        ranks = loads @ one_hot + by_rank[which, l] - by_rank[which, f]
        ranks[rows, stage_rank[f - 1]] += self.head - loads[f - 1]
        ranks[rows, stage_rank[l]] += self.tail - loads[l]
        self.ranks = ranks
        self.squares_delta = (squares[which, l] - squares[which, f] + self.head ** 2
                              - loads[f - 1] ** 2 + self.tail ** 2 - loads[l] ** 2)
        before = np.concatenate([[-np.inf], np.maximum.accumulate(loads)])       # max loads[:j]
        after = np.concatenate([np.maximum.accumulate(loads[::-1])[::-1], [-np.inf]])  # loads[j:]
        self.outside_max = np.maximum(before[f - 1], after[l + 1])
        upper = np.triu(np.ones((k, k), dtype=bool))                      # [first, j] runs
        runs = np.maximum.accumulate(np.where(upper[None], moved[:, None, :], -np.inf), axis=2)
        runs = np.concatenate([np.full((shifts.size, k, 1), -np.inf), runs], axis=2)
        self.between_max = runs[which, f, l]                            # max moved[first:last]


def _moved(problem: BalanceProblem, bounds: np.ndarray, reference: np.ndarray) -> tuple[int, int]:
    """(bytes, layers) that leave their rank going from `reference` to `bounds`."""
    layers = np.arange(problem.num_layers)
    rank = problem.stage_rank
    now = rank[np.searchsorted(bounds, layers, side="right") - 1]
    before = rank[np.searchsorted(reference, layers, side="right") - 1]
    off = now != before
    return int(problem.move_key[off].sum()), int(off.sum())
