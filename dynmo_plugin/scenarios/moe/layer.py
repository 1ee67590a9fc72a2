"""A TransformerLayer that is Megatron's MoE layer or a dense one by its global number.

Megatron builds an MoE pattern (`moe_layer_freq`: every N-th layer, or a 0/1 list) as a
block spec with one layer spec per layer. A migration, however, builds a single layer
from ONE spec (dynmo_plugin.megatron.migration.migrate: `build_module(spec, layer_number=...)`),
wherever the layer lands. So `MoeTransformerLayer` carries the MoE spec's MLP half
(pre-MLP norm, MLP) beside the dense submodules and picks by its global layer number:
MoE iff it is in `moe_layers` (the scenario resolves the pattern once:
dynmo_plugin.scenarios.moe.live.moe_layer_numbers). The attention half of an MoE layer is
always the dense spec's, so whatever core attention the run's spec has (or is given
later: packed documents' VarlenCoreAttention, a fused one) reaches MoE layers too.

An MoE layer counts the rows each of its experts computed, per micro-batch, from the
router's output (`routing_map.sum(0)`: after capacity dropping; padded to the capacity
when the scheme pads, Megatron's moe_pad_expert_input_to_capacity), and the tokens each
really kept (a non-zero routing probability; padding rows have none); the scenario reads
and resets both every iteration (`take_counts`, `take_kept`). They are per-iteration
statistics, read before any migration can happen, so they are plain attributes, not
state that moves. Everything that must move with the layer (router and expert weights)
is a parameter of Megatron's own modules.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
from types import SimpleNamespace
from typing import Optional, Sequence

import torch
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_utils import get_capacity, unpermute
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.utils import get_pg_rank, get_pg_size
from megatron.core.transformer.transformer_layer import (TransformerLayer,
                                                         get_transformer_layer_offset)

from dynmo_plugin.megatron.recompute import in_backward
from dynmo_plugin.megatron.training.scratch import rng_streams_kept


__all__ = ["MoeTransformerLayer", "moe_layer_spec", "calibrate", "flop_fixed_tokens",
           "CapacityDispatcher", "GroupedExperts", "padded_capacity"]

logger = logging.getLogger(__name__)


# ---- at a padded capacity: index dispatch, batched experts -------------------------------------
# MoE at a fixed capacity on a GPU: one batched GEMM per projection, no host reads.
#
# With a capacity and padding (Megatron's moe_pad_expert_input_to_capacity, the scheme's
# default) every expert computes exactly C rows per micro-batch, a number the host knows
# from the shapes alone (Megatron's get_capacity of the tokens). Megatron-Core 0.16.1's
# local path does not use that: its allgather dispatcher selects the routed tokens with
# `masked_select` (two output sizes the host must wait for) and copies the token counts
# to the host, and SequentialMLP runs the experts one after another (fc1, activation,
# scale, fc2 and their backward per expert: ~100 kernels of a ~200-kernel layer at 8
# experts, each costing the host ~35 us to enqueue, which made the layer host-bound).
# Its grouped paths need Transformer Engine or the grouped_gemm package; the alltoall
# dispatcher creates a CUDA stream when built (no CPU runs).
#
# Here, when the layer is padded to a capacity:
# * `CapacityDispatcher` (MoeTransformerLayer swaps it in for the allgather one MoELayer
#   builds) picks each expert's C tokens by index (`topk` over the routing map, whose
#   columns hold exactly C ones), gathers tokens and probabilities with them and
#   scatters the outputs back with Megatron's own `unpermute`: fixed shapes, nothing read
#   back, no token counts made (the experts get None: C each).
# * `GroupedExperts` (a SequentialMLP: the same per-expert parameters, state-dict keys,
#   sharded checkpoint and migration format) runs the experts as [E, C, h] x [E, h, f]
#   batched matmuls (`_BatchedLinear`). Keeping the parameters per expert costs nothing
#   at run time: they lie side by side in one buffer (packed when built and after every
#   `.to()`/`.cuda()`/`.bfloat16()`), so the [E, f, h] weight is a view, not a copy, and
#   the weight gradients come out as slices of one product that autograd keeps as they
#   are. Where something re-homed the weights (Megatron's distributed optimizer puts
#   parameters in its own buffer) they are stacked by a copy each way: as correct, one
#   copy per weight slower. (Stacked [E, f, h] parameters would have changed the
#   parameter names, hence the checkpoint and migration format and the initialisation by
#   global name.)
# Unpadded (`--dynmo-moe-no-pad`), without a capacity, or with settings the batched path
# does not cover (bias, FP8, expert tensor parallelism, TE activations), Megatron's own
# path runs unchanged.


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
                and get_pg_size(self.tp_group) == 1 and self.num_local_experts > 1)

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


class MoeTransformerLayer(TransformerLayer):
    """MoE submodules when the global layer number is in `moe_layers`, else the dense ones."""

    def __init__(self, config, submodules, layer_number: int = 1, *, moe_mlp: dict,
                 moe_layers: tuple[int, ...], **kwargs):
        pg = kwargs.get("pg_collection")
        pp_rank = get_pg_rank(pg.pp) if pg is not None else None
        number = layer_number + get_transformer_layer_offset(config, kwargs.get("vp_stage"), pp_rank)
        self.is_moe = number in moe_layers
        if self.is_moe:  # the dense layer's attention half (whatever the spec's core
            submodules = copy.copy(submodules)  # attention is now), the MoE's MLP half
            for name, value in moe_mlp.items():
                setattr(submodules, name, value)
        super().__init__(config, submodules, layer_number, **kwargs)
        if self.layer_number != number:  # the offset above must be Megatron's own
            raise RuntimeError(f"MoE layer numbered {number}, Megatron says {self.layer_number}")
        self._counts = None  # a tensor per expert, or an int every expert shares (padded)
        self._kept: Optional[torch.Tensor] = None
        self.micro_batches = 0
        if self.is_moe:
            self.mlp.router.register_forward_hook(self._count_tokens)
            if isinstance(self.mlp.experts, GroupedExperts):  # dispatch by index when padded
                self.mlp.token_dispatcher = CapacityDispatcher.replacing(self.mlp.token_dispatcher)

    def _count_tokens(self, module, args, output) -> None:
        """Padded to a capacity, each expert computes its capacity: a number the host knows
        (no kernel); otherwise the routing map's columns. Kept tokens are the non-zero
        probabilities (the router zeroes every probability outside its map, and padding
        rows have none): two small kernels, read only when an event asks (`take_kept`).
        A recomputed forward (activation recompute: inside the backward) routed the same
        tokens once already: not counted again."""
        if in_backward():
            return
        probs, routing_map = output
        capacity = padded_capacity(self.config, routing_map.shape[0])
        if capacity is not None:
            counts = capacity
        else:
            counts = routing_map.detach().sum(0)
        kept = probs.detach().ne(0).sum(0)
        self._counts = counts if self._counts is None else self._counts + counts
        self._kept = kept if self._kept is None else self._kept + kept
        self.micro_batches += 1

    def reset_counts(self) -> None:
        """Drop the counts without reading them (a read waits for the device)."""
        self._counts, self._kept, self.micro_batches = None, None, 0

    def take_counts(self) -> Optional[list[int]]:
        """Rows each expert computed since the last call (summed over micro-batches, after
        dropping; with padding, its capacity each micro-batch), or None for a dense layer;
        resets the counts (read `take_kept` first)."""
        if not self.is_moe:
            return None
        counts = self._counts
        self._counts, self._kept, self.micro_batches = None, None, 0
        return self._listed(counts)

    def take_kept(self) -> Optional[list[int]]:
        """Tokens each expert kept since the last call (rows less padding), or None for a
        dense layer; does not reset (`take_counts` does)."""
        return self._listed(self._kept) if self.is_moe else None

    def _listed(self, counts) -> list[int]:
        """Per expert: a tensor of counts, a count every expert shares (int), or None."""
        if counts is None:
            return [0] * self.config.num_moe_experts
        if isinstance(counts, int):
            return [counts] * self.config.num_moe_experts
        return [int(c) for c in counts.tolist()]


# The attention half of a TransformerLayer's submodules: an MoE layer takes these from the
# dense spec as the layer is built (a later edit of the spec, e.g. the trainer's
# varlen_attention_spec for packed documents, reaches MoE layers too), the rest from `moe`.
_ATTENTION_HALF = {"input_layernorm", "self_attention", "self_attn_bda", "pre_cross_attn_layernorm",
                   "cross_attention", "cross_attn_bda"}


def moe_layer_spec(dense: ModuleSpec, moe: ModuleSpec, moe_layers: tuple[int, ...]) -> ModuleSpec:
    """One layer spec: on MoE layers `dense`'s attention half and `moe`'s MLP half
    (pre-MLP norm, MLP, their state-dict key map), `dense`'s submodules elsewhere."""
    for spec in (dense, moe):
        if not (isinstance(spec.module, type) and issubclass(spec.module, TransformerLayer)):
            raise ValueError(f"MoE needs TransformerLayer specs, got {spec.module!r}")
    out = copy.copy(dense)
    out.module = MoeTransformerLayer
    mlp_half = {f.name: getattr(moe.submodules, f.name) for f in dataclasses.fields(moe.submodules)
                if f.name not in _ATTENTION_HALF}
    out.params = {**(dense.params or {}), "moe_mlp": mlp_half, "moe_layers": tuple(moe_layers)}
    return out


