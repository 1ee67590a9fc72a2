"""One stage's model and optimizer through Megatron-Core's `dist_checkpointing`.

The checkpoint holds Megatron's sharded state dicts: `GPTModel.sharded_state_dict()`
keys every decoder tensor by its GLOBAL layer (a pipeline axis of length num_layers,
offset `layer_number - 1`), and the Megatron optimizer's `sharded_state_dict` keys
each parameter's state by the model key it belongs to. So a stage of any layout —
including one whose layers a migration brought from elsewhere — writes its slice of
the same global tensors, and a stage of any other layout or pipeline size reads its
own slice back. The tied output weight is the embedding's replica; DP replicas and
TP shards carry Megatron's replica ids, so each tensor is written exactly once.

Saving uses the `torch_dist` format (readable by Megatron's default loader) but
writes in the calling process: Megatron's own torch_dist save strategy starts a
`spawn` multiprocessing Manager and forks writer processes on every save, which took
21-33 s for the first save of a 1.5 MB checkpoint on this loaded 2-core machine
(0.4-2.5 s in process; docs/checkpoints.md).

Not in Megatron's state dicts, so kept by the caller (megatron.checkpoint's meta):
which parameters are frozen, the layout, the scheduler, the scenario and data state.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path
from typing import Optional

import torch
import torch.distributed.checkpoint as dcp
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor
from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess, save_preprocess
from megatron.core.dist_checkpointing.utils import extract_sharded_base
from megatron.core.dist_checkpointing.validation import (determine_global_metadata,
                                                         validate_sharding_integrity)
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.strategies.base import SaveShardedStrategy
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner, _replace_state_dict_keys_with_sharded_keys, mcore_to_pyt_state_dict)

__all__ = ["check_sharding", "save_sharded", "load_sharded", "sharded_state", "read_tensors",
           "OPTIMIZER_METADATA", "frozen_placeholders", "local_steps", "agreed_steps", "steps_where_none",
           "pop_step_holders"]

_MASK_SUFFIX = "_mask"
# Optimizer state keyed by model parameter whatever the layout: the distributed
# optimizer's 'fully_reshardable' form (gathered over DP on save, canonical per
# parameter; its default 'fully_sharded_model_space' uses flattened ranges, which
# Megatron 0.16's dist_checkpointing refuses), and no per-chain-index key prefix.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable",
                      "chained_optim_avoid_prefix": True}


class _InProcessTorchDist(SaveShardedStrategy):
    """Megatron's torch_dist format written by torch.distributed.checkpoint in this
    process (one file per rank, fsync'ed), with Megatron's own key translation and
    save planner, so `dist_checkpointing.load`'s default strategy reads it."""

    def __init__(self):
        super().__init__("torch_dist", 1)

    def save(self, sharded_state_dict, checkpoint_dir) -> None:
        by_key, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, True)
        dcp.save(mcore_to_pyt_state_dict(by_key, False),
                 storage_writer=dcp.FileSystemWriter(str(checkpoint_dir), thread_count=1),
                 planner=MCoreSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False))

    def can_handle_sharded_objects(self) -> bool:
        return True


def _masks_follow_weights(sharded: dict) -> None:
    """A buffer `<name>_mask` (pruning masks) is sharded like `<name>`.

    Megatron's linear layers shard only `weight`/`bias` over TP and declare every
    other entry replicated; a mask has its weight's local shape, so under TP > 1 it
    must take the weight's global shape and offsets, or one TP rank's mask would be
    saved for all."""
    for key, value in list(sharded.items()):
        owner = sharded.get(key[: -len(_MASK_SUFFIX)]) if key.endswith(_MASK_SUFFIX) else None
        if (isinstance(value, ShardedTensor) and isinstance(owner, ShardedTensor)
                and value.local_shape == owner.local_shape and value.flattened_range is None):
            sharded[key] = dataclasses.replace(owner, key=value.key, data=value.data, dtype=value.dtype)


def _init_adam_state(optimizer) -> None:
    """Give a fresh optimizer the state one Adam step creates (zero moments, step 0).

    Without Apex or Transformer Engine (CPU), `DistributedOptimizer.state_dict` reads
    the step from the per-parameter state and asserts it exists, which a never-stepped
    optimizer lacks; loading replaces all of it."""
    import torch

    from dynmo_plugin.megatron.migration.optim_state import megatron_optimizers
    for opt in megatron_optimizers(optimizer):
        inner = opt.optimizer
        for group in inner.param_groups:
            for p in group["params"]:
                if not inner.state[p]:
                    inner.state[p] = {"step": torch.zeros((), dtype=torch.float32),
                                      "exp_avg": torch.zeros_like(p.data),
                                      "exp_avg_sq": torch.zeros_like(p.data)}


