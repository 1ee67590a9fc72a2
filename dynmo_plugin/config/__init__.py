"""One typed configuration for the plugin and its launcher: YAML file + flags.

Every setting is a field of a keyword-only dataclass; its metadata gives the flag that
sets it, the help text and a check. Values are resolved as: dataclass default, then
the YAML file (`--dynmo-config PATH`; sections at its top level), then flags given on
the command line (a flag wins over the file). The merged result is validated once,
before any process group exists, and every problem is a `ConfigError` whose message
names where the value came from, the key and what was expected, e.g.
``configs/x.yaml: rebalance.interval: expected a positive integer, got -3``.

`add_dynmo_args(parser)` adds only the plugin's flags, so it can serve as
Megatron-LM's `extra_args_provider`; the launcher also adds `add_model_args(parser)`
(Megatron-LM's own spellings). The YAML `model:` section is read by the launcher only.

The package, bottom up: `fields` (a field's metadata and value checks), `schema` (the
dataclasses; pure; each scenario's section is its own dataclass in
`dynmo_plugin/scenarios/<name>/config.py`, found through the scenario registry), `flags`
(argparse from the dataclasses), `checks` (across fields), `load` (YAML + flags ->
`RunConfig`). Probing the machine lives in `dynmo_plugin.megatron.training.machine`, reading the
dataset's tokenizer in `dynmo_plugin.data.tokenizer`.

The names below are loaded on first use (PEP 562): the scenarios' config dataclasses
import `config.fields`, and the schema imports them through the registry, so this
package must not import its modules when it is first entered.
"""
from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "fields": ("ConfigError",),
    "checks": ("check_paths", "resolve_transformer_impl"),
    "flags": ("add_dynmo_args", "add_model_args", "flag_of", "leaf_fields"),
    "load": ("load_config",),
    "schema": ("BALANCER_NAMES", "CLUSTER_STRATEGIES", "ClusterConfig", "DataConfig",
               "DynamismConfig", "DynmoConfig", "ModelArgs", "ProfilingConfig",
               "RebalanceConfig", "RepackConfig", "RunConfig"),
}
_WHERE = {name: module for module, names in _HOMES.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
