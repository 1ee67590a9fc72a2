"""Megatron-LM's parsed args, checked and read for the plugin: its validated `RunConfig`
(`load_plugin_config`), the Megatron-LM settings the plugin cannot follow (refused in
one line naming the alternative), the scenario specs (`--spec SPEC_MODULE <scenario>`)
and Megatron-LM's own MoE layers built from the plugin's `moe` spec.
"""
from __future__ import annotations

import argparse
import sys

from dynmo_plugin.config import ConfigError, RunConfig
from dynmo_plugin.config.checks import (BLOCK_MOVES_WHY, MTP_CHUNKS_WHY, block_recompute_moves,
                                         check_chunks_fill, check_forced_blocks, layers_may_move,
                                         recompute_block)
from dynmo_plugin.integrations.megatron_lm_hooks import MegatronLMError
from dynmo_plugin.megatron.training.machine import load_run_config

__all__ = ["SPEC_MODULE", "SCENARIO_SPECS", "load_plugin_config", "set_layout", "use_native_moe_spec",
           "forced_mtp_move", "move_notes"]

# Scenarios that run inside Megatron-LM's train(): their layer spec, named to Megatron-LM's
# `--spec` as SPEC_MODULE and the scenario's name (dynmo_plugin.integrations.megatron_lm_specs).
SPEC_MODULE = "dynmo_plugin.integrations.megatron_lm_specs"
SCENARIO_SPECS = ("layer_freezing", "gradual_pruning")
# Megatron-LM's other ways to split the layers, and their values when unset: a layout
# string excludes them (TransformerConfig raises beside the first four, validate_args
# beside the virtual-stage counts; the layout holds its virtual stages itself)
_OTHER_SPLITS = {"decoder_first_pipeline_num_layers": None, "decoder_last_pipeline_num_layers": None,
                 "account_for_embedding_in_pipeline_split": False,
                 "account_for_loss_in_pipeline_split": False,
                 "num_layers_per_virtual_pipeline_stage": None,
                 "num_virtual_stages_per_pipeline_rank": None}


def set_layout(args, text: str) -> None:
    """Make the layout `text` the only split in Megatron-LM's args. pretrain_gpt.py's
    get_batch builds a TransformerConfig from the args at every micro-batch, and a
    checkpoint's args build the model it resumes (and with --use-checkpoint-args are
    validated again): a layout beside --decoder-first/last-pipeline-num-layers,
    --account-for-embedding/loss-in-pipeline-split or a virtual-stage count raises
    there. The split they described is the layout's now, so they go (after
    validate_args Megatron-LM reads the virtual stages from virtual_pipeline_model_parallel_size)."""
    args.pipeline_model_parallel_layout = text
    for key, unset in _OTHER_SPLITS.items():
        setattr(args, key, unset)


# Megatron-LM argument names that dynmo_plugin.config validates the plugin's settings
# against (the rest of its namespace is Megatron-LM's business).
_MODEL_KEYS = ("num_layers", "pipeline_model_parallel_size", "tensor_model_parallel_size",
               "hidden_size", "num_attention_heads", "micro_batch_size", "global_batch_size", "save",
               "mtp_num_layers")


def load_plugin_config(args: argparse.Namespace) -> RunConfig:
    """The plugin's validated config from Megatron-LM's parsed args.

    Raises:
        ConfigError: a bad --dynmo* value, or a Megatron-LM setting the plugin cannot
            follow while --dynmo is on (named, with the alternative).
    """
    ns = argparse.Namespace(**{k: v for k, v in vars(args).items() if k.startswith("dynmo")})
    for key in _MODEL_KEYS:
        setattr(ns, key, getattr(args, key, None))
    # tied or not decides whether the MTP block may move live (config.checks)
    ns.untie_embeddings_and_output_weights = bool(getattr(args, "untie_embeddings_and_output_weights",
                                                          False))
    layout = getattr(args, "pipeline_model_parallel_layout", None)
    ns.pipeline_model_parallel_layout = None if layout is None else str(layout)
    ns.train_iters = args.train_iters or sys.maxsize  # sample-based runs: not known yet
    ns.num_virtual_stages_per_pipeline_rank = getattr(args, "virtual_pipeline_model_parallel_size",
                                                      None) or 1
    try:
        cfg = load_run_config(ns)
    except ConfigError:
        asked = any(v not in (None, False) for k, v in vars(args).items() if k.startswith("dynmo")
                    and k != "dynmo_output")
        if asked:
            raise
        return RunConfig()  # nothing of the plugin's asked for: Megatron-LM's settings are its own
    if cfg.dynmo.enabled:
        _check_supported(args, cfg)
    return cfg


