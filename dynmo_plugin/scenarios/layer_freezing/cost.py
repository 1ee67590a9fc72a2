"""Progressive layer freezing, front layers first (Egeria-like).

Provenance: Egeria (Wang et al., EuroSys'23) freezes layers front to back as their
training plasticity converges; the DynMo paper compares against it. A frozen prefix
(embedding included) runs no backward at all (autograd stops at the first trainable
layer; measured here on CPU: dynamism-on-cpu.md), keeps its forward, and its gradients
leave the all-reduce. Egeria's freezing decisions depend on the loss curve; we model
them as a schedule: the first freeze at `start`, then every `interval` iterations the
next `fraction_per_step` of the layers, up to `max_frozen_fraction` (our choices,
tuned to freeze three quarters of the model within the run).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dynmo_plugin.errors import UserError
from dynmo_plugin.sim.gpt import LayerLoad
from dynmo_plugin.sim.trajectory import Scenario, World, step_points

__all__ = ["Freezing"]


@dataclass(frozen=True, kw_only=True)
class Freezing(Scenario):
    """start, interval: iterations of the first freeze and between freezes;
    fraction_per_step: share of the layers frozen per step; max_frozen_fraction: cap."""

    start: int = 2000
    interval: int = 1000
    fraction_per_step: float = 0.125
    max_frozen_fraction: float = 0.75

    name = "layer_freezing"
    rng_key = "freezing"  # its random stream's v1 key: results reproduce across the rename
    world = World(dp=30, pp=24)
    paper_baseline = "static"

    def __post_init__(self) -> None:
        super().__post_init__()
        for f in ("fraction_per_step", "max_frozen_fraction"):
            if not 0 < getattr(self, f) <= 1:
                raise UserError(f"freezing: {f} must be in (0, 1], got {getattr(self, f)}")

    def change_points(self, iterations: int) -> list[int]:
        steps = int(np.ceil(self.max_frozen_fraction / self.fraction_per_step))
        return [p for p in step_points(self.start, self.interval, iterations)][:steps]

    def frozen_layers(self, iteration: int) -> int:
        done = sum(1 for p in self.change_points(iteration + 1) if p <= iteration)
        frac = min(self.max_frozen_fraction, done * self.fraction_per_step)
        return int(round(frac * self.num_layers))

    def load(self, iteration: int) -> LayerLoad:
        load = LayerLoad.dense(self.num_layers)
        load.backward[: self.frozen_layers(iteration)] = 0.0
        return load
