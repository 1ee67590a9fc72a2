"""Where a model parameter's optimizer state lives inside Megatron's optimizer wrappers.

`get_megatron_optimizer` returns a ChainedOptimizer of FP32Optimizer (state keyed by
the model parameter itself) and/or Float16OptimizerWithFloat16Params (state keyed by an
fp32 master copy of each bf16/fp16 parameter). Profiling and migration both need
"the state of this parameter", including that master copy.

State that is not per parameter must survive a rebuild too: the `param_groups` entries
(learning rate set by a scheduler; `step` where fused Adam keeps it per group, as TE's
and Apex's FusedAdam do on GPU) and the fp16 loss scaler. `carry_optimizer_state`
moves those from the optimizer being replaced to its replacement.

With --use-distributed-optimizer (Megatron's DistributedOptimizer) each DP rank holds
only its shard of every state tensor and of every fp32 master weight, cut from the
flat gradient buffer without regard to parameter boundaries. Rebuilding DDP over a
changed layer set changes that buffer, so the shards of the layers that STAY move too,
not only those of the moved layers. The design is therefore: unshard, move, reshard.
`gather_param_states` gives every DP rank the full state of every parameter of its
stage (one all-reduce over the DP group: each rank writes its own ranges into zeroed
tensors, summed as integers so every bit, -0.0 included, arrives unchanged); the
migration then moves full tensors exactly as without sharding, and `put_param_state`
cuts each DP rank's new range out of them. Megatron's own
`get_parameter_state_dp_zero` / `load_parameter_state_from_dp_zero` do the same per
bucket, but keyed by the OLD buffer's layout, which the new optimizer does not share.
Cost: the full state of one stage is held transiently on each DP rank, what an
unsharded optimizer holds all the time.
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch
import torch.distributed as dist
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

__all__ = ["GatherAbandoned", "megatron_optimizers", "state_owner", "param_state", "state_nbytes", "local_state_pieces",
           "carry_optimizer_state", "gather_param_states", "put_param_state"]

# Keys that identify a Megatron param group (besides its position).
_GROUP_IDENTITY = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr")


def megatron_optimizers(optimizer) -> Iterator:
    yield from getattr(optimizer, "chained_optimizers", [optimizer])


def state_owner(optimizer, param: torch.nn.Parameter):
    """(inner torch optimizer, tensor its state is keyed by) for a model parameter, or
    None when the optimizer does not manage it (a frozen parameter)."""
    for opt in megatron_optimizers(optimizer):
        for model_group, main_group in zip(getattr(opt, "float16_groups", []),
                                           getattr(opt, "fp32_from_float16_groups", [])):
            for p, main in zip(model_group, main_group):
                if p is param:
                    return opt.optimizer, main
        for group in opt.optimizer.param_groups:
            if any(p is param for p in group["params"]):
                return opt.optimizer, param
    return None


def param_state(optimizer, param: torch.nn.Parameter) -> dict[str, torch.Tensor]:
    """Optimizer state tensors of `param` (e.g. exp_avg, exp_avg_sq, step), plus the fp32
    master copy under 'main_param' when training in bf16/fp16. Empty before the first
    step and for parameters the optimizer does not manage (frozen ones)."""
    owner = state_owner(optimizer, param)
    if owner is None:
        return {}
    inner, key = owner
    state = {k: v for k, v in inner.state.get(key, {}).items() if torch.is_tensor(v)}
    if key is not param:
        state["main_param"] = key.data
    return state


def state_nbytes(optimizer, param: torch.nn.Parameter) -> int:
    """Bytes of `param`'s optimizer state held on this rank (its shard when sharded)."""
    for opt in _distributed(optimizer):
        shard = _shard(opt, param)
        if shard is not None:
            main, _ = shard
            state = [t for t in opt.optimizer.state.get(main, {}).values() if torch.is_tensor(t)]
            if main.dtype != param.dtype:
                state.append(main)
            return sum(t.numel() * t.element_size() for t in state)
    return sum(t.numel() * t.element_size() for t in param_state(optimizer, param).values())


def local_state_pieces(optimizer, param: torch.nn.Parameter) -> Iterator[tuple[dict, Optional[torch.Tensor], slice]]:
    """(state dict, master tensor or None, slice of the flattened `param`) for each piece of
    `param`'s optimizer state held on THIS rank; local, no collective.

    Plain optimizers give one piece covering all of `param` (master: the fp32 copy of a
    bf16/fp16 weight, None for an fp32 one, whose state is keyed by `param` itself). The
    DistributedOptimizer gives this DP rank's contiguous range of the flattened `param`
    (its shard main param, a 1-D tensor of that range) or nothing where this rank owns no
    piece. Masking code (pruning) cuts `mask.reshape(-1)[piece]` and needs no special
    case for sharding. The state dict is empty before the first step."""
    for opt in _distributed(optimizer):
        shard = _shard(opt, param)
        if shard is not None:
            main, rng = shard
            yield opt.optimizer.state.get(main, {}), main, slice(rng.start, rng.end)
            return
        if any(param in b.param_index_map for b in opt.buffers):
            return  # managed here, but another DP rank owns all of it
    owner = state_owner(optimizer, param)
    if owner is not None:
        inner, key = owner
        yield inner.state.get(key, {}), (key if key is not param else None), slice(0, param.numel())


