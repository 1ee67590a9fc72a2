"""The plugin inside Megatron-LM's own `pretrain()` (the only module that knows `megatron.training`).

    from dynmo_plugin.integrations import megatron_lm
    megatron_lm.enable()        # once, before pretrain(...)
    pretrain(...)               # --dynmo* flags now work in Megatron-LM's train() loop

or, with Megatron-LM's own script unchanged:
`python -m dynmo_plugin.integrations.pretrain_gpt <Megatron-LM flags> --dynmo ...`.

Megatron-LM's `pretrain()` and `train()` look a few functions of
`megatron.training.training` up as module globals at call time; `enable()` replaces
five of them, and `save_checkpoint`'s `generate_state_dict`, with wrappers that call the
originals (checked against Megatron-LM tag core_v0.16.1; any other version is refused
with a message):
  initialize_megatron       - the plugin's flags join the caller's extra_args_provider
                              (chained, never replaced); the plugin's config is validated
                              once, before any model is built
  setup_model_and_optimizer - the stage handle (`MegatronLMStage`) and the controller
                              are built on what it returns; the optimizers' gradient
                              norm summed exactly, whichever rank holds which gradient
                              (`grad_norm`)
  build_train_valid_test_data_iterators
                            - with MTP on three or more pipeline ranks, batches on every
                              rank, so the block moves live (megatron_lm_data)
  train_step                - the controller's before_step/after_step around every step
  train                     - the report is completed and the writers flushed at the end
  checkpointing.generate_state_dict
                            - frozen parameters' optimizer rows filled in what a save writes
`train()` keeps `model` (a list of DDP chunks: more than one with virtual pipeline stages)
and `optimizer` (a ChainedOptimizer) as locals for the whole loop, so a migration changes
nothing train() holds by reference: the new DDP wrappers replace the chunks in the same
list, and the same ChainedOptimizer
object (which train(), the OptimizerParamScheduler and `config.grad_scale_func` hold)
is re-initialised over the new inner optimizers. Per-layer timings and rebalance events
go to Megatron-LM's TensorBoard / W&B writers (scalars `dynmo/...` at the iteration)
and, through the profiling window's timer tap, into Megatron-LM's Timers.

This module holds `enable()` / `disable()`, the check of which Megatron-LM is there
(`use_source`, `check_version`) and the run the hooks drive (`_Run`: the controller,
scenario and report, built by `assemble()`). Its parts have their own modules:
`megatron_lm_flags` (the --dynmo* flags in Megatron-LM's parser), `megatron_lm_args`
(the parsed args checked and read), `megatron_lm_data` (batches on every rank for live
MTP moves), `megatron_lm_wrappers` (the six wrapped functions,
train_step's among them), `megatron_lm_stage` (the stage handle over Megatron-LM's model),
`megatron_lm_checkpoint` (resuming under the saved layout), `megatron_lm_writers`
(TensorBoard / W&B scalars); their state is `megatron_lm_hooks`'.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import re
import sys
import time
from typing import Optional

from dynmo_plugin.config import RunConfig
from dynmo_plugin.integrations.megatron_lm_args import (SCENARIO_SPECS, SPEC_MODULE, forced_mtp_move,
                                                        load_plugin_config, move_notes, set_layout,
                                                        use_native_moe_spec)
from dynmo_plugin.integrations.megatron_lm_checkpoint import refuse_scenario_resume, restore_saved_layout
from dynmo_plugin.integrations.megatron_lm_flags import add_args, chain_flags
from dynmo_plugin.integrations.megatron_lm_hooks import MegatronLMError
from dynmo_plugin.integrations.megatron_lm_hooks import hooks as _hooks
from dynmo_plugin.integrations.megatron_lm_stage import MegatronLMStage
from dynmo_plugin.integrations.megatron_lm_writers import Writers, WritersReport, event_scalars
from dynmo_plugin.integrations.megatron_lm_wrappers import wrappers
from dynmo_plugin.layout import Layout

# enable() and the run it drives are this module's; the other names are re-exported from
# the modules that hold them (flags, args, checkpoint, stage, writers), where users, docs
# and tests have found them.
__all__ = ["enable", "disable", "is_enabled", "use_source", "check_version", "add_args",
           "notify_event", "MegatronLMStage", "MegatronLMError", "event_scalars",
           "SUPPORTED_CORE", "SUPPORTED_TAG", "SOURCE_ENV", "SPEC_MODULE", "SCENARIO_SPECS",
           "load_plugin_config", "restore_saved_layout", "refuse_scenario_resume",
           "use_native_moe_spec", "move_notes"]

_chain = chain_flags  # its name here before the split (tests build parsers with it)

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
    "build_train_valid_test_data_iterators": ("build_train_valid_test_datasets_provider",),
    "train_step": ("forward_step_func", "data_iterator", "model", "optimizer",
                   "opt_param_scheduler", "config", "forward_backward_func", "iteration"),
    "train": ("forward_step_func", "model", "optimizer", "opt_param_scheduler",
              "train_data_iterator", "valid_data_iterator", "process_non_loss_data_func",
              "config", "checkpointing_context", "non_loss_data_func", "inference_model"),
    "checkpointing.generate_state_dict": ("args", "model", "optimizer", "opt_param_scheduler",
                                          "rng_state", "iteration", "optim_sd_kwargs",
                                          "model_sd_kwargs", "rerun_state"),
}


def _home(mtt, name: str) -> tuple:
    """(module, attribute) of a wrapped function: `megatron.training.training`'s, or a
    dotted name's under `megatron.training` ("checkpointing.generate_state_dict")."""
    if "." not in name:
        return mtt, name
    import importlib
    module, attribute = name.rsplit(".", 1)
    return importlib.import_module(f"megatron.training.{module}"), attribute


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
        fn = getattr(*_home(mtt, name), None)
        params = tuple(inspect.signature(fn).parameters) if callable(fn) else None
        if params != expected:
            shown = "missing" if params is None else f"{name}({', '.join(params)})"
            raise MegatronLMError(
                f"megatron.training.{name if '.' in name else 'training.' + name} is {shown}, not "
                f"{name}({', '.join(expected)}) "
                f"as in Megatron-LM {SUPPORTED_TAG}: this Megatron-LM is a version the "
                f"integration does not know; use the tag {SUPPORTED_TAG}")
    return mtt


