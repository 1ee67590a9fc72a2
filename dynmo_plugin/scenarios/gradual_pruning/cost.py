"""Gradual global magnitude pruning.

Provenance: the DynMo paper prunes between iterations 3000 and 7000 to a final sparsity
of 52%, 79% or 90%, following the gradual schedule of Zhu & Gupta (2017, "To prune, or
not to prune"): s_t = s_f (1 - (1 - (t - t0) / (t1 - t0))^3), applied every
`prune_every` iterations (1000 here: our choice; the paper gives the region only).
Global magnitude pruning leaves per-layer sparsity uneven; we draw each layer's
"prunability" w_l (mean 1, deeper layers more prunable, seeded noise) and set
sparsity_l = 1 - (1 - s_t)^w_l. In the FLOP model linear layers (QKV, projection,
MLP) cost their kept fraction (an ideal sparse kernel, as the paper's speedups assume);
the attention core is not pruned. With measured curves the layer is priced by the
`pruning_<granularity>` curve of its share kept (on an H100 unstructured pruning saves
nothing). A by-parameter balancer counts the kept weights.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from dynmo_plugin.errors import UserError
from dynmo_plugin.sim.gpt import LayerLoad
from dynmo_plugin.sim.trajectory import Scenario, World, rng_for, step_points

__all__ = ["Pruning"]


@dataclass(frozen=True, kw_only=True)
class Pruning(Scenario):
    """final_sparsity: 0.52 / 0.79 / 0.90 in the paper; start/end: pruning region;
    prune_every: iterations between rounds; spread: std-dev of per-layer prunability;
    granularity: unstructured (the paper's magnitude pruning) or structured (whole heads
    and FFN neurons: what a measured curve prices differently)."""

    final_sparsity: float = 0.90
    start: int = 3000
    end: int = 7000
    prune_every: int = 1000
    spread: float = 0.25
    granularity: str = "unstructured"

    name = "gradual_pruning"
    rng_key = "pruning"  # its random stream's v1 key: results reproduce across the rename
    world = World(dp=30, pp=24)
    paper_baseline = "static_best"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.final_sparsity < 1:
            raise UserError(f"pruning: final_sparsity must be in [0, 1), got {self.final_sparsity}")
        if not 0 <= self.start < self.end:
            raise UserError(f"pruning: need 0 <= start < end, got {self.start}, {self.end}")
        if self.granularity not in ("unstructured", "structured"):
            raise UserError(f"pruning: granularity must be unstructured or structured, got "
                            f"{self.granularity!r}")

    def change_points(self, iterations: int) -> list[int]:
        return [p for p in step_points(self.start, self.prune_every, self.end + 1) if p < iterations]

    def global_sparsity(self, iteration: int) -> float:
        """Zhu & Gupta's cubic schedule over the rounds in the region; round k of n
        (1-based, at start + (k-1) * prune_every) reaches s_f (1 - (1 - k/n)^3)."""
        rounds = self.change_points(self.end + 1)
        done = sum(1 for r in rounds if r <= iteration)
        return self.final_sparsity * (1 - (1 - done / len(rounds)) ** 3)

    @cached_property
    def prunability(self) -> np.ndarray:
        depth = np.linspace(-0.5, 0.5, self.num_layers)
        noise = rng_for(self.seed, self.rng_key, 0).normal(0.0, self.spread, self.num_layers)
        w = np.clip(1.0 + 0.6 * depth + noise, 0.2, None)
        return w / w.mean()

    def layer_sparsity(self, iteration: int) -> np.ndarray:
        s = self.global_sparsity(iteration)
        return 1.0 - (1.0 - s) ** self.prunability

    def load(self, iteration: int) -> LayerLoad:
        keep = 1.0 - self.layer_sparsity(iteration)
        dense = LayerLoad.dense(self.num_layers)
        return LayerLoad(attn_linear=keep, mlp=keep.copy(), attn_core=dense.attn_core,
                         backward=dense.backward, knob=f"pruning_{self.granularity}",
                         knob_value=keep.copy(), params=keep.copy())
