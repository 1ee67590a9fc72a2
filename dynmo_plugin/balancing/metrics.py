"""Pure helpers that score a layout: stage loads, memory, imbalance, predicted time.

Loads use the same formula as the solvers (``extras + (prefix[j] - prefix[i])``) so a
plan's reported bottleneck is exactly what the solver compared against.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from dynmo_plugin.balancing.problem import BalanceProblem
from dynmo_plugin.layout import Layout

__all__ = ["stage_loads", "stage_memory", "moved_layers", "migration_peak_memory", "imbalance",
           "predicted_iteration_s", "memory_violations", "empty_stages", "feasibility_problems"]


def _segments(layout: Layout) -> tuple[np.ndarray, np.ndarray]:
    b = np.asarray(layout.boundaries)
    return b[:-1], b[1:]


def stage_loads(problem: BalanceProblem, layout: Layout) -> list[float]:
    """Per-stage load: extras cost + the stage's layer costs."""
    lo, hi = _segments(layout)
    pre = problem.cost_prefix
    return (problem.extras_cost_arr + (pre[hi] - pre[lo])).tolist()


def stage_memory(problem: BalanceProblem, layout: Layout) -> list[float]:
    """Per-stage bytes: extras memory + the stage's layer memory."""
    lo, hi = _segments(layout)
    pre = problem.memory_prefix
    return (problem.extras_memory_arr + (pre[hi] - pre[lo])).tolist()


def moved_layers(before: Layout, after: Layout) -> list[tuple[int, int, int]]:
    """(layer, src stage, dst stage) for each layer `after` places elsewhere: the same
    list as `before.moved_layers(after)`, from the boundaries in O(p + moved)."""
    a, b = before.boundaries, after.boundaries
    if a[-1] != b[-1]:
        return before.moved_layers(after)  # raises LayoutError with the message
    out: list[tuple[int, int, int]] = []
    s = t = x = 0
    while x < a[-1]:
        while a[s + 1] <= x:
            s += 1
        while b[t + 1] <= x:
            t += 1
        y = min(a[s + 1], b[t + 1])
        if s != t:
            out.extend((layer, s, t) for layer in range(x + 1, y + 1))
        x = y
    return out


def migration_peak_memory(problem: BalanceProblem, before: Layout, after: Layout, *,
                          moved: list[tuple[int, int, int]] | None = None,
                          memory_before: list[float] | None = None) -> list[float]:
    """Per-stage bytes while a migration from `before` to `after` is prepared.

    Migration is atomic: until every rank agrees, the old state stays live beside the
    new — the stage's memory before, plus each incoming layer twice (the receive buffer
    and the built layer with its optimizer state), plus what is rebuilt for the stage's
    new contents (gradient buffers). Outgoing layers are freed only after the commit.
    `moved` (`moved_layers(before, after)`) and `memory_before` (`stage_memory(problem,
    before)`) may be passed when the caller has them.
    """
    incoming = [0.0] * problem.num_stages
    move_bytes = problem.move_bytes_arr
    for layer, _src, dst in moved_layers(before, after) if moved is None else moved:
        incoming[dst] += float(move_bytes[layer - 1])
    lo, hi = _segments(after)
    rebuilt = problem.extras_rebuild_arr + (problem.rebuild_prefix[hi] - problem.rebuild_prefix[lo])
    if memory_before is None:
        memory_before = stage_memory(problem, before)
    return [m + 2 * i + r for m, i, r in zip(memory_before, incoming, rebuilt.tolist())]


def imbalance(loads: Sequence[float]) -> float:
    """DynMo eq. 2: (max - min) / mean; 0 for an all-zero pipeline."""
    arr = np.asarray(loads, dtype=float)
    mean = float(arr.mean()) if arr.size else 0.0
    return 0.0 if mean <= 0 else float((arr.max() - arr.min()) / mean)


def predicted_iteration_s(loads: Sequence[float], num_microbatches: int) -> float:
    """Predicted 1F1B iteration time: sum(loads) + (m - 1) * max(loads).

    Identical micro-batches through a p-stage flow shop: the first micro-batch crosses
    every stage (fill + drain = sum of stage loads), each further one leaves at the
    bottleneck's pace. Tighter than (m + p - 1) * max when stages differ; equal when
    balanced. Communication is not modelled.
    """
    arr = np.asarray(loads, dtype=float)
    return float(arr.sum() + (num_microbatches - 1) * arr.max())


def memory_violations(problem: BalanceProblem, layout: Layout) -> list[tuple[int, float, float]]:
    """(stage, bytes, capacity) for each stage over its capacity (beyond mem_tol)."""
    mem = stage_memory(problem, layout)
    cap = problem.capacity_arr
    return [(s, m, float(cap[s])) for s, m in enumerate(mem) if m > cap[s] + problem.mem_tol]


def empty_stages(problem: BalanceProblem, layout: Layout) -> list[int]:
    """Stages without layers, when the problem forbids them (else [])."""
    if problem.allow_empty_stages:
        return []
    return [s for s, c in enumerate(layout.counts) if c == 0]


def feasibility_problems(problem: BalanceProblem, layout: Layout) -> list[str]:
    """Human-readable reasons `layout` is not allowed; [] when it is."""
    out = [f"stage {s} needs {m:.4g} bytes > capacity {c:.4g}"
           for s, m, c in memory_violations(problem, layout)]
    empty = empty_stages(problem, layout)
    if empty:
        out.append(f"stage(s) {empty} hold no layers but empty stages are not allowed")
    return out
