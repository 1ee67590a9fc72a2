"""The DynMo paper's six dynamism scenarios as per-layer load trajectories."""
from __future__ import annotations

from typing import Any

from dynmo_plugin.errors import UserError
from dynmo_plugin.sim.scenarios.base import Scenario, World
from dynmo_plugin.sim.scenarios.early_exit import EarlyExit
from dynmo_plugin.sim.scenarios.freezing import Freezing
from dynmo_plugin.sim.scenarios.mod import MoD
from dynmo_plugin.sim.scenarios.moe import MoE
from dynmo_plugin.sim.scenarios.pruning import Pruning
from dynmo_plugin.sim.scenarios.sparse_attention import SparseAttention

__all__ = ["SCENARIOS", "Scenario", "World", "make_scenario"]

SCENARIOS: dict[str, type[Scenario]] = {
    cls.name: cls for cls in (Pruning, Freezing, MoE, MoD, EarlyExit, SparseAttention)
}


def make_scenario(name: str, *, num_layers: int, seed: int = 0, **params: Any) -> Scenario:
    """Scenario `name` for a model of `num_layers` layers; `params` override defaults."""
    if name not in SCENARIOS:
        raise UserError(f"unknown scenario {name!r}; choose one of {', '.join(SCENARIOS)}")
    try:
        return SCENARIOS[name](num_layers=num_layers, seed=seed, **params)
    except TypeError as e:
        raise UserError(f"scenario {name!r}: {e}") from e
