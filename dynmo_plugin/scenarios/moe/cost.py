"""Mixture of Experts with drifting routing imbalance.

Provenance: the DynMo paper's MoE case (128 GPUs, 8-way DP x 16-way PP) reports about
25% routing imbalance. With expert parallelism the busiest expert sets a layer's MLP
time, so a layer's MLP costs (1 + imbalance_l) times the balanced expert MLP. Each
layer's imbalance is redrawn every `drift_every` iterations (routing drifts as the
router trains) from a gamma distribution of mean `mean_imbalance` and coefficient of
variation `cv` (our choices; the paper gives the mean only).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dynmo_plugin.errors import UserError
from dynmo_plugin.sim.gpt import LayerLoad
from dynmo_plugin.sim.trajectory import Scenario, World, rng_for, step_points

__all__ = ["MoE", "gamma_imbalance"]


def gamma_imbalance(rng: np.random.Generator, mean: float, cv: float, n: int) -> np.ndarray:
    """n non-negative draws of the given mean and coefficient of variation."""
    if mean <= 0:
        return np.zeros(n)
    k = 1.0 / cv ** 2
    return rng.gamma(k, mean / k, n)


@dataclass(frozen=True, kw_only=True)
class MoE(Scenario):
    """mean_imbalance: busiest-expert excess (paper ~0.25); cv: its spread across
    layers; drift_every: iterations between routing changes."""

    mean_imbalance: float = 0.25
    cv: float = 0.6
    drift_every: int = 1000

    name = "moe"
    world = World(dp=8, pp=16)
    paper_baseline = "static_best"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mean_imbalance < 0 or self.cv <= 0:
            raise UserError(f"moe: need mean_imbalance >= 0 and cv > 0, got "
                            f"{self.mean_imbalance}, {self.cv}")

    def change_points(self, iterations: int) -> list[int]:
        return step_points(self.drift_every, self.drift_every, iterations)

    def load(self, iteration: int) -> LayerLoad:
        point = self._last_point(iteration, self.change_points(iteration + 1))
        rng = rng_for(self.seed, self.rng_key, point)
        load = LayerLoad.dense(self.num_layers)
        imbalance = gamma_imbalance(rng, self.mean_imbalance, self.cv, self.num_layers)
        return LayerLoad(attn_linear=load.attn_linear, mlp=1.0 + imbalance,
                         attn_core=load.attn_core, backward=load.backward, knob="expert_load",
                         knob_value=1.0 + imbalance)
