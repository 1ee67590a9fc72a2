"""What this machine offers the model build: how many CUDA GPUs are visible and whether
Transformer Engine (with Megatron's TE layer spec) imports.

The configuration decides from these answers (`config.checks.resolve_transformer_impl`,
`config.load.load_config(cuda_devices=..., te_problem=...)`) but does not ask them
itself: asking imports torch, Transformer Engine and Megatron, which config/ must not.
Both import lazily, inside the call, so importing this module costs nothing (the
launcher's --help and torchrun's pre-spawn check stay light).
"""
from __future__ import annotations

from typing import Optional

__all__ = ["cuda_device_count", "transformer_engine_problem", "load_run_config"]


def cuda_device_count() -> int:
    """CUDA GPUs visible to this process (0 on a CPU-only build or machine)."""
    import torch
    return torch.cuda.device_count()


def transformer_engine_problem() -> Optional[str]:
    """None when Transformer Engine and Megatron's TE layer spec import, else why not."""
    try:
        import transformer_engine.pytorch  # noqa: F401
        from megatron.core.models.gpt.gpt_layer_specs import (  # noqa: F401
            get_gpt_layer_with_transformer_engine_spec)
    except Exception as e:  # noqa: BLE001 - any import failure means "not usable here"
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")
    return None


def load_run_config(args, world_size: Optional[int] = None):
    """`config.load_config` answered by this machine: what every process that builds a
    model calls (workers, the Megatron-LM integration, the GPU checks)."""
    from dynmo_plugin.config.load import load_config
    return load_config(args, world_size, cuda_devices=cuda_device_count,
                       te_problem=transformer_engine_problem)
