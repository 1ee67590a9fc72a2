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
caps and the rebuild (`_rebuild_split`, the same min-max and tie-break), if within
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
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Optional, Sequence

import numpy as np

from dynmo_plugin.balancing import metrics
from dynmo_plugin.balancing.exact import optimal_bottleneck, solve_exact
from dynmo_plugin.balancing.gate import GateConfig
from dynmo_plugin.balancing.plan import Move
from dynmo_plugin.balancing.problem import REL_TOL, BalanceProblem, InfeasibleError, ProblemError
from dynmo_plugin.balancing.render import human_bytes
from dynmo_plugin.balancing.segments import SegmentModel
from dynmo_plugin.layout import Layout

__all__ = ["OBJECTIVES", "IterationModel", "RepackCriteria", "RepackCandidate", "RepackPlan",
           "flow_shop_model", "plan_repack", "first_fit_repack", "shrink_problem"]

OBJECTIVES = ("min_stages", "throughput_per_gpu")

IterationModel = Callable[[BalanceProblem, Layout], float]
"""Predicted seconds of one iteration of `layout` (K stages) on `problem` (shrunk to K)."""


# ---- criteria ---------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class RepackCriteria:
    """What a repack must satisfy (mirrors `config.RepackConfig`).

    Attributes:
        min_stages: never repack below this many pipeline stages.
        max_slowdown: every objective: predicted iteration time after <= this x the
            current one (1.0 = no slower, i.e. tokens/s never drops).
        objective: "min_stages" (fewest stages within max_slowdown) or
            "throughput_per_gpu" (most predicted tokens/s per GPU within max_slowdown).
        memory_margin: a stage fits if its predicted memory x (1 + margin) <= capacity.
        rebuild_s: estimated seconds to regroup and rebuild (the gate's fixed cost; it
            also covers moving the output layer, which is not a decoder layer).
    Raises:
        ProblemError: a value out of range (the message names the field).
    """

    min_stages: int = 1
    max_slowdown: float = 1.0
    objective: str = "min_stages"
    memory_margin: float = 0.1
    rebuild_s: float = 10.0

    def __post_init__(self) -> None:
        if isinstance(self.min_stages, bool) or not isinstance(self.min_stages, int) or self.min_stages < 1:
            raise ProblemError(f"min_stages must be an integer >= 1, got {self.min_stages!r}")
        if self.objective not in OBJECTIVES:
            raise ProblemError(f"objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        for name, low_ok in (("max_slowdown", False), ("memory_margin", True), ("rebuild_s", True)):
            value = getattr(self, name)
            good = isinstance(value, (int, float)) and not isinstance(value, bool) \
                and math.isfinite(value) and (value >= 0 if low_ok else value > 0)
            if not good:
                raise ProblemError(f"{name} must be a finite number {'>= 0' if low_ok else '> 0'}, "
                                   f"got {value!r}")

    @classmethod
    def from_config(cls, repack_config: Any) -> "RepackCriteria":
        """From `config.RepackConfig` (or anything with the same attributes)."""
        return cls(min_stages=repack_config.min_stages, max_slowdown=repack_config.max_slowdown,
                   objective=repack_config.objective, memory_margin=repack_config.memory_margin,
                   rebuild_s=repack_config.rebuild_s)


# ---- the smaller problem ----------------------------------------------------------------
def _shrink_extras(values: Sequence[float] | None, p: int, k: int) -> list[float] | None:
    """Per-stage extras for k of p stages: first stays first, last goes to the new last,
    middle stages get the median of the old middle ones (0 if there were none)."""
    if values is None or k == p:
        return None if values is None else list(values)
    v = [float(x) for x in values]
    if k == 1:
        return [v[0] + v[-1]]
    middle = float(statistics.median(v[1:-1])) if p > 2 else 0.0
    return [v[0], *([middle] * (k - 2)), v[-1]]


def shrink_problem(problem: BalanceProblem, k: int) -> BalanceProblem:
    """The same profiled layers over the first k <= P stages (interleaved: k of the P
    ranks, each with its `num_chunks` chunks; see `_shrink_interleaved`).

    Extras (cost, memory, rebuild bytes): stage 0 keeps stage 0's (embedding); stage k-1
    gets the old last stage's (output layer + loss); stages 1..k-2 get the MEDIAN of the
    old middle stages' extras (robust to one odd stage; 0 when P <= 2); k == 1 sums the
    first and last; k == P keeps them all unchanged. The calibrated `memory_overhead`
    maps the same way (the head's logits go with the head). Capacity: the first k
    entries (the survivors are the lowest ranks). `current` is dropped (it has P stages).

    Per-layer memory is kept as measured. It includes the activations of the micro-batches
    in flight under 1F1B on P stages (stage s holds up to P - s); on fewer stages fewer
    are in flight, so the estimate is conservative: a repack is never refused for lack
    of memory it would have had, only possibly for memory it would not have needed.

    Raises:
        ProblemError: k not an integer in [1, P].
        InfeasibleError: a surviving stage's extras alone exceed its capacity.
    """
    p = problem.num_ranks
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= p:
        raise ProblemError(f"cannot shrink a {p}-stage problem to {k!r} stages; give 1 <= k <= {p}")
    if problem.num_chunks > 1:
        return _shrink_interleaved(problem, k)
    return replace(
        problem, num_stages=k, current=None,
        capacity=None if problem.capacity is None else tuple(problem.capacity[:k]),
        extras_cost=_shrink_extras(problem.extras_cost, p, k),
        extras_memory=_shrink_extras(problem.extras_memory, p, k),
        extras_rebuild_bytes=_shrink_extras(problem.extras_rebuild_bytes, p, k),
        memory_overhead=_shrink_extras(problem.memory_overhead, p, k))


def _shrink_interleaved(problem: BalanceProblem, k: int) -> BalanceProblem:
    """`shrink_problem` for v > 1 chunks per rank: per-virtual-stage extras shrink from
    P x v to k x v virtual stages (the embedding stays on the first, the head goes to the
    last, the middle ones get the median); capacity and the calibrated overhead are per
    rank, so they shrink from P to k ranks the same way."""
    p, v = problem.num_ranks, problem.num_chunks
    return replace(
        problem, num_stages=k * v, current=None,
        capacity=None if problem.capacity is None else tuple(problem.capacity[:k]),
        extras_cost=_shrink_extras(problem.extras_cost, p * v, k * v),
        extras_memory=_shrink_extras(problem.extras_memory, p * v, k * v),
        extras_rebuild_bytes=_shrink_extras(problem.extras_rebuild_bytes, p * v, k * v),
        memory_overhead=_shrink_extras(problem.memory_overhead, p, k))


def _with_margin(problem: BalanceProblem, margin: float) -> BalanceProblem:
    """Caps scaled by 1 / (1 + margin): memory <= that  <=>  memory x (1 + margin) <= cap."""
    if problem.capacity is None or margin == 0:
        return problem
    return replace(problem, capacity=tuple(c / (1 + margin) for c in problem.capacity))


# ---- data -------------------------------------------------------------------------------
@dataclass
class RepackCandidate:
    """One stage count considered.

    `fits`: admissible under the criteria (memory with the margin; within max_slowdown;
    the live rebuild's peak within the caps, else `reason` starts "rebuild does not fit"). `layout`/`predicted_iter_s` are None when no
    split was computed (memory infeasible, or skipped by a lower bound; `reason` says).
    `tokens_per_gpu_s_rel`: relative tokens/s per GPU, 1 / (iteration s x stages).
    """

    stages: int
    layout: Layout | None
    predicted_iter_s: float | None
    fits: bool
    tokens_per_gpu_s_rel: float | None
    reason: str

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["layout"] = None if self.layout is None else self.layout.to_megatron()
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any], num_chunks: int = 1) -> "RepackCandidate":
        layout = None if d["layout"] is None else Layout.parse(d["layout"], num_chunks=num_chunks)
        return cls(stages=d["stages"], layout=layout, predicted_iter_s=d["predicted_iter_s"],
                   fits=d["fits"], tokens_per_gpu_s_rel=d["tokens_per_gpu_s_rel"], reason=d["reason"])


