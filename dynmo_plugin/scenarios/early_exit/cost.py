"""Early exit: fewer tokens survive to deeper layers as exits grow confident.

Provenance: the DynMo paper's early-exit case (CALM-like exits; 720 GPUs, 30 x 24)
describes survival decaying with depth. We model the share of tokens reaching layer l
(0-based) as survival_l = max(min_survival, exp(-rate_t * l / L)), with the exit rate
rate_t rising linearly from 0 at `start` to `final_rate` at `end` in steps every
`update_every` iterations (our choices: final_rate = ln 10, i.e. 10% of tokens reach the
last layer at the end). Work scales with surviving tokens (linear layers and, since
exited tokens stop being queries, the attention core too).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dynmo_plugin.errors import UserError
from dynmo_plugin.sim.gpt import LayerLoad
from dynmo_plugin.sim.trajectory import Scenario, World, step_points

__all__ = ["EarlyExit"]


@dataclass(frozen=True, kw_only=True)
class EarlyExit(Scenario):
    """final_rate: exponential decay constant over the depth at the end; min_survival:
    floor; start/end/update_every: when the exit rate rises."""

    final_rate: float = float(np.log(10.0))
    min_survival: float = 0.05
    start: int = 1000
    end: int = 7000
    update_every: int = 1000

    name = "early_exit"
    world = World(dp=30, pp=24)
    paper_baseline = "no_dynamism"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.final_rate < 0 or not 0 < self.min_survival <= 1 or self.start >= self.end:
            raise UserError(f"early_exit: need final_rate >= 0, 0 < min_survival <= 1, "
                            f"start < end; got {self.final_rate}, {self.min_survival}, "
                            f"{self.start}, {self.end}")

    def change_points(self, iterations: int) -> list[int]:
        return [p for p in step_points(self.start, self.update_every, self.end + 1) if p < iterations]

    def survival(self, iteration: int) -> np.ndarray:
        t = self._last_point(iteration, self.change_points(self.end + 1))
        frac = 0.0 if t < self.start else min(1.0, (t - self.start + self.update_every)
                                              / (self.end - self.start + self.update_every))
        depth = np.arange(self.num_layers) / self.num_layers
        return np.maximum(self.min_survival, np.exp(-self.final_rate * frac * depth))

    def load(self, iteration: int) -> LayerLoad:
        s = self.survival(iteration)
        return LayerLoad(attn_linear=s, mlp=s.copy(), attn_core=s.copy(),
                         backward=np.ones(self.num_layers), knob="tokens", knob_value=s.copy())
