"""Repacking: consolidating the pipeline onto fewer stages once the work has shrunk.

When pruning, freezing or early exit make the layers cheaper, a P-stage pipeline may
run about as fast on K < P stages; the other P - K GPUs can go back to the cluster.
This module decides K and the new split (pure: numpy only); the live controller
executes it. Two planners, both returning a `RepackPlan`:

* `plan_repack` (method "dynmo"): for each K in [min_stages, P - 1], the exact
  min-max partition of the profiled layers over K stages (`exact`'s solver on
  `shrink_problem(problem, K)`, memory caps scaled by 1 / (1 + memory_margin), ties
  broken by the fewest bytes moved from the current layout). Objective `min_stages`
  takes the smallest K whose partition fits memory and whose predicted iteration time
  is within `max_slowdown` of the current one; `throughput_per_gpu` takes, among the
  K within the same `max_slowdown`, the one with the most predicted tokens/s per GPU,
  i.e. the least (iteration time x K), if it beats the current pipeline. Both bound
  the slowdown: nobody loses two thirds of their tokens/s to a per-GPU gain without
  asking (raise max_slowdown to trade throughput for GPUs). A K whose split would
  overflow a survivor during the live rebuild is not admissible either (next
  paragraph). Then a gate: the move must pay for itself.
* `first_fit_repack` (method "first_fit"): the DynMo paper's Algorithm 2 (first-fit
  packing of whole stages under the memory cap) as a baseline. The paper packs any
  worker into any other; without reordering layers only ADJACENT stages can merge, so
  this is the adjacent variant (which is next-fit: a closed group can never receive
  a later stage). It merges stages as they are and ignores time.

Survivors are always the LOWEST pipeline ranks 0..K-1 (a StatefulSet removes its
highest ordinals first; under torchrun the rendezvous lives with rank 0). The live
migration first moves to `RepackPlan.intermediate_layout()` (K stages' layers, then
empty released stages) over the old P-stage pipeline, then rebuilds on K ranks.
Both are transients the caps must hold (without the memory margin, as the
migration's peak): the migration's (`metrics.migration_peak_memory`, checked by the
gate) and the rebuild's (`metrics.repack_rebuild_memory`: each survivor builds its new
stage while its old stage's state, captured before the shrink, is still alive, about
twice its state; the new last rank also holds the received head beside the built one).
`plan_repack` checks the rebuild per K on the split the exact solver chose; when it
overflows, a plain pipeline takes the fastest split of that K that fits both the steady
caps and the rebuild (`repack_memory.rebuild_split`, the same min-max and tie-break), if within
max_slowdown; else the K is refused and the scan goes on to another K. Interleaved:
checked, no other split searched.

Interleaved problems (`num_chunks` = v > 1): P and K count pipeline RANKS, each keeping
its v chunks (K x v virtual stages after); extras shrink over virtual stages, memory
caps and overheads over ranks; a K below 2, or not dividing the micro-batches, is
skipped (Megatron's interleaved schedule); each K is solved by `exact`'s interleaved
solver, without the lower-bound skips (they assume plain 1F1B); moves within a rank
cost no bytes. `first_fit_repack` is plain-pipeline only.

Predicted iteration times come from an `IterationModel`. The default,
`flow_shop_model`, is the balancers' formula (`metrics.predicted_iteration_s`: stage
loads only, no communication, and it overstates an unbalanced pipeline). A caller that
knows better passes its own: the simulator passes its whole iteration (p2p transfers on
the critical path, the data-parallel all-reduce of each rank's gradients, which grows
as the stages get fewer, the real 1F1B order), so a repack it applies never simulates
slower than `max_slowdown` allows (`sim.planner`); the live controller passes the same
simulated iteration built from its profiled problem (`sim.problem_model`). With a
custom model the lower-bound skips are off (they bound the default formula only).

Floating point follows `problem`: "a <= b" means ``a <= b + REL_TOL * |b|`` for times,
and memory checks are the solver's (``<= cap / (1 + margin) + mem_tol``).

This module is the search (the scans over K, the first-fit baseline, the plan they
assemble); its parts have their own modules: `repack_plan` (criteria, candidates and
the plan, as data), `shrink` (the problem over K stages), `repack_throughput` (the
iteration model and its lower bound), `repack_memory` (the migration's and the
rebuild's peaks), `repack_gate` (does it pay) and `repack_render` (the plan as text).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import replace
from typing import Optional

from dynmo_plugin.balancing.blocks import coarse_layout, coarsen, in_blocks, refine
from dynmo_plugin.balancing.exact import optimal_bottleneck, solve_exact
from dynmo_plugin.balancing.gate import GateConfig
from dynmo_plugin.balancing.plan import Move
from dynmo_plugin.balancing.problem import REL_TOL, BalanceProblem, InfeasibleError, ProblemError
from dynmo_plugin.balancing.repack_gate import judge
from dynmo_plugin.balancing.repack_memory import rebuild_overflow, rebuild_split
from dynmo_plugin.balancing.repack_plan import OBJECTIVES, RepackCandidate, RepackCriteria, RepackPlan
from dynmo_plugin.balancing.repack_render import ratio_text
from dynmo_plugin.balancing.repack_throughput import (IterationModel, LowerBound, at_most, better,
                                                      bounds_apply, flow_shop_model, per_gpu)
from dynmo_plugin.balancing.segments import SegmentModel
from dynmo_plugin.balancing.shrink import shrink_problem, with_margin
from dynmo_plugin.layout import Layout

# The planners are this module's; the rest of the names are re-exported from their homes
# (repack_plan, repack_throughput, shrink), where callers, docs and tests have found them.
__all__ = ["OBJECTIVES", "IterationModel", "RepackCriteria", "RepackCandidate", "RepackPlan",
           "flow_shop_model", "plan_repack", "first_fit_repack", "shrink_problem"]


def _closest_optimal(fit: BalanceProblem, current: Layout) -> Layout:
    """`exact`'s optimal split of `fit`, tie-broken by the fewest bytes (then layers)
    moved away from the current layout: survivor s keeps what current stage s holds,
    everything on the released stages moves.

    Raises:
        InfeasibleError: no split fits the (margin-scaled) memory caps.
    """
    model = SegmentModel(fit)
    best = optimal_bottleneck(fit, model)
    bounds = model.closest(best, current.boundaries[:fit.num_stages + 1])
    if bounds is None:  # cannot happen: the optimum is admissible
        raise RuntimeError(f"repack: no layout at the optimal bottleneck {best!r}")
    return Layout.from_boundaries(bounds)


def _candidate(problem: BalanceProblem, k: int, criteria: RepackCriteria,
               model: IterationModel) -> RepackCandidate:
    """Solve k stages. `fits` here means memory only; the objectives refine it."""
    scale = 1 + criteria.memory_margin
    if problem.num_chunks > 1 and (k < 2 or problem.num_microbatches % k):
        return _skipped(k, f"the interleaved schedule needs >= 2 ranks and the micro-batches "
                           f"({problem.num_microbatches}) a multiple of them")
    try:
        sub = shrink_problem(problem, k)
        fit = with_margin(sub, criteria.memory_margin)
    except InfeasibleError as e:  # a survivor's extras alone
        return RepackCandidate(k, None, None, False, None, f"does not fit (caps / {scale:g}): {e}")
    try:
        q = problem.layer_block  # whole blocks of layers on every stage (`blocks`)
        layout = in_blocks(fit, lambda f: _closest_optimal(f, coarse_layout(problem.current, q))
                           if problem.num_chunks == 1 else solve_exact(f))
    except InfeasibleError:
        return RepackCandidate(k, None, None, False, None, "does not fit: no split keeps every "
                               f"stage's memory x {scale:g} within its cap")
    iter_s = model(sub, layout)
    return RepackCandidate(k, layout, iter_s, True, per_gpu(iter_s, k), "fits memory")


def _within(cand: RepackCandidate, limit: float, slow: str) -> RepackCandidate:
    """`cand`, refused when its predicted iteration exceeds `limit` (max_slowdown)."""
    if cand.fits and not at_most(cand.predicted_iter_s, limit):
        return replace(cand, fits=False, reason=f"too slow: {cand.predicted_iter_s:.4g} s {slow}")
    return cand


_REBUILD = "rebuild does not fit: "
_SPLIT = "split chosen for the rebuild, the fastest one would not fit it: "


def _admit(problem: BalanceProblem, k: int, criteria: RepackCriteria, model: IterationModel,
           limit: float, slow: str) -> RepackCandidate:
    """Solve k (`_candidate`), bound its time (`_within`), then check the live rebuild
    (`rebuild_overflow`). When the solver's split overflows it, a plain pipeline takes
    the best split that fits the rebuild too (`rebuild_split`) if that one is within
    max_slowdown; otherwise k is refused ("rebuild does not fit: ...") and the scans go
    on to another K. Interleaved: checked, no other split searched."""
    cand = _within(_candidate(problem, k, criteria, model), limit, slow)
    why = rebuild_overflow(problem, cand.layout) if cand.fits else ""
    if not why:
        return cand
    refused = replace(cand, fits=False, reason=_REBUILD + why)
    if problem.num_chunks > 1:
        return refused
    sub = shrink_problem(problem, k)
    alt = rebuild_split(coarsen(problem), coarsen(with_margin(sub, criteria.memory_margin)))
    if alt is None:
        return refused
    alt = refine(alt, problem.layer_block)
    iter_s = model(sub, alt)
    other = _within(RepackCandidate(k, alt, iter_s, True, per_gpu(iter_s, k), ""), limit, slow)
    return replace(other, reason=f"{_SPLIT}{cand.layout}: {why}") if other.fits else refused


def _fits_reason(cand: RepackCandidate, text: str) -> str:
    """The scans' 'fits: ...' text, keeping why a split other than the solver's was taken."""
    return f"{text}; {cand.reason}" if cand.reason.startswith(_SPLIT) else text


def _rebuild_refusal(candidates: list[RepackCandidate], most_gpu_s: float | None) -> str:
    """One line naming the rebuild's peak when it alone refused a K that otherwise
    qualified (fits memory, within max_slowdown and, for throughput_per_gpu, under
    `most_gpu_s` GPU-seconds per iteration); '' when none."""
    for c in candidates:
        if c.reason.startswith(_REBUILD) and (
                most_gpu_s is None or better(c.predicted_iter_s * c.stages, most_gpu_s)):
            return (f"refused for rebuild memory: K = {c.stages} ({c.layout}) qualifies, but "
                    f"{c.reason[len(_REBUILD):]}")
    return ""


def _skipped(k: int, why: str) -> RepackCandidate:
    return RepackCandidate(k, None, None, False, None, f"skipped: {why}")


def _scan_min_stages(problem: BalanceProblem, criteria: RepackCriteria, iter_now: float,
                     model: IterationModel) -> tuple[list[RepackCandidate], RepackCandidate | None]:
    """Ascending K; the first that fits memory and max_slowdown is the smallest, and
    larger K are not evaluated. A K whose lower bound already breaks max_slowdown is
    not solved."""
    limit = criteria.max_slowdown * iter_now
    slow = f"exceeds max_slowdown {criteria.max_slowdown:g} x current {iter_now:.4g} s"
    lower = LowerBound.of(problem)
    out: list[RepackCandidate] = []
    for k in range(criteria.min_stages, problem.num_ranks):
        if bounds_apply(problem, model) and not at_most(lower(k), limit):
            out.append(_skipped(k, f"even its lower bound {lower(k):.4g} s {slow}"))
            continue
        cand = _admit(problem, k, criteria, model, limit, slow)
        if cand.fits:
            cand.reason = _fits_reason(cand, f"fits: {ratio_text(cand.predicted_iter_s, iter_now)} of "
                                             f"current, within max_slowdown {criteria.max_slowdown:g}")
        out.append(cand)
        if cand.fits:
            return out, cand
    return out, None


def _scan_throughput(problem: BalanceProblem, criteria: RepackCriteria, iter_now: float,
                     model: IterationModel) -> tuple[list[RepackCandidate], RepackCandidate | None]:
    """Ascending K; the least GPU-seconds per iteration (iteration s x K) wins if it
    beats the current pipeline's; near-ties keep the smaller K. A K whose lower bound
    cannot beat the best so far is not solved; once even K x (sum of loads) cannot,
    no larger K can (it grows with K) and the scan stops."""
    p = problem.num_ranks
    best_value, best = iter_now * p, None
    lower = LowerBound.of(problem)
    plain = bounds_apply(problem, model)
    limit = criteria.max_slowdown * iter_now
    slow = f"exceeds max_slowdown {criteria.max_slowdown:g} x current {iter_now:.4g} s"
    out: list[RepackCandidate] = []
    for k in range(criteria.min_stages, p):
        if plain and not better(k * lower.total(k) * (1 - REL_TOL), best_value):
            break
        if plain and not better(k * lower(k), best_value):
            out.append(_skipped(k, f"even its lower bound {lower(k):.4g} s x {k} GPUs does not beat "
                                   f"{best_value:.4g} GPU-s/iter"))
            continue
        cand = _admit(problem, k, criteria, model, limit, slow)
        if cand.fits:
            value = cand.predicted_iter_s * k
            if better(value, best_value):
                best_value, best = value, cand
            cand.reason = _fits_reason(cand, f"fits: {value:.4g} GPU-s/iter (current {iter_now * p:.4g})")
        out.append(cand)
    return out, best


def _move_bytes(problem: BalanceProblem, layout: Layout, layer: int, src: int, dst: int) -> float:
    """A layer's bytes, 0 when it only changes chunk on its rank (no communication)."""
    if layout.rank_of(src) == layout.rank_of(dst):
        return 0.0
    return float(problem.move_bytes_arr[layer - 1])