@dataclass
class RepackPlan:
    """A repack decision (data: `to_dict`/`from_dict` round-trip exactly; `str` reads).

    When `apply` is False, `stages_after == stages_before`, `layout_after ==
    layout_before`, no moves; `saving_gpu_s`/`cost_s` and `reason` still describe the
    refused option. `released_stages` are always the highest ranks.
    `tokens_per_iteration` (per pipeline replica; None = unknown) turns the predicted
    iteration times into tokens/s and tokens per GPU-hour (`tokens_per_s`,
    `tokens_per_gpu_hour`); tokens per GPU-hour do not depend on data parallelism.
    """

    method: str
    stages_before: int
    stages_after: int
    layout_before: Layout
    layout_after: Layout
    predicted_iter_s_before: float
    predicted_iter_s_after: float
    released_stages: list[int]
    moves: list[Move]
    bytes_moved: float
    candidates: list[RepackCandidate]
    apply: bool
    reason: str
    saving_gpu_s: float
    cost_s: float
    solve_seconds: float
    tokens_per_iteration: float | None = None

    def tokens_per_s(self, after: bool) -> float | None:
        """Predicted tokens/s of one pipeline replica before or after (None: unknown)."""
        it = self.predicted_iter_s_after if after else self.predicted_iter_s_before
        return None if self.tokens_per_iteration is None or not it > 0 else self.tokens_per_iteration / it

    def tokens_per_gpu_hour(self, after: bool) -> float | None:
        """Predicted tokens per GPU-hour before or after (None: unknown)."""
        rate = self.tokens_per_s(after)
        stages = self.stages_after if after else self.stages_before
        return None if rate is None else rate * 3600.0 / stages

    def intermediate_layout(self) -> Layout:
        """`layout_after` over all `stages_before` stages, the released ones empty
        (e.g. 'Ettt|ttttt||L'; interleaved: every chunk of a released rank empty, see
        `Layout.padded`): what the live migration moves to before the rebuild."""
        return self.layout_after.padded(self.stages_before)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict (what `dynmo plan --repack --json` prints)."""
        return {
            "method": self.method, "apply": self.apply, "reason": self.reason,
            "stages_before": self.stages_before, "stages_after": self.stages_after,
            "num_chunks": self.layout_before.num_chunks,
            "layout_before": self.layout_before.to_megatron(),
            "layout_after": self.layout_after.to_megatron(),
            "intermediate_layout": self.intermediate_layout().to_megatron(),
            "predicted_iter_s_before": self.predicted_iter_s_before,
            "predicted_iter_s_after": self.predicted_iter_s_after,
            "released_stages": list(self.released_stages),
            "moves": [asdict(m) for m in self.moves], "bytes_moved": self.bytes_moved,
            "candidates": [c.to_dict() for c in self.candidates],
            "saving_gpu_s": self.saving_gpu_s, "cost_s": self.cost_s,
            "solve_seconds": self.solve_seconds, "tokens_per_iteration": self.tokens_per_iteration,
            **{f"{name}_{when}": getattr(self, name)(when == "after")
               for name in ("tokens_per_s", "tokens_per_gpu_hour") for when in ("before", "after")},
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RepackPlan":
        """Inverse of `to_dict` (`intermediate_layout` is derived, not read).

        Raises:
            ProblemError: `d` is not a repack plan dict.
        """
        try:
            v = d.get("num_chunks", 1)
            return cls(
                method=d["method"], stages_before=d["stages_before"], stages_after=d["stages_after"],
                layout_before=Layout.parse(d["layout_before"], num_chunks=v),
                layout_after=Layout.parse(d["layout_after"], num_chunks=v),
                predicted_iter_s_before=d["predicted_iter_s_before"],
                predicted_iter_s_after=d["predicted_iter_s_after"],
                released_stages=list(d["released_stages"]), moves=[Move(**m) for m in d["moves"]],
                bytes_moved=d["bytes_moved"],
                candidates=[RepackCandidate.from_dict(c, v) for c in d["candidates"]],
                apply=d["apply"], reason=d["reason"], saving_gpu_s=d["saving_gpu_s"],
                cost_s=d["cost_s"], solve_seconds=d["solve_seconds"],
                tokens_per_iteration=d.get("tokens_per_iteration"))
        except (KeyError, TypeError, AttributeError) as e:
            raise ProblemError(f"not a repack plan dict ({type(e).__name__}: {e})") from e

    def __str__(self) -> str:
        return _render(self)


# ---- helpers ------------------------------------------------------------------------------
def _at_most(a: float, b: float) -> bool:
    return a <= b + REL_TOL * abs(b)


def _better(a: float, b: float) -> bool:
    """a < b by more than the tolerance (so near-ties keep the earlier, smaller K)."""
    return a < b - REL_TOL * abs(b)


def flow_shop_model(problem: BalanceProblem, layout: Layout) -> float:
    """The default `IterationModel`: the balancers' 1F1B formula over stage loads
    (`metrics.predicted_iteration_s`; no communication)."""
    return metrics.predicted_iteration_s(metrics.stage_loads(problem, layout), problem.num_microbatches,
                                         problem.num_chunks)


def _per_gpu(iter_s: float, stages: int) -> float | None:
    value = 1.0 / (iter_s * stages) if iter_s > 0 else math.inf
    return value if math.isfinite(value) else None


@dataclass(frozen=True)
class _LowerBound:
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
    def of(cls, problem: BalanceProblem) -> "_LowerBound":
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
        fit = _with_margin(sub, criteria.memory_margin)
    except InfeasibleError as e:  # a survivor's extras alone
        return RepackCandidate(k, None, None, False, None, f"does not fit (caps / {scale:g}): {e}")
    try:
        layout = (_closest_optimal(fit, problem.current) if problem.num_chunks == 1
                  else solve_exact(fit))
    except InfeasibleError:
        return RepackCandidate(k, None, None, False, None, "does not fit: no split keeps every "
                               f"stage's memory x {scale:g} within its cap")
    iter_s = model(sub, layout)
    return RepackCandidate(k, layout, iter_s, True, _per_gpu(iter_s, k), "fits memory")


def _bounds_apply(problem: BalanceProblem, model: IterationModel) -> bool:
    """Whether `_LowerBound` bounds `model`: the default formula on a plain pipeline."""
    return problem.num_chunks == 1 and model is flow_shop_model


def _within(cand: RepackCandidate, limit: float, slow: str) -> RepackCandidate:
    """`cand`, refused when its predicted iteration exceeds `limit` (max_slowdown)."""
    if cand.fits and not _at_most(cand.predicted_iter_s, limit):
        return replace(cand, fits=False, reason=f"too slow: {cand.predicted_iter_s:.4g} s {slow}")
    return cand


_REBUILD = "rebuild does not fit: "
_SPLIT = "split chosen for the rebuild, the fastest one would not fit it: "


def _segment_table(problem: BalanceProblem, fit: BalanceProblem, s: int) -> tuple[np.ndarray, np.ndarray]:
    """Stage s of `fit` holding layers [i, j): (load, admissible) as (n+1) x (n+1) arrays.
    Admissible: at least min_layers, the steady memory within `fit`'s cap (the solver's
    test) and the live rebuild within the survivor's cap (`_rebuild_overflow`'s)."""
    i, j = np.ogrid[:fit.num_layers + 1, :fit.num_layers + 1]
    mem, cost = fit.memory_prefix, fit.cost_prefix
    state = np.concatenate(([0.0], np.cumsum(problem.move_bytes_arr)))
    fixed = metrics.repack_rebuild_extras(problem, fit)[s]
    cap = float(problem.rank_capacity_arr[s]) + problem.mem_tol
    ok = ((j - i >= fit.min_layers_per_stage)
          & (mem[None, :] <= mem[:, None] + ((fit.capacity_arr[s] - fit.extras_memory_arr[s]) + fit.mem_tol))
          & (fixed + 2 * (state[None, :] - state[:, None]) <= cap))
    return fit.extras_cost_arr[s] + (cost[None, :] - cost[:, None]), ok


def _rebuild_split(problem: BalanceProblem, fit: BalanceProblem) -> Layout | None:
    """Plain pipelines: the min-max split of `fit` (K stages, steady caps with the margin)
    among those whose live rebuild fits too, tie-broken as `_closest_optimal` (fewest
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
    return None if _rebuild_overflow(problem, layout) else layout  # rounding guard


def _admit(problem: BalanceProblem, k: int, criteria: RepackCriteria, model: IterationModel,
           limit: float, slow: str) -> RepackCandidate:
    """Solve k (`_candidate`), bound its time (`_within`), then check the live rebuild
    (`_rebuild_overflow`). When the solver's split overflows it, a plain pipeline takes
    the best split that fits the rebuild too (`_rebuild_split`) if that one is within
    max_slowdown; otherwise k is refused ("rebuild does not fit: ...") and the scans go
    on to another K. Interleaved: checked, no other split searched."""
    cand = _within(_candidate(problem, k, criteria, model), limit, slow)
    why = _rebuild_overflow(problem, cand.layout) if cand.fits else ""
    if not why:
        return cand
    refused = replace(cand, fits=False, reason=_REBUILD + why)
    if problem.num_chunks > 1:
        return refused
    sub = shrink_problem(problem, k)
    alt = _rebuild_split(problem, _with_margin(sub, criteria.memory_margin))
    if alt is None:
        return refused
    iter_s = model(sub, alt)
    other = _within(RepackCandidate(k, alt, iter_s, True, _per_gpu(iter_s, k), ""), limit, slow)
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
                most_gpu_s is None or _better(c.predicted_iter_s * c.stages, most_gpu_s)):
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
    lower = _LowerBound.of(problem)
    out: list[RepackCandidate] = []
    for k in range(criteria.min_stages, problem.num_ranks):
        if _bounds_apply(problem, model) and not _at_most(lower(k), limit):
            out.append(_skipped(k, f"even its lower bound {lower(k):.4g} s {slow}"))
            continue
        cand = _admit(problem, k, criteria, model, limit, slow)
        if cand.fits:
            cand.reason = _fits_reason(cand, f"fits: {_ratio(cand.predicted_iter_s, iter_now)} of "
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
    lower = _LowerBound.of(problem)
    plain = _bounds_apply(problem, model)
    limit = criteria.max_slowdown * iter_now
    slow = f"exceeds max_slowdown {criteria.max_slowdown:g} x current {iter_now:.4g} s"
    out: list[RepackCandidate] = []
    for k in range(criteria.min_stages, p):
        if plain and not _better(k * lower.total(k) * (1 - REL_TOL), best_value):
            break
        if plain and not _better(k * lower(k), best_value):
            out.append(_skipped(k, f"even its lower bound {lower(k):.4g} s x {k} GPUs does not beat "
                                   f"{best_value:.4g} GPU-s/iter"))
            continue
        cand = _admit(problem, k, criteria, model, limit, slow)
        if cand.fits:
            value = cand.predicted_iter_s * k
            if _better(value, best_value):
                best_value, best = value, cand
            cand.reason = _fits_reason(cand, f"fits: {value:.4g} GPU-s/iter (current {iter_now * p:.4g})")
        out.append(cand)
    return out, best


def _ratio(a: float, b: float) -> str:
    return f"x{a / b:.3f}" if b > 0 else "x-"


# ---- the decision ---------------------------------------------------------------------
@dataclass(frozen=True)
class _Verdict:
    apply: bool
    reason: str
    saving_gpu_s: float
    cost_s: float


def _peak_problem(problem: BalanceProblem, intermediate: Layout) -> str:
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


def _rebuild_overflow(problem: BalanceProblem, layout: Layout) -> str:
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


def _judge(problem: BalanceProblem, layout: Layout, iter_after: float, iter_now: float,
           bytes_moved: float, criteria: RepackCriteria, gate: GateConfig | None) -> _Verdict:
    """The gate. Cost: every one of the P stages stalls for
    cost_s = bytes_moved / bandwidth + rebuild_s. Saving, in GPU-seconds over the
    horizon h = iterations until the next event: the h iterations take P x h x before
    GPU-seconds now and K x h x after repacked, so

        saving = h x (P x before - K x after)
               = (P - K) x h x before  -  K x h x (after - before).

    Released GPUs count at the current pace (the time they would have spent on those h
    iterations); a slowdown is charged to every survivor, and a speed-up (less fill and
    drain on fewer stages) is credited the same way. Apply iff
    saving > margin x P x cost_s (all P GPUs stall for cost_s). With no gate, apply (the
    criteria already hold). Either way the migration's transient peak must fit every
    stage's cap, and so must the rebuild's (`_rebuild_overflow`; `plan_repack` already
    skipped a K whose rebuild overflows, `first_fit_repack` is refused here).

    Why not (P - K) x h x after - K x h x max(0, after - before), the form first
    proposed: it counts released GPUs at the new pace and ignores speed-ups, so it
    overstates the saving by (P - K) x h x (after - before) when the repack is slower and
    understates it by P x h x (before - after) when it is faster. The GPU-seconds the
    same h iterations occupy is what the cluster pays for."""
    p, k = problem.num_ranks, layout.num_ranks
    peak = _peak_problem(problem, layout.padded(p)) or _rebuild_overflow(problem, layout)
    if gate is None:
        cost = criteria.rebuild_s
        if peak:
            return _Verdict(False, f"refused: {peak}", 0.0, cost)
        return _Verdict(True, "no gate given: the criteria hold (cost and horizon not weighed)",
                        0.0, cost)
    h = gate.iterations_until_next_event
    cost = bytes_moved / gate.bandwidth_bytes_per_s + criteria.rebuild_s
    saving = h * (p * iter_now - k * iter_after)
    if peak:
        return _Verdict(False, f"refused: {peak}", saving, cost)
    apply = saving > gate.margin * p * cost
    numbers = (f"saves {saving:.4g} GPU-s over {h} iterations vs {p} GPUs x {cost:.4g} s stall "
               f"({human_bytes(bytes_moved)} moved + {criteria.rebuild_s:g} s rebuild) "
               f"x margin {gate.margin:g}")
    return _Verdict(apply, ("pays: " if apply else "does not pay: ") + numbers, saving, cost)


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
    verdict = _judge(problem, layout, chosen.predicted_iter_s, iter_now, moved, criteria, gate)
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
    through the gate (see `_judge`: apply iff h x (P x before - K x after) >
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
    transient peaks of the migration and of the rebuild are still checked, `_judge`).
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
    cand = RepackCandidate(k, layout, iter_s, True, _per_gpu(iter_s, k),
                           f"merged stages {groups}; {_ratio(iter_s, iter_now)} of current "
                           "(time not considered)")
    return _assemble(problem, "first_fit", cand, [cand], criteria, None, "", started, iter_now)


# ---- text ----------------------------------------------------------------------------------
def _fmt(value: float | None, spec: str = ".4g") -> str:
    return "-" if value is None else format(value, spec)


def _tokens_line(plan: RepackPlan) -> str:
    """Predicted tokens/s (one pipeline replica) and tokens per GPU-hour, before -> after."""
    if plan.tokens_per_iteration is None:
        return "tokens/s and tokens per GPU-hour: unknown (give the tokens per iteration)"
    rate = [plan.tokens_per_s(a) for a in (False, True)]
    hour = [plan.tokens_per_gpu_hour(a) for a in (False, True)]
    return (f"predicted tokens/s per replica {_fmt(rate[0], ',.0f')} -> {_fmt(rate[1], ',.0f')}; "
            f"tokens per GPU-hour {_fmt(hour[0], ',.0f')} -> {_fmt(hour[1], ',.0f')}")


def _render(plan: RepackPlan) -> str:
    """Header, candidate table, moves, decision."""
    if plan.apply:
        head = (f"repack ({plan.method}): {plan.stages_before} -> {plan.stages_after} stages, "
                f"releases stage(s) {plan.released_stages}: {plan.layout_before} -> "
                f"{plan.layout_after} (via {plan.intermediate_layout()})")
    else:
        head = f"repack ({plan.method}): keep {plan.stages_before} stages ({plan.layout_before})"
    now = plan.predicted_iter_s_before
    lines = [head, f"current: {plan.stages_before} stages, predicted iteration {now:.4g} s, "
                   f"tokens/s/GPU (rel) {_fmt(_per_gpu(now, plan.stages_before))}",
             _tokens_line(plan)]
    if plan.candidates:
        lines.append(f"{'stages':>6}  {'iter s':>10}  {'vs now':>7}  {'tok/s/GPU':>10}  "
                     f"{'fits':<4}  layout / reason")
    for c in plan.candidates:
        vs = "-" if c.predicted_iter_s is None else _ratio(c.predicted_iter_s, now)
        layout = "" if c.layout is None else f"{c.layout}  "
        lines.append(f"{c.stages:>6}  {_fmt(c.predicted_iter_s):>10}  {vs:>7}  "
                     f"{_fmt(c.tokens_per_gpu_s_rel):>10}  {'yes' if c.fits else 'no':<4}  "
                     f"{layout}{c.reason}")
    if plan.moves:
        lines.append(f"moves: {len(plan.moves)} layer(s), {human_bytes(plan.bytes_moved)}")
        lines += [f"  layer {m.layer}: stage {m.src} -> {m.dst} ({human_bytes(m.bytes)})"
                  for m in plan.moves]
    lines.append(f"decision: {'REPACK' if plan.apply else 'keep'} - {plan.reason}  "
                 f"[{plan.solve_seconds * 1e3:.1f} ms]")
    return "\n".join(lines)