def sharded_state(trainer, loading: bool, steps: Optional[list] = None) -> dict:
    """{'model': ..., 'optimizer': ..., 'frozen_optimizer_state': ...}: the stage's
    sharded state dicts (tensors by reference; with `loading`, the optimizer's state is
    created first to load into). Local: it may raise on this rank alone, so callers
    agree on it before any collective.

    Frozen parameters have no optimizer state, yet Megatron keys a decoder tensor's
    state by its GLOBAL layer: with layers 1-2 frozen no rank would write (or read)
    rows 0-1 of `optimizer.state.exp_avg.decoder...` and Megatron's sharding check
    fails, on rank 0 only. So a frozen parameter's state is written as zeros, and read
    back into throw-away zeros: a placeholder no optimizer uses.

    `steps` (saving; `agreed_steps`): Adam's step per chained optimizer, for a stage
    that holds none. Loading, the checkpoint's step replaces a placeholder."""
    model = _model_state(trainer)
    if loading:
        _init_adam_state(trainer.optimizer)
        steps = [torch.zeros((), dtype=torch.float32)] * len(local_steps(trainer.optimizer))
    with steps_where_none(trainer.optimizer, steps or []):
        optimizer = trainer.optimizer.sharded_state_dict(model, is_loading=loading,
                                                         metadata=dict(OPTIMIZER_METADATA))
    pop_step_holders(optimizer)
    state = {"model": model, "optimizer": optimizer}
    state["frozen_optimizer_state"] = frozen_placeholders(trainer, state)
    return state


def local_steps(optimizer) -> list:
    """Adam's step per chained optimizer on this rank (None: it holds no Adam state, e.g.
    every parameter of the stage is frozen). Gather it over the ranks: `agreed_steps`."""
    from dynmo_plugin.megatron.migration.optim_state import megatron_optimizers
    steps = [next((s["step"] for s in opt.optimizer.state.values() if "step" in s), None)
             for opt in megatron_optimizers(optimizer)]
    return [None if s is None else torch.as_tensor(s).detach().cpu() for s in steps]


def agreed_steps(gathered: list[list]) -> list:
    """Per chained optimizer, the step every rank's `local_steps` that has one agrees on.

    Raises:
        ValueError: when ranks hold different steps (on every rank: same input)."""
    out = []
    for i in range(max(map(len, gathered), default=0)):
        known = [steps[i] for steps in gathered if i < len(steps) and steps[i] is not None]
        if any(not torch.equal(torch.as_tensor(s), torch.as_tensor(known[0])) for s in known):
            raise ValueError(f"chained optimizer {i}: ranks hold different Adam steps "
                             f"{sorted({float(s) for s in known})}")
        out.append(known[0] if known else None)
    return out


_STEP_HOLDER = "dynmo-step"  # a state key torch keeps as is (not a parameter)


@contextlib.contextmanager
def steps_where_none(optimizer, steps: list):
    """Megatron saves Adam's step once, in the common state, which rank 0 alone writes,
    and reads it from the shard's Adam state. A stage whose parameters are all frozen
    (layer freezing's prefix can fill the first stage) holds no such state: the fp32
    and mixed-precision optimizers then leave the step out (the checkpoint lacked it
    and the other stages failed to load: KeyError 'step'), the distributed one asserts.
    So such an optimizer holds the agreed step, under a key that is no parameter, while
    Megatron builds its state dict."""
    from dynmo_plugin.megatron.migration.optim_state import megatron_optimizers
    empty = [(opt.optimizer, step) for opt, step in zip(megatron_optimizers(optimizer), steps)
             if step is not None and not opt.optimizer.state]
    for inner, step in empty:
        inner.state[_STEP_HOLDER] = {"step": step.clone()}
    try:
        yield
    finally:
        for inner, _ in empty:
            inner.state.pop(_STEP_HOLDER, None)


def pop_step_holders(optimizer_state: dict) -> None:
    """Take the steps `steps_where_none` lent out of an optimizer state dict built under
    it (Megatron keeps a state entry it does not know as it is: rank 0 would write it to
    common.pt and every rank read it back as a state key of no parameter)."""
    _pop_everywhere(optimizer_state, _STEP_HOLDER)


def _pop_everywhere(value: dict, key) -> None:
    """Remove `key` from `value` and every dict nested in it."""
    value.pop(key, None)
    for v in value.values():
        if isinstance(v, dict):
            _pop_everywhere(v, key)


