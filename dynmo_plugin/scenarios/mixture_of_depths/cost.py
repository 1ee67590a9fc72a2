"""Mixture of Depths: routed layers process a dynamic subset of tokens.

Provenance: Mixture-of-Depths (Raposo et al. 2024) routes a capacity share of the
tokens (12.5% in their best setting) through every other layer, the rest skip it. The
DynMo paper's MoD case (128 GPUs, 8 x 16) reports about 18% routing imbalance: the
tokens a routed layer actually processes deviate from capacity by a mean of
`mean_imbalance`, redrawn every `drift_every` iterations. Linear work scales with
tokens, attention among the selected tokens with their square.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dynmo_plugin.errors import UserError
from dynmo_plugin.sim.gpt import LayerLoad
from dynmo_plugin.sim.trajectory import Scenario, World, rng_for, step_points
from dynmo_plugin.scenarios.moe.cost import gamma_imbalance

__all__ = ["MoD"]


@dataclass(frozen=True, kw_only=True)
class MoD(Scenario):
    """capacity: token share of routed layers; every: routed layer period (2 = every
    other); mean_imbalance (paper ~0.18), cv, drift_every: as in `MoE`."""

    capacity: float = 0.125
    every: int = 2
    mean_imbalance: float = 0.18
    cv: float = 0.6
    drift_every: int = 1000

    name = "mixture_of_depths"
    rng_key = "mod"  # its random stream's v1 key: results reproduce across the rename
    world = World(dp=8, pp=16)
    paper_baseline = "static_best"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.capacity <= 1 or self.every < 1:
            raise UserError(f"mod: need 0 < capacity <= 1 and every >= 1, got "
                            f"{self.capacity}, {self.every}")

    def change_points(self, iterations: int) -> list[int]:
        return step_points(self.drift_every, self.drift_every, iterations)

    def tokens(self, iteration: int) -> np.ndarray:
        point = self._last_point(iteration, self.change_points(iteration + 1))
        rng = rng_for(self.seed, self.rng_key, point)
        excess = gamma_imbalance(rng, self.mean_imbalance, self.cv, self.num_layers)
        routed = (np.arange(self.num_layers) % self.every) == self.every - 1
        share = np.minimum(1.0, self.capacity * (1.0 + excess))
        return np.where(routed, share, 1.0)

    def load(self, iteration: int) -> LayerLoad:
        t = self.tokens(iteration)
        return LayerLoad(attn_linear=t, mlp=t.copy(), attn_core=t ** 2,
                         backward=np.ones(self.num_layers), knob="tokens", knob_value=t.copy())
