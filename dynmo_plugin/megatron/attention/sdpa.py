"""Fused attention for `--transformer-impl local`: torch's SDPA as the core attention.

Megatron-Core's local layer spec has one core attention, `DotProductAttention`: it
materialises the `[b, heads, s, s]` scores, scales, masks and soft-maxes them in fp32,
one pass each. On a GPU that is memory-bound and dominates a layer at long sequences
(an H200 at h4096 s2048: ~3 of a layer's 7.3 ms; at h8192 s4096 about half), so it
hides what a scheme saves in the GEMMs (structured pruning read 0.81x of dense with it,
against 0.62x of the FLOPs). Users with Transformer Engine get TE's fused attention;
`--attention-backend sdpa` gives the local spec torch's fused kernels instead
(`F.scaled_dot_product_attention`: FlashAttention-2 or memory-efficient attention on
CUDA, the math kernel on CPU).

Same interface and numbers as DotProductAttention (Megatron's mask convention: True =
masked out). With a causal mask type the mask tensor is taken to be the causal one, as
Transformer Engine's fused attention takes it, and SDPA runs with `is_causal` (flash
attention skips the masked half); a mask marked `arbitrary_mask` (the schemes' gathered
masks: Mixture of Depths', early exit's) is applied as it is. No attention dropout (the
project runs without it: dropout would consume RNG differently per split), no context
parallelism.
"""
from __future__ import annotations

import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec

from dynmo_plugin.megatron.attention.core import CausalCoreAttention, with_core_attention
from dynmo_plugin.scenarios.gathered_tokens import is_arbitrary_mask

__all__ = ["SDPACoreAttention", "sdpa_attention_spec"]


class SDPACoreAttention(CausalCoreAttention):
    """DotProductAttention's drop-in through torch SDPA (module docstring)."""

    kind = "SDPA attention"

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if attention_bias is not None or packed_seq_params is not None:
            raise NotImplementedError("SDPA attention takes no attention bias or packed sequences; "
                                      "use --attention-backend unfused")
        sq, b, n, _ = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))   # [b, n, s, d]
        causal = (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
        if attention_mask is None or (causal and not is_arbitrary_mask(attention_mask)):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal and sq > 1,
                                                 scale=self.softmax_scale, enable_gqa=k.shape[1] != n)
        else:  # Megatron's True = masked out; SDPA's True = may attend
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask,
                                                 scale=self.softmax_scale, enable_gqa=k.shape[1] != n)
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)


def sdpa_attention_spec(spec: ModuleSpec) -> ModuleSpec:
    """`spec` with Megatron's DotProductAttention replaced by SDPACoreAttention; any
    other core attention (TE's, a scheme's own) is left as it is."""
    try:
        sub = spec.submodules.self_attention.submodules
    except AttributeError:
        return spec
    current = sub.core_attention
    if getattr(current, "__name__", "") != "DotProductAttention":
        return spec
    return with_core_attention(spec, SDPACoreAttention)

