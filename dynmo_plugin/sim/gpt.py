"""Analytic cost of GPT decoder layers on a GPU cluster (what the simulator schedules).

FLOPs per micro-batch of one layer (Narayanan et al., SC'21, "Efficient Large-Scale
Language Model Training on GPU Clusters", eq. 2 without the logit layer), with b the
micro-batch size, s the sequence length and h the hidden size:
  attention projections 8 b s h^2, MLP 16 b s h^2, attention core (QK^T and AV) 4 b s^2 h;
backward = 2x forward. The output layer costs 2 b s h V forward (vocabulary V) and sits on
the last stage; the embedding lookup is negligible compute. Seconds = FLOPs / (peak *
efficiency); the attention core runs `attn_core_slowdown` times slower than GEMMs
(softmax and memory traffic). Scenarios scale each component per layer via `LayerLoad`.

With `Hardware.measured` set (a profile of measured per-layer costs,
`dynmo_plugin.sim.measured`), `layer_costs` prices layers from those curves instead:
on GPUs a layer's time is not proportional to its FLOPs at small shapes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from dynmo_plugin.errors import UserError
from dynmo_plugin.sim.cost import Link

__all__ = ["GPTShape", "Hardware", "LayerLoad", "LayerCosts", "MeasuredModel", "layer_costs",
           "flop_layer_costs"]


@dataclass(frozen=True, kw_only=True)
class GPTShape:
    """GPT model and batch shape. Defaults: the DynMo paper's setup (hidden 1024,
    32 heads, sequence 2048, micro-batch 2; GPT-2 vocabulary of 50257 tokens).
    output_layer=False leaves the output layer's compute out of the schedule (the
    paper's balancing discussion counts decoder layers only)."""

    num_layers: int
    hidden: int = 1024
    heads: int = 32
    seq: int = 2048
    micro_batch: int = 2
    vocab: int = 50257
    output_layer: bool = True

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden", "heads", "seq", "micro_batch", "vocab"):
            if getattr(self, name) < 1:
                raise UserError(f"GPT {name} must be >= 1, got {getattr(self, name)}")
        if self.hidden % self.heads:
            raise UserError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")

    @property
    def tokens_per_microbatch(self) -> int:
        return self.seq * self.micro_batch

    @property
    def layer_params(self) -> int:
        """Weights and biases of one layer: 12 h^2 + 13 h."""
        return 12 * self.hidden ** 2 + 13 * self.hidden

    @property
    def act_bytes(self) -> float:
        """Activation sent between stages per micro-batch: s * b * h in bf16."""
        return 2.0 * self.seq * self.micro_batch * self.hidden


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """Per-GPU speed and links. Defaults: an A100-80GB class GPU (312 TFLOP/s bf16 peak)
    at 45% of peak on GEMMs, HDR InfiniBand between pipeline neighbours and DP peers
    (25 GB/s, 5 us). Gradients are all-reduced in bf16 (2 bytes per parameter); a moved
    layer carries 18 bytes per parameter (bf16 weight and grad, fp32 master weight and
    two Adam moments). `measured`: per-layer costs from measured curves (replaces the
    FLOP model for compute; links and memory stay as given here); `name` labels it."""

    peak_flops: float = 312e12
    efficiency: float = 0.45
    attn_core_slowdown: float = 1.5
    p2p: Link = field(default_factory=lambda: Link(latency_s=5e-6, bandwidth_Bps=25e9))
    dp_link: Link = field(default_factory=lambda: Link(latency_s=5e-6, bandwidth_Bps=25e9))
    grad_bytes_per_param: float = 2.0
    state_bytes_per_param: float = 18.0
    memory_bytes: float = 80e9
    measured: "MeasuredModel | None" = None
    name: str = "a100-flops"

    def __post_init__(self) -> None:
        if not self.peak_flops > 0 or not 0 < self.efficiency <= 1:
            raise UserError(f"need peak_flops > 0 and 0 < efficiency <= 1, got "
                            f"{self.peak_flops}, {self.efficiency}")

    @property
    def flops_per_s(self) -> float:
        return self.peak_flops * self.efficiency


