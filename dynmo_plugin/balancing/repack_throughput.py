"""How fast a repacked pipeline is predicted to run: the iteration model every K is
priced with, and the bounds that let the repack search skip a K without solving it.

`IterationModel` is what a caller passes to predict seconds per iteration; the default,
`flow_shop_model`, is the balancers' 1F1B formula over stage loads (no communication).
`LowerBound` bounds that formula from below in O(1) per K; `bounds_apply` says when it
may be used (the default model on a plain pipeline). `at_most` / `better` compare times
with the problem's relative tolerance; `per_gpu` is the relative tokens/s per GPU.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Callable

from dynmo_plugin.balancing import metrics
from dynmo_plugin.balancing.problem import REL_TOL, BalanceProblem
from dynmo_plugin.layout import Layout

__all__ = ["IterationModel", "LowerBound", "at_most", "better", "bounds_apply",
           "flow_shop_model", "per_gpu"]

IterationModel = Callable[[BalanceProblem, Layout], float]
"""Predicted seconds of one iteration of `layout` (K stages) on `problem` (shrunk to K)."""


def at_most(a: float, b: float) -> bool:
    return a <= b + REL_TOL * abs(b)


def better(a: float, b: float) -> bool:
    """a < b by more than the tolerance (so near-ties keep the earlier, smaller K)."""
    return a < b - REL_TOL * abs(b)


def flow_shop_model(problem: BalanceProblem, layout: Layout) -> float:
    """The default `IterationModel`: the balancers' 1F1B formula over stage loads
    (`metrics.predicted_iteration_s`; no communication)."""
    return metrics.predicted_iteration_s(metrics.stage_loads(problem, layout), problem.num_microbatches,
                                         problem.num_chunks)


def per_gpu(iter_s: float, stages: int) -> float | None:
    value = 1.0 / (iter_s * stages) if iter_s > 0 else math.inf
    return value if math.isfinite(value) else None


@dataclass(frozen=True)
class LowerBound:
    """Predicted iteration time no split over k stages can beat, in O(1) per k (the
    scans skip hopeless k before building their problems). The sum of stage loads is
    fixed for k (layers + `shrink_problem`'s extras) and the bottleneck is at least the
    average load, the heaviest layer on the cheapest stage and the largest extras;
    minus the tolerance, as in `exact`."""

    layers: float
    heaviest: float
    first: float
    last: float
    middle: float
    microbatches: int
    tol: float

    @classmethod
    def of(cls, problem: BalanceProblem) -> "LowerBound":
        ec = problem.extras_cost_arr
        p = problem.num_stages
        return cls(layers=float(problem.cost_prefix[-1]), heaviest=float(problem.cost_arr.max()),
                   first=float(ec[0]), last=float(ec[-1]),
                   middle=float(statistics.median(ec[1:-1])) if p > 2 else 0.0,
                   microbatches=problem.num_microbatches, tol=3 * problem.load_tol)

    def extras(self, k: int) -> list[float]:
        """The distinct extras of k < P shrunk stages."""
        return [self.first + self.last] if k == 1 else [self.first, self.last] + [self.middle] * (k > 2)

    def total(self, k: int) -> float:
        """Sum of the k stages' loads (any split)."""
        return self.layers + self.first + self.last + max(k - 2, 0) * self.middle

    def __call__(self, k: int) -> float:
        ex, total = self.extras(k), self.total(k)
        bottleneck = max(total / k, self.heaviest + min(ex), max(ex)) - self.tol
        return (total + (self.microbatches - 1) * max(bottleneck, 0.0)) * (1 - REL_TOL)


def bounds_apply(problem: BalanceProblem, model: IterationModel) -> bool:
    """Whether `LowerBound` bounds `model`: the default formula on a plain pipeline."""
    return problem.num_chunks == 1 and model is flow_shop_model
