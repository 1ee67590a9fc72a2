"""Whether a forward is a recompute.

Activation checkpointing runs a forward again from inside autograd's backward:
Megatron's `tensor_parallel.checkpoint` (reentrant), TE's and torch's non-reentrant
checkpoint alike. Such a forward adds no work of its own to what the plugin counts: the
probe times it into the layer's backward (`profiling.probe`), and the MoE router's
tokens are counted in the first forward only (`scenarios.moe.layer`).
"""
from __future__ import annotations

import torch

__all__ = ["in_backward"]


def in_backward() -> bool:
    """Inside autograd's backward (a forward here is a recompute). torch's own
    checkpoint asks the same (`torch.utils.checkpoint`)."""
    return torch._C._current_graph_task_id() != -1