def _model_state(trainer) -> dict:
    """The model's sharded state dict; interleaved, one per model chunk under
    `chunk<c>`. The grouping is local only: each chunk keys its tensors by global layer
    (Megatron offsets a chunk's layers by its `vp_stage`), the checkpoint keeps only
    those keys and no model entry outside them (common.pt holds optimizer entries), so
    a checkpoint saved under any number of chunks loads into any other."""
    states = [_chunk_state(chunk) for chunk in trainer.chunks]
    for state in states:
        _masks_follow_weights(state)
    return states[0] if len(states) == 1 else {f"chunk{c}": s for c, s in enumerate(states)}


def _chunk_state(chunk) -> dict:
    """One chunk's sharded state dict. An MTP stage needs the metadata's dp_cp_group:
    GPTModel.sharded_state_dict reads it for the MTP embedding copy without filling it in
    (megatron-core 0.16.1 fills only the copy it hands its parent class). Its own
    position table (not the first stage's: nothing keeps the two equal) is saved under
    its global name (`training.mtp.MTP_POSITION_NAME`), not as a second copy of the first
    stage's key, which Megatron's sharding check refuses."""
    if not getattr(chunk, "mtp_process", False):
        return chunk.sharded_state_dict()
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

    from dynmo_plugin.megatron.training.mtp import MTP_POSITION_NAME
    state = chunk.sharded_state_dict(metadata=ensure_metadata_has_dp_cp_group(None))
    table = state.get("embedding.position_embeddings.weight")
    if table is not None and not getattr(chunk, "pre_process", False):
        table.key = MTP_POSITION_NAME
    return state


def check_sharding(state: dict, loading: bool) -> None:
    """Collective: Megatron's sharding check of `state` (`sharded_state`) over every
    rank: each tensor covered exactly once. It raises on rank 0 ONLY, so callers agree
    on it before `save_sharded`/`load_sharded`: a rank that went on into their
    collectives would wait there for ever."""
    if loading:
        state, _, _ = load_preprocess(state)  # a copy: the load preprocesses again
        state, _ = extract_sharded_base(state)
        validate_sharding_integrity(determine_global_metadata(state)[1])
    else:
        save_preprocess(state, validate_access_integrity=True)


def save_sharded(state: dict, directory: str) -> None:
    """Collective: every rank writes its main-replica shards of `state` (`sharded_state`,
    passed by `check_sharding`) into `directory` (exists, empty). Raises what
    torch.distributed.checkpoint raises, on every rank."""
    dist_checkpointing.save(state, directory, sharded_strategy=_InProcessTorchDist(),
                            validate_access_integrity=False)


def frozen_placeholders(trainer, state: dict) -> dict:
    """Optimizer-state tensors for this stage's frozen parameters, keyed and sharded as
    Megatron keys a trainable parameter's (`optimizer.state.<kind>.<model key>`, the
    model tensor's replica id: one writer): Adam's moments zero, the master weights
    (`param`, `fp32_param`) the parameter's own values in fp32, so a load that trains
    the layer again starts from its weights, not from zeros. Kinds: those this rank's
    optimizer holds, else what Adam holds under this configuration. Tensors a factory
    shards (Megatron's fused SwiGLU fc1: `_w` and `_v` halves) get the factory's
    placeholder. `trainer`: a stage (its `chunks` and `args`); `state`: its sharded
    "model" (nested per chunk as one likes) and "optimizer" state dicts (`sharded_state`;
    Megatron-LM's save: megatron_lm_checkpoint.frozen_optimizer_state)."""
    frozen = {id(p) for chunk in trainer.chunks for p in chunk.parameters() if not p.requires_grad}
    if not frozen:
        return {}
    kinds = sorted({t.key.split(".")[2] for t in _sharded_tensors(state["optimizer"])
                    if t.key.startswith("optimizer.state.")})
    if not kinds:
        args = trainer.args
        extra = ("param",) if args.use_distributed_optimizer else (
            ("fp32_param",) if args.bf16 or args.fp16 else ())
        kinds = ["exp_avg", "exp_avg_sq", *extra]
    out = {}
    for key, model_tensor in _sharded_items(state["model"]):
        if id(model_tensor.data) in frozen:
            for kind in kinds:  # on the host: a save must not need device memory for them
                value = (model_tensor.data.detach().to("cpu", torch.float32, copy=True)
                         if kind in _MASTER_WEIGHTS else
                         torch.zeros(tuple(model_tensor.data.shape), dtype=torch.float32))
                out[f"{kind}.{key}"] = make_sharded_optimizer_tensor(
                    model_tensor, value, prefix=f"optimizer.state.{kind}")
    return out


