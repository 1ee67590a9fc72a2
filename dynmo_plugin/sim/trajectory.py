"""What every dynamism scenario provides: per-layer work over training iterations.

A scenario is piecewise constant: its load changes only at `change_points` (a pruning
round, a freeze, a routing drift), which is when DynMo's event-triggered rebalancing
runs. Random parts are drawn from a generator seeded by (seed, scenario, iteration), so
a scenario is a pure function of its parameters.
"""
from __future__ import annotations

import zlib
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from dynmo_plugin.errors import UserError
from dynmo_plugin.sim.gpt import LayerLoad

__all__ = ["Scenario", "World", "rng_for", "step_points"]


@dataclass(frozen=True, kw_only=True)
class World:
    """Cluster shape a scenario was evaluated on in the DynMo paper."""

    dp: int
    pp: int


def rng_for(seed: int, name: str, iteration: int) -> np.random.Generator:
    """Deterministic generator for one scenario at one change point."""
    return np.random.default_rng([seed, zlib.crc32(name.encode()), iteration])


def step_points(start: int, every: int, end: int) -> list[int]:
    if every < 1:
        raise UserError(f"an event interval must be >= 1 iteration, got {every}")
    return list(range(start, end, every))


@dataclass(frozen=True, kw_only=True)
class Scenario(ABC):
    """Base of the six scenarios. num_layers: decoder layers; seed: randomness."""

    num_layers: int
    seed: int = 0

    name = "scenario"  # the scenario's one name (dynmo_plugin.scenarios.SCENARIOS)
    world = World(dp=1, pp=1)
    default_iterations = 10000
    # The DynMo paper's Figure 3 baseline for this scenario (a CampaignResult baseline):
    # "static" (same dynamism, Megatron's split), "static_best" (same dynamism, the
    # better of Megatron's and DeepSpeed's static splits) or "no_dynamism" (the dense
    # model: no early exit, dense attention).
    paper_baseline = "static"

    @property
    def rng_key(self) -> str:
        """What seeds its random draws besides `seed` (`rng_for`): its name, unless a
        scenario keeps the key of an older name so its results reproduce."""
        return self.name

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise UserError(f"{self.name}: num_layers must be >= 1, got {self.num_layers}")

    @abstractmethod
    def change_points(self, iterations: int) -> list[int]:
        """Iterations (>0, < iterations) at which the load changes."""

    @abstractmethod
    def load(self, iteration: int) -> LayerLoad:
        """Per-layer work during `iteration`."""

    def _last_point(self, iteration: int, points: list[int]) -> int:
        """The change point in force at `iteration` (0 before the first one)."""
        past = [p for p in points if p <= iteration]
        return past[-1] if past else 0
