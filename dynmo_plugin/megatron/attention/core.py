"""What the project's own core-attention kernels share: Megatron's constructor interface.

Megatron builds a layer's `core_attention` submodule with a fixed set of arguments
(`DotProductAttention`'s). The CPU kernels here (LSH buckets for sparse attention,
per-document SDPA for packed documents) take them the same way and refuse what they do
not implement (attention dropout, context parallelism) at build time, with the
kernel's name in the message, rather than computing something else silently.
"""
from __future__ import annotations

import copy
import math
from typing import Optional

from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

__all__ = ["CausalCoreAttention", "with_core_attention"]


class CausalCoreAttention(MegatronModule):
    """Base of a project-owned core attention; subclasses name themselves in `kind`."""

    kind = "this core attention"

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None,
                 pg_collection=None):
        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"{self.kind} has no attention dropout; got attention_dropout={dropout}")
        if config.context_parallel_size != 1:
            raise ValueError(f"{self.kind} does not support context parallelism")
        self.layer_number = max(1, layer_number)  # global, as Megatron numbers layers
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = (softmax_scale if softmax_scale is not None
                              else 1.0 / math.sqrt(config.kv_channels))


def with_core_attention(spec, core_attention):
    """A copy of a layer spec whose self-attention's `core_attention` is `core_attention`
    (the spec's other parts shared, the path down to it copied: the input is untouched)."""
    out = copy.copy(spec)
    out.submodules = copy.copy(spec.submodules)
    out.submodules.self_attention = copy.copy(spec.submodules.self_attention)
    out.submodules.self_attention.submodules = copy.copy(spec.submodules.self_attention.submodules)
    out.submodules.self_attention.submodules.core_attention = core_attention
    return out
