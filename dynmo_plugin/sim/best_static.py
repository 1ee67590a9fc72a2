"""The best static choice: the bar DynMo is measured against (issue 38).

What a careful user can do without DynMo, decided once before training and never
changed: tune the split (`exact` on the initial model's costs), size the pipeline (the
live repack decision on the initial model: `plan_repack`, K <= pp stages) and use the
GPUs that frees as data parallelism from the start (the grow arithmetic of
`balancing.grow`: P x dp / K replicas, the global batch unchanged, each replica running
m x dp / dp' micro-batches). The candidates, each simulated over the whole run:

* uniform: Megatron's split on pp stages, dp replicas;
* tuned: the exact split of the initial model on pp stages, dp replicas;
* packed: the repack decision's K stages, dp replicas (the freed GPUs released);
* grown_K: K stages on P x dp / K replicas (every GPU kept), for every K < P into which
  the ranks and the global batch split evenly (`grow.grow_refusal`) and the layers fit
  in memory: the repack decision's own layout at its K, the exact split of the initial
  model on K stages otherwise. All such K, not only the decision's: the decision sizes
  for release (no slower on fewer GPUs) and its K need not split evenly (6 of 8 stages
  at dp 8 does not), while grown, fewer stages can be faster.

`pick` returns the best candidate by one objective: "tokens_per_s" (every candidate
uses at most pp x dp GPUs, so the pick is never below uniform or tuned in tokens per
GPU-hour either) or "tokens_per_gpu_hour". Which candidate wins is chosen with the
whole run in view: a bar at least as high as any one static rule. Pure: no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from dynmo_plugin.balancing.grow import grow_refusal, grown_dp
from dynmo_plugin.errors import UserError
from dynmo_plugin.layout import Layout

__all__ = ["OBJECTIVES", "StaticChoice", "pick", "static_choices"]

OBJECTIVES = ("tokens_per_s", "tokens_per_gpu_hour")


@dataclass(frozen=True)
class StaticChoice:
    """One static configuration and its run (`summary`: a campaign `RunSummary`)."""

    name: str
    layout: Layout
    dp: int
    num_microbatches: int
    summary: Any

    @property
    def gpus(self) -> int:
        return self.layout.num_stages * self.dp

    def measure(self, objective: str) -> float:
        s = self.summary
        return s.tokens_per_s if objective == "tokens_per_s" else s.tokens_per_gpu_s * 3600.0

    def describe(self) -> str:
        return (f"{self.name}: {self.layout.num_stages} stages x dp {self.dp}, "
                f"{self.num_microbatches} micro-batches per replica ({self.gpus} GPUs)")


RunFixed = Callable[[Layout, int, int], Any]


def static_choices(*, uniform: Layout, tuned: Layout, packed: Layout, dp: int,
                   num_microbatches: int, run_fixed: RunFixed,
                   split_at: Callable[[int], Layout | None]) -> dict[str, StaticChoice]:
    """Every candidate (module docstring), simulated by `run_fixed(layout, dp, m)`;
    `split_at(k)`: the exact split of the initial model on k stages (None: infeasible)."""
    m = num_microbatches

    def choice(name: str, layout: Layout, d: int, mb: int) -> StaticChoice:
        return StaticChoice(name, layout, d, mb, run_fixed(layout, d, mb))

    out = {"uniform": choice("uniform", uniform, dp, m), "tuned": choice("tuned", tuned, dp, m)}
    p, k = uniform.num_stages, packed.num_stages
    if k < p:
        out["packed"] = choice("packed", packed, dp, m)
    for size in range(1, p):
        if grow_refusal(p, size, dp, m) is not None:
            continue
        layout = packed if size == k else split_at(size)
        if layout is not None:
            new = grown_dp(p, size, dp)
            out[f"grown_{size}"] = choice(f"grown_{size}", layout, new, m * dp // new)  # type: ignore[operator]
    return out


def pick(choices: dict[str, StaticChoice], objective: str = "tokens_per_s") -> StaticChoice:
    """The best of `choices` by `objective`; a tie goes to the earlier (simpler) one.

    Raises:
        UserError: an unknown objective or no choices.
    """
    if objective not in OBJECTIVES:
        raise UserError(f"best static objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    if not choices:
        raise UserError("best static: no candidate configurations")
    best = None
    for c in choices.values():
        if best is None or c.measure(objective) > best.measure(objective):
            best = c
    return best  # type: ignore[return-value]