def _require_current(problem: BalanceProblem) -> Layout:
    if problem.current is None:
        raise ProblemError("repacking needs the current layout (BalanceProblem.current, "
                           "--current-layout)")
    return problem.current


def _assemble(problem: BalanceProblem, method: str, chosen: RepackCandidate | None,
              candidates: list[RepackCandidate], criteria: RepackCriteria,
              gate: GateConfig | None, no_choice: str, started: float,
              iter_now: float) -> RepackPlan:
    """The plan for `chosen` (None: nothing qualified, `no_choice` says why), gated."""
    current = problem.current
    p = problem.num_ranks
    keep = dict(method=method, stages_before=p, layout_before=current,
                predicted_iter_s_before=iter_now, candidates=candidates,
                tokens_per_iteration=problem.tokens_per_iteration)
    if chosen is None:
        return RepackPlan(**keep, stages_after=p, layout_after=current, predicted_iter_s_after=iter_now,
                          released_stages=[], moves=[], bytes_moved=0.0, apply=False, reason=no_choice,
                          saving_gpu_s=0.0, cost_s=0.0, solve_seconds=time.perf_counter() - started)
    layout, k = chosen.layout, chosen.stages
    intermediate = layout.padded(p)
    moves = [Move(layer, src, dst, _move_bytes(problem, intermediate, layer, src, dst))
             for layer, src, dst in current.moved_layers(intermediate)]
    moved = float(sum(m.bytes for m in moves))
    verdict = judge(problem, layout, chosen.predicted_iter_s, iter_now, moved, criteria, gate)
    reason = f"{p} -> {k} stages: {verdict.reason}"
    if not verdict.apply:
        return RepackPlan(**keep, stages_after=p, layout_after=current, predicted_iter_s_after=iter_now,
                          released_stages=[], moves=[], bytes_moved=0.0, apply=False, reason=reason,
                          saving_gpu_s=verdict.saving_gpu_s, cost_s=verdict.cost_s,
                          solve_seconds=time.perf_counter() - started)
    return RepackPlan(**keep, stages_after=k, layout_after=layout,
                      predicted_iter_s_after=chosen.predicted_iter_s,
                      released_stages=list(range(k, p)), moves=moves, bytes_moved=moved,
                      apply=True, reason=reason, saving_gpu_s=verdict.saving_gpu_s,
                      cost_s=verdict.cost_s, solve_seconds=time.perf_counter() - started)