def _check_supported(args, cfg: RunConfig) -> None:
    unsupported = [
        (getattr(args, "overlap_param_gather", False),
         "--overlap-param-gather (train() keeps the chunks' param_sync_func as a local, which a "
         "migration would leave pointing at the old DDP; the distributed optimizer without it works)"),
        (getattr(args, "use_megatron_fsdp", False) or getattr(args, "use_torch_fsdp2", False),
         "FSDP (--use-megatron-fsdp / --use-torch-fsdp2)"),
        (getattr(args, "cuda_graph_impl", "none") not in ("none", None),
         f"--cuda-graph-impl {getattr(args, 'cuda_graph_impl', None)} (graphs are captured once: "
         "after a move they would replay the layers that left, and a profile's hooks do not "
         "run inside a replay)"),
        (bool(getattr(args, "mtp_num_layers", None))
         and (getattr(args, "virtual_pipeline_model_parallel_size", None) or 1) > 1,
         "--mtp-num-layers with virtual pipeline stages (MTP under Megatron-LM: one chunk per rank)"),
        (getattr(args, "optimizer", "adam") not in ("adam", "sgd"), f"--optimizer {args.optimizer}"),
        (getattr(args, "overlap_moe_expert_parallel_comm", False),
         "--overlap-moe-expert-parallel-comm (Megatron then runs each layer's attention and MLP "
         "through its fine-grained callables, never the layer module, whose hooks the profiler "
         "and the layers' own random streams are)"),
        (getattr(args, "te_rng_tracker", False) and layer_streams_on(args, cfg),
         "--te-rng-tracker with dropout or MoE input jitter (each layer draws from streams of its "
         "own, set into Megatron's RNG tracker, not TE's graph-safe one: add --dynmo-rank-rng to "
         "draw from the rank's streams, as without the plugin; a move then changes the masks)"),
        (block_recompute_moves(args, cfg), f"{BLOCK_MOVES_WHY} (use --recompute-method uniform, or "
         "profile only: --dynmo-profile-every N without rebalancing)"),
        (bool(getattr(args, "mtp_num_layers", None)) and recompute_block(args) > 1,
         f"{MTP_CHUNKS_WHY} (use --recompute-num-layers 1 or --recompute-method block)"),
        (cfg.dynmo.dynamism.kind == "layer_freezing" and getattr(args, "recompute_granularity", None) == "full",
         "--recompute-granularity full with --dynmo-dynamism layer_freezing (the frozen embedding and "
         "layers leave a checkpointed trainable layer an input without gradient, and Megatron's "
         "reentrant checkpoint then gives that layer no gradient: it silently stops training; "
         "--recompute-granularity selective works)"),
        (cfg.dynmo.dynamism.kind == "layer_freezing" and getattr(args, "recompute_granularity", None) == "selective"
         and "layernorm" in (getattr(args, "recompute_modules", None) or []),
         "--recompute-modules layernorm with --dynmo-dynamism layer_freezing (the first layer after a "
         "frozen prefix gets an input without gradient, and Megatron's checkpoint of its norm then "
         "fails in the backward: 'LayerNorm.forward() missing ... input'; core_attn and mlp work)"),
        (getattr(args, "distribute_saved_activations", False) and bool(getattr(args, "mtp_num_layers", None)),
         "--distribute-saved-activations with --mtp-num-layers (the MTP block's checkpoint runs "
         "under the profiler's MTP counter, which cannot step aside for its in-place 1/TP swap)"),
        (getattr(args, "distribute_saved_activations", False)
         and bool(getattr(args, "fp8", None) or getattr(args, "fp4", None)),
         "--distribute-saved-activations with --fp8-format or --fp4-format (Megatron then "
         "checkpoints through Transformer Engine's own function, whose in-place 1/TP swap of "
         "the kept input the profiler's saved-tensor hooks would break; the profiler steps "
         "aside for Megatron's tensor_parallel.checkpoint only, which bf16 and fp32 use)"),
        (getattr(args, "recompute_granularity", None) == "selective"
         and "mlp" in (getattr(args, "recompute_modules", None) or [])
         and getattr(args, "add_bias_linear", False) and getattr(args, "transformer_impl", None) == "local",
         "--recompute-modules mlp with bias linears and --transformer-impl local (Megatron's "
         "checkpoint returns fc2's bias and each backward recurses into the last step's: the run "
         "hangs, with or without --dynmo; add --disable-bias-linear)"),
        (cfg.dynmo.dynamism.kind not in ("none", *SCENARIO_SPECS)
         and not (cfg.dynmo.dynamism.kind == "moe" and getattr(args, "num_experts", None)),
         f"--dynmo-dynamism {cfg.dynmo.dynamism.kind} (its layers exist in the launcher only; "
         f"under Megatron-LM: {', '.join(SCENARIO_SPECS)} through --spec, or report your own "
         "events with megatron_lm.notify_event)"),
        (cfg.dynmo.repack.enabled and getattr(args, "use_tp_pp_dp_mapping", False),
         "--dynmo-repack with --use-tp-pp-dp-mapping (a repack keeps the ranks of the lowest "
         "stages, global ranks 0..K-1 only where the pipeline rank varies slowest)"),
        (cfg.dynmo.repack.enabled and cfg.dynmo.repack.mode != "checkpoint",
         f"--dynmo-repack-mode {cfg.dynmo.repack.mode} (under Megatron-LM a repack saves a "
         "checkpoint and restarts smaller: --dynmo-repack-mode checkpoint)"),
    ]
    bad = [what for hit, what in unsupported if hit]
    if bad:
        raise ConfigError(f"--dynmo under Megatron-LM does not support: {'; '.join(bad)}. Drop "
                          "them, or run without --dynmo")
    _check_scenario_spec(args, cfg.dynmo.dynamism.kind)
    block = recompute_block(args)
    check_forced_blocks(cfg, block, "--dynmo-forced-layouts")
    stages = args.pipeline_model_parallel_size * cfg.model.num_virtual_stages_per_pipeline_rank
    check_chunks_fill(cfg, block, stages, "--recompute-num-layers")


