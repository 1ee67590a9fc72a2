"""Where a model parameter's optimizer state lives inside Megatron's optimizer wrappers.

`get_megatron_optimizer` returns a ChainedOptimizer of FP32Optimizer (state keyed by
the model parameter itself) and/or Float16OptimizerWithFloat16Params (state keyed by an
fp32 master copy of each bf16/fp16 parameter). Profiling and migration both need
"the state of this parameter", including that master copy.

State that is not per parameter must survive a rebuild too: the `param_groups` entries
(learning rate set by a scheduler; `step` where fused Adam keeps it per group, as TE's
and Apex's FusedAdam do on GPU) and the fp16 loss scaler. `carry_optimizer_state`
moves those from the optimizer being replaced to its replacement.
"""
from __future__ import annotations

from typing import Iterator, Optional

import torch

__all__ = ["megatron_optimizers", "state_owner", "param_state", "state_nbytes",
           "carry_optimizer_state"]

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
    return sum(t.numel() * t.element_size() for t in param_state(optimizer, param).values())


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
