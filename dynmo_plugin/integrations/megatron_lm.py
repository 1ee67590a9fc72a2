"""The plugin inside Megatron-LM's own `pretrain()` (the only module that knows `megatron.training`).

    from dynmo_plugin.integrations import megatron_lm
    megatron_lm.enable()        # once, before pretrain(...)
    pretrain(...)               # --dynmo* flags now work in Megatron-LM's train() loop

or, with Megatron-LM's own script unchanged:
`python -m dynmo_plugin.integrations.pretrain_gpt <Megatron-LM flags> --dynmo ...`.

Megatron-LM's `pretrain()` and `train()` look a few functions of
`megatron.training.training` up as module globals at call time; `enable()` replaces
four of them with wrappers that call the originals (checked against Megatron-LM tag
core_v0.16.1; any other version is refused with a message):
  initialize_megatron       - the plugin's flags join the caller's extra_args_provider
                              (chained, never replaced); the plugin's config is validated
                              once, before any model is built
  setup_model_and_optimizer - the stage handle (`MegatronLMStage`) and the controller
                              are built on what it returns
  train_step                - the controller's before_step/after_step around every step
  train                     - the report is completed and the writers flushed at the end
`train()` keeps `model` (a list of DDP chunks: more than one with virtual pipeline stages)
and `optimizer` (a ChainedOptimizer) as locals for the whole loop, so a migration changes
nothing train() holds by reference: the new DDP wrappers replace the chunks in the same
list, and the same ChainedOptimizer
object (which train(), the OptimizerParamScheduler and `config.grad_scale_func` hold)
is re-initialised over the new inner optimizers. Per-layer timings and rebalance events
go to Megatron-LM's TensorBoard / W&B writers (scalars `dynmo/...` at the iteration)
and, through the profiling window's timer tap, into Megatron-LM's Timers.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import logging
import os
import re
import sys
import time
from typing import Callable, Optional

from dynmo_plugin.config import ConfigError, RunConfig, add_dynmo_args
from dynmo_plugin.megatron.training.machine import load_run_config
from dynmo_plugin.integrations.megatron_lm_hooks import MegatronLMError
from dynmo_plugin.integrations.megatron_lm_hooks import hooks as _hooks
from dynmo_plugin.layout import Layout
from dynmo_plugin.report import RunReport

__all__ = ["enable", "disable", "is_enabled", "use_source", "check_version", "add_args",
           "notify_event", "MegatronLMStage", "MegatronLMError", "event_scalars",
           "SUPPORTED_CORE", "SUPPORTED_TAG", "SOURCE_ENV"]

logger = logging.getLogger(__name__)

SUPPORTED_CORE = "0.16.1"          # megatron.core.package_info.__version__
SUPPORTED_TAG = "core_v0.16.1"     # the Megatron-LM tag whose megatron.training this knows
SOURCE_ENV = "DYNMO_MEGATRON_LM"   # root of a Megatron-LM checkout at that tag

# The functions enable() wraps, with their parameters at SUPPORTED_TAG: a version whose
# functions differ is refused rather than half-hooked.
_SIGNATURES = {
    "initialize_megatron": ("extra_args_provider", "args_defaults", "ignore_unknown_args",
                            "allow_no_cuda", "skip_mpu_initialization", "get_embedding_ranks",
                            "get_position_embedding_ranks", "parsed_args", "store"),
    "setup_model_and_optimizer": ("model_provider_func", "model_type", "checkpointing_context"),
    "train_step": ("forward_step_func", "data_iterator", "model", "optimizer",
                   "opt_param_scheduler", "config", "forward_backward_func", "iteration"),
    "train": ("forward_step_func", "model", "optimizer", "opt_param_scheduler",
              "train_data_iterator", "valid_data_iterator", "process_non_loss_data_func",
              "config", "checkpointing_context", "non_loss_data_func", "inference_model"),
}


# Scenarios that run inside Megatron-LM's train(): their layer spec, named to Megatron-LM's
# `--spec` as SPEC_MODULE and the scenario's name (dynmo_plugin.integrations.megatron_lm_specs).
SPEC_MODULE = "dynmo_plugin.integrations.megatron_lm_specs"
SCENARIO_SPECS = ("layer_freezing", "gradual_pruning")


# ---- the source and its version ----------------------------------------------------------
def _source_core_version(root: str) -> Optional[str]:
    path = os.path.join(root, "megatron", "core", "package_info.py")
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError:
        return None
    parts = [re.search(rf"^{k}\s*=\s*(\d+)", text, re.M) for k in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(m.group(1) for m in parts) if all(parts) else None


def use_source(path: str) -> str:
    """Make Megatron-LM's `megatron.training` (not on PyPI) importable from a checkout.

    The root is appended to sys.path, not prepended: `megatron` is a namespace package,
    so the installed megatron-core stays the `megatron.core` in use and only what the
    wheel lacks (megatron.training, legacy, rl, post_training, gpt_builders,
    model_provider) comes from the checkout. Returns the absolute root.

    Raises:
        MegatronLMError: not a Megatron-LM tree, or one for another megatron-core.
    """
    root = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(os.path.join(root, "megatron", "training", "training.py")):
        raise MegatronLMError(f"{path}: not a Megatron-LM source tree (no megatron/training/"
                              f"training.py); give the root of a checkout at tag {SUPPORTED_TAG}")
    found, installed = _source_core_version(root), _installed_core_version()
    if found != installed:
        raise MegatronLMError(f"{root} is Megatron-LM for megatron-core {found}, but megatron-core "
                              f"{installed} is installed; check out the tag core_v{installed} "
                              f"there (this integration knows {SUPPORTED_TAG})")
    if root not in sys.path:
        sys.path.append(root)
    return root


def _installed_core_version() -> str:
    """megatron-core's version, read from its package_info.py without importing megatron.core
    (seconds of imports and warnings, before any check could refuse)."""
    import importlib.util
    spec = importlib.util.find_spec("megatron.core")
    version = None if spec is None or not spec.origin else _source_core_version(
        os.path.dirname(os.path.dirname(os.path.dirname(spec.origin))))
    if version is None:
        raise MegatronLMError(f"megatron-core is not installed (or has no package_info.py); pip "
                              f"install megatron-core=={SUPPORTED_CORE}")
    return version


def check_version():
    """The `megatron.training.training` module, if it is the version this integration
    knows: megatron-core SUPPORTED_CORE and the wrapped functions' signatures at
    SUPPORTED_TAG.

    Raises:
        MegatronLMError: naming what differs and the version to use.
    """
    found = _installed_core_version()
    if found != SUPPORTED_CORE:
        raise MegatronLMError(f"megatron-core {found} is installed; dynmo_plugin's Megatron-LM "
                              f"integration knows Megatron-LM {SUPPORTED_TAG} (megatron-core "
                              f"{SUPPORTED_CORE}) only: install megatron-core=={SUPPORTED_CORE} "
                              f"and use Megatron-LM's source at tag {SUPPORTED_TAG}")
    try:
        import megatron.training.training as mtt
    except ImportError as e:
        raise MegatronLMError(
            f"Megatron-LM's training package cannot be imported ({e}). It is not on PyPI: check "
            f"out Megatron-LM at tag {SUPPORTED_TAG} and set {SOURCE_ENV} to its root (or call "
            "use_source(root)); its imports also need: pip install six regex triton") from e
    for name, expected in _SIGNATURES.items():
        fn = getattr(mtt, name, None)
        params = tuple(inspect.signature(fn).parameters) if callable(fn) else None
        if params != expected:
            shown = "missing" if params is None else f"{name}({', '.join(params)})"
            raise MegatronLMError(
                f"megatron.training.training.{name} is {shown}, not {name}({', '.join(expected)}) "
                f"as in Megatron-LM {SUPPORTED_TAG}: this Megatron-LM is a version the "
                f"integration does not know; use the tag {SUPPORTED_TAG}")
    return mtt


# ---- flags --------------------------------------------------------------------------------
def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The plugin's flags for Megatron-LM's parser (what enable() chains in): the --dynmo*
    flags of dynmo_plugin.config plus where the report goes."""
    add_dynmo_args(parser)
    parser.add_argument("--dynmo-output", default="runs/latest", metavar="DIR",
                        help="directory for the plugin's report.json / report.jsonl "
                             "(written by global rank 0)")
    return parser


