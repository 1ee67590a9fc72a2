"""A Megatron TransformerLayer with its own exit head: CALM-style token early exit.

Every decoder layer L carries a small exit head (LayerNorm + Linear(hidden -> vocab)).
After running, the layer predicts the next token of each token it processed; the
maximum softmax probability is that token's confidence (CALM's "softmax response").
A token whose confidence exceeds the threshold has exited: layers after L do not
process it any more (its hidden state is copied through unchanged, so the final norm
and output layer still see it). Each head is trained jointly with the model by
cross-entropy against the labels (`exit loss`), which reaches backward through
`AttachLoss` on the layer's output; the reported LM loss is unchanged.

Which tokens have exited travels WITH the activation, so it crosses pipeline stages
whatever the layout: the embedding's output gets `carrier_rows(s, h)` zero rows
appended to its [s, b, h] hidden states, holding one flag per token (`attach_carrier`
hooks the model), every layer reads and updates them, and the final LayerNorm's input
drops them again. EVERY inter-stage tensor is therefore [s + R, b, h], whatever the
layout (a stage holding only the embedding or only the output layer included). One
shape everywhere is what Megatron's interleaved schedule needs: it receives a
chunk's activation and the next chunk's gradient in one call, and with pp = 2 (both
neighbours the same rank) its shape exchange (`variable_seq_lengths=True`, which the
scenario sets) pairs the two shape messages in posting order, so two different
shapes got swapped (gloo: "Received data size doesn't match expected size"). The decision is a function
of the layer's own inputs and parameters only, so it is the same on any pipeline
split and moves with the layer in a migration (the head is a submodule: its
weights, gradients and Adam state move too).

Compute really shrinks: the active tokens of each sample are gathered to [C, b, h]
(C = most active tokens in any sample of the micro-batch, rounded up to the context's
`token_multiple` so the GEMMs and attention run the GPU's fast kernels; shorter samples
and the rounding are padded with exited tokens, masked as keys, outputs discarded), the causal mask is gathered at the
tokens' ORIGINAL positions to [b, 1, C, C], the base layer runs on that, and the
result is scattered back. Keys are the active tokens only (exited tokens are neither
queries nor keys/values in later layers; CALM instead propagates exited tokens'
states to later layers' keys/values). Learned absolute position embeddings are added
before layer 1, so gathering keeps positions right; rotary embeddings are refused.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer

from dynmo_plugin.scenarios.gathered_tokens import AttachLoss, arbitrary_mask, gather_mask
from dynmo_plugin.scenarios.shapes import round_up

__all__ = ["ExitContext", "ExitHead", "EarlyExitLayer", "early_exit_spec", "attach_carrier",
           "carrier_rows",
           "encode_exited", "decode_exited"]


def carrier_rows(seq_length: int, hidden_size: int) -> int:
    """Rows appended to the [s, b, h] activation to carry two exit flags per token: after
    the layer that sent it, and after the layer before that (`StagedCount`)."""
    return math.ceil(2 * seq_length / hidden_size)


def encode_exited(exited: torch.Tensor, hidden_size: int, dtype: torch.dtype,
                  before: Optional[torch.Tensor] = None) -> torch.Tensor:
    """[s, b] bool flags now (and one layer earlier: `before`, default the same) ->
    [R, b, h] rows of 0.0/1.0 (token t of sample j at flat index t, then s + t)."""
    s, b = exited.shape
    rows = carrier_rows(s, hidden_size)
    flat = torch.zeros(rows * hidden_size, b, dtype=dtype, device=exited.device)
    flat[:2 * s] = torch.cat([exited, exited if before is None else before]).to(dtype)
    return flat.view(rows, hidden_size, b).permute(0, 2, 1).contiguous()


def decode_exited(rows: torch.Tensor, seq_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `encode_exited`: [R, b, h] -> ([s, b] bool now, [s, b] one layer earlier)."""
    r, b, h = rows.shape
    flat = rows.detach().permute(0, 2, 1).reshape(r * h, b)[:2 * seq_length] > 0.5
    return flat[:seq_length], flat[seq_length:]


