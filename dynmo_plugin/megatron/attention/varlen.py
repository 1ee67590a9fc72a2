"""Per-document causal attention over packed (THD) micro-batches, for CPU.

Megatron's local `DotProductAttention` refuses `packed_seq_params` and its THD path
needs Transformer Engine, so packing documents on CPU needs a core attention of its
own. `VarlenCoreAttention` replaces DotProductAttention as the `core_attention`
submodule of a layer's self-attention (`varlen_attention_spec`) and is called like it.
With `packed_seq_params` (qkv_format "thd"): query/key/value `[t, heads, head_dim]`,
documents back to back as `cu_seqlens_q` says; each document attends causally to
itself only, through torch's SDPA, one call per document, so a micro-batch costs
sum(l_i^2) in attention, not t^2: packing changes compute. Positions after the last
document (padding) get zeros. Without packed params it is dense causal SDPA on
`[s, b, heads, head_dim]`, like DotProductAttention with a causal mask.

Where CUDA and Transformer Engine exist, TE's layer spec handles THD natively and
`varlen_attention_spec` leaves it as it is.
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec

from dynmo_plugin.megatron.attention.core import CausalCoreAttention, with_core_attention

__all__ = ["VarlenCoreAttention", "varlen_attention", "varlen_attention_spec",
           "packed_seq_params"]


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens,
                     scale: float) -> torch.Tensor:
    """Causal attention within each document: q, k, v `[t, n, d]`, `cu_seqlens` the
    document boundaries (a list or 1-D tensor, starting at 0). Returns `[t, n, d]`."""
    bounds = [int(x) for x in cu_seqlens]
    t = q.shape[0]
    outs = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b > a:
            x = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1),
                                               v[a:b].transpose(0, 1), is_causal=True, scale=scale)
            outs.append(x.transpose(0, 1))
    if bounds[-1] < t:
        outs.append(q.new_zeros(t - bounds[-1], q.shape[1], v.shape[2]))
    return torch.cat(outs, 0) if len(outs) > 1 else outs[0]


class VarlenCoreAttention(CausalCoreAttention):
    """Core attention for packed documents (see the module docstring). Built by
    Megatron's Attention with DotProductAttention's arguments."""

    kind = "varlen attention on CPU"

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if attention_bias is not None:
            raise NotImplementedError("varlen attention does not take an attention bias")
        if (attn_mask_type or self.attn_mask_type) != AttnMaskType.causal:
            raise NotImplementedError("varlen attention is causal only")
        n = query.shape[-2]
        if key.shape[-2] != n:  # grouped-query attention: repeat keys/values per query head
            key = key.repeat_interleave(n // key.shape[-2], dim=-2)
            value = value.repeat_interleave(n // value.shape[-2], dim=-2)
        if packed_seq_params is None:
            s, b = query.shape[:2]
            out = F.scaled_dot_product_attention(
                query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3),
                is_causal=True, scale=self.softmax_scale)
            return out.permute(2, 0, 1, 3).reshape(s, b, -1)
        if packed_seq_params.qkv_format != "thd":
            raise NotImplementedError(f"packed format {packed_seq_params.qkv_format!r}; only thd")
        cu, cu_kv = packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_kv
        if cu_kv is not None and cu_kv is not cu and not torch.equal(cu_kv, cu):
            raise NotImplementedError("self-attention only: cu_seqlens_q must equal cu_seqlens_kv")
        # the boundaries slice the tensors: the host's copy when the batch brought one
        bounds = getattr(packed_seq_params, "cu_seqlens_host", None) or cu.tolist()
        out = varlen_attention(query, key, value, bounds, self.softmax_scale)
        return out.reshape(out.shape[0], -1)


def varlen_attention_spec(spec: ModuleSpec) -> ModuleSpec:
    """`spec` whose self-attention's core attention handles packed documents: TE's own
    where the spec already uses Transformer Engine, else VarlenCoreAttention.

    Raises:
        ValueError: the spec's core attention is something else (e.g. LSH attention).
    """
    try:
        sub = spec.submodules.self_attention.submodules
        current = sub.core_attention
    except AttributeError as e:
        raise ValueError(f"packed documents need a layer spec with self_attention.submodules."
                         f"core_attention, got {spec.module!r}") from e
    name = getattr(current, "__name__", type(current).__name__)
    if name.startswith("TE"):
        return spec
    if name not in ("DotProductAttention", "VarlenCoreAttention"):
        raise ValueError(f"packed documents replace the core attention with per-document "
                         f"attention, but this layer spec already uses {name}; train that "
                         "scenario on the synthetic token stream")
    return with_core_attention(spec, VarlenCoreAttention)


def packed_seq_params(batch: dict) -> PackedSeqParams:
    """Megatron's THD parameters for a micro-batch built by data.stream.PackedDocuments
    (`cu_seqlens_padded` ends at the row, so padded positions are attended by nobody),
    with the document boundaries also as a host list (`cu_seqlens_host`, from the batch's
    `lengths`): VarlenCoreAttention slices by them and would otherwise read the device
    tensor back in every layer of every micro-batch."""
    cu, padded = batch["cu_seqlens"], batch.get("cu_seqlens_padded")
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             cu_seqlens_q_padded=padded, cu_seqlens_kv_padded=padded,
                             max_seqlen_q=batch["max_seqlen"], max_seqlen_kv=batch["max_seqlen"])
    if batch.get("lengths") is not None:
        params.cu_seqlens_host = [0, *itertools.accumulate(batch["lengths"])]
    return params
