"""Neutralise Megatron-Core's CUDA assumptions so it runs on CPU with gloo.

Megatron-Core 0.16 hard-codes CUDA in ~40 places (``device=torch.cuda.current_device()``,
``torch.cuda.synchronize()`` in timers and p2p, ``device="cuda"`` in schedules and the
optimizer, ``weight.cuda()`` for tied embeddings, the CUDA RNG tracker). On a machine
without CUDA, `apply()` redirects exactly those calls to the CPU; with CUDA present it
refuses to run, so the GPU path is never altered. This is the only module of the
plugin that patches anything, and it patches nothing on the hot path except the
tensor-factory wrappers (a dictionary lookup per call).

The minimal set of patches was measured on this project's machines (see
docs/cpu.md); a catch-all TorchFunctionMode also works but costs 15-30% CPU time.
"""
from __future__ import annotations

import functools
import logging

import torch

__all__ = ["apply", "is_applied"]

logger = logging.getLogger(__name__)

_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "rand", "randn",
              "zeros_like", "ones_like", "empty_like", "full_like", "as_tensor")
_applied = False


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
    for name in _FACTORIES:
        setattr(torch, name, _wrap_factory(getattr(torch, name)))
    _patch_megatron()
    _applied = True
    logger.info("CPU compatibility layer applied (no CUDA on this host)")


def _patch_megatron() -> None:
    from megatron.core.tensor_parallel import random as mp_random
    from megatron.core.transformer.moe import moe_utils

    # The tracker's add()/fork() become no-ops; the CPU generator is seeded by the caller.
    mp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    # Megatron bug without Transformer Engine: the router references an undefined name.
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