def _chain(user_provider: Optional[Callable]) -> Callable:
    """The caller's extra_args_provider, then the plugin's flags (unless it added them)."""
    def provider(parser):
        if user_provider is not None:
            parser = user_provider(parser)
        if "--dynmo" not in parser._option_string_actions:
            add_args(parser)
        return parser
    provider.dynmo_chained = True
    return provider


# Megatron-LM argument names that dynmo_plugin.config validates the plugin's settings
# against (the rest of its namespace is Megatron-LM's business).
_MODEL_KEYS = ("num_layers", "pipeline_model_parallel_size", "tensor_model_parallel_size",
               "hidden_size", "num_attention_heads", "micro_batch_size", "global_batch_size", "save")


def load_plugin_config(args: argparse.Namespace) -> RunConfig:
    """The plugin's validated config from Megatron-LM's parsed args.

    Raises:
        ConfigError: a bad --dynmo* value, or a Megatron-LM setting the plugin cannot
            follow while --dynmo is on (named, with the alternative).
    """
    ns = argparse.Namespace(**{k: v for k, v in vars(args).items() if k.startswith("dynmo")})
    for key in _MODEL_KEYS:
        setattr(ns, key, getattr(args, key, None))
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
        (bool(getattr(args, "mtp_num_layers", None)), "--mtp-num-layers"),
        (getattr(args, "optimizer", "adam") not in ("adam", "sgd"), f"--optimizer {args.optimizer}"),
        (cfg.dynmo.dynamism.kind not in ("none", *SCENARIO_SPECS)
         and not (cfg.dynmo.dynamism.kind == "moe" and getattr(args, "num_experts", None)),
         f"--dynmo-dynamism {cfg.dynmo.dynamism.kind} (its layers exist in the launcher only; "
         f"under Megatron-LM: {', '.join(SCENARIO_SPECS)} through --spec, or report your own "
         "events with megatron_lm.notify_event)"),
        (cfg.dynmo.repack.enabled and cfg.dynmo.repack.mode != "checkpoint",
         f"--dynmo-repack-mode {cfg.dynmo.repack.mode} (under Megatron-LM a repack saves a "
         "checkpoint and restarts smaller: --dynmo-repack-mode checkpoint)"),
    ]
    bad = [what for hit, what in unsupported if hit]
    if bad:
        raise ConfigError(f"--dynmo under Megatron-LM does not support: {'; '.join(bad)}. Drop "
                          "them, or run without --dynmo")
    _check_scenario_spec(args, cfg.dynmo.dynamism.kind)


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


