"""What the ranks a repack frees do: leave the job (release) or stay and grow data
parallelism (grow) — PipeTransformer's choice.

A repack from P to K pipeline stages frees (P - K) x tp x dp ranks. Released, they go
back to the cluster and the job runs on K x tp x dp ranks. Grown, every rank stays:
the pipeline has K stages and P x dp / K data-parallel replicas, the global batch is
unchanged (its micro-batches are split over the replicas, so each replica runs
m x dp / dp' of them), and the iteration gets shorter at the price of more GPUs.

Which is better depends on what the user optimises, the planner's repack objective:
* `min_stages` protects tokens/s (it never trades more than `max_slowdown` of it):
  `auto` grows when growing predicts more tokens/s than releasing;
* `throughput_per_gpu` maximises tokens per GPU-hour: `auto` grows when growing
  predicts more tokens per GPU-hour (rare: the pipeline bubble and the all-reduce
  make a replica less than proportionally faster).

Both options are timed by the same iteration model as the repack (the simulator's
iteration on the profiled problem, `sim.problem_model`): the caller passes the
release time (the plan's) and the grow time (the same layout at DP' with m' micro-
batches). Pure: no torch, no megatron.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Callable, Optional

from dynmo_plugin.balancing.problem import BalanceProblem
from dynmo_plugin.balancing.repack_throughput import IterationModel
from dynmo_plugin.balancing.shrink import shrink_problem
from dynmo_plugin.layout import Layout

__all__ = ["FREED_MODES", "FreedChoice", "choose_freed", "grow_iteration_s", "grow_refusal",
           "grown_dp"]

FREED_MODES = ("release", "grow", "auto")
MEASURE = {"min_stages": "tokens_per_s", "throughput_per_gpu": "tokens_per_gpu_hour"}


def grown_dp(stages_before: int, stages_after: int, dp: int) -> Optional[int]:
    """The data-parallel size that keeps every rank after a P -> K repack, or None
    when the ranks do not split evenly into K stages (P x dp not a multiple of K)."""
    if stages_after >= stages_before or (stages_before * dp) % stages_after:
        return None
    return stages_before * dp // stages_after


def grow_refusal(stages_before: int, stages_after: int, dp: int,
                 num_microbatches: int) -> Optional[str]:
    """One line saying why the freed ranks cannot grow DP (None: they can).
    `num_microbatches`: per replica now; the global batch holds `num_microbatches x dp`."""
    new = grown_dp(stages_before, stages_after, dp)
    if new is None:
        return (f"cannot grow data parallelism after {stages_before} -> {stages_after} stages: "
                f"{stages_before * dp} ranks per tensor-parallel group do not split into "
                f"{stages_after} stages; use repack.freed: release")
    total = num_microbatches * dp
    if total % new:
        return (f"cannot grow data parallelism {dp} -> {new}: the global batch's {total} "
                f"micro-batches do not split over {new} replicas; make the global batch size a "
                f"multiple of micro-batch size x {new}, or use repack.freed: release")
    return None


def grow_iteration_s(problem: BalanceProblem, layout: Layout, dp: int,
                     model_at: Callable[[int], IterationModel]) -> Optional[float]:
    """Predicted iteration time of `layout` (K stages) when the freed ranks grow DP:
    the problem shrunk to K stages (as the repack planner times it) with the global
    batch's micro-batches split over the grown replicas, timed by `model_at(dp')` (the
    iteration model at that DP: the all-reduce grows with it). None: cannot grow.
    `problem.num_microbatches` is per replica at the current `dp`.

    A profiled problem holds the optimizer step spread over micro-batches
    (`profile_problem.step_shares`), and at m' this counts m' of them: the caller spreads
    it over m' with the plain optimizer (every replica still steps all its parameters)
    and over the profiled m with the distributed one (each replica's shard shrinks by
    dp / dp' = m' / m): `controller.DynMo._freed_choice`."""
    k = layout.num_ranks
    if grow_refusal(problem.num_ranks, k, dp, problem.num_microbatches) is not None:
        return None
    new_dp = grown_dp(problem.num_ranks, k, dp)
    grown = replace(shrink_problem(problem, k),
                    num_microbatches=problem.num_microbatches * dp // new_dp)
    return model_at(new_dp)(grown, layout)


@dataclass(frozen=True)
class FreedChoice:
    """The decision and both predictions (plain data: broadcast and reported as is).
    `ranks_*`: GPUs in use after each option; `iter_s_grow`/`dp_grow` are None when
    growing is impossible (`reason` says why)."""

    mode: str
    objective: str
    choice: str
    reason: str
    dp_before: int
    dp_grow: Optional[int]
    ranks_release: int
    ranks_grow: int
    iter_s_release: float
    iter_s_grow: Optional[float]
    tokens_per_iteration: float

    def tokens_per_s(self, option: str) -> Optional[float]:
        it = self.iter_s_grow if option == "grow" else self.iter_s_release
        return None if it is None or not it > 0 else self.tokens_per_iteration / it

    def tokens_per_gpu_hour(self, option: str) -> Optional[float]:
        rate = self.tokens_per_s(option)
        ranks = self.ranks_grow if option == "grow" else self.ranks_release
        return None if rate is None else rate * 3600.0 / ranks

    def to_dict(self) -> dict:
        out = asdict(self)
        for option in ("release", "grow"):
            out[f"tokens_per_s_{option}"] = self.tokens_per_s(option)
            out[f"tokens_per_gpu_hour_{option}"] = self.tokens_per_gpu_hour(option)
        return out

    def line(self) -> str:
        """The log line: which one, why, and the predicted numbers of both."""
        def fmt(v: Optional[float]) -> str:
            return "-" if v is None else f"{v:,.0f}"
        both = "; ".join(f"{o} on {r} GPUs: {fmt(self.tokens_per_s(o))} tokens/s, "
                         f"{fmt(self.tokens_per_gpu_hour(o))} tokens/GPU-hour"
                         for o, r in (("release", self.ranks_release), ("grow", self.ranks_grow)))
        return f"freed ranks: {self.choice} ({self.reason}) - predicted {both}"


def choose_freed(mode: str, objective: str, *, stages_before: int, stages_after: int,
                 ranks_per_stage: int, dp: int, num_microbatches: int, iter_s_release: float,
                 iter_s_grow: Optional[float], tokens_per_iteration: float,
                 unsupported: Optional[str] = None) -> FreedChoice:
    """Release or grow after a P -> K repack (module docstring). `mode` "release" and
    "grow" are the user's word (grow still needs an even split: else the choice is
    "refuse" and `reason` is the one line to show); "auto" compares the objective's
    measure and grows only when it is strictly better. `ranks_per_stage`: each stage's
    TP x CP x DP ranks before the repack (what the GPU counts are multiples of).
    `unsupported`: why this run cannot grow at all (refused like an uneven split)."""
    if mode not in FREED_MODES:
        raise ValueError(f"freed must be one of {', '.join(FREED_MODES)}, got {mode!r}")
    refusal = unsupported or grow_refusal(stages_before, stages_after, dp, num_microbatches)
    new_dp = None if refusal else grown_dp(stages_before, stages_after, dp)
    base = dict(mode=mode, objective=objective, dp_before=dp, dp_grow=new_dp,
                ranks_release=ranks_per_stage * stages_after,
                ranks_grow=ranks_per_stage * stages_before,
                iter_s_release=iter_s_release, iter_s_grow=None if refusal else iter_s_grow,
                tokens_per_iteration=tokens_per_iteration)
    if mode == "release":
        return FreedChoice(choice="release", reason="repack.freed: release", **base)
    if refusal:
        return FreedChoice(choice="refuse" if mode == "grow" else "release", reason=refusal, **base)
    if mode == "grow":
        return FreedChoice(choice="grow", reason=f"repack.freed: grow, DP {dp} -> {new_dp}", **base)
    measure = MEASURE.get(objective, "tokens_per_s")
    probe = FreedChoice(choice="release", reason="", **base)
    grow, release = getattr(probe, measure)("grow"), getattr(probe, measure)("release")
    if grow is None or release is None:  # a forced layout: nothing was profiled
        return FreedChoice(choice="release", reason="auto without predictions: release", **base)
    better = grow > release
    what = measure.replace("_", " ").replace("tokens per s", "tokens/s")
    reason = (f"auto, objective {objective}: {what} {'higher' if better else 'not higher'} "
              f"when growing DP {dp} -> {new_dp}")
    return FreedChoice(choice="grow" if better else "release", reason=reason, **base)
