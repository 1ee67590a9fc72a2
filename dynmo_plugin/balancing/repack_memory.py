"""Whether a repack fits in memory while it happens, not only once it is done.

Two transients, both checked against the caps without the memory margin (they last
between two iterations): the migration to the intermediate layout, while old and new
state coexist (`migration_overflow`, `metrics.migration_peak_memory`), and the rebuild
on the K survivors, each building its new stage while its old one is alive
(`rebuild_overflow`, `metrics.repack_rebuild_memory`). When the split the exact solver
chose overflows the rebuild, `rebuild_split` finds the fastest split of that K that fits
both the steady caps and the rebuild (plain pipelines). Pure: numpy only.
"""
from __future__ import annotations

import numpy as np

from dynmo_plugin.balancing import metrics
from dynmo_plugin.balancing.problem import BalanceProblem
from dynmo_plugin.balancing.render import human_bytes
from dynmo_plugin.balancing.shrink import shrink_problem
from dynmo_plugin.layout import Layout

__all__ = ["migration_overflow", "rebuild_overflow", "rebuild_split"]


def migration_overflow(problem: BalanceProblem, intermediate: Layout) -> str:
    """Why the migration to `intermediate` overflows a stage ('' when it fits): old and
    new state coexist until the commit (`metrics.migration_peak_memory`)."""
    if problem.capacity is None:
        return ""
    peaks = metrics.migration_peak_memory(problem, problem.current, intermediate)
    for s, (peak, cap) in enumerate(zip(peaks, problem.capacity_arr)):
        if peak > cap + problem.mem_tol:
            return (f"the migration needs {human_bytes(peak)} on stage {s} while old and new "
                    f"state coexist, above its cap {human_bytes(float(cap))}")
    return ""


def rebuild_overflow(problem: BalanceProblem, layout: Layout) -> str:
    """Why the live repack's rebuild onto `layout` (K ranks) overflows a survivor ('' when
    it fits): each survivor builds its new stage while its old one and the captured state
    are alive (`metrics.repack_rebuild_memory`). Checked against the caps without the
    memory margin, like the migration's peak (both are transients between iterations),
    less the calibrated overhead (`rank_capacity_arr`)."""
    if problem.capacity is None:
        return ""
    peaks = metrics.repack_rebuild_memory(problem, shrink_problem(problem, layout.num_ranks), layout)
    for r, (peak, cap) in enumerate(zip(peaks, problem.rank_capacity_arr)):
        if peak > cap + problem.mem_tol:
            return (f"the rebuild needs {human_bytes(peak)} on rank {r} while its old stage and "
                    f"the new one coexist, above its cap {human_bytes(float(cap))}")
    return ""


def _segment_table(problem: BalanceProblem, fit: BalanceProblem, s: int) -> tuple[np.ndarray, np.ndarray]:
    """Stage s of `fit` holding layers [i, j): (load, admissible) as (n+1) x (n+1) arrays.
    Admissible: at least min_layers, the steady memory within `fit`'s cap (the solver's
    test) and the live rebuild within the survivor's cap (`rebuild_overflow`'s)."""
    i, j = np.ogrid[:fit.num_layers + 1, :fit.num_layers + 1]
    mem, cost = fit.memory_prefix, fit.cost_prefix
    state = np.concatenate(([0.0], np.cumsum(problem.move_bytes_arr)))
    fixed = metrics.repack_rebuild_extras(problem, fit)[s]
    cap = float(problem.rank_capacity_arr[s]) + problem.mem_tol
    ok = ((j - i >= fit.min_layers_per_stage)
          & (mem[None, :] <= mem[:, None] + ((fit.capacity_arr[s] - fit.extras_memory_arr[s]) + fit.mem_tol))
          & (fixed + 2 * (state[None, :] - state[:, None]) <= cap))
    return fit.extras_cost_arr[s] + (cost[None, :] - cost[:, None]), ok


def rebuild_split(problem: BalanceProblem, fit: BalanceProblem) -> Layout | None:
    """Plain pipelines: the min-max split of `fit` (K stages, steady caps with the margin)
    among those whose live rebuild fits too, tie-broken as `repack._closest_optimal` (fewest
    bytes, then layers, moved from `problem.current`); None when no split fits both.
    Two dynamic programmes over (stage, end), O(K n^2) vectorised: the solver bounds one
    memory quantity per stage, so this runs only when its split overflows the rebuild."""
    k, n = fit.num_stages, fit.num_layers
    best = np.full(n + 1, np.inf)
    best[0] = -np.inf  # before stage 0: position 0 only
    for s in range(k):
        load, ok = _segment_table(problem, fit, s)
        best = np.where(ok, np.maximum(best[:, None], load), np.inf).min(axis=0)
    if not np.isfinite(best[n]):
        return None
    limit = best[n] + fit.load_tol
    current = np.repeat(np.arange(problem.num_stages), problem.current.counts)
    never = np.int64(2**62)
    moved = np.full(n + 1, never)
    moved[0] = 0
    back = []
    for s in range(k):
        load, ok = _segment_table(problem, fit, s)
        keys = np.concatenate(([0], np.cumsum(np.where(current != s, fit.move_key, 0))))
        reached = moved < never
        total = np.where(ok & (load <= limit) & reached[:, None],  # no overflow past `never`
                         np.where(reached, moved, 0)[:, None] + (keys[None, :] - keys[:, None]), never)
        back.append(total.argmin(axis=0))
        moved = total.min(axis=0)
    bounds = [n]
    for s in range(k - 1, 0, -1):
        bounds.append(int(back[s][bounds[-1]]))
    layout = Layout.from_boundaries((0, *reversed(bounds)))
    return None if rebuild_overflow(problem, layout) else layout  # rounding guard