# ---- one run inside pretrain() ----------------------------------------------------------------
class _Run:
    """The controller and what it needs, built after setup_model_and_optimizer."""

    def __init__(self, cfg: RunConfig, args, chunks: list, optimizer, scheduler):
        from dynmo_plugin.assembly import assemble

        self.args, self.cfg = args, cfg
        self.stage = MegatronLMStage(chunks, optimizer, scheduler, args)
        self.writers = Writers()
        self.iteration, self.restart = args.iteration, None
        self._completed = args.iteration  # the last step that ended (a resumed run: the loaded one)
        new_report = functools.partial(
            WritersReport, path=os.path.join(args.dynmo_output, "report.json"),
            config={"dynmo": dataclasses.asdict(cfg.dynmo), "megatron_lm": _run_settings(args)},
            sink=self.writers.event)
        parts = assemble(cfg.dynmo, self.stage, new_report, iteration=args.iteration,
                         scenario=_scenario(cfg, self.stage), repacker=self._checkpoint_repack,
                         layout_listeners=[self._layout_changed])
        self.control, self.migrator, self.report = parts.control, parts.migrator, parts.report
        self.controller, self.scenario = parts.dynmo, parts.scenario
        self._start = 0.0
        from megatron.training.utils import print_rank_0
        for note in move_notes(args, cfg):
            print_rank_0(f" dynmo: note: {note}")

    def data_built(self, everywhere: bool) -> None:
        """After Megatron-LM built its data iterators (every rank alike): the MTP block
        moves live where every rank has batches (megatron_lm_data); otherwise it stays,
        and a forced layout that moves it cannot run.

        Raises:
            MegatronLMError: a forced layout moves the block but some rank has no data.
        """
        self.stage.mtp_moves_live = everywhere
        if not everywhere and forced_mtp_move(self.cfg):
            raise MegatronLMError(
                "a forced layout moves the MTP block to another rank, but the dataset provider "
                "built no data on some pipeline rank of tensor rank 0: build on every such rank "
                "(pretrain_gpt.py's provider does under --dynmo), or force layouts that keep "
                "the block where it starts")

    def _layout_changed(self) -> None:
        """Megatron-LM's args (saved with its checkpoints; pretrain_gpt.py's get_batch reads
        the MTP rank from them) follow the new layout, as the string its parser gives: the
        config's PipelineParallelLayerLayout object in the args would make the checkpoint
        unreadable by Megatron-LM's weights-only loader. The first/last-stage counts and
        account-for flags and virtual-stage counts the run started with go (`set_layout`)."""
        set_layout(self.args, str(self.stage.layout))

    def _checkpoint_repack(self, layout: Layout, iteration: int, info: dict):
        """A repack onto `layout` (fewer pipeline ranks), in checkpoint mode: Megatron-LM's
        own exit path saves a checkpoint after this iteration (`args.exit_interval`: its
        checkpoint_and_decide_exit saves with --save and train() exits), whose args carry
        `dynmo_next_layout` for the restart's --load (restore_saved_layout); every rank
        decides alike (the controller's decision is collective)."""
        from dynmo_plugin.megatron.migration.repack import RepackResult
        d, args = self.stage.dims, self.args
        world = d.world_size // d.pp * layout.num_ranks  # each stage's TP x CP x DP ranks
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

    def rerun_started(self, iteration: int) -> None:
        """Megatron-LM runs this step's forward and backward again in place (its rerun
        state machine): the scenario starts its counts over, the controller drops a
        window that timed the first run."""
        self.controller.rerun_started(iteration)
        if self.scenario is not None:
            self.scenario.rerun_started(iteration)

    def after_step(self, iteration: int, result) -> None:
        """As the launcher's step: the scenario's event (reported, and the controller
        told: it profiles and rebalances), then the controller's own step end."""
        self._completed = iteration
        self.controller.step_done()
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
        try:
            self.controller.finish(self._completed)
        finally:
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
            "fp16", "transformer_impl", "use_distributed_optimizer", "recompute_granularity",
            "recompute_method", "recompute_num_layers")
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
    # Megatron-Core's MoE router reads te_general_gemm, bound only when Transformer Engine
    # imports: without TE (on CUDA too) Megatron-LM's own MoE would die with a NameError
    from dynmo_plugin.megatron.training.te_names import bind_missing_te_names
    bind_missing_te_names()
    for name, make in wrappers(make_run=_Run).items():
        module, attribute = _home(mtt, name)
        original = getattr(module, attribute)
        _hooks.originals[name] = original
        setattr(module, attribute, functools.wraps(original)(make(original)))
    _skip_helper_build()


def disable() -> None:
    """Restore Megatron-LM's functions (and Megatron-Core's gradient norm) and forget the run."""
    if not is_enabled():
        return
    import megatron.training.training as mtt
    for name, original in _hooks.originals.items():
        setattr(*_home(mtt, name), original)
    _hooks.originals.clear()
    from dynmo_plugin.megatron.training import grad_norm, grad_reduce
    grad_norm.uninstall()
    grad_reduce.uninstall()
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
