"""The plugin's scenario layer specs for Megatron-LM's own `--spec MODULE NAME`.

    torchrun ... -m dynmo_plugin.integrations.pretrain_gpt <Megatron-LM flags> \
        --spec dynmo_plugin.integrations.megatron_lm_specs layer_freezing \
        --dynmo --dynmo-config freezing.yaml      # dynamism: {kind: layer_freezing, ...}

Megatron-LM's `gpt_builder` resolves `--spec` with megatron.core's `import_module`,
which imports MODULE and takes its attribute NAME as it is (nothing is called). So each
spec is a module attribute, built when gpt_builder first imports this module — Megatron-LM's
args exist by then — from the layer spec gpt_builder itself would have used (its own
`_get_transformer_layer_spec`), with the scenario's layer class swapped in as the
launcher's scenario does (`Scenario.layer_spec`).

`moe` is not named by users: with --dynmo and Megatron-LM's own --num-experts the
integration sets `--spec` to it (megatron_lm.restore_saved_layout's neighbour,
`_native_moe_spec`). It is Megatron-LM's own dense and MoE layer specs — those
gpt_builder's `get_gpt_decoder_block_spec` would give each layer under --moe-layer-freq —
joined into ONE spec whose layer picks its submodules by global number
(dynmo_plugin.scenarios.moe.layer.MoeTransformerLayer): a layer that a migration rebuilds
elsewhere is what it was, and every MoE layer counts its router's tokens per expert.
Its parameters and sharded checkpoint keys are those of Megatron-LM's native layers.

The other scenarios are refused by name with --dynmo
(dynmo_plugin.integrations.megatron_lm.SCENARIO_SPECS).
"""
from __future__ import annotations

__all__ = ["layer_freezing", "gradual_pruning", "moe", "moe_layers"]


def _args_and_config():
    """Megatron-LM's parsed args and the TransformerConfig gpt_builder makes of them."""
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args
    try:
        args = get_args()
    except AssertionError as e:
        from dynmo_plugin.integrations.megatron_lm_hooks import MegatronLMError
        raise MegatronLMError(f"{__name__} builds its specs from Megatron-LM's parsed args: import "
                              "it through --spec, after initialize_megatron") from e
    return args, core_transformer_config_from_args(args)


def _megatron_lm_layer_spec():
    """The TransformerLayer spec gpt_builder builds without --spec (dense models)."""
    from gpt_builders import _get_transformer_layer_spec
    args, config = _args_and_config()
    return _get_transformer_layer_spec(args.transformer_impl == "transformer_engine", config)


def moe_layer_numbers(config) -> tuple:
    """Global numbers of the MoE layers under Megatron's `moe_layer_freq` (an int N: every
    N-th from layer 1; or one 0/1 per layer), as get_gpt_decoder_layer_specs reads it."""
    freq = config.moe_layer_freq
    flags = ([n % freq == 0 for n in range(config.num_layers)] if isinstance(freq, int)
             else [bool(x) for x in freq])
    return tuple(n for n, flag in enumerate(flags, start=1) if flag)


def _native_moe():
    """(spec, MoE layer numbers) of a --num-experts model: Megatron-LM's own per-layer
    specs (what gpt_builder builds), joined by global number into one spec."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs

    from dynmo_plugin.scenarios.moe.layer import moe_layer_spec
    args, config = _args_and_config()
    if not args.num_experts:
        return None, ()
    specs = get_gpt_decoder_layer_specs(config, args.transformer_impl == "transformer_engine",
                                        normalization=args.normalization, qk_l2_norm=args.qk_l2_norm)
    numbers = moe_layer_numbers(config)
    dense = next((s for n, s in enumerate(specs, start=1) if n not in numbers), specs[0])
    return moe_layer_spec(dense, specs[numbers[0] - 1], numbers), numbers


def _layer_freezing():
    from dynmo_plugin.scenarios.layer_freezing.layer import freezable_spec
    return freezable_spec(_megatron_lm_layer_spec())


def _gradual_pruning():
    """The pruning scenario's spec (prunable linears; by whole FFN neurons with
    `granularity: structured`), or None unless the plugin's config asks for the scenario
    (its settings pick the spec; they are validated before any model is built)."""
    from dynmo_plugin.scenarios import build_scenario
    from dynmo_plugin.integrations.megatron_lm_hooks import hooks
    cfg = hooks.cfg
    if cfg is None or cfg.dynmo.dynamism.kind != "gradual_pruning":
        return None
    return build_scenario(cfg.dynmo.dynamism).layer_spec(_megatron_lm_layer_spec(), None)


layer_freezing = _layer_freezing()
gradual_pruning = _gradual_pruning()
moe, moe_layers = _native_moe()