def layer_streams_on(args, cfg: RunConfig) -> bool:
    """Whether each layer draws from its own streams: the model draws and --dynmo-rank-rng
    is off (megatron.training.layer_streams)."""
    from dynmo_plugin.megatron.training.layer_streams import model_draws
    return model_draws(args) and not cfg.dynmo.rank_rng


def move_notes(args, cfg: RunConfig) -> list[str]:
    """What a run whose layers may move should say at its start (docs/megatron-lm.md "What
    a move changes"): which of its settings make a moved run equal the never-moved one in
    distribution rather than to the bit (Megatron-LM's dropout 0.1 only with
    --dynmo-rank-rng: else each layer draws from its own streams, which move with it; a
    data-parallel size >= 3 only with --dynmo-native-grad-reduce or several
    distributed-optimizer instances: else the gradients are reduced in rank order,
    `grad_reduce`; its clipping 1.0 never: the norm is summed exactly, `grad_norm`), and
    how a per-rank checkpoint saved after a move is resumed."""
    if not layers_may_move(args, cfg):
        return []
    notes = []
    drawn = [f"--{flag} {value:g}" for flag, value in (
        *(() if not cfg.dynmo.rank_rng else (
            ("hidden-dropout", getattr(args, "hidden_dropout", 0)),
            ("attention-dropout", getattr(args, "attention_dropout", 0)),
            ("moe-input-jitter-eps", getattr(args, "moe_input_jitter_eps", None) or 0))),
        *_native_reduction(args, cfg)) if value]
    if drawn:
        notes.append(f"layers may move in this run: with {', '.join(drawn)} a moved run equals the "
                     "never-moved one in distribution, not to the bit (each rank draws and sums in "
                     "its own order: docs/megatron-lm.md \"What a move changes\")")
    fmt = getattr(args, "ckpt_format", "torch_dist")
    if getattr(args, "save", None) and fmt in ("torch", "torch_dcp"):
        notes.append(f"--ckpt-format {fmt} numbers layers within each stage: resume a checkpoint "
                     "saved after a move with --dynmo (or the --pipeline-model-parallel-layout it "
                     "was saved under); Megatron-LM alone would load it under its own split "
                     "without an error")
    return notes


