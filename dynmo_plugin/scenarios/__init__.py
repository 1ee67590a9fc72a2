"""The six dynamism scenarios: one registry, one name each.

A scenario is a workload change that makes a pipeline go out of balance. Each lives in
its own folder, `dynmo_plugin/scenarios/<name>/`, with up to five parts:

- `config.py`  its dataclass (the YAML section `dynamism.<section>`, flags
  `--dynmo-<section>-*`); pure.
- `cost.py`    its per-layer cost trajectory for the simulator; pure (numpy, `sim`).
- `live.py`    the `Scenario` (see `base`) that changes the running model at its events;
               imports torch and, through its layers, Megatron.
- `layer.py`   the Megatron module subclasses it plugs into the layer spec.
- `kernels.py` process-free math it needs (pruning only: schedule, threshold, CSR linear).

`SCENARIOS` below is the only list of them: the launcher (`build_scenario`), the config
(`dynamism.kind`), the simulator and its CLI (`make_trajectory`) all read it. `name` is
the scenario's one name (reports, `dynamism.kind`, the simulator's output); `section` is
the shorter key of its YAML section and flags, also accepted as input by `dynmo simulate`.
Importing this module imports only the scenarios' config dataclasses: `live` and `cost`
are loaded when chosen, so the pure wings can read the registry without torch or Megatron.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Optional

from dynmo_plugin.errors import UserError
from dynmo_plugin.scenarios.base import DynamismEvent, Runtime, Scenario
from dynmo_plugin.scenarios.early_exit.config import EarlyExitConfig
from dynmo_plugin.scenarios.gradual_pruning.config import PruningConfig
from dynmo_plugin.scenarios.layer_freezing.config import FreezingConfig
from dynmo_plugin.scenarios.mixture_of_depths.config import ModConfig
from dynmo_plugin.scenarios.moe.config import MoeConfig
from dynmo_plugin.scenarios.sparse_attention.config import SparseAttentionConfig

__all__ = ["SCENARIOS", "ScenarioEntry", "DynamismEvent", "Runtime", "Scenario", "build_scenario",
           "canonical_name", "make_trajectory", "trajectory_class"]


@dataclass(frozen=True)
class ScenarioEntry:
    name: str
    section: str
    config: type  # its settings' dataclass (the YAML section `dynamism.<section>`)
    live: str  # "module:Class" of its live Scenario
    cost: str  # "module:Class" of its simulator trajectory
    local_only: Optional[str] = None  # why its layers need Megatron's local spec, if they do
    packed_refused: Optional[str] = None  # why its layers cannot take packed documents, if so

    def load(self, part: str) -> type:
        module, cls = getattr(self, part).split(":")
        return getattr(importlib.import_module(module), cls)


def _entry(name: str, section: str, config: type, live: str, cost: str,
           local_only: Optional[str] = None, packed_refused: Optional[str] = None):
    base = f"dynmo_plugin.scenarios.{name}"
    return ScenarioEntry(name, section, config, f"{base}.live:{live}", f"{base}.cost:{cost}",
                         local_only, packed_refused)


_GATHERED_TOKENS = ("it runs attention on gathered tokens with their own mask, which TE's "
                    "fused causal attention ignores")
# Scenarios without `packed_refused` (gradual_pruning, layer_freezing) keep
# TransformerLayer's forward, which passes packed_seq_params on to the per-document core
# attention.
SCENARIOS: dict[str, ScenarioEntry] = {e.name: e for e in (
    _entry("gradual_pruning", "pruning", PruningConfig, "GradualPruning", "Pruning",
           local_only="its masked linears replace Megatron's local Column/RowParallelLinear"),
    _entry("layer_freezing", "freezing", FreezingConfig, "LayerFreezing", "Freezing"),
    _entry("moe", "moe", MoeConfig, "MixtureOfExperts", "MoE",
           packed_refused="its MoE layers are built from Megatron's MoE spec, whose core "
                          "attention is not replaced by the per-document one (not wired)"),
    _entry("mixture_of_depths", "mod", ModConfig, "MixtureOfDepths", "MoD", _GATHERED_TOKENS,
           packed_refused="its layers route the top tokens of each sequence, which a packed "
                          "row of several documents does not index (they refuse "
                          "packed_seq_params)"),
    _entry("early_exit", "early_exit", EarlyExitConfig, "EarlyExit", "EarlyExit", _GATHERED_TOKENS,
           packed_refused="its layers gather the tokens still active at absolute positions "
                          "and refuse packed_seq_params"),
    _entry("sparse_attention", "sparse_attention", SparseAttentionConfig, "SparseAttention",
           "SparseAttention",
           local_only="its LSH core attention is written against Megatron's local attention "
                      "and not verified with TE",
           packed_refused="its LSH core attention replaces the per-document attention packed "
                          "documents need"),
)}
_BY_SECTION = {e.section: e.name for e in SCENARIOS.values()}


def canonical_name(name: str) -> str:
    """The scenario's one name for `name` or its section key; UserError if neither."""
    if name in SCENARIOS:
        return name
    if name in _BY_SECTION:
        return _BY_SECTION[name]
    raise UserError(f"unknown scenario {name!r}; choose one of {', '.join(SCENARIOS)}")


def build_scenario(config) -> Optional[Scenario]:
    """The live scenario `config.kind` names (a DynamismConfig), or None for 'none'."""
    if config.kind == "none":
        return None
    return SCENARIOS[config.kind].load("live")(config)


def trajectory_class(name: str) -> type:
    """The simulator's cost trajectory class of scenario `name` (or its section key)."""
    return SCENARIOS[canonical_name(name)].load("cost")


def make_trajectory(name: str, *, num_layers: int, seed: int = 0, **params: Any):
    """Scenario `name`'s simulator trajectory for `num_layers` layers; `params` override
    its defaults (UserError naming the bad one)."""
    cls = trajectory_class(name)
    try:
        return cls(num_layers=num_layers, seed=seed, **params)
    except TypeError as e:
        raise UserError(f"scenario {cls.name!r}: {e}") from e