# the optimizer-state kinds that are the fp32 master copy of a parameter (the
# mixed-precision optimizer's, the distributed one's fully reshardable format)
_MASTER_WEIGHTS = ("param", "fp32_param")


def _sharded_items(value, prefix: str = ""):
    """(dotted path, ShardedTensor or ShardedTensorFactory) for every one in a nested
    dict: the path is unique on the rank where sharded keys are not (a chunk's layers
    share theirs)."""
    for k, v in value.items():
        if isinstance(v, (ShardedTensor, ShardedTensorFactory)):
            yield f"{prefix}{k}", v
        elif isinstance(v, dict):
            yield from _sharded_items(v, f"{prefix}{k}.")


def _sharded_tensors(value):
    """Every ShardedTensor in a nested state dict."""
    if isinstance(value, ShardedTensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _sharded_tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _sharded_tensors(v)


def load_sharded(trainer, state: dict, directory: str) -> None:
    """Collective: load this stage's slice of the model and optimizer from `directory`
    into `state` (`sharded_state(trainer, loading=True)`, passed by `check_sharding`).

    Build `state` after the optimizer covers exactly the parameters that should train
    (frozen ones excluded): the optimizer state is matched to its parameters by model key.
    """
    loaded = dist_checkpointing.load(state, str(Path(directory)), validate_access_integrity=False)
    chunks = trainer.chunks
    for c, chunk in enumerate(chunks):
        chunk.load_state_dict(loaded["model"] if len(chunks) == 1 else loaded["model"][f"chunk{c}"],
                              strict=True)
    _load_optimizer(trainer.optimizer, loaded["optimizer"])


def _load_optimizer(optimizer, state: dict) -> None:
    """`optimizer.load_state_dict(state)`, around a Megatron 0.16 bug of the distributed
    optimizer without Apex/TE (torch Adam, e.g. on CPU): its load puts Adam's `step` into
    every parameter's state, then copies the per-parameter tensors of the checkpoint
    over ALL state entries, `step` included, which the checkpoint's entries never hold
    (KeyError 'step'). So the parameter state is loaded with `step` set aside."""
    from megatron.core.optimizer.distrib_optimizer import HAVE_APEX_OR_TE, DistributedOptimizer

    from dynmo_plugin.megatron.migration.optim_state import megatron_optimizers
    chain = list(megatron_optimizers(optimizer))
    if HAVE_APEX_OR_TE or not any(isinstance(o, DistributedOptimizer) for o in chain):
        optimizer.load_state_dict(state)
        return
    for opt, part in zip(chain, [state] if len(chain) == 1 else [state[i] for i in range(len(chain))]):
        if not isinstance(opt, DistributedOptimizer):
            opt.load_state_dict(part)
            continue
        param_state = part.pop("param_state")
        kind = part.pop("param_state_sharding_type")
        if kind != OPTIMIZER_METADATA["distrib_optim_sharding_type"]:
            raise ValueError(f"distributed optimizer state saved as {kind!r}, expected "
                             f"{OPTIMIZER_METADATA['distrib_optim_sharding_type']!r}")
        opt.load_state_dict(part)  # param groups, step, grad scaler; placeholder tensors
        steps = {p: s.pop("step") for p, s in opt.optimizer.state.items() if "step" in s}
        opt.load_parameter_state_from_fully_reshardable(param_state)
        for p, step in steps.items():  # Megatron set ONE tensor for all: Adam would add
            opt.optimizer.state[p]["step"] = step.clone()  # 1 to it once per parameter


def read_tensors(directory: str) -> dict:
    """Every tensor of the checkpoint in `directory` by its global key, read in this
    process without a process group (tests, inspection): model tensors stack the
    decoder layers on a leading axis; optimizer state is under
    `optimizer.state.<kind>.<model key>`; tensors of the common state (rank 0's, e.g.
    `optimizer.state.common_step`) by their dotted path."""
    import tempfile

    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "all.pt")
        dcp_to_torch_save(directory, path)
        state = torch.load(path, weights_only=False)
    tensors = {k: v for k, v in state.items() if torch.is_tensor(v)}
    _flatten(torch.load(os.path.join(directory, "common.pt"), weights_only=False), "", tensors)
    return tensors


def _flatten(value, prefix: str, out: dict) -> None:
    import torch
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(v, f"{prefix}{k}.", out)
    elif torch.is_tensor(value):
        out[prefix[:-1]] = value