def plan_repack(problem: BalanceProblem, criteria: RepackCriteria,
                gate: GateConfig | None = None, *,
                iteration_model: Optional[IterationModel] = None) -> RepackPlan:
    """Decide whether and how to repack the current P-stage pipeline onto K < P stages.

    Candidates K = min_stages .. P-1 are solved exactly (module docstring); each records
    why it does or does not qualify, and an infeasible K is a candidate, never an
    exception. Objective min_stages stops at the first qualifying K. The chosen K goes
    through the gate (see `judge`: apply iff h x (P x before - K x after) >
    margin x P x (bytes / bandwidth + rebuild_s)). `gate.fixed_overhead_s` and
    `min_relative_gain` are rebalancing settings and are not used: `rebuild_s` is the
    repack's fixed cost. `iteration_model` predicts every iteration time, the current
    pipeline's included (default `flow_shop_model`; module docstring).

    Raises:
        ProblemError: `problem.current` is not set.
    """
    started = time.perf_counter()
    current = _require_current(problem)
    model = flow_shop_model if iteration_model is None else iteration_model
    p = problem.num_ranks
    iter_now = model(problem, current)
    if criteria.min_stages >= p:
        return _assemble(problem, "dynmo", None, [], criteria, gate,
                         f"nothing to consider: the pipeline has {p} stage(s) and min_stages is "
                         f"{criteria.min_stages}", started, iter_now)
    if criteria.objective == "min_stages":
        candidates, chosen = _scan_min_stages(problem, criteria, iter_now, model)
        none = (_rebuild_refusal(candidates, None)
                or f"no K in [{criteria.min_stages}, {p - 1}] fits memory within "
                   f"max_slowdown {criteria.max_slowdown:g}")
    else:
        candidates, chosen = _scan_throughput(problem, criteria, iter_now, model)
        none = (_rebuild_refusal(candidates, iter_now * p)
                or f"no K in [{criteria.min_stages}, {p - 1}] beats the current {p} stages' "
                   f"throughput per GPU within max_slowdown {criteria.max_slowdown:g}")
    return _assemble(problem, "dynmo", chosen, candidates, criteria, gate, none, started, iter_now)


