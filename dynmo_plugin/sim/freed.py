"""What the simulated DynMo does with the ranks a repack frees: the live decision.

After an applied P -> K repack the simulator asks `balancing.grow.choose_freed` (the
function the live plugin calls) whether to release the freed ranks or grow data
parallelism, with both options timed by the simulator's own iteration: released, K
stages on dp replicas with m micro-batches each; grown, K stages on P x dp / K replicas
with m x dp / dp' micro-batches each (the global batch unchanged). Growing costs, on top
of the repack, one copy of the model state to the new replicas: the largest stage's
training state at p2p bandwidth (every new replica receives its stage in parallel).
Pure: no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from dynmo_plugin.balancing.grow import FreedChoice, choose_freed, grown_dp
from dynmo_plugin.layout import Layout

__all__ = ["FreedStep", "freed_step"]


@dataclass(frozen=True)
class FreedStep:
    """The decision and what runs after it: `dp` replicas of `num_microbatches` each."""

    choice: FreedChoice
    dp: int
    num_microbatches: int

    @property
    def grown(self) -> bool:
        return self.choice.choice == "grow"

    @property
    def refused(self) -> bool:
        """`repack.freed: grow` where growing is impossible: live, nothing moves."""
        return self.choice.choice == "refuse"


def freed_step(*, mode: str, objective: str, stages_before: int, layout_after: Layout, dp: int,
               num_microbatches: int, tokens_per_iteration: float,
               iteration_s: Callable[[int, int], float]) -> FreedStep:
    """Release or grow after a repack to `layout_after` (module docstring);
    `iteration_s(dp, m)` times `layout_after` at that data parallelism."""
    k = layout_after.num_ranks
    new = grown_dp(stages_before, k, dp)
    grow_m = num_microbatches * dp // new if new else None
    iter_grow = iteration_s(new, grow_m) if new and (num_microbatches * dp) % new == 0 else None
    choice = choose_freed(mode, objective, stages_before=stages_before, stages_after=k,
                          ranks_per_stage=dp, dp=dp, num_microbatches=num_microbatches,
                          iter_s_release=iteration_s(dp, num_microbatches),
                          iter_s_grow=iter_grow, tokens_per_iteration=tokens_per_iteration)
    if choice.choice == "grow":
        return FreedStep(choice, choice.dp_grow, grow_m)  # type: ignore[arg-type]
    return FreedStep(choice, dp, num_microbatches)
