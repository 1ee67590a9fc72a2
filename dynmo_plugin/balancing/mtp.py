"""The Multi-Token Prediction (MTP) block as one unit of the balancing problem.

Megatron-Core puts the k MTP layers in one (virtual) stage after every decoder layer,
never on the first rank (`layout`), so a layout with MTP is a decoder split plus the
MTP stage s, and every stage after s holds no decoder layer: on the last rank s = p-1,
"standalone" s < p-1 (the last stage then holds only the output layer and loss).

`solve_exact_mtp` (not interleaved) is exact: for every candidate s (1..p-1; 0 when
p = 1) it solves the min-max problem over the stages 0..s with the block's cost and
memory added to stage s's extras (and, when empty stages are not allowed, also with
stage s holding the block alone: "m" only, over stages 0..s-1), the stages after s
being fixed loads (their extras). The optimum B* is the least of the candidates'
bottlenecks; among the layouts at B* (every candidate s whose bottleneck is within the
tolerance of B*, each searched at threshold B*: `SegmentModel.closest`), the one moving
the fewest bytes, then layers (the block counts as its k layers and its bytes), wins;
a full tie keeps the latest s (Megatron's default, the last rank). Each candidate is the
`exact` solver's problem, so optimality follows from its proof; the union over s is
every admissible layout. Cost: p exact solves.

The other balancers, and interleaved pipelines, keep the block on the last stage
(`fold_mtp_last`: its cost and memory become the last stage's extras) and say so.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from dynmo_plugin.balancing.exact import optimal_bottleneck, reference_boundaries
from dynmo_plugin.balancing.metrics import moved_layers
from dynmo_plugin.balancing.plan import Outcome
from dynmo_plugin.balancing.problem import REL_TOL, BalanceProblem, InfeasibleError
from dynmo_plugin.balancing.segments import SegmentModel
from dynmo_plugin.layout import Layout

__all__ = ["solve_exact_mtp", "fold_mtp_last", "kept_mtp_stage", "mtp_candidates",
           "LAST_STAGE_NOTE"]

LAST_STAGE_NOTE = ("MTP block kept on the last stage: only the exact balancer places it "
                   "(and not on interleaved pipelines)")


def mtp_candidates(problem: BalanceProblem) -> list[int]:
    """Stages the MTP block may take: any but the first (unless it is the only one)."""
    p = problem.num_stages
    allowed = problem.mtp_stages
    return [s for s in range(1 if p > 1 else 0, p) if allowed is None or s in allowed]


def _strip(layout: Layout | None) -> Layout | None:
    return None if layout is None else Layout(layout.counts, layout.num_chunks)


def kept_mtp_stage(problem: BalanceProblem) -> int:
    """Where the balancers other than exact keep the block: the last stage, unless
    `mtp_stages` pins it elsewhere (then its first)."""
    last = problem.num_stages - 1
    stages = problem.mtp_stages
    return last if stages is None or last in stages else stages[0]


def fold_mtp_last(problem: BalanceProblem) -> BalanceProblem:
    """The problem without MTP, the block's cost and memory on its kept stage's extras
    (`kept_mtp_stage`)."""
    ec = problem.extras_cost_arr.copy()
    em = problem.extras_memory_arr.copy()
    s = kept_mtp_stage(problem)
    ec[s] += problem.mtp_cost
    em[s] += problem.mtp_memory
    return dataclasses.replace(problem, extras_cost=ec.tolist(), extras_memory=em.tolist(),
                               current=_strip(problem.current), **_NO_MTP)


_NO_MTP = dict(mtp_layers=0, mtp_cost=0.0, mtp_memory=0.0, mtp_move_bytes=None, mtp_stages=None)


def _sub_problem(problem: BalanceProblem, k: int, with_block: bool) -> BalanceProblem | None:
    """Stages 0..k-1 of `problem`, without MTP; `with_block`: the block's cost and memory
    on stage k-1's extras. None when no layout can exist (too few layers, extras too big)."""
    if not problem.allow_empty_stages and problem.num_layers < k:
        return None
    ec = problem.extras_cost_arr[:k].copy()
    em = problem.extras_memory_arr[:k].copy()
    if with_block:
        ec[-1] += problem.mtp_cost
        em[-1] += problem.mtp_memory
    cut = lambda a: None if a is None else list(a)[:k]  # noqa: E731
    try:
        return dataclasses.replace(
            problem, num_stages=k, extras_cost=ec.tolist(), extras_memory=em.tolist(),
            capacity=cut(problem.capacity), memory_overhead=cut(problem.memory_overhead),
            extras_rebuild_bytes=cut(problem.extras_rebuild_bytes), current=None, **_NO_MTP)
    except InfeasibleError:
        return None


