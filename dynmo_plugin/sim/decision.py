"""Modelled decision time: how long a balancer is assumed to think, in simulated seconds.

Why modelled and not measured: a campaign's result must be a function of its
configuration alone. The wall-clock time a balancer takes in this process varies from
run to run (and with the load other processes put on the machine), so charging it to
simulated time made two identical campaigns differ. Instead each balancer has a cost
formula in the number of decoder layers n and pipeline stages p:

    seconds = fixed_s + per_unit_s * work(n, p)

Default constants (`DEFAULT_DECISION_COSTS`), fitted to medians of `solve(...)` on the
project's 2-core CPU machine (2026-11-22; log-normal costs, current layout uniform,
n/p from 16/4 to 1000/128); within ~2x of those measurements, which is all the
overhead accounting needs (a decision costs milliseconds against iterations of
seconds):

| balancer | work(n, p) | fixed_s | per_unit_s | why this shape |
|---|---|---|---|---|
| exact | p * log2(n + 1) | 1.5 ms | 40 us | O(log n) feasibility tests of O(p) numpy calls each |
| partition, parameters | n^2 * p | 0 | 0.7 us | DeepSpeed's O(n^2 p) pure-Python DP |
| diffusion | p | 0.2 ms | 6 us | a few rounds of p neighbour exchanges from a near-balanced start |
| uniform | - | 0 | 0 | no computation |

Not modelled: partition's fallback to `exact` when its layout breaks a memory cap,
and diffusion's extra rounds from a badly imbalanced start. Give a `DecisionTimeModel`
with other `DecisionCost`s to change any of it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Mapping

from dynmo_plugin.errors import UserError

__all__ = ["DecisionCost", "DecisionTimeModel", "DEFAULT_DECISION_COSTS",
           "stages_log2_layers", "layers_squared_stages", "stages_only"]


def stages_log2_layers(layers: int, stages: int) -> float:
    """Work of `exact`: p * log2(n + 1)."""
    return stages * math.log2(layers + 1)


def layers_squared_stages(layers: int, stages: int) -> float:
    """Work of DeepSpeed's partition_balanced: n^2 * p."""
    return float(layers * layers * stages)


def stages_only(layers: int, stages: int) -> float:
    """Work of `diffusion` (and of no-op balancers): p."""
    return float(stages)


@dataclass(frozen=True, kw_only=True)
class DecisionCost:
    """One balancer's decision time: fixed_s + per_unit_s * work(layers, stages).

    Raises:
        UserError: a negative or non-finite constant.
    """

    fixed_s: float
    per_unit_s: float
    work: Callable[[int, int], float] = stages_only

    def __post_init__(self) -> None:
        for name in ("fixed_s", "per_unit_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise UserError(f"DecisionCost.{name} must be a finite number of seconds >= 0, "
                                f"got {value!r}")

    def seconds(self, layers: int, stages: int) -> float:
        return self.fixed_s + self.per_unit_s * self.work(layers, stages)


_PARTITION = DecisionCost(fixed_s=0.0, per_unit_s=0.7e-6, work=layers_squared_stages)
DEFAULT_DECISION_COSTS: Mapping[str, DecisionCost] = MappingProxyType({
    "exact": DecisionCost(fixed_s=1.5e-3, per_unit_s=40e-6, work=stages_log2_layers),
    "partition": _PARTITION,
    "parameters": _PARTITION,
    "diffusion": DecisionCost(fixed_s=0.2e-3, per_unit_s=6e-6, work=stages_only),
    "uniform": DecisionCost(fixed_s=0.0, per_unit_s=0.0),
})


@dataclass(frozen=True, kw_only=True)
class DecisionTimeModel:
    """Simulated seconds of one balancing decision, per balancer name (module docstring).

    costs: balancer name -> DecisionCost; default `DEFAULT_DECISION_COSTS`.
    """

    costs: Mapping[str, DecisionCost] = field(default_factory=lambda: dict(DEFAULT_DECISION_COSTS))

    def cost_of(self, method: str) -> DecisionCost:
        """The cost formula of `method`; looked up once per planner, so a gap fails early.

        Raises:
            UserError: `method` has no DecisionCost.
        """
        cost = self.costs.get(method)
        if cost is None:
            raise UserError(f"no decision-time model for balancer {method!r} (modelled: "
                            f"{', '.join(sorted(self.costs))}); add a DecisionCost for it to "
                            "DecisionTimeModel(costs=...)")
        return cost

    def seconds(self, method: str, layers: int, stages: int) -> float:
        """Modelled seconds for `method` to balance `layers` layers over `stages` stages."""
        return self.cost_of(method).seconds(layers, stages)