@dataclass(frozen=True)
class LayerLoad:
    """Work of each decoder layer relative to the dense layer (index 0 = layer 1).

    attn_linear, mlp, attn_core: multipliers on the forward work of each component
    (the FLOP model); backward: multiplier on the backward work (0 = the layer runs no
    backward: frozen prefix); trainable: whether the layer's gradients are all-reduced.
    knob, knob_value: what the scenario changes, per layer, in the units a measured
    curve is indexed by (`dynmo_plugin.sim.measured.KNOBS`), e.g. knob "tokens" with the
    share of tokens each layer processes; None = nothing a curve prices.
    params: share of a layer's parameters that count for a by-parameter balancer
    (DeepSpeed's 'parameters' method: pruned weights gone, frozen layers 0); None = 1.
    """

    attn_linear: np.ndarray
    mlp: np.ndarray
    attn_core: np.ndarray
    backward: np.ndarray
    knob: str | None = None
    knob_value: np.ndarray | None = None
    params: np.ndarray | None = None

    @classmethod
    def dense(cls, num_layers: int) -> "LayerLoad":
        one = np.ones(num_layers)
        return cls(one.copy(), one.copy(), one.copy(), one.copy())

    @property
    def num_layers(self) -> int:
        return len(self.mlp)

    @property
    def trainable(self) -> np.ndarray:
        return self.backward > 0

    @property
    def param_share(self) -> np.ndarray:
        """Per layer, the parameters a by-parameter balancer counts, in layers' worth:
        trainable layers only (DeepSpeed counts parameters with requires_grad)."""
        share = np.ones(self.num_layers) if self.params is None else np.asarray(self.params, float)
        return share * self.trainable


@dataclass(frozen=True)
class LayerCosts:
    """Seconds per micro-batch of each layer, and the forward of the output layer (last
    stage) and of the embedding (first stage; 0 in the FLOP model: a lookup); their
    backward costs twice their forward."""

    fwd_s: np.ndarray
    bwd_s: np.ndarray
    head_fwd_s: float
    embed_fwd_s: float = 0.0

    @property
    def total_s(self) -> np.ndarray:
        return self.fwd_s + self.bwd_s

    def extras_s(self, num_stages: int) -> list[float]:
        """Fixed forward+backward seconds per stage (embedding on the first, output
        layer + loss on the last)."""
        out = [0.0] * num_stages
        out[0] += 3 * self.embed_fwd_s
        out[-1] += 3 * self.head_fwd_s
        return out


class MeasuredModel(Protocol):
    """What `layer_costs` asks of `Hardware.measured`: a profile of measured per-layer
    costs (`dynmo_plugin.sim.measured.MeasuredCosts`, which builds on this module's types,
    so this module names the one method it calls instead of importing it)."""

    def layer_costs(self, shape: GPTShape, load: LayerLoad) -> LayerCosts: ...


def layer_costs(shape: GPTShape, hw: Hardware, load: LayerLoad) -> LayerCosts:
    """Per-layer forward/backward seconds per micro-batch under `load`: from the
    hardware's measured curves when it has them, else from FLOPs."""
    if load.num_layers != shape.num_layers:
        raise UserError(f"load describes {load.num_layers} layers, the model has {shape.num_layers}")
    if hw.measured is not None:
        return hw.measured.layer_costs(shape, load)
    return flop_layer_costs(shape, hw, load)


def flop_layer_costs(shape: GPTShape, hw: Hardware, load: LayerLoad) -> LayerCosts:
    """The FLOP model (module docstring), whatever `hw.measured` holds."""
    b, s, h = shape.micro_batch, shape.seq, shape.hidden
    rate = hw.flops_per_s
    attn_linear = 8 * b * s * h * h / rate
    mlp = 16 * b * s * h * h / rate
    core = 4 * b * s * s * h / rate * hw.attn_core_slowdown
    fwd = attn_linear * load.attn_linear + mlp * load.mlp + core * load.attn_core
    head = 2 * b * s * h * shape.vocab / rate if shape.output_layer else 0.0
    return LayerCosts(fwd_s=fwd, bwd_s=2 * fwd * load.backward, head_fwd_s=head)