# ---- calibration: what one expert-token costs next to the rest of a layer ------------------
def _time_fwd_bwd(layer, x, grad, mask, clock, repeats: int) -> tuple[list[float], int]:
    """Seconds (CPU thread or GPU) of `repeats` fwd+bwd calls of `layer` on `x`, and the
    expert tokens per call (0 for a dense layer)."""
    seconds, tokens = [], 0
    for _ in range(repeats):
        inp = x.detach().requires_grad_(True)
        start = clock.mark()
        out, _ = layer(hidden_states=inp, attention_mask=mask)
        out.backward(grad)
        end = clock.mark()
        clock.resolve()
        seconds.append(clock.seconds(start, end))
        layer.zero_grad(set_to_none=True)
        counts = layer.take_counts()
        tokens = sum(counts) if counts is not None else 0
    return seconds, tokens


def flop_fixed_tokens(cfg, seq_length: int) -> float:
    """An MoE layer's non-expert work per token, in units of one expert token's work, by
    matmul FLOPs: QKV and output projections 8h^2, attention scores and values 4sh, router
    2hE, against an expert's 4hf (6hf gated). What `calibrate` falls back to when timing
    cannot tell full from quarter capacity (layers too small for the clock)."""
    h, f = cfg.hidden_size, cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size
    expert = (6 if cfg.gated_linear_unit else 4) * h * f
    return (8 * h * h + 4 * seq_length * h + 2 * h * cfg.num_moe_experts) / expert