class StagedCount:
    """Active tokens per sample entering a layer, copied to the host without waiting for
    it: into pinned memory with an event on CUDA (a plain copy on CPU).

    Why: a layer gathers at most C of its tokens, and C must be known on the host. The
    exact count entering layer L is decided by layer L-1 on the device, so reading it
    drains the queue once per layer (issue 33). The count entering L-1 bounds it (an
    exited token stays exited) and was staged by L-1 at its start: waiting for that copy
    lets the host enqueue L while the device still runs L-1. The padded slots between
    the bound and each sample's exact count are masked on the device (`valid`). The
    bound is the same on every pipeline layout: a stage's first layer reads the count
    entering L-1 from the carrier's second flag set (its one host read per micro-batch)."""

    def __init__(self, counts: torch.Tensor):
        self.event = None
        if counts.is_cuda:
            self.host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
            self.host.copy_(counts, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = counts.detach().clone()
        self.host._dynmo_host_copy = True  # a host buffer: reading it reads no device value

    def read(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


@dataclass
class ExitContext:
    """What the stage's layers need for one iteration, set by the scenario before it.

    labels / loss_masks: this DP replica's micro-batches in order, [s, b] each (layers
    take them in forward-call order: 1F1B runs each stage's forwards in micro-batch
    order). grad_scale: multiplies the exit loss's gradient (1 / micro-batches times
    the optimizer's loss scale), as the schedule does for the LM loss."""

    seq_length: int
    threshold: float
    min_layer: int
    exits_on: bool
    loss_weight: float
    grad_scale: float
    labels: list = field(default_factory=list)
    loss_masks: list = field(default_factory=list)
    token_multiple: int = 64  # gathered token counts are rounded up to a multiple of this
    # micro-batch -> (layer number, active tokens per sample entering it) of the last
    # layer of this stage that ran it: a StagedCount, or a list the host knows
    staged: dict = field(default_factory=dict)


class ExitHead(torch.nn.Module):
    """LayerNorm + Linear(hidden -> vocab): next-token logits from a layer's output."""

    def __init__(self, hidden_size: int, vocab_size: int, eps: float):
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden_size, eps=eps)
        self.linear = torch.nn.Linear(hidden_size, vocab_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear(self.norm(hidden))



class EarlyExitLayer(TransformerLayer):
    """TransformerLayer + exit head; skips tokens that exited at an earlier layer."""

    def __init__(self, *args, vocab_size: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.exit_head = ExitHead(self.config.hidden_size, vocab_size, self.config.layernorm_epsilon)
        self.exit_context: Optional[ExitContext] = None
        self.reset_exit_stats()

    def reset_exit_stats(self) -> None:
        """Start a new iteration: micro-batch counter and token counts back to zero."""
        self._calls = 0
        self.tokens_seen = 0    # tokens of this iteration's micro-batches
        # of which not exited before this layer: a device tensor once a token may have
        # exited (read by the scenario at its events, not per forward)
        self._active = 0
        # exit-head confidence summed over the active tokens: a float64 device tensor once
        # a micro-batch ran (read by the scenario at its events, not per forward)
        self.confidence_sum = 0.0

    @property
    def tokens_active(self) -> int:
        """Tokens this iteration's micro-batches ran through this layer (a host read)."""
        return int(self._active)

    def forward(self, *args, **kwargs):
        ctx = self.exit_context
        if ctx is None:
            raise RuntimeError(f"layer {self.layer_number}: EarlyExitLayer runs only under the "
                               "early_exit scenario (no ExitContext was bound)")
        if args:
            raise TypeError("EarlyExitLayer takes keyword arguments only (as TransformerBlock calls it)")
        if kwargs.get("rotary_pos_emb") is not None or kwargs.get("packed_seq_params") is not None:
            raise NotImplementedError("early exit gathers tokens at learned absolute positions; "
                                      "rotary embeddings and packed sequences are not supported")
        mb = self._calls
        self._calls += 1
        hidden = kwargs.pop("hidden_states")
        s, h = ctx.seq_length, self.config.hidden_size
        x, (exited, before) = hidden[:s], decode_exited(hidden[s:], s)
        self.tokens_seen += exited.numel()
        if not self._exits_possible():  # known on the host: every token is active
            ctx.staged[mb] = (self.layer_number, [s] * exited.shape[1])
            self._active += exited.numel()
            out, context, exited_after = self._run_active(x, exited, None, None, mb, kwargs)
            return torch.cat([out, encode_exited(exited_after, h, out.dtype, exited)], dim=0), context
        active = ~exited
        counts = active.sum(0)                 # exact, on the device: masks the padded slots
        bound = max(self._bound(before, mb))   # on the host, without draining the queue
        ctx.staged[mb] = (self.layer_number, StagedCount(counts))
        self._active = self._active + counts.sum()
        if bound == 0:  # every token of the micro-batch had exited
            return torch.cat([x, encode_exited(exited, h, x.dtype, exited)], dim=0), kwargs.get("context")
        # C rounded up to the granularity: GEMM-friendly, padded with exited tokens
        c = round_up(bound, ctx.token_multiple, s)
        out, context, exited_after = self._run_active(x, exited, active, (counts, c), mb, kwargs)
        return torch.cat([out, encode_exited(exited_after, h, out.dtype, exited)], dim=0), context

    def _bound(self, before: torch.Tensor, mb: int) -> list[int]:
        """Active tokens per sample entering the layer before this one: an upper bound of
        this layer's (`StagedCount`). Staged by that layer when it ran on this stage; else
        (this is the stage's first layer) read from the carrier: one host read."""
        staged = self.exit_context.staged.get(mb)
        if staged is not None and staged[0] == self.layer_number - 1:
            return staged[1] if isinstance(staged[1], list) else staged[1].read()
        return (~before).sum(0).tolist()

    def _exits_possible(self) -> bool:
        """Whether a token may have exited before this layer: only after a layer >=
        min_layer once exits are on (what `_decide` allows), so the host knows."""
        ctx = self.exit_context
        return ctx.exits_on and self.layer_number > ctx.min_layer

    def _run_active(self, x, exited, active, counts, mb: int, kwargs):
        """`active` None: every token runs (the plain layer); else `counts` is (active
        tokens per sample on the device, their maximum C on the host)."""
        ctx, s = self.exit_context, x.shape[0]
        b, h = x.shape[1], x.shape[2]
        if active is None:  # nothing to gather: the plain layer
            y, context = super().forward(hidden_states=x, **kwargs)
            idx = valid = None
            y_active = y
        else:
            counts, c = counts
            # active tokens first, each group in original order (stable sort); slots past a
            # sample's count hold its exited tokens (masked as keys, outputs discarded)
            idx = torch.sort((~active).to(torch.int8), dim=0, stable=True).indices[:c]  # [C, b]
            valid = torch.arange(c, device=x.device)[:, None] < counts[None, :]       # [C, b]
            x_active = x.gather(0, idx[..., None].expand(c, b, h))
            kwargs["attention_mask"] = _gather_mask(kwargs.get("attention_mask"), idx, valid, s)
            y_active, context = super().forward(hidden_states=x_active, **kwargs)
            # padded slots hold exited tokens: put their own state back unchanged
            y_active = torch.where(valid[..., None], y_active, x_active)
            y = x.scatter(0, idx[..., None].expand(c, b, h), y_active)
        logits = self.exit_head(y_active)  # [C, b, V]: only the tokens this layer ran
        labels, loss_mask = ctx.labels[mb], ctx.loss_masks[mb]
        if idx is not None:
            labels, loss_mask = labels.gather(0, idx), loss_mask.gather(0, idx) * valid
        ce = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="none")
        exit_loss = (ce * loss_mask.flatten()).sum() / loss_mask.sum().clamp(min=1)
        scale = ctx.grad_scale * ctx.loss_weight / self.config.num_layers
        y = AttachLoss.apply(y, exit_loss, scale)
        return y, context, self._decide(logits, exited, idx, valid)

    @torch.no_grad()
    def _decide(self, logits, exited, idx, valid) -> torch.Tensor:
        """Exited flags after this layer: before, or confidence above the threshold now."""
        ctx = self.exit_context
        confidence = torch.softmax(logits.float(), dim=-1).amax(-1)  # [C, b]
        total = confidence.sum() if valid is None else (confidence * valid).sum()
        self.confidence_sum = self.confidence_sum + total.double()  # no host read
        may_exit = (ctx.exits_on and self.layer_number >= ctx.min_layer
                    and self.layer_number < self.config.num_layers)
        if not may_exit:
            return exited
        now = confidence > ctx.threshold
        if idx is None:
            return exited | now
        return exited.scatter(0, idx, exited.gather(0, idx) | (now & valid))


def _gather_mask(mask: Optional[torch.Tensor], idx: torch.Tensor, valid: torch.Tensor,
                 s: int) -> torch.Tensor:
    """[*, 1, s, s] bool (True = masked) -> [b, 1, C, C] at the gathered positions;
    padded slots are masked as keys and see only themselves as queries."""
    c = idx.shape[0]
    out = gather_mask(mask, idx, s, "EarlyExitLayer") | ~valid.T[:, None, None, :]
    eye = torch.eye(c, dtype=torch.bool, device=idx.device)
    return arbitrary_mask(torch.where(~valid.T[:, None, :, None], ~eye, out))


def attach_carrier(model, seq_length: int) -> None:
    """Hook a GPTModel chunk so every stage boundary carries [s + R, b, h]: the
    embedding (first stage) appends R zero rows (no token has exited), the final
    LayerNorm (last stage) drops the rows before the output layer. Idempotent (a
    chunk already hooked is left alone)."""
    if getattr(model, "_dynmo_exit_carrier", False):
        return
    embedding = getattr(model, "embedding", None) if getattr(model, "pre_process", False) else None
    if embedding is not None:
        def add_rows(_module, _inputs, out):
            rows = carrier_rows(seq_length, out.shape[2])
            return torch.cat([out, out.new_zeros(rows, out.shape[1], out.shape[2])], dim=0)
        embedding.register_forward_hook(add_rows)
    if getattr(model, "post_process", False):
        norm = model.decoder.final_layernorm
        if norm is None:
            raise ValueError("early exit strips its exit-flag rows at the final LayerNorm; this "
                             "model has none on its last stage (keep the final layer norm on)")

        def drop_rows(_module, args):
            return (args[0][:seq_length],) + tuple(args[1:])
        norm.register_forward_pre_hook(drop_rows)
    model._dynmo_exit_carrier = True


def early_exit_spec(spec: ModuleSpec, vocab_size: int) -> ModuleSpec:
    """`spec` (a TransformerLayer spec) with EarlyExitLayer as its module."""
    if not (isinstance(spec.module, type) and issubclass(spec.module, TransformerLayer)):
        raise ValueError(f"early exit needs a TransformerLayer spec, got {spec.module!r}")
    out = copy.copy(spec)
    out.module = EarlyExitLayer
    out.params = {**(spec.params or {}), "vocab_size": vocab_size}
    return out
