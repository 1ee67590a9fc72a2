"""A Megatron TransformerLayer with Mixture-of-Depths routing (Raposo et al., 2024).

A routed layer (the scenario decides which: every N-th) owns a router, a linear map
hidden -> 1 scalar per token. Per sequence, the C tokens with the highest router logits
(expert-choice top-C; C = capacity x s rounded to a multiple of `granularity`, 64 tokens
by default, so every GEMM of the block has a GPU-friendly size) go through the whole
block; the others
ride the residual stream unchanged. The selected tokens are gathered to [C, b, h]
(Megatron is [seq, batch, hidden]) in their original order, so among them the causal
mask is the causal mask again (its [C, C] corner: a view, and SDPA's causal kernel;
a mask marked arbitrary is gathered at the tokens' ORIGINAL positions instead, as are
rotary embeddings, if any), the base layer runs on that, and the result is scattered
back:

    out_i = x_i + sigmoid(r_i) * (block(x~)_i - x_i)   for selected tokens i,
    out_i = x_i                                      for the others,

(one scatter_add of the gated update into x), so the router receives gradients through
the block output it scales. Compute shrinks with C: the layer's linear parts scale with
C, its attention with C^2. What a routed layer adds to its block is a fixed, short list
of kernels with hand-written backwards (routing.py: router GEMV, top-C, sort, gathers,
the gated scatter, the predictor's gradient; 30 kernels per forward + backward, was 44:
tests/scenarios/test_mod_kernels.py counts them), none of which reads a device value on
the host.

Top-C over a sequence looks at future tokens, so it cannot be used when sampling
autoregressively. As in the paper, each routed layer also trains a small auxiliary
predictor (Linear -> SiLU -> Linear on the block input, stop-gradient on that input)
by binary cross-entropy to predict whether a token is in the top C; at sampling time
it would replace the top-C. Its loss's gradient joins backward through `PredictorGrad`
(weighted by the scenario's `predictor_loss_weight`; the value is never computed, and
the predictor's forward runs in the backward); since its input is detached it cannot
change the backbone. Its accuracy is counted only in iterations the scenario reports
(`ModContext.collect_stats`: event iterations), two int64 counts per micro-batch; the
tokens and the selected count are known on the host.

Per-layer state lives in the layer, so a migration or a repack moves it: router and
predictor are submodules (weights, gradients, Adam state travel), and the current
capacity is a persistent buffer (`capacity`, float64). A layer that is not routed is
a plain TransformerLayer. A routed layer with capacity < 1 still holds every
parameter and its optimizer state ("shadow" parameters of the tokens it skips); only
its time and activation memory shrink, which is what the profiler reports.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer

from dynmo_plugin.megatron.training.scratch import rng_streams_kept
from dynmo_plugin.scenarios.gathered_tokens import gather_mask, is_arbitrary_mask
from dynmo_plugin.scenarios.mixture_of_depths.routing import PredictorGrad, RouteIn, RouteOut
from dynmo_plugin.scenarios.shapes import round_nearest

__all__ = ["ModContext", "Predictor", "MoDLayer", "mod_spec", "tokens_for", "GRANULARITY",
           "gather_rotary", "time_scratch_layers"]

# kwargs of TransformerLayer.forward this layer cannot route (they index tokens in ways
# a gather would have to follow; none is used by the launcher's GPT)
_UNSUPPORTED = ("rotary_pos_cos", "rotary_pos_sin", "rotary_pos_cos_sin", "attention_bias",
                "inference_context", "packed_seq_params", "sequence_len_offset", "padding_mask",
                "inference_params")


GRANULARITY = 64  # tokens: the default multiple a routed block's token count is rounded to


def tokens_for(capacity: float, seq_length: int, granularity: int = GRANULARITY) -> int:
    """Tokens per sequence a block of this capacity processes: c x s rounded to the
    nearest multiple of `granularity`, at least one granule, at most the sequence."""
    return round_nearest(capacity * seq_length, granularity, seq_length)


@dataclass
class ModContext:
    """Set by the scenario before each iteration. grad_scale multiplies the predictor
    loss's gradient (1 / micro-batches x the optimizer's loss scale), as the schedule
    scales the LM loss."""

    predictor_loss_weight: float
    grad_scale: float
    collect_stats: bool = False  # count the predictor's hits (an event iteration)


class Predictor(torch.nn.Module):
    """Linear(h -> p) -> SiLU -> Linear(p -> 1): a token's top-C logit, causal (per token)."""

    def __init__(self, hidden_size: int, width: int):
        super().__init__()
        self.fc1 = torch.nn.Linear(hidden_size, width)
        self.fc2 = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.silu(self.fc1(x))).squeeze(-1)