# ---- the stage handle -------------------------------------------------------------------------
class MegatronLMStage:
    """The `dynmo_plugin.stage.StageHandle` under Megatron-LM (the launcher's is
    StageTrainer): what the controller, migrator, profiler and scenarios drive, built over
    the objects Megatron-LM's train() holds: `model_list` (train()'s list
    of DDP model chunks, updated in place; more than one with virtual pipeline stages),
    `optimizer` (a ChainedOptimizer over all chunks, kept as the same object), `scheduler`
    and the model's TransformerConfig. With --use-distributed-optimizer
    the ChainedOptimizer chains DistributedOptimizers: the migrator finds them through
    `optimizer` and moves their sharded state with optim_state, as in the launcher."""

    def __init__(self, chunks: list, optimizer, scheduler, args):
        from megatron.core.distributed import DistributedDataParallel
        from megatron.core.models.gpt import GPTModel
        from megatron.core.optimizer import ChainedOptimizer
        from megatron.core.utils import get_model_config
        from megatron.training.utils import unwrap_model

        if not chunks or not all(isinstance(c, DistributedDataParallel) for c in chunks):
            raise MegatronLMError(f"--dynmo needs Megatron DDP model chunks; got "
                                  f"{[type(c).__name__ for c in chunks]} (FSDP is not supported)")
        if not isinstance(optimizer, ChainedOptimizer):
            raise MegatronLMError(f"--dynmo needs Megatron's ChainedOptimizer, got {type(optimizer).__name__}")
        self.model_list, self._optimizer, self.scheduler, self.args = chunks, optimizer, scheduler, args
        self.chunks = [unwrap_model(c) for c in chunks]  # the GPTModels: a migration keeps them
        bad = [type(m).__name__ for m in self.chunks if not isinstance(m, GPTModel)]
        if bad:
            raise MegatronLMError(f"--dynmo supports GPTModel, got {', '.join(bad)}")
        self.model = self.chunks[0]
        self.num_chunks = len(chunks)
        self.config = get_model_config(chunks[0])
        self.spec = _layer_spec(self.chunks)
        from dynmo_plugin.megatron.training.parallel import current_dims
        self.dims = current_dims()
        self.layout = _current_layout(self.chunks, self.dims)

    @property
    def layers(self) -> list:
        """This rank's decoder layers over all its model chunks, in layer order (what a
        scenario walks; read afresh after a migration)."""
        return [layer for chunk in self.chunks for layer in chunk.decoder.layers]

    @property
    def ddp(self):
        """The DDP of chunk 0 (of the only chunk without virtual pipeline stages)."""
        return self.model_list[0]

    @property
    def ddps(self) -> list:
        """The DDP of every model chunk, chunk 0 first."""
        return list(self.model_list)

    @property
    def module(self):
        """What chunk 0's DDP wraps: the GPTModel, or its Float16Module with --bf16/--fp16."""
        return self.ddp.module

    @property
    def ddp_config(self):
        return self.ddp.ddp_config

    @property
    def optimizer(self):
        return self._optimizer

    @property
    def num_microbatches(self) -> int:
        from megatron.core.num_microbatches_calculator import get_num_microbatches
        return get_num_microbatches()

    def build_ddp(self, chunk: int = 0):
        """A Megatron DDP over model chunk `chunk`'s module as it is now, configured as
        Megatron-LM's get_model configured the live one (no bucketing past chunk 0;
        local; the live one is untouched)."""
        from megatron.core.distributed import DistributedDataParallel
        return DistributedDataParallel(
            config=self.config, ddp_config=self.ddp_config, module=self.model_list[chunk].module,
            disable_bucketing=chunk > 0 or bool(getattr(
                self.args, "overlap_param_gather_with_optimizer_step", False)))

    def build_optimizer(self, ddp):
        """A fresh optimizer over `ddp` (with virtual pipeline stages: the list of every
        chunk's DDP), made as Megatron-LM's setup_model_and_optimizer makes it (collective)."""
        from megatron.core.optimizer import ChainedOptimizer
        from megatron.training import get_timers
        import megatron.training.training as mtt
        config, overrides = mtt.get_megatron_optimizer_config(self.args)
        config.timers = get_timers()
        optimizer = mtt.get_megatron_optimizer(
            config, ddp if isinstance(ddp, list) else [ddp], config_overrides=overrides,
            use_gloo_process_groups=self.args.enable_gloo_process_groups)
        if not isinstance(optimizer, ChainedOptimizer):
            raise MegatronLMError(f"get_megatron_optimizer returned {type(optimizer).__name__}, "
                                  "not a ChainedOptimizer")
        return optimizer

    def install_wrappers(self, ddp, optimizer) -> None:
        """Switch train() to `ddp` (a list with virtual pipeline stages) and `optimizer`
        without changing what it holds: the same list gets the new chunks, the same
        ChainedOptimizer object takes the new
        inner optimizers (re-initialised in place, as its constructor builds it), so the
        scheduler and config.grad_scale_func (bound to it) stay valid. The DDP-bound sync
        functions train() set are re-pointed. Reference updates only: cannot fail."""
        from megatron.core.optimizer import ChainedOptimizer
        ddps = ddp if isinstance(ddp, list) else [ddp]
        self.model_list[:] = ddps
        if optimizer is not self._optimizer:
            ChainedOptimizer.__init__(self._optimizer, list(optimizer.chained_optimizers))
        cfg = self.config  # train() binds these to the chunks only with --overlap-grad-reduce
        if cfg.no_sync_func is not None:
            cfg.no_sync_func = [d.no_sync for d in ddps] if len(ddps) > 1 else ddps[0].no_sync
        if cfg.grad_sync_func is not None:
            cfg.grad_sync_func = ([d.start_grad_sync for d in ddps] if len(ddps) > 1
                                  else ddps[0].start_grad_sync)