def _fixed_stages(problem: BalanceProblem, s: int, block_alone: bool) -> float | None:
    """Largest load of the stages without decoder layers (after s; s too with the block
    alone), or None if one of them does not fit its memory."""
    first = s if block_alone else s + 1
    loads = [-math.inf]
    for t in range(first, problem.num_stages):
        block = t == s
        mem = problem.extras_memory_arr[t] + (problem.mtp_memory if block else 0.0)
        if mem > problem.rank_capacity_arr[t] + problem.mem_tol:
            return None
        loads.append(float(problem.extras_cost_arr[t]) + (problem.mtp_cost if block else 0.0))
    return max(loads)


def _candidates(problem: BalanceProblem):
    """(s, block_alone, sub-problem, its best bottleneck, fixed loads) per admissible one."""
    for s in mtp_candidates(problem):
        variants = [False] if problem.allow_empty_stages or s == 0 else [False, True]
        for alone in variants:
            fixed = _fixed_stages(problem, s, alone)
            sub = _sub_problem(problem, s if alone else s + 1, not alone)
            if fixed is None or sub is None:
                continue
            try:
                best = optimal_bottleneck(sub)
            except InfeasibleError:
                continue
            yield s, alone, sub, max(best, fixed)


def _moved_key(problem: BalanceProblem, reference: Layout, layout: Layout) -> tuple[int, int]:
    """(bytes, layers) `layout` moves away from `reference`, the block as its k layers."""
    move = problem.move_bytes_arr
    moved = moved_layers(reference, layout)
    key = (sum(int(np.rint(move[layer - 1])) for layer, _, _ in moved), len(moved))
    if reference.mtp_stage != layout.mtp_stage:
        key = (key[0] + int(np.rint(problem.mtp_move_bytes_value)), key[1] + layout.mtp_layers)
    return key


def _reference(problem: BalanceProblem) -> Layout:
    if problem.current is not None:
        return problem.current
    return Layout.uniform(problem.num_layers, problem.num_stages, mtp_layers=problem.mtp_layers)


def solve_exact_mtp(problem: BalanceProblem) -> Outcome:
    """Min bottleneck over decoder splits and MTP stages, then fewest bytes/layers moved
    (module docstring).

    Raises:
        InfeasibleError: no MTP stage admits a layout within the memory caps.
    """
    found = list(_candidates(problem))
    if not found:
        raise InfeasibleError(f"no layout of {problem.num_layers} decoder layers and the MTP "
                              f"block on {problem.num_stages} stages fits the memory caps; raise "
                              "--capacity, add stages or allow empty stages")
    best = min(b for *_, b in found)
    tol = problem.load_tol + REL_TOL * problem.mtp_cost
    reference = _reference(problem)
    ref_bounds = reference_boundaries(dataclasses.replace(problem, current=reference))
    chosen: tuple | None = None
    for s, alone, sub, bottleneck in found:
        if bottleneck > best + tol:
            continue
        model, ref = SegmentModel(sub), ref_bounds[:sub.num_stages + 1]
        bounds = model.closest(best, ref) or model.closest(bottleneck, ref)  # rounding
        if bounds is None:
            continue
        counts = [y - x for x, y in zip(bounds, bounds[1:])]
        counts += [0] * (problem.num_stages - len(counts))
        layout = Layout(tuple(counts), 1, problem.mtp_layers, s)
        rank = (_moved_key(problem, reference, layout), -s)
        if chosen is None or rank < chosen[0]:
            chosen = (rank, layout)
    if chosen is None:  # cannot happen: the best candidate is admissible at its bottleneck
        raise RuntimeError(f"exact (MTP): no layout at the optimal bottleneck {best!r}")
    layout = chosen[1]
    where = "standalone" if layout.mtp_standalone else "on the last rank"
    return Outcome(layout, [f"exact: MTP block {where} on stage {layout.mtp_stage}, chosen among "
                            f"stages {mtp_candidates(problem)}"])
