"""Throw-away layers for the scenarios' cost calibrations, in the run's own precision.

Three scenarios fit a work model by timing a scratch layer built from the run's layer
spec and TransformerConfig (Mixture of Depths: a routed block at several capacities;
MoE: an MoE layer at two token loads; sparse attention: a layer at each bucket count).
The scratch layer must compute as the stage's layers do: with --bf16/--fp16 Megatron
builds weights in `params_dtype` and Float16Module then casts the whole stage (norms
included) and its input to that dtype, so a scratch layer fed fp32 inputs fails
("expected m1 and m2 to have the same dtype") or times the wrong kernels. Everything
here is private to the calibration: no live parameter, gradient or RNG stream is used.
The run's random streams are drawn from by Megatron when it builds a module (torch's CPU
generator under --use-cpu-initialization, the CUDA RNG tracker's model-parallel and
expert streams on a GPU) and by a scratch layer's dropout (Megatron-LM's default 0.1:
torch's generator, the tracker's stream in attention), so each calibration runs inside
`rng_streams_kept`: else a --dynmo run's dropout masks would differ from the same run's
without the plugin. A migration builds the layers it receives inside it too (survey 22b:
a received layer's throw-away initialisation advanced the receiving rank's streams, and
MoE input jitter parted from the never-moved run at the move). They are still
initialised: Megatron marks a tensor-parallel weight (`tensor_model_parallel`) only then
(review 22c; the launcher, which builds without, marks them: model.mark_tensor_parallel).
"""
from __future__ import annotations

import contextlib

import torch

__all__ = ["stage_dtype", "build_scratch_layer", "scratch_input", "init_scratch_", "rng_streams_kept"]


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


def _tracker():
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    return get_cuda_rng_tracker()


@contextlib.contextmanager
def rng_streams_kept():
    """Torch's CPU generator, the current CUDA device's (only where CUDA is up: a CPU run
    on a GPU machine must not make a context) and Megatron's CUDA RNG tracker's streams,
    put back as they were. The tracker's states are copied: Megatron's own tracker
    replaces a stream's state tensor, a CUDA-graph-safe one advances its generators in
    place. Also a decorator."""
    tracker = _tracker()
    kept = ({name: state.clone() if isinstance(state, torch.Tensor) else state.get_state()
             for name, state in tracker.get_states().items()} if tracker.is_initialized() else {})
    devices = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            if kept:
                states = tracker.get_states()
                for name, state in kept.items():
                    if isinstance(states.get(name), torch.Tensor) or name not in states:
                        states[name] = state
                    else:
                        states[name].set_state(state)
                tracker.set_states(states)


def build_scratch_layer(spec, config, layer_number: int, pg_collection, vp_stage,
                        device: torch.device, gen: torch.Generator) -> torch.nn.Module:
    """A fresh layer of `spec` numbered `layer_number` (local to its stage) on the stage's
    process groups, initialised from `gen`, on `device`, cast as Float16Module casts the
    stage's layers."""
    from megatron.core.transformer.spec_utils import build_module
    with rng_streams_kept():
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
