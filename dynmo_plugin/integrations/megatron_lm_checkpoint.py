"""Megatron-LM's checkpoints under the plugin: a rebalanced (or checkpoint-repacked) run
resumes under the layout it saved (`restore_saved_layout`), a per-rank checkpoint is
never loaded under another split, and a scenario whose state the checkpoint lacks is
not resumed (`refuse_scenario_resume`). Both run before Megatron-LM validates its args.
"""
from __future__ import annotations

import contextlib
import logging
import os

from dynmo_plugin.config import RunConfig
from dynmo_plugin.config.checks import recompute_block, split_blocks
from dynmo_plugin.integrations.megatron_lm_args import SCENARIO_SPECS, set_layout
from dynmo_plugin.integrations.megatron_lm_hooks import MegatronLMError
from dynmo_plugin.layout import Layout

__all__ = ["restore_saved_layout", "refuse_scenario_resume", "frozen_optimizer_state", "steps_everywhere"]

logger = logging.getLogger("dynmo_plugin.integrations.megatron_lm")  # the integration's logger

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
        # mmap: only the args are read, not rank 0's weights and optimizer state
        return "torch", torch.load(files[0], map_location="cpu", weights_only=False, mmap=True).get("args")
    return ("torch_dcp" if os.path.isfile(os.path.join(folder, ".metadata")) else "unknown"), None


def _virtual_stages(args) -> int:
    """Virtual stages per pipeline rank that these (not yet validated) args ask for,
    counted as validate_args counts them: the embedding and the loss take a layer's
    place each with --account-for-embedding/loss-in-pipeline-split."""
    if args.num_virtual_stages_per_pipeline_rank:
        return args.num_virtual_stages_per_pipeline_rank
    if args.num_layers_per_virtual_pipeline_stage:
        places = (args.num_layers + bool(getattr(args, "account_for_embedding_in_pipeline_split", False))
                  + bool(getattr(args, "account_for_loss_in_pipeline_split", False)))
        return places // args.pipeline_model_parallel_size // args.num_layers_per_virtual_pipeline_stage
    return 1


def restore_saved_layout(args) -> None:
    """With --dynmo and --load: the layout the checkpoint was saved under (a rebalanced
    run resumes rebalanced), set in Megatron-LM's args before validate_args, as the
    launcher restores it (docs/checkpoints.md): an explicit --pipeline-model-parallel-
    layout wins; a saved layout without this run's pp x v stages (another pipeline
    size) leaves Megatron-LM's own split. torch_dist checkpoints key layers by global
    number, so any split loads them. Without --dynmo (the hooks installed, the plugin
    off) the per-rank check below still runs: Megatron-LM's strict=False fallback loaded
    a moved run's per-rank checkpoint under its uniform split with layers in the wrong
    stages and no error (survey 22b).

    Raises:
        MegatronLMError: a per-rank checkpoint (--ckpt-format torch / torch_dcp numbers
            layers within each stage) that this run would load under another split; a
            saved layout that splits this run's uniform recompute chunks (`recompute_block`).
    """
    if not args.load:
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
    dynmo = getattr(args, "dynmo__enabled", False)
    if (dynmo and args.pipeline_model_parallel_layout is None and fitting
            and getattr(saved, "num_layers", None) == args.num_layers):
        chosen = fitting[0]
        why = split_blocks(Layout.parse(chosen), recompute_block(args))
        if why:
            raise MegatronLMError(f"--load {args.load}: its saved layout {chosen}: {why}; give a "
                                  "--pipeline-model-parallel-layout of whole chunks, or another "
                                  "--recompute-num-layers")
        set_layout(args, chosen)
        logger.info("--load %s: resuming under the saved layout %s", args.load, chosen)
    if fmt not in _PER_RANK_FORMATS:
        return
    saved_split = None if saved is None else _split(saved, saved_layout)
    run_split = _split(args, args.pipeline_model_parallel_layout)
    if saved_split != run_split:
        resume = ("resume with the saved pipeline sizes and split flags and no "
                  "--pipeline-model-parallel-layout" if dynmo else
                  "resume with --dynmo (it restores the saved layout) or with "
                  f"--pipeline-model-parallel-layout '{saved_layout}'" if saved_layout else
                  "resume with the saved pipeline sizes and split flags")
        raise MegatronLMError(
            f"--load {args.load}: a --ckpt-format {fmt} checkpoint (layers numbered within each "
            f"stage) saved under {_shown(saved_split)} cannot be loaded under this run's "
            f"{_shown(run_split)} without putting other layers' weights into its stages (Megatron "
            f"loads them without an error); {resume}, or save in --ckpt-format torch_dist (layers "
            "keyed by global number, any split)")


