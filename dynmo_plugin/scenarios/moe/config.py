"""The settings of Mixture of Experts: YAML section `dynamism.moe`, flags `--dynmo-moe-*`.

Pure: the standard library and the config's field helpers.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from dynmo_plugin.config.fields import multiple_of_8, non_negative, opt, positive, zeros_and_ones

__all__ = ["MoeConfig"]


@dataclass(kw_only=True)
class MoeConfig:
    """Megatron-Core's own Mixture of Experts: top-k token-choice routing."""

    num_experts: int = field(default=8, metadata=opt("experts per MoE layer", "--dynmo-moe-num-experts", positive))
    top_k: int = field(default=2, metadata=opt("experts each token is routed to", "--dynmo-moe-top-k", positive))
    every: int = field(default=1, metadata=opt(
        "every N-th decoder layer is an MoE layer (1: all, 2: every other)", "--dynmo-moe-every", positive))
    pattern: str = field(default="", metadata=opt(
        "Megatron's moe_layer_freq as a list: one 1 (MoE) or 0 (dense) per decoder layer, "
        "e.g. '1,1,1,1,0,0,0,0'; overrides `every`", "--dynmo-moe-pattern", zeros_and_ones))
    capacity_factor: float = field(default=0.0, metadata=opt(
        "expert capacity factor; tokens over capacity are dropped (0: no dropping)",
        "--dynmo-moe-capacity-factor", non_negative))
    granularity: int = field(default=64, metadata=opt(
        "an expert's capacity per micro-batch (tokens it may keep) is rounded to a multiple of "
        "this many tokens (a GEMM-friendly size; the events report the capacity used)",
        "--dynmo-moe-granularity", multiple_of_8))
    no_pad: bool = field(default=False, metadata=opt(
        "with a capacity, let each expert compute only the tokens it kept (GEMM rows that "
        "follow the routing, read back to the host every forward) instead of padding every "
        "expert to its capacity (static shapes: the work is what the capacity says)",
        "--dynmo-moe-no-pad"))
    aux_loss_coeff: float = field(default=0.01, metadata=opt(
        "weight of the router's load-balancing loss", "--dynmo-moe-aux-loss-coeff", non_negative))
    start: int = field(default=2, metadata=opt("iteration of the first routing event",
                                                "--dynmo-moe-start", positive))
    interval: int = field(default=1, metadata=opt(
        "iterations between routing events (each updates costs; the gate decides moves)",
        "--dynmo-moe-interval", positive))
    ep_model: int = field(default=1, metadata=opt(
        "expert-parallel size the work model assumes: the busiest of this many expert groups "
        "paces an MoE layer (1: this launcher's EP; >1 models what real EP would measure)",
        "--dynmo-moe-ep-model", positive))