class MoDLayer(TransformerLayer):
    """TransformerLayer that, if routed, processes only its top-C tokens per sequence."""

    def __init__(self, *args, capacities: dict, predictor_width: int,
                 granularity: int = GRANULARITY, **kwargs):
        """`capacities`: {global layer number: initial capacity} of the routed layers;
        `granularity`: the multiple (tokens) a block's token count is rounded to."""
        super().__init__(*args, **kwargs)
        capacity = capacities.get(self.layer_number)
        self.routed = capacity is not None
        self.granularity = granularity
        self.mod_context: Optional[ModContext] = None
        if self.routed:
            h = self.config.hidden_size
            self.router = torch.nn.Linear(h, 1, bias=False)
            self.predictor = Predictor(h, predictor_width)
            self.register_buffer("capacity", torch.tensor(float(capacity), dtype=torch.float64))
            self._capacity = float(capacity)  # the host's copy: forward reads no device tensor
        self.reset_mod_stats()

    def set_capacity(self, capacity: float) -> None:
        self._capacity = float(capacity)
        self.capacity.fill_(self._capacity)

    def _apply(self, fn, recurse=True):
        """Keep `capacity` float64 through half casts (Float16Module's bfloat16(), a
        migrated layer's .to(params_dtype)): bf16 would turn 0.56 into 0.5625."""
        out = super()._apply(fn, recurse)
        if getattr(self, "routed", False) and self.capacity.dtype != torch.float64:
            self.capacity = torch.tensor(self._capacity, dtype=torch.float64,
                                         device=self.capacity.device)
        return out

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """A migration or checkpoint brings the capacity: refresh the host's copy (one
        read per load, not per forward)."""
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if self.routed and prefix + "capacity" in state_dict:
            self._capacity = float(state_dict[prefix + "capacity"])

    def tokens(self, seq_length: int) -> int:
        """Tokens per sequence this block processes at its current capacity."""
        return tokens_for(self._capacity, seq_length, self.granularity)

    def reset_mod_stats(self) -> None:
        """Start a new iteration's predictor counts: tokens and selected (host ints,
        known from the shapes) and [predicted, predicted & selected] (device int64,
        allocated at the first counted micro-batch)."""
        self._seen = [0, 0]
        self._hits: Optional[torch.Tensor] = None

    def mod_counts(self) -> list[int]:
        """[tokens, selected, predicted, predicted & selected, predictions right] summed
        over the micro-batches counted since the last reset (one device read)."""
        tokens, selected = self._seen
        predicted, both = self._hits.tolist() if self._hits is not None else (0, 0)
        return [tokens, selected, predicted, both, tokens - selected - predicted + 2 * both]

    def forward(self, *args, **kwargs):
        if not self.routed:
            return super().forward(*args, **kwargs)
        if args:
            raise TypeError("MoDLayer takes keyword arguments only (as TransformerBlock calls it)")
        ctx = self.mod_context
        if ctx is None:
            raise RuntimeError(f"layer {self.layer_number}: MoDLayer runs only under the "
                               "mixture_of_depths scenario (no ModContext was bound)")
        used = [k for k in _UNSUPPORTED if kwargs.get(k) is not None]
        if used:
            raise NotImplementedError(f"Mixture of Depths routes tokens by gathering them; "
                                      f"{used} are not supported")
        if self.config.sequence_parallel:
            raise NotImplementedError("Mixture of Depths needs whole sequences (no sequence parallel)")
        x = kwargs.pop("hidden_states")
        s, b, h = x.shape
        c = self.tokens(s)
        if c == s:  # every token: the gated plain layer, no gather
            return self._every_token(x, ctx, kwargs)
        box: dict = {}  # RouteOut's backward hands RouteIn's the output gradient
        x_sel, gate, idx = RouteIn.apply(x, self.router.weight, c, box)
        kwargs["attention_mask"] = self._block_mask(kwargs.get("attention_mask"), idx, s)
        if kwargs.get("rotary_pos_emb") is not None:
            kwargs["rotary_pos_emb"] = gather_rotary(kwargs["rotary_pos_emb"], idx)
        y_sel, context = super().forward(hidden_states=x_sel, **kwargs)
        out = RouteOut.apply(x.detach(), x_sel.detach(), y_sel, gate, idx, box)
        return self._predictor_loss(out, x, idx, ctx), context

    def _block_mask(self, mask: Optional[torch.Tensor], idx: torch.Tensor, s: int) -> torch.Tensor:
        """The attention mask among the selected tokens. A causal layer's mask (not marked
        arbitrary) is the causal one, as Transformer Engine and the SDPA backend take it;
        among tokens kept in their original order that is the causal mask again: its
        leading [C, C] corner, a view (no kernel; SDPA runs its causal kernel on it). Any
        other mask is gathered at the tokens' positions."""
        c = idx.shape[0]
        causal = self.self_attention.attn_mask_type == AttnMaskType.causal
        if causal and mask is not None and not is_arbitrary_mask(mask) and mask.shape[-2:] == (s, s):
            return mask[..., :c, :c]
        return gather_mask(mask, idx, s, "MoDLayer")

    def _every_token(self, x: torch.Tensor, ctx: ModContext, kwargs: dict):
        """Capacity 1: the block on all tokens, gated (the router still learns)."""
        logits = self.router(x).squeeze(-1)                                   # [s, b]
        idx = torch.arange(x.shape[0], device=x.device)[:, None].expand(logits.shape)
        y, context = super().forward(hidden_states=x, **kwargs)
        out = x + torch.sigmoid(logits)[..., None] * (y - x)
        return self._predictor_loss(out, x, idx, ctx), context

    def _predictor_loss(self, out: torch.Tensor, x: torch.Tensor, idx: torch.Tensor,
                        ctx: ModContext) -> torch.Tensor:
        """Train the causal predictor on this micro-batch's top-C membership (its forward
        runs in the backward; here only where its hits are counted)."""
        scale = ctx.grad_scale * ctx.predictor_loss_weight
        if ctx.collect_stats:
            with torch.no_grad():
                self._count_hits(self.predictor(x), idx)
        if scale == 0.0:
            return out
        p = self.predictor
        return PredictorGrad.apply(out, x.detach(), idx, scale, p.fc1.weight, p.fc1.bias,
                                   p.fc2.weight, p.fc2.bias)

    @torch.no_grad()
    def _count_hits(self, pred: torch.Tensor, idx: torch.Tensor) -> None:
        """Add [predicted, predicted & selected] on the device (no host read; the scenario
        reads them once per event) and the shapes' tokens and selected on the host."""
        yes = pred > 0
        hits = torch.stack([yes.sum(), yes.gather(0, idx).sum()])
        self._hits = hits if self._hits is None else self._hits + hits
        self._seen[0] += pred.numel()
        self._seen[1] += idx.numel()