def _split(args, layout) -> tuple:
    """What decides which layers each stage of a per-rank checkpoint holds: the layout,
    the pipeline and tensor sizes, the first/last-stage counts, the account-for flags and
    the virtual stages (however they were asked for), as the flags were given."""
    return (layout, getattr(args, "pipeline_model_parallel_size", None),
            getattr(args, "tensor_model_parallel_size", None),
            tuple((key, getattr(args, key, None) or None) for key in _UNEVEN_SPLITS),
            None if layout is not None else _virtual_stages(args))


# the flags beside pipeline sizes that split the layers unevenly (unset: None or False)
_UNEVEN_SPLITS = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                  "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")


def _shown(split) -> str:
    if split is None:
        return "an unknown split (no args in the checkpoint)"
    layout, pp, tp, uneven, vstages = split
    flags = "".join(f" --{key.replace('_', '-')}" + ("" if value is True else f" {value}")
                    for key, value in uneven if value)
    virtual = f", {vstages} virtual stages per rank" if vstages and vstages > 1 else ""
    return f"layout {layout or 'uniform'}{flags} at PP {pp}, TP {tp}{virtual}"


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


def frozen_optimizer_state(stage, args, state: dict) -> dict:
    """What Megatron-LM's torch_dist save adds for frozen parameters (layer freezing):
    {"dynmo_frozen_optimizer_state": placeholders} or nothing. Megatron keys a decoder
    tensor's optimizer state by its GLOBAL layer, one row per layer: a frozen layer has
    none, the rows no rank writes fail Megatron's sharding check ("Invalid access
    pattern") and the save raised on every rank. The placeholders fill those rows as the
    launcher's checkpoints do (`dist_ckpt.frozen_placeholders`: moments zero, master
    weights the layer's own); a load that trains the layers again reads them as their
    state. The distributed optimizer's default (dp_reshardable) saves per gradient
    bucket, where a frozen parameter leaves no gap.

    `state`: generate_state_dict's (its "model"/"model<i>" and "optimizer" entries); the
    step `steps_everywhere` lent is taken out of its optimizer entry here."""
    from dynmo_plugin.megatron.checkpoint.dist_ckpt import frozen_placeholders, pop_step_holders
    if isinstance(state.get("optimizer"), dict):
        pop_step_holders(state["optimizer"])
    if args.ckpt_format != "torch_dist" or "optimizer" not in state or (
            args.use_distributed_optimizer and not args.dist_ckpt_optim_fully_reshardable):
        return {}
    models = {k: v for k, v in state.items() if k == "model" or (k.startswith("model") and k[5:].isdigit())}
    placeholders = frozen_placeholders(stage, {"model": models, "optimizer": state["optimizer"]})
    placeholders.update(_masters_of_emptied_groups(state["optimizer"]))
    return {"dynmo_frozen_optimizer_state": placeholders} if placeholders else {}


def _masters_of_emptied_groups(optimizer_state: dict, path: str = "") -> dict:
    """The mixed-precision optimizer's fp32 master weights (`fp32_from_fp16_params`, a
    list per parameter group), taken out of its state dict where freezing left a group
    empty, keyed by where they were. Megatron's save keeps an empty list in the common
    state rank 0 writes (a sharded tensor list leaves nothing there): a stage whose
    parameters all froze wrote `[[]]`, and a resume without the scenario, whose group
    holds parameters, failed to merge them ("Cannot merge two lists with different
    lengths"). The tensors keep their sharded keys wherever they sit in the dict, so the
    checkpoint holds the same masters; the resume's own list then meets nothing."""
    moved = {}
    for key, value in list(optimizer_state.items()):
        if isinstance(value, dict):  # a chained optimizer's entries
            moved.update(_masters_of_emptied_groups(value, f"{path}{key}."))
        elif key == "fp32_from_fp16_params" and any(group == [] for group in value):
            del optimizer_state[key]
            moved.update({f"{path}{key}.{g}.{i}": tensor for g, group in enumerate(value)
                          for i, tensor in enumerate(group)})
    return moved


@contextlib.contextmanager
def steps_everywhere(control, args, optimizer):
    """Around Megatron-LM's torch_dist save: every chained optimizer holds Adam's step
    while the save builds its state dict, a stage whose parameters are all frozen too.
    Megatron writes the step once, from the shard's Adam state: such a stage holds none,
    and the distributed optimizer asserted there (the others leave it out, and a load
    fails on it). The step every other rank holds is lent (`dist_ckpt.steps_where_none`).
    Collective over `control` (every rank builds a torch_dist state dict)."""
    if args.ckpt_format != "torch_dist" or args.no_save_optim or optimizer is None:
        yield
        return
    from dynmo_plugin.megatron.checkpoint.dist_ckpt import agreed_steps, local_steps, steps_where_none
    steps = agreed_steps(control.all_gather(local_steps(optimizer), "megatron-lm-save-steps"))
    with steps_where_none(optimizer, steps):
        yield
