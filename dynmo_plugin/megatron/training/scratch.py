"""Throw-away layers for the scenarios' cost calibrations, in the run's own precision.

Three scenarios fit a work model by timing a scratch layer built from the run's layer
spec and TransformerConfig (Mixture of Depths: a routed block at several capacities;
MoE: an MoE layer at two token loads; sparse attention: a layer at each bucket count).
The scratch layer must compute as the stage's layers do: with --bf16/--fp16 Megatron
builds weights in `params_dtype` and Float16Module then casts the whole stage (norms
included) and its input to that dtype, so a scratch layer fed fp32 inputs fails
("expected m1 and m2 to have the same dtype") or times the wrong kernels. Everything
here is private to the calibration: no live parameter, gradient or RNG stream is used —
Megatron initialises a new module from the run's streams (torch's CPU generator under
--use-cpu-initialization, the CUDA RNG tracker's model-parallel and expert streams on a
GPU), so the build puts every one of them back as it was (`_rng_kept`): else a --dynmo
run's dropout masks would differ from the same run's without the plugin.
"""
from __future__ import annotations

import contextlib

import torch

__all__ = ["stage_dtype", "build_scratch_layer", "scratch_input", "init_scratch_"]


def stage_dtype(config) -> torch.dtype:
    """The dtype of the stage's weights and activations (what Float16Module casts to)."""
    return config.params_dtype if (config.bf16 or config.fp16) else torch.float32


@torch.no_grad()
def init_scratch_(layer: torch.nn.Module, gen: torch.Generator, std: float = 0.02) -> None:
    """Weights N(0, std) from `gen`, norm weights 1, biases 0 (as training starts)."""
    for name, p in layer.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if "norm" in name and leaf in ("weight", "layer_norm_weight"):
            p.fill_(1.0)
        elif leaf.endswith("bias"):
            p.zero_()
        else:
            p.copy_(torch.randn(p.shape, generator=gen) * std)


@contextlib.contextmanager
def _rng_kept():
    """Torch's CPU and CUDA generators and Megatron's CUDA RNG tracker as they were."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    tracker = get_cuda_rng_tracker()
    states = tracker.get_states() if tracker.is_initialized() else None
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            if states is not None:
                tracker.set_states(states)


def build_scratch_layer(spec, config, layer_number: int, pg_collection, vp_stage,
                        device: torch.device, gen: torch.Generator) -> torch.nn.Module:
    """A fresh layer of `spec` numbered `layer_number` (local to its stage) on the stage's
    process groups, initialised from `gen`, on `device`, cast as Float16Module casts the
    stage's layers."""
    from megatron.core.transformer.spec_utils import build_module
    with _rng_kept():
        layer = build_module(spec, config=config, layer_number=layer_number,
                             pg_collection=pg_collection, vp_stage=vp_stage)
    init_scratch_(layer, gen)
    layer.to(device)
    if config.bf16 or config.fp16:  # as Float16Module (and a migration) casts a stage's layers
        layer.to(config.params_dtype)
    return layer.train()


def scratch_input(shape: tuple, config, device: torch.device, gen: torch.Generator,
                  requires_grad: bool = False) -> torch.Tensor:
    """Random hidden states N(0, 1) of `shape` in the stage's dtype."""
    x = torch.randn(shape, generator=gen).to(device=device, dtype=stage_dtype(config))
    return x.requires_grad_(requires_grad)