# ---- the paper's baseline ------------------------------------------------------------------
def _first_fit_groups(problem: BalanceProblem, criteria: RepackCriteria) -> tuple[list[list[int]], str]:
    """Groups of adjacent old stages, one per survivor, packed in order: stage s joins
    the open group while the group's memory x (1 + margin) fits the survivor's cap (and
    enough stages remain for min_stages), else it opens the next group. A group's
    memory is its layers' plus the extras `shrink_problem` gives that survivor (the
    first group the embedding's, the one with the old last stage the head's, others
    the median middle extras), so the result fits exactly as evaluated. Returns the
    groups and '' or why a group does not fit (a stage too big even alone). P >= 2."""
    p, cur = problem.num_stages, problem.current
    bounds, mem = cur.boundaries, problem.memory_prefix
    layer_mem = [float(mem[bounds[s + 1]] - mem[bounds[s]]) for s in range(p)]
    extras = problem.extras_memory_arr
    middle = float(statistics.median(extras[1:-1])) if p > 2 else 0.0
    scale = 1 + criteria.memory_margin

    def fits(group: list[int], j: int) -> bool:
        first, last = group[0] == 0, group[-1] == p - 1
        fixed = (extras[0] if first else 0.0) + (extras[-1] if last else 0.0)
        need = sum(layer_mem[s] for s in group) + (fixed if first or last else middle)
        return need <= problem.capacity_arr[j] / scale + problem.mem_tol

    groups: list[list[int]] = [[0]]
    for s in range(1, p):
        enough = len(groups) + (p - 1 - s) >= criteria.min_stages
        if enough and fits(groups[-1] + [s], len(groups) - 1):
            groups[-1].append(s)
        else:
            groups.append([s])
    bad = [(j, g) for j, g in enumerate(groups) if not fits(g, j)]
    why = "" if not bad else (f"stage(s) {bad[0][1]} do not fit survivor {bad[0][0]}'s cap with "
                              f"memory margin {criteria.memory_margin:g}")
    return groups, why


