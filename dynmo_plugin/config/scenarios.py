"""The dynamism scenarios' settings: one dataclass per scenario, the YAML section each
reads, and what each scenario's layers can run on (Transformer Engine, packed documents).

Each dataclass will move into its scenario's own package (dynmo_plugin/scenarios/<kind>/);
until then they live together here, below `config.schema`'s `DynamismConfig`. Pure:
standard library only.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from dynmo_plugin.config.fields import (below_one, fraction, non_negative, one_of, opt, positive,
                                        zeros_and_ones)

__all__ = ["PruningConfig", "FreezingConfig", "EarlyExitConfig", "MoeConfig", "ModConfig",
           "SparseAttentionConfig", "SCENARIO_SECTIONS", "LOCAL_ONLY_SCENARIOS", "PACKED_REFUSED"]


@dataclass(kw_only=True)
class PruningConfig:
    """Gradual global magnitude pruning (Zhu & Gupta's cubic schedule)."""

    start: int = field(default=4, metadata=opt("iteration of the first pruning round (t0)",
                                                "--dynmo-pruning-start", positive))
    interval: int = field(default=4, metadata=opt("iterations between pruning rounds",
                                                   "--dynmo-pruning-interval", positive))
    rounds: int = field(default=4, metadata=opt("pruning rounds until the final sparsity",
                                                "--dynmo-pruning-rounds", positive))
    initial_sparsity: float = field(default=0.0, metadata=opt(
        "sparsity before the first round", "--dynmo-pruning-initial-sparsity", fraction))
    final_sparsity: float = field(default=0.9, metadata=opt(
        "global sparsity of decoder linear weights after the last round",
        "--dynmo-pruning-final-sparsity", below_one))
    granularity: str = field(default="unstructured", metadata=opt(
        "unstructured (CSR kernels on CPU) or structured (whole FFN neurons; what saves "
        "time on GPUs)", "--dynmo-pruning-granularity", one_of("unstructured", "structured")))
    structured: str = field(default="physical", metadata=opt(
        "structured pruning rebuilds the linears with the kept neurons only (physical: weights, "
        "gradients and optimizer state shrink) or masks them (masked: full size kept)",
        "--dynmo-pruning-structured", one_of("physical", "masked")))
    sparse_threshold: float = field(default=0.85, metadata=opt(
        "a linear switches to the CSR kernel above this sparsity (CPU crossover)",
        "--dynmo-pruning-sparse-threshold", fraction))
    heads: float = field(default=0.0, metadata=opt(
        "structured only: fraction of each layer's attention heads removed after the last round "
        "(on the sparsity's cubic schedule; 0 = heads untouched)", "--dynmo-pruning-heads",
        below_one))


@dataclass(kw_only=True)
class FreezingConfig:
    """Egeria-style layer freezing by plasticity, front to back."""

    start: int = field(default=4, metadata=opt("iteration of the first plasticity check",
                                                "--dynmo-freezing-start", positive))
    interval: int = field(default=4, metadata=opt("iterations between plasticity checks",
                                                   "--dynmo-freezing-interval", positive))
    threshold: float = field(default=0.05, metadata=opt(
        "a layer whose plasticity falls below this fraction of its reference converged",
        "--dynmo-freezing-threshold", positive))
    max_layers: int = field(default=0, metadata=opt(
        "freeze at most this many layers (0 = all but the last)", "--dynmo-freezing-max-layers",
        non_negative))


@dataclass(kw_only=True)
class EarlyExitConfig:
    """CALM-style token early exit with a small exit head per layer."""

    threshold: float = field(default=0.9, metadata=opt(
        "confidence at which a token stops being processed", "--dynmo-early-exit-threshold", fraction))
    start: int = field(default=4, metadata=opt("iteration from which tokens may exit",
                                                "--dynmo-early-exit-start", positive))
    interval: int = field(default=4, metadata=opt(
        "iterations between exit-fraction reports (events)", "--dynmo-early-exit-interval", positive))
    loss_weight: float = field(default=0.1, metadata=opt(
        "weight of the exit heads' loss in the training loss", "--dynmo-early-exit-loss-weight",
        non_negative))
    min_layer: int = field(default=1, metadata=opt("first layer after which a token may exit",
                                                    "--dynmo-early-exit-min-layer", positive))


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


@dataclass(kw_only=True)
class ModConfig:
    """Mixture of Depths (Raposo et al. 2024): top-C tokens per routed block."""

    every: int = field(default=2, metadata=opt(
        "every N-th decoder layer is routed (the paper: every other)", "--dynmo-mod-every", positive))
    capacity: float = field(default=0.5, metadata=opt(
        "fraction of tokens a routed block processes", "--dynmo-mod-capacity", fraction))
    capacity_per_layer: str = field(default="", metadata=opt(
        "per-layer capacities overriding `capacity`, e.g. '2:0.25,4:0.75'", "--dynmo-mod-capacity-per-layer"))
    final_capacity: float = field(default=0.0, metadata=opt(
        "capacity the schedule reaches (0: constant capacity)", "--dynmo-mod-final-capacity", fraction))
    start: int = field(default=4, metadata=opt("iteration of the first capacity change",
                                                "--dynmo-mod-start", positive))
    interval: int = field(default=4, metadata=opt("iterations between capacity changes",
                                                   "--dynmo-mod-interval", positive))
    rounds: int = field(default=4, metadata=opt("capacity changes until final_capacity",
                                                "--dynmo-mod-rounds", positive))
    predictor_loss_weight: float = field(default=0.01, metadata=opt(
        "weight of the auxiliary predictor's loss (causal top-C at sampling time)",
        "--dynmo-mod-predictor-loss-weight", non_negative))


@dataclass(kw_only=True)
class SparseAttentionConfig:
    """Hash-bucketed (LSH) causal attention; buckets per layer change over training."""

    buckets: int = field(default=16, metadata=opt(
        "hash buckets per layer (more buckets: sparser, cheaper attention)",
        "--dynmo-sparse-attention-buckets", positive))
    buckets_per_layer: str = field(default="", metadata=opt(
        "per-layer buckets overriding `buckets`, e.g. '1:8,2:32'", "--dynmo-sparse-attention-buckets-per-layer"))
    final_buckets: int = field(default=0, metadata=opt(
        "buckets the schedule reaches (0: constant)", "--dynmo-sparse-attention-final-buckets",
        non_negative))
    start: int = field(default=4, metadata=opt("iteration of the first density change",
                                                "--dynmo-sparse-attention-start", positive))
    interval: int = field(default=4, metadata=opt("iterations between density changes",
                                                   "--dynmo-sparse-attention-interval", positive))
    rounds: int = field(default=4, metadata=opt("density changes until final_buckets",
                                                "--dynmo-sparse-attention-rounds", positive))
    hashes: int = field(default=1, metadata=opt("hash rounds per iteration",
                                                 "--dynmo-sparse-attention-hashes", positive))


SCENARIO_SECTIONS = {"gradual_pruning": "pruning", "layer_freezing": "freezing",
                     "early_exit": "early_exit", "moe": "moe", "mixture_of_depths": "mod",
                     "sparse_attention": "sparse_attention"}

# Scenarios whose layers are written against Megatron's local layer spec, and why.
LOCAL_ONLY_SCENARIOS = {
    "gradual_pruning": "its masked linears replace Megatron's local Column/RowParallelLinear",
    "early_exit": "it runs attention on gathered tokens with their own mask, which TE's "
                  "fused causal attention ignores",
    "mixture_of_depths": "it runs attention on gathered tokens with their own mask, which "
                         "TE's fused causal attention ignores",
    "sparse_attention": "its LSH core attention is written against Megatron's local "
                        "attention and not verified with TE",
}

# Scenarios whose layers cannot take packed (THD) micro-batches, and why. The others
# (none, gradual_pruning, layer_freezing) keep TransformerLayer's forward, which passes
# packed_seq_params on to the per-document core attention.
PACKED_REFUSED = {
    "early_exit": "its layers gather the tokens still active at absolute positions and "
                  "refuse packed_seq_params",
    "mixture_of_depths": "its layers route the top tokens of each sequence, which a packed "
                         "row of several documents does not index (they refuse packed_seq_params)",
    "sparse_attention": "its LSH core attention replaces the per-document attention packed "
                        "documents need",
    "moe": "its MoE layers are built from Megatron's MoE spec, whose core attention is not "
           "replaced by the per-document one (not wired)",
}
