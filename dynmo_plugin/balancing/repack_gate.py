"""The repack's gate: does releasing P - K GPUs pay for the stall of moving there?

`judge` weighs the GPU-seconds saved over the horizon against every stage stalling for
the move and the rebuild, and refuses a repack whose migration or rebuild would overflow
a cap on the way (`repack_memory`), gate or no gate.
"""
from __future__ import annotations

from dataclasses import dataclass

from dynmo_plugin.balancing.gate import GateConfig
from dynmo_plugin.balancing.problem import BalanceProblem
from dynmo_plugin.balancing.render import human_bytes
from dynmo_plugin.balancing.repack_memory import migration_overflow, rebuild_overflow
from dynmo_plugin.balancing.repack_plan import RepackCriteria
from dynmo_plugin.layout import Layout

__all__ = ["Verdict", "judge"]


@dataclass(frozen=True)
class Verdict:
    apply: bool
    reason: str
    saving_gpu_s: float
    cost_s: float


def judge(problem: BalanceProblem, layout: Layout, iter_after: float, iter_now: float,
           bytes_moved: float, criteria: RepackCriteria, gate: GateConfig | None) -> Verdict:
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
    stage's cap, and so must the rebuild's (`rebuild_overflow`; `plan_repack` already
    skipped a K whose rebuild overflows, `first_fit_repack` is refused here).

    Why not (P - K) x h x after - K x h x max(0, after - before), the form first
    proposed: it counts released GPUs at the new pace and ignores speed-ups, so it
    overstates the saving by (P - K) x h x (after - before) when the repack is slower and
    understates it by P x h x (before - after) when it is faster. The GPU-seconds the
    same h iterations occupy is what the cluster pays for."""
    p, k = problem.num_ranks, layout.num_ranks
    peak = migration_overflow(problem, layout.padded(p)) or rebuild_overflow(problem, layout)
    if gate is None:
        cost = criteria.rebuild_s
        if peak:
            return Verdict(False, f"refused: {peak}", 0.0, cost)
        return Verdict(True, "no gate given: the criteria hold (cost and horizon not weighed)",
                        0.0, cost)
    h = gate.iterations_until_next_event
    cost = bytes_moved / gate.bandwidth_bytes_per_s + criteria.rebuild_s
    saving = h * (p * iter_now - k * iter_after)
    if peak:
        return Verdict(False, f"refused: {peak}", saving, cost)
    apply = saving > gate.margin * p * cost
    numbers = (f"saves {saving:.4g} GPU-s over {h} iterations vs {p} GPUs x {cost:.4g} s stall "
               f"({human_bytes(bytes_moved)} moved + {criteria.rebuild_s:g} s rebuild) "
               f"x margin {gate.margin:g}")
    return Verdict(apply, ("pays: " if apply else "does not pay: ") + numbers, saving, cost)