def first_fit_repack(problem: BalanceProblem, criteria: RepackCriteria, *,
                     iteration_model: Optional[IterationModel] = None) -> RepackPlan:
    """Baseline: the DynMo paper's Algorithm 2 (first-fit packing under the memory cap),
    adjacent-merge variant: only neighbouring stages merge, so no layer is reordered;
    whole stages move as they are (no re-split). It considers memory (with the margin)
    and min_stages only: neither max_slowdown nor the objective, and no gate (the
    transient peaks of the migration and of the rebuild are still checked, `judge`).
    Applies iff it releases a stage.

    Raises:
        ProblemError: `problem.current` is not set, or the problem is interleaved.
    """
    started = time.perf_counter()
    current = _require_current(problem)
    if problem.num_chunks > 1:
        raise ProblemError("first_fit_repack merges whole stages of a plain pipeline; for "
                           "interleaved (virtual) stages use plan_repack")
    p = problem.num_stages
    model = flow_shop_model if iteration_model is None else iteration_model
    iter_now = model(problem, current)
    if criteria.min_stages >= p:
        return _assemble(problem, "first_fit", None, [], criteria, None,
                         f"nothing to consider: the pipeline has {p} stage(s) and min_stages is "
                         f"{criteria.min_stages}", started, iter_now)
    groups, why = _first_fit_groups(problem, criteria)
    if len(groups) == p:
        return _assemble(problem, "first_fit", None, [], criteria, None,
                         "first fit merges no stages: no two adjacent stages fit together",
                         started, iter_now)
    if why:
        return _assemble(problem, "first_fit", None, [], criteria, None, why, started, iter_now)
    k = len(groups)
    layout = Layout(tuple(sum(current.counts[s] for s in g) for g in groups))
    iter_s = model(shrink_problem(problem, k), layout)
    cand = RepackCandidate(k, layout, iter_s, True, per_gpu(iter_s, k),
                           f"merged stages {groups}; {ratio_text(iter_s, iter_now)} of current "
                           "(time not considered)")
    return _assemble(problem, "first_fit", cand, [cand], criteria, None, "", started, iter_now)
