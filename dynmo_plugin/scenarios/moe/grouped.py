"""MoE at a fixed capacity on a GPU: one batched GEMM per projection, no host reads.

With a capacity and padding (Megatron's moe_pad_expert_input_to_capacity, the scheme's
default) every expert computes exactly C rows per micro-batch, a number the host knows
from the shapes alone (Megatron's get_capacity of the tokens). Megatron-Core 0.16.1's
local path does not use that: its allgather dispatcher selects the routed tokens with
`masked_select` (two output sizes the host must wait for) and copies the token counts
to the host, and SequentialMLP runs the experts one after another (fc1, activation,
scale, fc2 and their backward per expert: ~100 kernels of a ~200-kernel layer at 8
experts, each costing the host ~35 us to enqueue, which made the layer host-bound).
Its grouped paths need Transformer Engine or the grouped_gemm package; the alltoall
dispatcher creates a CUDA stream when built (no CPU runs).

Here, when the layer is padded to a capacity:
* `CapacityDispatcher` (MoeTransformerLayer swaps it in for the allgather one MoELayer
  builds) picks each expert's C tokens by index (`topk` over the routing map, whose
  columns hold exactly C ones), gathers tokens and probabilities with them and
  scatters the outputs back with Megatron's own `unpermute`: fixed shapes, nothing read
  back, no token counts made (the experts get None: C each).
* `GroupedExperts` (a SequentialMLP: the same per-expert parameters, state-dict keys,
  sharded checkpoint and migration format) runs the experts as [E, C, h] x [E, h, f]
  batched matmuls (`_BatchedLinear`). Keeping the parameters per expert costs nothing
  at run time: they lie side by side in one buffer (packed when built and after every
  `.to()`/`.cuda()`/`.bfloat16()`), so the [E, f, h] weight is a view, not a copy, and
  the weight gradients come out as slices of one product that autograd keeps as they
  are. Where something re-homed the weights (Megatron's distributed optimizer puts
  parameters in its own buffer) they are stacked by a copy each way: as correct, one
  copy per weight slower. (Stacked [E, f, h] parameters would have changed the
  parameter names, hence the checkpoint and migration format and the initialisation by
  global name.)
Unpadded (`--dynmo-moe-no-pad`), without a capacity, or with settings the batched path
does not cover (bias, FP8, expert tensor parallelism, TE activations), Megatron's own
path runs unchanged.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Optional, Sequence

import torch
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_utils import get_capacity, unpermute
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher

__all__ = ["CapacityDispatcher", "GroupedExperts", "padded_capacity"]


def padded_capacity(config, tokens: int) -> Optional[int]:
    """Rows each expert computes per micro-batch of `tokens` local tokens when the router
    pads to a capacity (Megatron's apply_router_token_dropping: get_capacity, or every
    token when that exceeds them), else None. Read per call: a config's capacity
    factor may change between calls (the scheme's calibration times 1.0 and 0.25)."""
    factor = config.moe_expert_capacity_factor
    if factor is None or not config.moe_pad_expert_input_to_capacity:
        return None
    capacity = get_capacity(num_tokens=tokens * config.moe_router_topk,
                            num_experts=config.num_moe_experts, capacity_factor=factor)
    return tokens if capacity > tokens else capacity


class CapacityDispatcher(MoEAllGatherTokenDispatcher):
    """Megatron's allgather dispatcher with an index-based permutation when padded: the
    experts then get `tokens_per_expert` None (every expert has the same rows)."""

    @classmethod
    def replacing(cls, built: MoEAllGatherTokenDispatcher) -> "CapacityDispatcher":
        """This dispatcher over the process groups of the one MoELayer built (MoELayer
        picks its dispatcher class by the config's name; TransformerLayer hands process
        groups only to MoELayer itself, so the layer stays Megatron's and swaps this in)."""
        if type(built) is not MoEAllGatherTokenDispatcher:
            raise ValueError(f"the MoE scheme needs Megatron's allgather dispatcher, got {type(built).__name__}")
        groups = SimpleNamespace(ep=built.ep_group, expt_tp=built.tp_group, tp_ep=built.tp_ep_group)
        return cls(built.num_local_experts, built.local_expert_indices, config=built.config,
                   pg_collection=groups)

    def dispatch_postprocess(self, hidden_states, probs):
        capacity = padded_capacity(self.config, self.hidden_shape[:-1].numel())
        if capacity is None:
            self.padded_indices = None
            return super().dispatch_postprocess(hidden_states, probs)
        self.hidden_shape_before_permute = hidden_states.shape
        first, last = self.local_expert_indices[0], self.local_expert_indices[-1] + 1
        # every column holds exactly `capacity` ones per gathered rank: their rows, by
        # index (which of equal entries topk returns first does not matter: a token's
        # row is computed alone, and its top-k outputs add up in either order)
        rows = capacity * hidden_states.shape[0] // self.hidden_shape[:-1].numel()
        local_map = self.routing_map[:, first:last].T.to(torch.int8)
        indices = torch.topk(local_map, rows, dim=1, sorted=False).indices      # [E, C]
        self.local_probs = probs[:, first:last].T.gather(1, indices).view(-1)  # [E * C]
        self.padded_indices = indices.view(-1)
        self.routing_map = None
        # tokens_per_expert None: every expert has `rows` (the host knows; no tensor made)
        return hidden_states.index_select(0, self.padded_indices), None, self.local_probs

    def combine_preprocess(self, hidden_states):
        if self.padded_indices is None:
            return super().combine_preprocess(hidden_states)
        out = unpermute(hidden_states, self.padded_indices, restore_shape=self.hidden_shape_before_permute)
        self.padded_indices = None
        return out


def _adjacent(weights: Sequence[torch.Tensor]) -> bool:
    """True when the weights are contiguous, equally shaped and back to back in one storage."""
    w = weights[0]
    if not w.is_contiguous():
        return False
    storage = w.untyped_storage().data_ptr()
    return all(v.shape == w.shape and v.dtype == w.dtype and v.is_contiguous()
               and v.untyped_storage().data_ptr() == storage
               and v.storage_offset() == w.storage_offset() + i * w.numel()
               for i, v in enumerate(weights))


def stacked(weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """[E, out, in] of E [out, in] weights: a view where they lie back to back, else a copy."""
    w = weights[0]
    if _adjacent(weights):
        return w.as_strided((len(weights), *w.shape), (w.numel(), *w.stride()), w.storage_offset())
    return torch.stack(list(weights))


class _BatchedLinear(torch.autograd.Function):
    """[E, C, in] x E weights [out, in] -> [E, C, out], each expert's rows through its own
    weight, as one bmm each way. Written out (not torch.bmm of a stack) so that every
    weight's gradient comes out as a contiguous [out, in] slice of one [E, out, in]
    product, which autograd hands to the parameter as it is; bmm's own backward would
    give the transposed layout, which autograd copies into a fresh gradient per weight
    (E copy kernels and the gradients' bytes, every step)."""

    @staticmethod
    def forward(ctx, x, *weights):
        ctx.save_for_backward(x, *weights)  # re-stacked in backward: a view, or (re-homed
        return torch.bmm(x, stacked(weights).transpose(1, 2))  # weights) a copy not kept

    @staticmethod
    def backward(ctx, grad):
        x, *weights = ctx.saved_tensors
        dx = torch.bmm(grad, stacked(weights)) if ctx.needs_input_grad[0] else None
        dw = torch.bmm(grad.transpose(1, 2), x)   # [E, out, in], contiguous
        return (dx, *dw.unbind(0))


class GroupedExperts(SequentialMLP):
    """SequentialMLP's experts and parameters, run as batched matmuls at a fixed capacity
    (`grouped`); its own per-expert loop otherwise (`forward`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pack_weights()

    def _weights(self, name: str) -> list[torch.nn.Parameter]:
        return [getattr(e, name).weight for e in self.local_experts]

    def pack_weights(self) -> None:
        """Put each projection's expert weights back to back in one buffer (in place of
        their own: the same Parameter objects, values unchanged), unless a DDP already
        owns them (`main_grad`: its buffers are where they must stay)."""
        for name in ("linear_fc1", "linear_fc2"):
            weights = self._weights(name)
            if _adjacent(weights) or any(hasattr(w, "main_grad") for w in weights):
                continue
            with torch.no_grad():
                buffer = torch.stack([w.detach() for w in weights])
            for w, part in zip(weights, buffer.unbind(0)):
                w.data = part

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)  # .to/.cuda/.bfloat16 re-allocate each weight
        self.pack_weights()
        return out

    def can_group(self) -> bool:
        """The batched path computes what MLP.forward does for these settings."""
        c = self.config
        return (not c.add_bias_linear and not c.bias_activation_fusion and not c.use_te_activation_func
                and not (c.fp8 or c.fp4) and not c.moe_apply_probs_on_input
                and self.tp_group.size() == 1 and self.num_local_experts > 1)

    def _activation(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        if not c.gated_linear_unit:
            return c.activation_func(x)
        x_glu, x_linear = torch.chunk(x, 2, dim=-1)  # as MLP.forward's glu
        if (val := c.activation_func_clamp_value) is not None:
            x_glu = x_glu.clamp(min=None, max=val)
            x_linear = x_linear.clamp(min=-val, max=val)
        return c.activation_func(x_glu) * (x_linear + c.glu_linear_offset)

    def forward(self, tokens: torch.Tensor, tokens_per_expert: Optional[torch.Tensor], probs: torch.Tensor):
        """`tokens_per_expert` None: padded (CapacityDispatcher), every expert has the same
        rows: batched when `can_group`, else SequentialMLP's loop over equal splits."""
        if tokens_per_expert is not None:
            return super().forward(tokens, tokens_per_expert, probs)
        if self.can_group():
            return self.grouped(tokens, probs)
        rows = tokens.shape[0] // self.num_local_experts
        return super().forward(tokens, torch.full((self.num_local_experts,), rows, dtype=torch.long), probs)

    def grouped(self, tokens: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, None]:
        """[E * C, h] tokens, expert by expert, and their [E * C] routing probabilities ->
        [E * C, h]: fc1, activation, scale by the probability, fc2, as MLP.forward."""
        experts = self.num_local_experts
        x = tokens.view(experts, tokens.shape[0] // experts, tokens.shape[-1])
        inter = _BatchedLinear.apply(x, *self._weights("linear_fc1"))
        inter = self._activation(inter)
        inter = (inter * probs.view(experts, -1, 1)).to(inter.dtype)
        out = _BatchedLinear.apply(inter, *self._weights("linear_fc2"))
        return out.view(tokens.shape[0], -1), None