def gather_rotary(emb, idx: torch.Tensor):
    """Rotary frequencies [s, 1, 1, d] (or a (q, k) pair of them) -> [C, b, 1, d] at the
    ORIGINAL positions of the selected tokens (else every token would be rotated as if
    it sat at position 0..C-1)."""
    if isinstance(emb, tuple):
        return tuple(None if e is None else gather_rotary(e, idx) for e in emb)
    if emb.dim() != 4 or emb.shape[1] != 1:
        raise NotImplementedError(f"rotary embedding of shape {tuple(emb.shape)}; expected [s, 1, 1, d]")
    return emb[:, 0][idx]


def mod_spec(spec: ModuleSpec, capacities: dict[int, float], predictor_width: int,
             granularity: int = GRANULARITY) -> ModuleSpec:
    """`spec` (a TransformerLayer spec) with MoDLayer as its module."""
    if not (isinstance(spec.module, type) and issubclass(spec.module, TransformerLayer)):
        raise ValueError(f"Mixture of Depths needs a TransformerLayer spec, got {spec.module!r}")
    out = copy.copy(spec)
    out.module = MoDLayer
    out.params = {**(spec.params or {}), "capacities": dict(capacities),
                  "predictor_width": predictor_width, "granularity": granularity}
    return out


def time_scratch_layers(trainer, clock, capacities, repeats: int) -> dict:
    """Seconds per micro-batch (forward + backward) of scratch layers built from
    `trainer`'s spec and config, in the run's precision, on random inputs of the run's
    shape: a plain layer (key None) and a routed one at each capacity, `repeats` rounds
    after one warm-up round. Touches no live layer and no RNG state."""
    from dynmo_plugin.megatron.training.scratch import build_scratch_layer, scratch_input
    cfg, args = trainer.config, trainer.args
    decoder, width = trainer.model.decoder, trainer.spec.params["predictor_width"]
    device = trainer.dims.device
    s, b = args.seq_length, args.micro_batch_size
    gen = torch.Generator().manual_seed(0)

    def scratch(routed: bool):
        caps = {n: 1.0 for n in range(1, cfg.num_layers + 1)} if routed else {}
        spec = mod_spec(trainer.spec, caps, width, trainer.spec.params.get("granularity", GRANULARITY))
        layer = build_scratch_layer(spec, cfg, 1,
                                    decoder.pg_collection, decoder.vp_stage, device, gen)
        layer.mod_context = ModContext(predictor_loss_weight=1.0, grad_scale=1.0)
        return layer

    with rng_streams_kept():  # the scratch layers' dropout draws from the run's streams
        plain, routed = scratch(False), scratch(True)
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None].to(device)
        x0 = scratch_input((s, b, cfg.hidden_size), cfg, device, gen)
        out: dict = {c: [] for c in (None, *capacities)}
        for rep in range(repeats + 1):
            for c in out:
                layer = plain if c is None else routed
                if c is not None:
                    layer.set_capacity(c)
                x = x0.clone().requires_grad_(True)
                start = clock.mark()
                y, _ = layer(hidden_states=x, attention_mask=mask)
                y.sum().backward()
                end = clock.mark()
                clock.resolve()
                if rep:
                    out[c].append(clock.seconds(start, end))
                layer.zero_grad(set_to_none=True)
    return out