@rng_streams_kept()
def calibrate(trainer, moe_layers: tuple[int, ...], repeats: int = 3, rounds: int = 3,
              seed: int = 0) -> dict:
    """Time a throw-away MoE layer (and a dense one when some layer is dense) of this run's spec
    and shape on one micro-batch, fwd+bwd: with every routed token kept, and with a
    capacity factor of 0.25 (about three quarters dropped), interleaved over `rounds`,
    the fastest call of each kept (other processes' load only ever adds to a call's
    CPU time; so fitted, the fixed part varied +-3% over four runs on a loaded machine,
    where medians of fewer calls had varied +-25%). The two points
    give the line seconds = fixed_s + per_token_s x expert tokens. Returns {"fixed_s", "per_token_s", "dense_s" (None when every layer is
    MoE), "tokens" (per micro-batch), "full_tokens", "low_tokens"}.

    The layers are built fresh from the trainer's spec on a shallow copy of its config
    and fed a private generator's data: no parameter, gradient, optimizer or RNG state
    of the run is touched (Megatron's aux-loss logging tracker gets values, which the
    scenario clears every iteration)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from dynmo_plugin.megatron.training.scratch import build_scratch_layer, scratch_input
    from dynmo_plugin.profiling.clock import clock_for

    t = trainer
    cfg = copy.copy(t.config)
    offset = t.layout.offset(t.dims.pp_rank)
    gen = torch.Generator().manual_seed(seed)
    s, b, h = t.args.seq_length, t.args.micro_batch_size, cfg.hidden_size
    x = scratch_input((s, b, h), cfg, t.dims.device, gen)      # the run's precision
    grad = scratch_input((s, b, h), cfg, t.dims.device, gen)
    mask = torch.ones(s, s, dtype=torch.bool, device=t.dims.device).triu(1)[None, None]
    clock = clock_for(t.dims.device)

    decoder = t.model.decoder

    def build(number: int):
        return build_scratch_layer(t.spec, cfg, number - offset, decoder.pg_collection,
                                   decoder.vp_stage, t.dims.device, gen)

    dense = [n for n in range(1, t.config.num_layers + 1) if n not in moe_layers]
    moe = build(moe_layers[0])
    loads = {"full": (moe, None), "quarter": (moe, 0.25)}
    if dense:
        loads["dense"] = (build(dense[0]), None)
    samples: dict[str, list[float]] = {name: [] for name in loads}
    tokens: dict[str, int] = {}
    # the aux-loss backward would create Megatron's global loss scale as a 0-d tensor,
    # which the schedule's later set_loss_scale (shape [1]) cannot copy into: keep it
    saved_scale = MoEAuxLossAutoScaler.main_loss_backward_scale
    try:
        for layer, factor in loads.values():  # warm-up, not kept
            cfg.moe_expert_capacity_factor = factor
            _time_fwd_bwd(layer, x, grad, mask, clock, 1)
        for _ in range(rounds):  # interleaved, so a change of machine load hits all alike
            for name, (layer, factor) in loads.items():
                cfg.moe_expert_capacity_factor = factor
                seconds, tokens[name] = _time_fwd_bwd(layer, x, grad, mask, clock, repeats)
                samples[name] += seconds
    finally:
        MoEAuxLossAutoScaler.main_loss_backward_scale = saved_scale
    best = {name: min(v) for name, v in samples.items()}
    n_full, n_low = tokens["full"], tokens["quarter"]
    if best["full"] > best["quarter"] and n_full > n_low:
        per_token = (best["full"] - best["quarter"]) / (n_full - n_low)
    else:  # the clock could not resolve the slope (a tiny layer): split the full time
        per_token = best["full"] / (flop_fixed_tokens(cfg, s) * s * b + n_full)
        logger.warning("MoE calibration: full and quarter capacity timed alike (%.3g s, %.3g s); "
                       "fixed part estimated from matmul FLOPs", best["full"], best["quarter"])
    return {"fixed_s": max(best["full"] - per_token * n_full, 0.0), "per_token_s": per_token,
            "dense_s": best.get("dense"), "tokens": s * b, "full_tokens": n_full, "low_tokens": n_low}
