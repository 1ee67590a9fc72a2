"""Dynamism scenarios: the workload changes that make a pipeline go out of balance.

One module per scenario behind the interface in `base` (`Scenario`, `DynamismEvent`),
chosen by `dynamism.kind` through `build_scenario`. Kernels and math that need no
processes live in their own modules (`pruning`: schedule, global threshold, masks, CSR
linear) so they are unit-testable in one process; the Megatron module subclasses a
scenario plugs into the layer spec live in `dynmo_plugin.megatron`.
"""
from __future__ import annotations

import importlib
from typing import Optional

from .base import DynamismEvent, Runtime, Scenario


# kind -> "module:Class", imported only when chosen (scenarios import Megatron).
_SCENARIOS = {
    "gradual_pruning": "dynmo_plugin.dynamism.gradual_pruning:GradualPruning",
    "layer_freezing": "dynmo_plugin.dynamism.layer_freezing:LayerFreezing",
    "early_exit": "dynmo_plugin.dynamism.early_exit:EarlyExit",
    "moe": "dynmo_plugin.dynamism.moe:MixtureOfExperts",
    "mixture_of_depths": "dynmo_plugin.dynamism.mixture_of_depths:MixtureOfDepths",
    "sparse_attention": "dynmo_plugin.dynamism.sparse_attention:SparseAttention",
}


def build_scenario(config) -> Optional[Scenario]:
    """The scenario `config.kind` names (a DynamismConfig), or None for 'none'."""
    if config.kind == "none":
        return None
    module, cls = _SCENARIOS[config.kind].split(":")
    return getattr(importlib.import_module(module), cls)(config)


__all__ = ["DynamismEvent", "Runtime", "Scenario", "build_scenario"]
