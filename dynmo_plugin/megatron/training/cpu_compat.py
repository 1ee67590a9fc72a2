"""Neutralise Megatron-Core's CUDA assumptions so it runs on CPU with gloo.

Megatron-Core 0.16 hard-codes CUDA in ~40 places (``device=torch.cuda.current_device()``,
``torch.cuda.synchronize()`` in timers and p2p, ``device="cuda"`` in schedules and the
optimizer, ``weight.cuda()`` for tied embeddings, the CUDA RNG tracker). On a machine
without CUDA, `apply()` redirects exactly those calls to the CPU; with CUDA present it
refuses to run, so the GPU path is never altered. This is the only module of the
plugin that patches torch or Megatron for the CPU (the gradient norm Megatron's
optimizers call, on every device, is `grad_norm`'s), and it patches nothing on the hot
path except the tensor-factory wrappers (a dictionary lookup per call).

The minimal set of patches was measured on this project's machines (see
docs/cpu.md); a catch-all TorchFunctionMode also works but costs 15-30% CPU time.

Mixed precision and the distributed optimizer: Megatron's
`Float16OptimizerWithFloat16Params` and `DistributedOptimizer` sort parameters by
comparing `param.type()` with CUDA type names ('torch.cuda.BFloat16Tensor',
'torch.cuda.HalfTensor', 'torch.cuda.FloatTensor') and refuse anything else ("Wrapped
parameters must be one of torch.cuda.FloatTensor ..."). Probed on megatron-core 0.16.1:
that check is the only thing that stops both on CPU. `Tensor.type()` therefore spells
CPU float tensors the CUDA way, but only when called without arguments from exactly
those two Megatron modules and gradient clipping's `clip_grads`, which asserts
'torch.cuda.FloatTensor' gradients (`_CUDA_TYPE_CALLERS`): every other caller, torch's
own included, sees the true CPU names. The optimizers ask when they are built;
clipping asks once per gradient per step (a frame lookup, ~0.1 us each).
"""
from __future__ import annotations

import functools
import logging
import sys

import torch

__all__ = ["apply", "is_applied"]

logger = logging.getLogger(__name__)

_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "rand", "randn",
              "zeros_like", "ones_like", "empty_like", "full_like", "as_tensor")
_applied = False
_CUDA_TYPE_NAMES = {"torch.FloatTensor": "torch.cuda.FloatTensor",
                    "torch.HalfTensor": "torch.cuda.HalfTensor",
                    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor"}
_CUDA_TYPE_CALLERS = ("megatron.core.optimizer.optimizer",
                      "megatron.core.optimizer.distrib_optimizer",
                      "megatron.core.optimizer.clip_grads")


def _to_cpu(device):
    if device is None:
        return None
    if isinstance(device, int):
        return torch.device("cpu")
    dev = torch.device(device)
    return torch.device("cpu") if dev.type == "cuda" else dev


def _wrap_factory(fn):
    @functools.wraps(fn)
    def factory(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _to_cpu(kwargs["device"])
        return fn(*args, **kwargs)

    return factory


def _wrap_type(fn):
    """`Tensor.type()` that answers the CUDA spelling to `_CUDA_TYPE_CALLERS` only."""
    @functools.wraps(fn)
    def type_(self, *args, **kwargs):
        name = fn(self, *args, **kwargs)
        if args or kwargs or sys._getframe(1).f_globals.get("__name__") not in _CUDA_TYPE_CALLERS:
            return name
        return _CUDA_TYPE_NAMES.get(name, name)

    return type_


def is_applied() -> bool:
    return _applied


def apply() -> None:
    """Patch torch/Megatron for CPU execution. Idempotent; an error when CUDA exists.

    Call after `initialize_model_parallel` and before building the model.
    """
    global _applied
    if _applied:
        return
    if torch.cuda.is_available():
        raise RuntimeError("cpu_compat.apply() must not run where CUDA is available")
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda *a, **k: None
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.Tensor.type = _wrap_type(torch.Tensor.type)
    for name in _FACTORIES:
        setattr(torch, name, _wrap_factory(getattr(torch, name)))
    _patch_megatron()
    _applied = True
    logger.info("CPU compatibility layer applied (no CUDA on this host)")


def _patch_megatron() -> None:
    from megatron.core.tensor_parallel import random as mp_random

    from dynmo_plugin.megatron.training.te_names import bind_missing_te_names

    # The tracker's add()/fork() become no-ops; the CPU generator is seeded by the caller.
    mp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    # Activation recompute (`tensor_parallel.checkpoint`) keeps and restores the CUDA
    # generator's state around each recomputed forward: there is none; the CPU one, which
    # it keeps too, is what dropout draws from here.
    mp_random._get_cuda_rng_state = lambda *a, **k: torch.empty(0, dtype=torch.uint8)
    mp_random._set_cuda_rng_state = lambda *a, **k: None
    # Megatron without Transformer Engine reads an unbound name in the MoE router; the
    # same binding runs on CUDA machines without TE (build_stage_model).
    bind_missing_te_names()