# ---- the distributed optimizer: full state from shards and back ---------------------------
def _distributed(optimizer) -> list[DistributedOptimizer]:
    return [o for o in megatron_optimizers(optimizer) if isinstance(o, DistributedOptimizer)]


def _shard(opt: DistributedOptimizer, param: torch.nn.Parameter):
    """(shard main param, its Range within the flattened `param`) on this DP rank, or
    None where this rank owns no piece of `param` (megatron-core 0.16 internals)."""
    index = opt.model_param_group_index_map.get(param)
    if index is None:
        return None
    group, order = index
    return (opt.optimizer.param_groups[group]["params"][order],
            opt._get_model_param_range_map(param)["param"])


def _state_keys(opt: DistributedOptimizer) -> list[str]:
    """The per-parameter state keys (Adam: exp_avg, exp_avg_sq, step), the same on every
    DP rank; empty before the first step."""
    local = next((sorted(k for k, v in s.items() if torch.is_tensor(v))
                  for s in opt.optimizer.state.values() if s), [])
    every: list = [None] * dist.get_world_size(opt.data_parallel_group)
    dist.all_gather_object(every, local, group=opt.data_parallel_group)
    return max(every, key=len)


class GatherAbandoned(RuntimeError):
    """Gathering the sharded optimizer state was abandoned on every DP rank of a stage
    because one of them could not allocate its part; nothing was communicated."""


def _gather_sharded(opt: DistributedOptimizer, params: list, on_allocated=None) -> dict:
    """Full state of each of `params` that `opt` manages, on every DP rank (collective).

    Allocate, agree, then communicate: the full fp32 state (12 B/param in bf16 Adam) is
    allocated and filled first, then the DP ranks agree on a one-word flag, and only
    then is it all-reduced. An out-of-memory on one DP rank thus raises on every DP
    rank of the stage instead of leaving its peers in an NCCL all-reduce it never
    joins (gloo hides that: a waiting peer times out; NCCL's watchdog kills the job).
    `on_allocated()` runs after the allocation (a test's fault injection)."""
    group = opt.data_parallel_group
    managed = [p for p in params if any(p in b.param_index_map for b in opt.buffers)]
    keys = _state_keys(opt)
    device = _collective_device(group, managed)
    ok = torch.ones(1, dtype=torch.int32, device=device)  # before the large allocation
    error: Optional[BaseException] = None
    try:
        flat, steps, layout = _local_pieces(opt, managed, keys, device)
        if on_allocated is not None:
            on_allocated()
    except Exception as e:  # noqa: BLE001 - every DP peer learns it through `ok`
        error = e
        ok.zero_()
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    if not ok.item():
        if error is not None:
            raise GatherAbandoned(f"optimizer state gather: {error!r}") from error
        raise GatherAbandoned("optimizer state gather: a data-parallel peer could not "
                              "allocate its part; nothing was sent")
    dist.all_reduce(flat.view(torch.int32), group=group)  # disjoint ranges
    dist.all_reduce(steps, op=dist.ReduceOp.MAX, group=group)
    full: dict = {p: {} for p in managed}
    for p, key, offset in layout:
        full[p][key] = flat[offset: offset + p.numel()].view(p.shape).to(p.device)
    if "step" in keys:
        steps = steps.cpu()
        for i, p in enumerate(managed):
            full[p]["step"] = torch.tensor(float(steps[i]), dtype=torch.float32)
    return full


