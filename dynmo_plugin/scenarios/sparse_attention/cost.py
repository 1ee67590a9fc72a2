"""Dynamic sparse attention with a per-layer density.

Provenance: the DynMo paper's sparse-attention case (720 GPUs, 30 x 24) uses dynamic
(hash-bucketed, Reformer-like) attention whose density differs per layer and changes as
training proceeds. We draw each layer's attention density log-uniformly in
[min_density, max_density] every `update_every` iterations after `start` (dense before;
our choices). Only the attention core shrinks; projections and MLP stay dense.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dynmo_plugin.errors import UserError
from dynmo_plugin.sim.gpt import LayerLoad
from dynmo_plugin.sim.trajectory import Scenario, World, rng_for, step_points

__all__ = ["SparseAttention"]


@dataclass(frozen=True, kw_only=True)
class SparseAttention(Scenario):
    """min_density/max_density: range of per-layer attention density; start,
    update_every: when densities are (re)drawn."""

    min_density: float = 0.05
    max_density: float = 0.5
    start: int = 1000
    update_every: int = 1000

    name = "sparse_attention"
    world = World(dp=30, pp=24)
    paper_baseline = "no_dynamism"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.min_density <= self.max_density <= 1:
            raise UserError(f"sparse_attention: need 0 < min_density <= max_density <= 1, "
                            f"got {self.min_density}, {self.max_density}")

    def change_points(self, iterations: int) -> list[int]:
        return step_points(self.start, self.update_every, iterations)

    def density(self, iteration: int) -> np.ndarray:
        point = self._last_point(iteration, self.change_points(iteration + 1))
        if point < self.start:
            return np.ones(self.num_layers)
        rng = rng_for(self.seed, self.rng_key, point)
        lo, hi = np.log(self.min_density), np.log(self.max_density)
        return np.exp(rng.uniform(lo, hi, self.num_layers))

    def load(self, iteration: int) -> LayerLoad:
        dense = LayerLoad.dense(self.num_layers)
        density = self.density(iteration)
        return LayerLoad(attn_linear=dense.attn_linear, mlp=dense.mlp, attn_core=density,
                         backward=dense.backward, knob="attention_density", knob_value=density.copy())
