"""Where a model parameter's optimizer state lives inside Megatron's optimizer wrappers.

`get_megatron_optimizer` returns a ChainedOptimizer of FP32Optimizer (state keyed by
the model parameter itself) and/or Float16OptimizerWithFloat16Params (state keyed by an
fp32 master copy of each bf16/fp16 parameter). Profiling and migration both need
"the state of this parameter", including that master copy.
"""
from __future__ import annotations

from typing import Iterator

import torch

__all__ = ["megatron_optimizers", "state_owner", "param_state", "state_nbytes"]


def megatron_optimizers(optimizer) -> Iterator:
    yield from getattr(optimizer, "chained_optimizers", [optimizer])


def state_owner(optimizer, param: torch.nn.Parameter):
    """(inner torch optimizer, tensor its state is keyed by) for a model parameter."""
    for opt in megatron_optimizers(optimizer):
        for model_group, main_group in zip(getattr(opt, "float16_groups", []),
                                           getattr(opt, "fp32_from_float16_groups", [])):
            for p, main in zip(model_group, main_group):
                if p is param:
                    return opt.optimizer, main
        for group in opt.optimizer.param_groups:
            if any(p is param for p in group["params"]):
                return opt.optimizer, param
    raise KeyError("parameter is not managed by this optimizer")


def param_state(optimizer, param: torch.nn.Parameter) -> dict[str, torch.Tensor]:
    """Optimizer state tensors of `param` (e.g. exp_avg, exp_avg_sq, step), plus the fp32
    master copy under 'main_param' when training in bf16/fp16. Empty before the first step."""
    inner, key = state_owner(optimizer, param)
    state = {k: v for k, v in inner.state.get(key, {}).items() if torch.is_tensor(v)}
    if key is not param:
        state["main_param"] = key.data
    return state


def state_nbytes(optimizer, param: torch.nn.Parameter) -> int:
    return sum(t.numel() * t.element_size() for t in param_state(optimizer, param).values())