def _native_reduction(args, cfg: RunConfig) -> tuple:
    """(flag, value) of what keeps Megatron's own data-parallel collective over 3 or more
    ranks (data x context parallel), where a move changes the reduced gradients' last
    bits: --dynmo-native-grad-reduce, or several distributed-optimizer instances
    (`grad_reduce` leaves their buckets to Megatron); () where neither does."""
    ranks = (getattr(args, "data_parallel_size", 1) or 1) * (getattr(args, "context_parallel_size", 1) or 1)
    instances = getattr(args, "num_distributed_optimizer_instances", 1) or 1
    if ranks < 3:
        return ()
    if cfg.dynmo.native_grad_reduce:
        return (("dynmo-native-grad-reduce at data-parallel size", ranks),)
    # Megatron reduce-scatters within an instance, then all-reduces across the instances
    return (("num-distributed-optimizer-instances", instances),) if (
        instances > 1 and max(ranks // instances, instances) >= 3) else ()


def forced_mtp_move(cfg: RunConfig) -> bool:
    """Whether a forced layout puts the MTP block on another rank than it starts on."""
    from dynmo_plugin.layout import Layout
    m = cfg.model
    if not m.mtp_num_layers:
        return False
    pp, v, k = m.pipeline_model_parallel_size, m.num_virtual_stages_per_pipeline_rank, m.mtp_num_layers
    start = (Layout.parse(m.pipeline_model_parallel_layout, pp, m.num_layers, v, k).mtp_rank
             if m.pipeline_model_parallel_layout else pp - 1)
    return any(Layout.parse(text, None, m.num_layers, v, k).mtp_rank != start
               for text in cfg.dynmo.rebalance.forced_layouts.values())


def _check_scenario_spec(args, kind: str) -> None:
    """A scenario needs the layers of its own --spec, and the plugin's --spec its scenario;
    Megatron-LM's MoE (--num-experts) is followed as the 'moe' scenario, alone."""
    if getattr(args, "num_experts", None) and kind not in ("none", "moe"):
        raise ConfigError(f"--dynmo-dynamism {kind} with --num-experts: one scenario at a time; "
                          "Megatron-LM's MoE layers are followed as the 'moe' scenario")
    spec = list(getattr(args, "spec", None) or [])
    native_moe = spec[1:] == ["moe"] and kind in ("none", "moe")
    if spec[:1] == [SPEC_MODULE] and spec[1:] != [kind] and not native_moe:
        raise ConfigError(f"--spec {' '.join(spec)} builds the {spec[-1]} scenario's layers: add "
                          f"--dynmo-dynamism {spec[-1]} (or its YAML dynamism.kind), got {kind}")
    if kind in SCENARIO_SPECS and spec != [SPEC_MODULE, kind]:
        raise ConfigError(f"--dynmo-dynamism {kind} under Megatron-LM builds its layers from its own "
                          f"spec: add --spec {SPEC_MODULE} {kind} (got --spec "
                          f"{' '.join(spec) or 'none'})")



def use_native_moe_spec(args) -> None:
    """With --dynmo and --num-experts, gpt_builder builds the decoder from the plugin's
    `moe` spec (megatron_lm_specs: Megatron-LM's own dense and MoE layer specs, picked by
    global layer number), so a migrated layer is rebuilt as what it was and every MoE
    layer counts its router's tokens per expert. Set before validate_args.

    Raises:
        MegatronLMError: --spec names another spec (the two cannot both build the layers).
    """
    if not getattr(args, "dynmo__enabled", False) or not getattr(args, "num_experts", None):
        return
    ours = [SPEC_MODULE, "moe"]
    if args.spec is not None and list(args.spec) != ours:
        raise MegatronLMError(f"--dynmo with --num-experts builds Megatron-LM's MoE layers from "
                              f"--spec {' '.join(ours)}; drop --spec {' '.join(args.spec)}")
    args.spec = ours