def _layer_spec(models: list):
    """The TransformerLayer spec arriving layers are built from: the decoders', which must
    be one spec for all their layers (heterogeneous blocks cannot be migrated)."""
    specs = [s for m in models for s in m.decoder.submodules.layer_specs]
    if any(s != specs[0] for s in specs[1:]):
        raise MegatronLMError("--dynmo needs one TransformerLayer spec for every decoder layer "
                              "(this model mixes layer kinds); run without --dynmo")
    return specs[0] if specs else None


def _current_layout(models: list, dims) -> Layout:
    """The split Megatron-LM built, read from the layers each (virtual) stage holds (it
    may come from a layout string, a uniform split or first/last-stage counts); virtual
    stage s is chunk s // pp of rank s % pp, as in Megatron."""
    import torch.distributed as dist
    numbers = [[layer.layer_number for layer in m.decoder.layers] for m in models]
    held: list = [None] * dims.pp
    dist.all_gather_object(held, numbers, group=dims.groups.pp)
    v = len(models)
    stages = [held[s % dims.pp][s // dims.pp] for s in range(dims.pp * v)]
    layout = Layout(tuple(len(n) for n in stages), v)
    if [n for stage in stages for n in stage] != list(range(1, layout.num_layers + 1)):
        raise MegatronLMError(f"decoder layers per (virtual) stage {stages} are not one "
                              "contiguous split")
    return layout


# ---- checkpoints ------------------------------------------------------------------------------
# Formats whose model state dicts number decoder layers within each stage: loaded under
# another split, a stage would take other layers' weights without an error.
_PER_RANK_FORMATS = ("torch", "torch_dcp")


def _saved_args(load_dir: str):
    """(format, Megatron-LM args) of the newest checkpoint under `load_dir`; None
    without one (a first run whose --load is also its --save)."""
    tracker = os.path.join(load_dir, "latest_checkpointed_iteration.txt")
    if not os.path.isfile(tracker):
        return None
    with open(tracker, encoding="utf-8") as fh:
        text = fh.read().strip()
    folder = os.path.join(load_dir, "release" if text == "release" else f"iter_{int(text):07d}")
    if os.path.isfile(os.path.join(folder, "metadata.json")):  # dist_checkpointing
        from megatron.core import dist_checkpointing
        return "torch_dist", dist_checkpointing.load_common_state_dict(folder).get("args")
    import glob

    import torch
    files = sorted(glob.glob(os.path.join(folder, "mp_rank_*", "model_optim_rng.pt")))
    if files:
        return "torch", torch.load(files[0], map_location="cpu", weights_only=False).get("args")
    return ("torch_dcp" if os.path.isfile(os.path.join(folder, ".metadata")) else "unknown"), None


def _virtual_stages(args) -> int:
    """Virtual stages per pipeline rank that these (not yet validated) args ask for."""
    if args.num_virtual_stages_per_pipeline_rank:
        return args.num_virtual_stages_per_pipeline_rank
    if args.num_layers_per_virtual_pipeline_stage:
        return args.num_layers // args.pipeline_model_parallel_size // \
            args.num_layers_per_virtual_pipeline_stage
    return 1


def restore_saved_layout(args) -> None:
    """With --dynmo and --load: the layout the checkpoint was saved under (a rebalanced
    run resumes rebalanced), set in Megatron-LM's args before validate_args, as the
    launcher restores it (docs/checkpoints.md): an explicit --pipeline-model-parallel-
    layout wins; a saved layout without this run's pp x v stages (another pipeline
    size) leaves Megatron-LM's own split. torch_dist checkpoints key layers by global
    number, so any split loads them.

    Raises:
        MegatronLMError: a per-rank checkpoint (--ckpt-format torch / torch_dcp numbers
            layers within each stage) that this run would load under another split.
    """
    if not getattr(args, "dynmo__enabled", False) or not args.load:
        return
    found = _saved_args(args.load)
    if found is None:
        return
    fmt, saved = found
    text = getattr(saved, "pipeline_model_parallel_layout", None)
    saved_layout = None if text is None else str(text)
    stages = args.pipeline_model_parallel_size * _virtual_stages(args)
    # a checkpoint repack's chosen layout first, then the layout in force when it saved
    fitting = [t for t in (getattr(saved, "dynmo_next_layout", None), saved_layout)
               if t is not None and Layout.parse(t).num_stages == stages]
    if (args.pipeline_model_parallel_layout is None and fitting
            and getattr(saved, "num_layers", None) == args.num_layers):
        args.pipeline_model_parallel_layout = chosen = fitting[0]
        args.num_layers_per_virtual_pipeline_stage = args.num_virtual_stages_per_pipeline_rank = None
        args.decoder_first_pipeline_num_layers = args.decoder_last_pipeline_num_layers = None
        logger.info("--load %s: resuming under the saved layout %s", args.load, chosen)
    if fmt not in _PER_RANK_FORMATS:
        return
    saved_split = (saved_layout, getattr(saved, "pipeline_model_parallel_size", None),
                   getattr(saved, "tensor_model_parallel_size", None))
    run_split = (args.pipeline_model_parallel_layout, args.pipeline_model_parallel_size,
                 args.tensor_model_parallel_size)
    if saved is None or saved_split != run_split:
        shown = (lambda lay, pp, tp: f"layout {lay or 'uniform'} at PP {pp}, TP {tp}")
        raise MegatronLMError(
            f"--load {args.load}: a --ckpt-format {fmt} checkpoint (layers numbered within each "
            f"stage) saved under {shown(*saved_split)} cannot be loaded under this run's "
            f"{shown(*run_split)} without putting other layers' weights into its stages; resume "
            "with the saved pipeline sizes and no --pipeline-model-parallel-layout, or save in "
            "--ckpt-format torch_dist (layers keyed by global number, any split)")


def refuse_scenario_resume(args, cfg: RunConfig) -> None:
    """Layer freezing and pruning keep state Megatron-LM's checkpoint does not hold (which
    parameters stopped training, the scenario's progress): resumed from one, frozen layers
    would silently train again. Until that is saved, such a resume is refused.

    Raises:
        MegatronLMError: --load holds a checkpoint and one of those scenarios is on.
    """
    kind = cfg.dynmo.dynamism.kind
    if cfg.dynmo.enabled and kind in SCENARIO_SPECS and args.load and _saved_args(args.load):
        raise MegatronLMError(f"--load {args.load} with --dynmo-dynamism {kind}: the scenario's "
                              "state (frozen or pruned parameters, its progress) is not in "
                              "Megatron-LM's checkpoint yet; resume without the scenario, or run "
                              "it in the launcher (python -m dynmo_plugin.train), whose "
                              "checkpoints hold it")


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


# ---- metrics for Megatron-LM's writers --------------------------------------------------------
def event_scalars(record: dict) -> dict[str, float]:
    """Scalars of one plugin event (an event's to_dict()) for TensorBoard / W&B:
    per-layer fwd/bwd ms and the stages' imbalance from its profile; for a rebalance,
    whether it applied, the imbalance it predicts after, and its overhead seconds."""
    from dynmo_plugin.balancing.metrics import imbalance
    out: dict[str, float] = {}
    profile = record.get("profile")
    if profile:
        loads: dict[int, float] = {s["stage"]: s["extra_s"] for s in profile["stages"]}
        for x in profile["layers"]:
            out[f"dynmo/layer_{x['layer']}_fwd_ms"] = x["fwd_s"] * 1e3
            out[f"dynmo/layer_{x['layer']}_bwd_ms"] = x["bwd_s"] * 1e3
            loads[x["stage"]] = loads.get(x["stage"], 0.0) + x["fwd_s"] + x["bwd_s"]
        out["dynmo/imbalance"] = imbalance(list(loads.values()))
    if record.get("kind") == "rebalance":
        out["dynmo/rebalance_applied"] = float(bool(record.get("applied")))
        if record.get("imbalance_after") is not None:
            out["dynmo/imbalance_after"] = float(record["imbalance_after"])
        out["dynmo/moved_layers"] = float(len(record.get("moves", [])))
        repack = record.get("repack") or {}
        if repack:  # a repack: the pipeline ranks and world size the run continues with
            out["dynmo/repack_stages_after"] = float(repack["stages_after"])
            out["dynmo/repack_world_size_after"] = float(repack["world_size_after"])
    for phase, seconds in record.get("overhead_s", {}).items():
        out[f"dynmo/{phase}_s"] = float(seconds)
    if record.get("kind") == "dynamism":  # a scenario's event: its count and what it changed
        out[f"dynmo/{record['scenario']}_events"] = 1.0
        detail = record.get("detail") or {}
        if "frozen_layers" in detail:
            out["dynmo/frozen_layers"] = float(len(detail["frozen_layers"]))
        if "target" in detail:  # pruning: the round's target sparsity
            out["dynmo/pruning_target"] = float(detail["target"])
        for layer, units in (record.get("work") or {}).items():
            out[f"dynmo/layer_{layer}_work"] = float(units)
    return out


@dataclasses.dataclass
class _Report(RunReport):
    """The run report, also handing each new event to `sink` (the writers)."""

    sink: Optional[Callable] = None

    def add_event(self, event) -> None:
        super().add_event(event)
        if self.sink is not None:
            self.sink(event)


class _Writers:
    """Megatron-LM's TensorBoard and W&B writers (each exists on one rank, or none)."""

    def __init__(self):
        from megatron.training import get_tensorboard_writer, get_wandb_writer
        self.tensorboard, self.wandb = get_tensorboard_writer(), get_wandb_writer()

    def event(self, event) -> None:
        record = event if isinstance(event, dict) else event.to_dict()
        scalars = event_scalars(record)
        it = record["iteration"]
        if self.tensorboard is not None:
            for name, value in scalars.items():
                self.tensorboard.add_scalar(name, value, it)
        if self.wandb is not None:
            self.wandb.log(scalars, it)
        from megatron.training.utils import print_rank_last
        layout = record.get("layout_after") or record.get("layout")
        cause = record.get("trigger") or record.get("scenario")
        print_rank_last(f" dynmo: iteration {it} {record['kind']} [{cause}] layout "
                        f"{layout} imbalance {scalars.get('dynmo/imbalance', float('nan')):.3f}")

    def flush(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.flush()


# ---- one run inside pretrain() ----------------------------------------------------------------
class _Run:
    """The controller and what it needs, built after setup_model_and_optimizer."""

    def __init__(self, cfg: RunConfig, args, chunks: list, optimizer, scheduler):
        from dynmo_plugin.assembly import assemble

        self.args = args
        self.stage = MegatronLMStage(chunks, optimizer, scheduler, args)
        self.writers = _Writers()
        self.iteration, self.restart = args.iteration, None
        new_report = functools.partial(
            _Report, path=os.path.join(args.dynmo_output, "report.json"),
            config={"dynmo": dataclasses.asdict(cfg.dynmo), "megatron_lm": _run_settings(args)},
            sink=self.writers.event)
        parts = assemble(cfg.dynmo, self.stage, new_report, iteration=args.iteration,
                         scenario=_scenario(cfg, self.stage), repacker=self._checkpoint_repack,
                         layout_listeners=[self._layout_changed])
        self.control, self.migrator, self.report = parts.control, parts.migrator, parts.report
        self.controller, self.scenario = parts.dynmo, parts.scenario
        self._start = 0.0

    def _layout_changed(self) -> None:
        """Megatron-LM's args (saved with its checkpoints) follow the new layout, as the
        string its parser gives: the config's PipelineParallelLayerLayout object in the
        args would make the checkpoint unreadable by Megatron-LM's weights-only loader."""
        self.args.pipeline_model_parallel_layout = str(self.stage.layout)

    def _checkpoint_repack(self, layout: Layout, iteration: int, info: dict):
        """A repack onto `layout` (fewer pipeline ranks), in checkpoint mode: Megatron-LM's
        own exit path saves a checkpoint after this iteration (`args.exit_interval`: its
        checkpoint_and_decide_exit saves with --save and train() exits), whose args carry
        `dynmo_next_layout` for the restart's --load (restore_saved_layout); every rank
        decides alike (the controller's decision is collective)."""
        from dynmo_plugin.megatron.migration.repack import RepackResult
        d, args = self.stage.dims, self.args
        world = d.tp * d.dp * layout.num_ranks
        args.exit_interval = self.iteration  # Megatron-LM counts it done after this step
        args.dynmo_next_layout = str(layout)
        vp = (f" --num-virtual-stages-per-pipeline-rank {layout.num_chunks}"
              if layout.num_chunks > 1 else "")
        self.restart = (f"torchrun --nproc-per-node <ranks per node, {world} ranks in all> ... "
                        f"--pipeline-model-parallel-size {layout.num_ranks}{vp} --load {args.save}")
        result = RepackResult(True, d.pp, layout.num_ranks, str(self.stage.layout),
                              ranks_released=list(range(world, d.world_size)),
                              world_size_before=d.world_size, world_size_after=world, generation=1)
        record = {**result.to_dict(), **info, "mode": "checkpoint", "next_layout": str(layout),
                  "checkpoint": os.path.join(args.save, f"iter_{self.iteration:07d}"),
                  "restart": self.restart, "cluster": None}
        del record["migration"]
        return record, result

    def before_step(self, iteration: int, model: list, optimizer) -> None:
        if model is not self.stage.model_list or optimizer is not self.stage.optimizer:
            raise MegatronLMError("train() passed train_step a model list or optimizer other than "
                                  "the ones setup_model_and_optimizer returned: this Megatron-LM "
                                  f"differs from {SUPPORTED_TAG}")
        self._start, self.iteration = time.perf_counter(), iteration
        self.controller.before_step(iteration)
        if self.scenario is not None:
            self.scenario.before_step(iteration)

    def after_step(self, iteration: int, result) -> None:
        """As the launcher's step: the scenario's event (reported, and the controller
        told: it profiles and rebalances), then the controller's own step end."""
        event = self.scenario.after_step(iteration) if self.scenario is not None else None
        if event is not None:
            self.report.add_event(event)
            if event.rebalance:
                self.controller.notify_event(event.name, event.work)
        self.controller.after_step(iteration)
        losses = result[0] if isinstance(result, tuple) and result else {}
        loss = losses.get("lm loss") if isinstance(losses, dict) else None
        self.report.add_iteration(iteration, None if loss is None else float(loss),
                                  time.perf_counter() - self._start)

    def finish(self) -> None:
        self.report.layout = str(self.stage.layout)
        self.report.close()
        self.writers.flush()
        if self.restart is not None:  # the line a torchrun / StatefulSet / Job restart follows
            from megatron.training.utils import print_rank_0
            print_rank_0(f" dynmo: checkpoint repack after iteration {self.iteration}; restart with: "
                         f"{self.restart}")


def _scenario(cfg: RunConfig, stage: MegatronLMStage):
    """The --dynmo-dynamism scenario over Megatron-LM's model (not attached yet), or None:
    its layers must be the ones its --spec built (load_plugin_config checked the flag; this
    checks the model)."""
    from dynmo_plugin.scenarios import build_scenario
    if getattr(stage.args, "num_experts", None):
        return _native_moe_scenario(cfg, stage)
    scenario = build_scenario(cfg.dynmo.dynamism)
    if scenario is None:
        return None
    from dynmo_plugin.integrations import megatron_lm_specs
    if stage.spec is None or stage.spec != getattr(megatron_lm_specs, scenario.name, None):
        module = getattr(stage.spec, "module", None)
        raise MegatronLMError(f"--dynmo-dynamism {scenario.name}: the decoder's layers ("
                              f"{getattr(module, '__name__', module)}) were not built from the "
                              f"scenario's spec: add --spec {SPEC_MODULE} {scenario.name}")
    return scenario


def _native_moe_scenario(cfg: RunConfig, stage: MegatronLMStage):
    """The launcher's `moe` scenario over Megatron-LM's own MoE model: the model's settings
    are Megatron-LM's flags (--num-experts, --moe-router-topk, --moe-layer-freq,
    --moe-expert-capacity-factor), when and how it reports are `dynamism.moe`'s (start,
    interval, ep_model; with --expert-model-parallel-size P > 1 the work model is P's:
    the busiest expert group sets a layer's pace). Its events carry each layer's work
    from the router's counts."""
    from dynmo_plugin.scenarios.moe.live import MixtureOfExperts
    from dynmo_plugin.integrations.megatron_lm_specs import moe_layer_numbers
    from dynmo_plugin.scenarios.moe.layer import MoeTransformerLayer
    if getattr(stage.spec, "module", None) is not MoeTransformerLayer:
        raise MegatronLMError("--dynmo with --num-experts: the decoder was not built from "
                              f"--spec {SPEC_MODULE} moe (the initialize_megatron hook sets it)")
    args, config = stage.args, stage.config
    numbers = moe_layer_numbers(config)
    pattern = ",".join("1" if n in numbers else "0" for n in range(1, config.num_layers + 1))
    ep = getattr(args, "expert_model_parallel_size", 1) or 1
    moe = dataclasses.replace(cfg.dynmo.dynamism.moe, num_experts=args.num_experts,
                              top_k=args.moe_router_topk, pattern=pattern,
                              capacity_factor=args.moe_expert_capacity_factor or 0.0,
                              # the busiest expert group's rank paces a layer under EP > 1
                              ep_model=cfg.dynmo.dynamism.moe.ep_model if ep == 1 else ep)
    return MixtureOfExperts(dataclasses.replace(cfg.dynmo.dynamism, kind="moe", moe=moe))


def _run_settings(args) -> dict:
    keys = ("num_layers", "hidden_size", "seq_length", "micro_batch_size", "global_batch_size",
            "train_iters", "tensor_model_parallel_size", "pipeline_model_parallel_size", "bf16",
            "fp16", "transformer_impl", "use_distributed_optimizer")
    return {k: getattr(args, k, None) for k in keys} | {"megatron_core": SUPPORTED_CORE}


# ---- the hooks (their state: megatron_lm_hooks) -------------------------------------------------


def is_enabled() -> bool:
    return bool(_hooks.originals)


def enable() -> None:
    """Hook the plugin into Megatron-LM's pretrain() (idempotent). Call before pretrain().

    Raises:
        MegatronLMError: Megatron-LM is missing or a version this does not know.
    """
    if is_enabled():
        return
    mtt = check_version()
    wrappers = {"initialize_megatron": _wrap_initialize, "setup_model_and_optimizer": _wrap_setup,
                "train_step": _wrap_train_step, "train": _wrap_train}
    for name, make in wrappers.items():
        original = getattr(mtt, name)
        _hooks.originals[name] = original
        setattr(mtt, name, functools.wraps(original)(make(original)))
    _skip_helper_build()


def disable() -> None:
    """Restore Megatron-LM's functions and forget the run."""
    if not is_enabled():
        return
    import megatron.training.training as mtt
    for name, original in _hooks.originals.items():
        setattr(mtt, name, original)
    _hooks.originals.clear()
    if _hooks.compile_helpers is not None:
        import megatron.core.datasets.utils as dutils
        dutils.compile_helpers, _hooks.compile_helpers = _hooks.compile_helpers, None
    _hooks.cfg = _hooks.run = None


def _skip_helper_build() -> None:
    """initialize_megatron runs `make` in megatron/core/datasets; the megatron-core wheel
    ships the built helpers_cpp and no Makefile, so that make fails. Skip it only then."""
    import megatron.core.datasets.utils as dutils
    folder = os.path.dirname(dutils.__file__)
    if os.path.exists(os.path.join(folder, "Makefile")):
        return
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        return
    _hooks.compile_helpers = dutils.compile_helpers
    dutils.compile_helpers = lambda: None


def notify_event(name: str, work: Optional[dict] = None) -> None:
    """Tell the controller a dynamism event happened (see DynMo.notify_event); call it on
    every rank at the same iteration. A no-op without --dynmo."""
    if _hooks.run is not None:
        _hooks.run.controller.notify_event(name, work)


def _wrap_initialize(original):
    signature = inspect.signature(original)

    def initialize_megatron(*a, **kw):
        bound = signature.bind(*a, **kw)
        bound.apply_defaults()
        given = bound.arguments
        if not getattr(given["extra_args_provider"], "dynmo_chained", False):
            given["extra_args_provider"] = _chain(given["extra_args_provider"])
        if given["parsed_args"] is None:  # parsed here so the saved layout can join them
            from megatron.training.arguments import parse_args  # before validate_args
            given["parsed_args"] = parse_args(given["extra_args_provider"],
                                              given["ignore_unknown_args"])
        restore_saved_layout(given["parsed_args"])
        use_native_moe_spec(given["parsed_args"])
        out = original(*bound.args, **bound.kwargs)
        from megatron.training import get_args
        _hooks.cfg = load_plugin_config(get_args())
        refuse_scenario_resume(get_args(), _hooks.cfg)
        return out
    return initialize_megatron


def _wrap_setup(original):
    def setup_model_and_optimizer(*a, **kw):
        model, optimizer, scheduler = original(*a, **kw)
        cfg = _hooks.cfg
        if cfg is not None and cfg.dynmo.enabled and optimizer is not None:
            from megatron.training import get_args
            _hooks.run = _Run(cfg, get_args(), model, optimizer, scheduler)
        return model, optimizer, scheduler
    return setup_model_and_optimizer


def _wrap_train_step(original):
    def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler,
                   config, forward_backward_func, iteration=None):
        run = _hooks.run
        if run is None or iteration is None:
            return original(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler,
                            config, forward_backward_func, iteration=iteration)
        n = iteration + 1  # Megatron-LM passes the iterations done; the plugin numbers from 1
        run.before_step(n, model, optimizer)
        result = original(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler,
                          config, forward_backward_func, iteration=iteration)
        run.after_step(n, result)
        return result
    return train_step


def _wrap_train(original):
    def train(*a, **kw):
        try:
            return original(*a, **kw)
        finally:
            if _hooks.run is not None:
                _hooks.run.finish()
    return train
