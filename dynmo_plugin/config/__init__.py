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

The package, bottom up: `fields` (a field's metadata and value checks), `scenarios`
(the dynamism scenarios' settings), `schema` (the dataclasses; pure), `flags` (argparse
from the dataclasses), `checks` (across fields), `load` (YAML + flags -> `RunConfig`).
Probing the machine lives in `dynmo_plugin.megatron.machine`, reading the dataset's
tokenizer in `dynmo_plugin.data.tokenizer`: config/ imports neither torch nor megatron.
"""
from dynmo_plugin.config.checks import check_paths, resolve_transformer_impl
from dynmo_plugin.config.fields import ConfigError
from dynmo_plugin.config.flags import add_dynmo_args, add_model_args, flag_of, leaf_fields
from dynmo_plugin.config.load import load_config
from dynmo_plugin.config.scenarios import (LOCAL_ONLY_SCENARIOS, SCENARIO_SECTIONS,
                                           EarlyExitConfig, FreezingConfig, ModConfig, MoeConfig,
                                           PruningConfig, SparseAttentionConfig)
from dynmo_plugin.config.schema import (BALANCER_NAMES, CLUSTER_STRATEGIES, ClusterConfig,
                                        DataConfig, DynamismConfig, DynmoConfig, ModelArgs,
                                        ProfilingConfig, RebalanceConfig, RepackConfig, RunConfig)

__all__ = [
    "ConfigError", "ModelArgs", "DataConfig", "ProfilingConfig", "RebalanceConfig", "PruningConfig",
    "FreezingConfig", "EarlyExitConfig", "MoeConfig", "ModConfig", "SparseAttentionConfig",
    "DynamismConfig", "SCENARIO_SECTIONS", "RepackConfig",
    "ClusterConfig", "CLUSTER_STRATEGIES", "DynmoConfig",
    "RunConfig", "add_model_args", "add_dynmo_args", "load_config",
    "LOCAL_ONLY_SCENARIOS", "resolve_transformer_impl", "check_paths", "BALANCER_NAMES",
    "flag_of", "leaf_fields",
]