def _local_pieces(opt: DistributedOptimizer, managed: list, keys: list[str],
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor, list]:
    """(flat fp32 tensor with this DP rank's ranges written, zeros elsewhere; per-param
    step; the (param, key, offset) layout of `flat`). Local: allocates, no collective."""
    moments = [k for k in keys if k != "step"]
    layout = []  # (param, key, offset) of each full fp32 tensor in `flat`
    size = 0
    for p in managed:
        for key in moments + (["main_param"] if p.dtype != torch.float32 else []):
            layout.append((p, key, size))
            size += p.numel()
    flat = torch.zeros(size, dtype=torch.float32, device=device)
    steps = torch.zeros(len(managed), dtype=torch.float64, device=device)
    for i, p in enumerate(managed):
        shard = _shard(opt, p)
        state = opt.optimizer.state.get(shard[0], {}) if shard is not None else {}
        if "step" in state:
            steps[i] = float(state["step"])
    for p, key, offset in layout:
        shard = _shard(opt, p)
        if shard is None:
            continue
        main, rng = shard
        value = main if key == "main_param" else opt.optimizer.state[main][key]
        if value.dtype != torch.float32:
            raise TypeError(f"distributed optimizer state {key} is {value.dtype}; only fp32 "
                            "state can be gathered (precision-aware optimizers are not supported)")
        flat[offset + rng.start: offset + rng.end] = value.detach().reshape(-1)
    return flat, steps, layout


def _collective_device(group, managed: list) -> torch.device:
    """Where tensors for a collective on `group` must live: NCCL moves CUDA tensors only,
    even when this stage's optimizer manages none of `managed` (a fully frozen stage,
    whose empty tensors would otherwise default to the CPU and make NCCL raise 'No
    backend type associated with device type cpu'); gloo takes the parameters' device."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return managed[0].device if managed else torch.device("cpu")


def gather_param_states(optimizer, params, on_allocated=None) -> dict:
    """{param: its full optimizer state} for `params`, as `param_state` gives it: moments,
    step and, for bf16/fp16 parameters, the fp32 master copy under 'main_param'.

    Collective over the DP group when `optimizer` is (or chains) a DistributedOptimizer:
    every DP rank of the stage must call it with the same parameters in the same order.
    Without one it is local, and the values are references to the live state.

    Raises:
        GatherAbandoned: on every DP rank of the stage when one of them could not
            allocate (nothing was communicated; see `_gather_sharded`).
    """
    params = list(params)
    states: dict = {}
    for opt in _distributed(optimizer):
        states.update(_gather_sharded(opt, params, on_allocated))
    for p in params:
        if p not in states:
            states[p] = param_state(optimizer, p)
    return states


def put_param_state(optimizer, param: torch.nn.Parameter, state: dict, copy: bool = True) -> bool:
    """Install `param`'s full `state` (from `gather_param_states`) into `optimizer`; a
    DistributedOptimizer keeps this DP rank's range of it. Returns whether `optimizer`
    holds state for `param` here (False: frozen, or no piece on this DP rank).
    `copy=False` keeps the given tensors where no sharding needs a cut (the caller
    guarantees nothing else writes them)."""
    if not state:
        return False
    for opt in _distributed(optimizer):
        shard = _shard(opt, param)
        if shard is not None:
            main, rng = shard
            cut = {k: v.clone() if v.dim() == 0 else v.reshape(-1)[rng.start:rng.end].to(main.device, copy=True)
                   for k, v in state.items()}
            value = cut.pop("main_param", None)
            if value is not None:
                main.data.copy_(value)
            opt.optimizer.state[main] = cut
            return True
    owner = state_owner(optimizer, param)
    if owner is None:
        return False
    inner, key = owner
    state = {k: v.clone() if v.dim() == 0 else v.to(key.device, copy=True) for k, v in state.items()} \
        if copy else dict(state)
    value = state.pop("main_param", None)
    if value is not None:
        key.data.copy_(value)
    inner.state[key] = state
    return True


def _identity(group: dict) -> tuple:
    return tuple(group.get(k) for k in _GROUP_IDENTITY)


def _matching_group(old_groups: list[dict], index: int, new_group: dict) -> Optional[dict]:
    """The old group at the same position if it has the same identity, else the first
    old group with that identity (Megatron aligns groups across ranks, so positions
    normally agree)."""
    if index < len(old_groups) and _identity(old_groups[index]) == _identity(new_group):
        return old_groups[index]
    return next((g for g in old_groups if _identity(g) == _identity(new_group)), None)


def carry_optimizer_state(old, new) -> None:
    """Copy per-group settings and the grad scaler from optimizer `old` to `new`.

    Everything in a param group except its parameter list is carried (lr as a scheduler
    left it, a per-group `step` of fused Adam, betas, weight decay); the loss scaler
    object itself is handed over, so dynamic loss scaling continues where it was.
    """
    for old_opt, new_opt in zip(megatron_optimizers(old), megatron_optimizers(new)):
        old_groups = old_opt.optimizer.param_groups
        for i, group in enumerate(new_opt.optimizer.param_groups):
            match = _matching_group(old_groups, i, group)
            if match is None:
                continue
            for key, value in match.items():
                if key != "params":
                    group[key] = value.clone() if torch.is_tensor(value) else value
        if getattr(old_opt, "grad_scaler", None) is not None:
            new_opt.grad_scaler = old_opt.grad_scaler
