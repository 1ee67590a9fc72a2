"""One typed configuration for the plugin and its launcher: YAML file + flags.

Every setting is a field of a keyword-only dataclass; its metadata gives the flag that
sets it, the help text and a check. Values are resolved as: dataclass default, then
the YAML file (`--dynmo-config PATH`; sections at its top level), then flags given on
the command line (a flag wins over the file). The merged result is validated once,
before any process group exists, and every problem is a `ConfigError` whose message
names where the value came from, the key and what was expected, e.g.
``configs/x.yaml: rebalance.interval: expected a positive integer, got -3``.

`add_dynmo_args(parser)` adds only the plugin's flags, so it can serve as
Megatron-LM's `extra_args_provider`; the launcher also adds `add_model_args(parser)`
(Megatron-LM's own spellings). The YAML `model:` section is read by the launcher only.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import yaml

from dynmo_plugin.errors import UserError
from dynmo_plugin.layout import Layout, LayoutError

__all__ = [
    "ConfigError", "ModelArgs", "DataConfig", "ProfilingConfig", "RebalanceConfig", "PruningConfig",
    "FreezingConfig", "EarlyExitConfig", "MoeConfig", "ModConfig", "SparseAttentionConfig",
    "DynamismConfig", "SCENARIO_SECTIONS", "RepackConfig",
    "ClusterConfig", "CLUSTER_STRATEGIES", "DynmoConfig",
    "RunConfig", "add_model_args", "add_dynmo_args", "load_config",
    "LOCAL_ONLY_SCENARIOS", "resolve_transformer_impl", "transformer_engine_problem",
    "check_paths",
]

BALANCER_NAMES = ("exact", "partition", "diffusion", "uniform", "parameters")
logger = logging.getLogger(__name__)


class ConfigError(UserError):
    """A configuration value that cannot be used; the message says where and why."""


# ---- field checks: return None when fine, else what was expected -------------------------
def positive(v: Any) -> Optional[str]:
    return None if v > 0 else "a positive number"


def non_negative(v: Any) -> Optional[str]:
    return None if v >= 0 else "a non-negative number"


def one_of(*choices: str) -> Callable[[Any], Optional[str]]:
    return lambda v: None if v in choices else f"one of {', '.join(choices)}"


def opt(help: str, flag: str | None = None, check: Callable | None = None, **kw) -> dict:
    """Field metadata: `flag` defaults to --<field-name> for model args, see `_flag`."""
    return {"help": help, "flag": flag, "check": check, **kw}


# ---- the launcher's data (dynmo_plugin.data) -----------------------------------------------
def _ascending_lengths(v: Any) -> Optional[str]:
    try:
        xs = [int(x) for x in v.split(",")] if v.strip() else []
    except ValueError:
        xs = None
    ok = xs is not None and xs == sorted(set(xs)) and all(x > 0 for x in xs)
    return None if ok else "ascending positive lengths separated by commas, e.g. '1024,1536'"


@dataclass(kw_only=True)
class DataConfig:
    """What the launcher trains on. Default: the synthetic token stream. With --data-path
    or --data-documents lognormal: documents packed into micro-batches of --seq-length
    positions (THD, per-document attention; --micro-batch-size 1)."""

    path: str = field(default="", metadata=opt(
        "Megatron indexed dataset prefix (PREFIX.bin/.idx, tokenizer beside it; made by "
        "scripts/prepare_data.py); the vocabulary size comes from its tokenizer", "--data-path"))
    documents: str = field(default="none", metadata=opt(
        "synthetic documents instead of a dataset: lognormal lengths (none: the synthetic "
        "token stream unless --data-path)", "--data-documents", one_of("none", "lognormal")))
    lognormal_median: float = field(default=256.0, metadata=opt(
        "median document length (positions) of --data-documents lognormal",
        "--data-lognormal-median", positive))
    lognormal_sigma: float = field(default=1.0, metadata=opt(
        "sigma of log(length) of --data-documents lognormal", "--data-lognormal-sigma", positive))
    packer: str = field(default="sequential", metadata=opt(
        "sequential (Megatron-style next-fit) or wlb (WLB-LLM: by predicted workload)",
        "--data-packer", one_of("sequential", "wlb")))
    cost_exponent: float = field(default=2.0, metadata=opt(
        "the prior cost of a document, length^p, which --data-packer wlb and "
        "--data-redistribute balance until a fitted model replaces it (2: quadratic attention)",
        "--data-cost-exponent", positive))
    cost_model: str = field(default="power", metadata=opt(
        "what packing and redistribution balance by: power (length^--data-cost-exponent, no "
        "fit), or a model fitted from the profiler's per-micro-batch layer times of the "
        "first --data-cost-fit-iters iterations: knapformer (k(24 T d^2 + gamma 4 d sum l^2)) "
        "or adaptiveload (a + b sum l^p)", "--data-cost-model",
        one_of("power", "knapformer", "adaptiveload")))
    cost_fit_iters: int = field(default=2, metadata=opt(
        "iterations profiled at the start of the run to fit --data-cost-model",
        "--data-cost-fit-iters", positive))
    batching: str = field(default="packed", metadata=opt(
        "packed: documents back to back in one row of --seq-length per micro-batch "
        "(per-document attention); adaptive (AdaptiveLoad): unpacked, each micro-batch "
        "holds B(S) documents of one length bucket S (--seq-length/8 .. --seq-length), "
        "each padded to S, B(S) = max(1, min(M_mem/S, cost(--seq-length)/cost(S))) from the "
        "cost model (--data-cost-model)", "--data-batching", one_of("packed", "adaptive")))
    mem_tokens: int = field(default=0, metadata=opt(
        "M_mem of --data-batching adaptive: positions one micro-batch may hold (0: 4 x "
        "--seq-length)", "--data-mem-tokens", non_negative))
    outlier_thresholds: str = field(default="", metadata=opt(
        "WLB-LLM outlier queues: ascending lengths, one queue per level (empty: no delay)",
        "--data-outlier-thresholds", _ascending_lengths))
    outlier_max_delay: int = field(default=8, metadata=opt(
        "iterations an outlier document waits at most", "--data-outlier-max-delay", positive))
    redistribute: bool = field(default=False, metadata=opt(
        "after packing, move whole documents between DP replicas to even their predicted "
        "workload (KnapFormer-style)", "--data-redistribute"))

    @property
    def packed(self) -> bool:
        return bool(self.path) or self.documents != "none"

    def thresholds(self) -> list[int]:
        return [int(x) for x in self.outlier_thresholds.split(",")] if self.outlier_thresholds.strip() else []


# ---- the launcher's model/run settings (Megatron-LM flag names) ---------------------------
@dataclass(kw_only=True)
class ModelArgs:
    """The small GPT the launcher trains; defaults are the CPU demo's model."""

    num_layers: int = field(default=8, metadata=opt("decoder layers", check=positive))
    hidden_size: int = field(default=64, metadata=opt("hidden size", check=positive))
    ffn_hidden_size: Optional[int] = field(default=None, metadata=opt("MLP size (default 4 x hidden)", check=positive))
    num_attention_heads: int = field(default=4, metadata=opt("attention heads", check=positive))
    seq_length: int = field(default=32, metadata=opt("tokens per sample", check=positive))
    max_position_embeddings: Optional[int] = field(default=None, metadata=opt("position table size (default seq length)", check=positive))
    vocab_size: int = field(default=256, metadata=opt("vocabulary size", check=positive))
    micro_batch_size: int = field(default=2, metadata=opt("samples per micro-batch", check=positive))
    global_batch_size: int = field(default=16, metadata=opt("samples per iteration over all DP replicas", check=positive))
    train_iters: int = field(default=20, metadata=opt("iterations to train", check=positive))
    lr: float = field(default=1e-3, metadata=opt("Adam learning rate", check=positive))
    lr_warmup_iters: int = field(default=0, metadata=opt("iterations of linear learning-rate warm-up from 0", check=non_negative))
    lr_decay_style: str = field(default="constant", metadata=opt("learning-rate decay after warm-up", check=one_of("constant", "linear", "cosine", "inverse-square-root")))
    lr_decay_iters: Optional[int] = field(default=None, metadata=opt("iterations over which the rate decays (default --train-iters)", check=positive))
    min_lr: float = field(default=0.0, metadata=opt("learning rate at the end of the decay", check=non_negative))
    clip_grad: float = field(default=0.0, metadata=opt("gradient clipping norm (0 = off; CPU needs 0)", check=non_negative))
    bf16: bool = field(default=False, metadata=opt("bf16 weights and activations, fp32 master weights in the optimizer"))
    fp16: bool = field(default=False, metadata=opt("fp16 weights and activations, fp32 master weights, dynamic loss scaling"))
    loss_scale: Optional[float] = field(default=None, metadata=opt("static loss scale for --fp16 (default: dynamic)", check=positive))
    initial_loss_scale: float = field(default=2.0**32, metadata=opt("initial dynamic loss scale for --fp16", check=positive))
    use_distributed_optimizer: bool = field(default=False, metadata=opt("shard optimizer state and fp32 master weights over data-parallel ranks"))
    seed: int = field(default=1234, metadata=opt("seed for weights and data", check=non_negative))
    log_interval: int = field(default=1, metadata=opt("iterations between log lines", check=positive))
    pipeline_model_parallel_size: int = field(default=1, metadata=opt("pipeline stages", check=positive))
    num_virtual_stages_per_pipeline_rank: int = field(default=1, metadata=opt(
        "model chunks per pipeline rank: > 1 runs Megatron's interleaved 1F1B (the layout "
        "then has pp x this many stages; virtual stage s on rank s %% pp)", check=positive))
    tensor_model_parallel_size: int = field(default=1, metadata=opt("tensor-parallel ranks", check=positive))
    distributed_backend: Optional[str] = field(default=None, metadata=opt(
        "torch.distributed backend: nccl (GPUs, one rank per GPU) or gloo (CPU); default nccl "
        "where CUDA GPUs are visible, else gloo", check=one_of("nccl", "gloo")))
    transformer_impl: Optional[str] = field(default=None, metadata=opt(
        "decoder layer implementation: transformer_engine (NVIDIA TE, CUDA only) or local "
        "(Megatron's own); default transformer_engine where TE imports and CUDA GPUs are "
        "visible, else local", check=one_of("local", "transformer_engine")))
    pipeline_model_parallel_layout: Optional[str] = field(default=None, metadata=opt("Megatron layout string, e.g. 'Ett|ttL'"))
    untie_embeddings_and_output_weights: bool = field(default=False, metadata=opt("separate output-layer weights"))
    output: str = field(default="runs/latest", metadata=opt("directory for report.json"))
    save: Optional[str] = field(default=None, metadata=opt("checkpoint directory to save to"))
    save_interval: int = field(default=0, metadata=opt("iterations between checkpoints (0 = only at a checkpoint repack)", check=non_negative))
    load: Optional[str] = field(default=None, metadata=opt("checkpoint directory to resume from (any pipeline split)"))
    data: DataConfig = field(default_factory=DataConfig)

    def validate_shape(self, where: str, world_size: int | None = None) -> None:
        """Cross-field checks: layout vs layers, batch divisibility, world shape."""
        pp, tp = self.pipeline_model_parallel_size, self.tensor_model_parallel_size
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"{where}: --hidden-size ({self.hidden_size}) must be divisible by "
                              f"--num-attention-heads ({self.num_attention_heads})")
        v = self.num_virtual_stages_per_pipeline_rank
        if self.pipeline_model_parallel_layout is not None:
            try:
                Layout.parse(self.pipeline_model_parallel_layout, pp, self.num_layers, v)
            except LayoutError as e:
                raise ConfigError(f"{where}: --pipeline-model-parallel-layout: {e}") from e
        elif self.num_layers < pp * v:
            raise ConfigError(f"{where}: --num-layers ({self.num_layers}) is smaller than "
                              f"--pipeline-model-parallel-size ({pp}) x "
                              f"--num-virtual-stages-per-pipeline-rank ({v}); give a layout with "
                              "empty stages")
        if self.max_position_embeddings is not None and self.seq_length > self.max_position_embeddings:
            raise ConfigError(f"{where}: model.seq_length ({self.seq_length}) exceeds "
                              f"model.max_position_embeddings ({self.max_position_embeddings}): "
                              "positions past the table have no embedding; raise "
                              "--max-position-embeddings or lower --seq-length")
        self._validate_schedule(where)
        if world_size is None:
            return
        self._validate_interleaved(where, world_size)
        if world_size % (tp * pp):
            raise ConfigError(f"{where}: world size {world_size} is not a multiple of TP({tp}) x PP({pp})")
        dp = world_size // (tp * pp)
        if self.global_batch_size % (self.micro_batch_size * dp):
            raise ConfigError(f"{where}: --global-batch-size ({self.global_batch_size}) must be a multiple "
                              f"of --micro-batch-size ({self.micro_batch_size}) x DP ({dp})")


    def _validate_interleaved(self, where: str, world_size: int) -> None:
        """Megatron's interleaved 1F1B runs micro-batches in groups of pp (its default
        microbatch_group_size_per_vp_stage) and refuses a partial last group."""
        pp, v = self.pipeline_model_parallel_size, self.num_virtual_stages_per_pipeline_rank
        if v == 1:
            return
        if pp < 2:
            raise ConfigError(f"{where}: --num-virtual-stages-per-pipeline-rank {v} needs "
                              "--pipeline-model-parallel-size >= 2 (Megatron interleaves only "
                              "across pipeline ranks)")
        m = self.global_batch_size // (self.micro_batch_size * (world_size // (self.tensor_model_parallel_size * pp)))
        if m % pp:
            raise ConfigError(f"{where}: the interleaved schedule (--num-virtual-stages-per-"
                              f"pipeline-rank {v}) needs the number of micro-batches ({m} = "
                              f"--global-batch-size / (--micro-batch-size x DP)) to be a multiple "
                              f"of --pipeline-model-parallel-size ({pp}); change the batch sizes")

    def _validate_schedule(self, where: str) -> None:
        decay = self.lr_decay_iters or self.train_iters
        if self.lr_warmup_iters >= decay:
            raise ConfigError(f"{where}: --lr-warmup-iters ({self.lr_warmup_iters}) must be smaller than "
                              f"the decay length ({decay}: --lr-decay-iters, else --train-iters)")
        if self.min_lr > self.lr:
            raise ConfigError(f"{where}: --min-lr ({self.min_lr}) must not exceed --lr ({self.lr})")


# ---- the plugin's settings ------------------------------------------------------------------
@dataclass(kw_only=True)
class ProfilingConfig:
    """When and how long per-layer profiling runs."""

    window: int = field(default=1, metadata=opt("iterations profiled after each event",
                                                 "--dynmo-profile-window", positive))
    every: int = field(default=0, metadata=opt("profile every N iterations without events (0 = off)",
                                               "--dynmo-profile-every", non_negative))
    start_at: int = field(default=0, metadata=opt(
        "profile a window at this iteration and apply the exact solver's layout before the "
        "dynamism begins (0 = off)", "--dynmo-start-balanced-at", non_negative))
    retime_every: int = field(default=8, metadata=opt(
        "events decided from the scenario's work estimates (no timing window) between timed "
        "windows; 0: time a window after every event", "--dynmo-profile-retime-every", non_negative))


@dataclass(kw_only=True)
class RebalanceConfig:
    """What triggers a rebalance and how the new split is chosen."""

    balancer: str = field(default="exact", metadata=opt("balancer", "--dynmo-balancer", one_of(*BALANCER_NAMES)))
    interval: int = field(default=0, metadata=opt("rebalance every N iterations (0 = off)",
                                                  "--dynmo-rebalance-interval", non_negative))
    forced_layouts: dict = field(default_factory=dict, metadata=opt(
        "layouts to apply at given iterations, e.g. '5:Ett|ttL;9:Et|tttL'", "--dynmo-forced-layouts",
        kind="layouts"))
    allow_empty_stages: bool = field(default=False, metadata=opt("let a stage hold no layers",
                                                                 "--dynmo-allow-empty-stages"))
    margin: float = field(default=1.0, metadata=opt("apply a plan only if its saving exceeds margin x its cost",
                                                    "--dynmo-gate-margin", non_negative))
    min_gain: float = field(default=0.05, metadata=opt(
        "skip plans predicted to save less than this fraction of iteration time, or than the "
        "profile's measured dispersion if larger (docs/profiling.md; 0 = no floor)",
        "--dynmo-min-gain", non_negative))
    expected_event_gap: int = field(default=100, metadata=opt(
        "iterations a new layout is expected to last (gate horizon)", "--dynmo-event-gap", positive))
    memory_cap_gb: float = field(default=0.0, metadata=opt(
        "per-stage memory cap for plans in GB (0 = none)", "--dynmo-memory-cap-gb", non_negative))
    bandwidth_gbps: float = field(default=1.0, metadata=opt(
        "assumed migration bandwidth in GB/s until one is measured", "--dynmo-bandwidth-gbps", positive))
    migration_timeout_s: float = field(default=300.0, metadata=opt(
        "seconds any plugin collective or transfer may block before the peer counts as lost",
        "--dynmo-migration-timeout", positive))


def fraction(v: Any) -> Optional[str]:
    return None if 0 <= v <= 1 else "a number in [0, 1]"


def below_one(v: Any) -> Optional[str]:
    return None if 0 <= v < 1 else "a number in [0, 1)"


def zeros_and_ones(v: Any) -> Optional[str]:
    ok = all(x.strip() in ("0", "1") for x in v.split(",")) and "1" in v
    return None if not v or ok else "comma-separated 0s and 1s with at least one 1, e.g. '1,1,0,0'"


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


@dataclass(kw_only=True)
class DynamismConfig:
    """Which workload change runs during training (active with or without --dynmo: a
    static baseline trains the same scenario on a split that never changes)."""

    kind: str = field(default="none", metadata=opt(
        "dynamism scenario", "--dynmo-dynamism", one_of("none", *SCENARIO_SECTIONS)))
    pruning: PruningConfig = field(default_factory=PruningConfig)
    freezing: FreezingConfig = field(default_factory=FreezingConfig)
    early_exit: EarlyExitConfig = field(default_factory=EarlyExitConfig)
    moe: MoeConfig = field(default_factory=MoeConfig)
    mod: ModConfig = field(default_factory=ModConfig)
    sparse_attention: SparseAttentionConfig = field(default_factory=SparseAttentionConfig)


@dataclass(kw_only=True)
class RepackConfig:
    """Consolidating the pipeline onto fewer stages once the work has shrunk."""

    enabled: bool = field(default=False, metadata=opt(
        "consider repacking onto fewer pipeline stages", "--dynmo-repack"))
    min_stages: int = field(default=1, metadata=opt(
        "never repack below this many pipeline stages", "--dynmo-repack-min-stages", positive))
    max_slowdown: float = field(default=1.0, metadata=opt(
        "every objective: the predicted iteration time may grow at most this factor over "
        "the current one", "--dynmo-repack-max-slowdown", positive))
    objective: str = field(default="min_stages", metadata=opt(
        "min_stages (fewest stages within max_slowdown) or throughput_per_gpu",
        "--dynmo-repack-objective", one_of("min_stages", "throughput_per_gpu")))
    trigger: str = field(default="event", metadata=opt(
        "event: consider repacking after dynamism events; rebalance: after every rebalance "
        "decision (interval ones too)", "--dynmo-repack-trigger", one_of("event", "rebalance")))
    mode: str = field(default="live", metadata=opt(
        "live (shrink the running job) or checkpoint (save, exit, restart with fewer ranks)",
        "--dynmo-repack-mode", one_of("live", "checkpoint")))
    memory_margin: float = field(default=0.1, metadata=opt(
        "a stage fits if its predicted memory x (1 + margin) is within the cap",
        "--dynmo-repack-memory-margin", non_negative))
    rebuild_s: float = field(default=10.0, metadata=opt(
        "estimated seconds to regroup and rebuild (the gate's cost, besides moving layers)",
        "--dynmo-repack-rebuild-s", non_negative))
    freed: str = field(default="release", metadata=opt(
        "the ranks a repack frees: release (leave the job), grow (stay as data-parallel "
        "replicas of the new stages) or auto (the objective picks)", "--dynmo-repack-freed",
        one_of("release", "grow", "auto")))


CLUSTER_STRATEGIES = ("none", "statefulset-scale", "job-parallelism", "delete-pods",
                      "patch-pod-resources")


@dataclass(kw_only=True)
class ClusterConfig:
    """How released GPUs go back to the cluster scheduler (dynmo_plugin.cluster)."""

    strategy: str = field(default="none", metadata=opt(
        "none (log only), statefulset-scale, job-parallelism, delete-pods, patch-pod-resources",
        "--dynmo-cluster-strategy", one_of(*CLUSTER_STRATEGIES)))
    fallback: str = field(default="none", metadata=opt(
        "strategy to try when the first is rejected (patch-pod-resources always is: 422)",
        "--dynmo-cluster-fallback", one_of(*CLUSTER_STRATEGIES)))
    namespace: str = field(default="", metadata=opt(
        "namespace (empty: POD_NAMESPACE from the downward API, else the service account's)",
        "--dynmo-cluster-namespace"))
    name: str = field(default="", metadata=opt(
        "StatefulSet/Job name (empty: derived from POD_NAME, e.g. train-3 -> train)",
        "--dynmo-cluster-name"))
    kubeconfig: str = field(default="", metadata=opt(
        "kubeconfig file (empty: in-cluster config, else $KUBECONFIG)", "--dynmo-cluster-kubeconfig"))
    retries: int = field(default=5, metadata=opt(
        "attempts per API call on 409/429/5xx/unreachable", "--dynmo-cluster-retries", positive))
    backoff_s: float = field(default=0.5, metadata=opt(
        "first retry delay in seconds (doubles each retry)", "--dynmo-cluster-backoff-s", non_negative))
    timeout_s: float = field(default=10.0, metadata=opt(
        "seconds per API request", "--dynmo-cluster-timeout-s", positive))
    ranks_per_replica: int = field(default=0, metadata=opt(
        "training ranks per pod / Job index (0: torchrun's LOCAL_WORLD_SIZE); only whole "
        "replicas can be released", "--dynmo-cluster-ranks-per-replica", non_negative))


@dataclass(kw_only=True)
class DynmoConfig:
    """The plugin's settings; the YAML file holds these sections at its top level."""

    enabled: bool = field(default=False, metadata=opt("enable the plugin", "--dynmo"))
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    rebalance: RebalanceConfig = field(default_factory=RebalanceConfig)
    dynamism: DynamismConfig = field(default_factory=DynamismConfig)
    repack: RepackConfig = field(default_factory=RepackConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)


@dataclass(kw_only=True)
class RunConfig:
    """Everything the launcher needs: the model/run (Megatron flags) and the plugin."""

    model: ModelArgs = field(default_factory=ModelArgs)
    dynmo: DynmoConfig = field(default_factory=DynmoConfig)
    config_path: Optional[str] = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---- flags ----------------------------------------------------------------------------------
def _flag(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _leaf_fields(cls, prefix=""):
    """(dotted key, field, argparse dest) for every leaf setting of a config dataclass."""
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.default_factory):
            yield from _leaf_fields(f.default_factory, f"{prefix}{f.name}.")
        elif cls is ModelArgs:  # Megatron-LM's own dest names: its `args` works as is
            yield f"{prefix}{f.name}", f, f.name
        else:
            yield f"{prefix}{f.name}", f, "dynmo__" + f"{prefix}{f.name}".replace(".", "__")


def _add_fields(parser: argparse.ArgumentParser, cls, title: str) -> None:
    group = parser.add_argument_group(title)
    for key, f, dest in _leaf_fields(cls):
        kw: dict[str, Any] = {"dest": dest, "default": None, "help": f.metadata.get("help")}
        base = f.type.replace("Optional[", "").rstrip("]")
        if base == "bool":
            kw["action"] = "store_true"
        else:
            kw["metavar"] = key.rsplit(".", 1)[-1].upper()
            kw["type"] = {"int": int, "float": float}.get(base, str)
        group.add_argument(_flag(f), **kw)


def add_model_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM-spelled model/run flags (the launcher only)."""
    _add_fields(parser, ModelArgs, "model (Megatron-LM flags)")
    return parser


def add_dynmo_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The plugin's flags; usable as Megatron-LM's `extra_args_provider`."""
    parser.add_argument("--dynmo-config", default=None, metavar="PATH",
                        help="YAML file with the plugin's settings (flags win over it)")
    _add_fields(parser, DynmoConfig, "dynmo_plugin")
    return parser


# ---- resolution -----------------------------------------------------------------------------
def _expect_type(f: dataclasses.Field, value: Any) -> tuple[Any, Optional[str]]:
    t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    if f.metadata.get("kind") == "layouts":
        return _layouts(value)
    if value is None and t.startswith("Optional"):
        return None, None
    base = t.replace("Optional[", "").rstrip("]")
    if base == "bool":
        return value, None if isinstance(value, bool) else "true or false"
    if base == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
        return value, None if ok else "an integer"
    if base == "float":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok and not math.isfinite(value):  # inf/nan: `nan > 0` fails a check, `inf > 0` passes
            return value, "a finite number"
        return (float(value) if ok else value), None if ok else "a number"
    if base == "str":
        return value, None if isinstance(value, str) else "a string"
    raise TypeError(f"unsupported config field type {t}")


def _layouts(value: Any) -> tuple[Any, Optional[str]]:
    """Forced layouts: a YAML mapping {iteration: layout} or the flag form '5:Ett|ttL;9:...'."""
    if isinstance(value, str):
        pairs = [p.split(":", 1) for p in value.split(";") if p.strip()]
        if any(len(p) != 2 for p in pairs):
            return value, "ITER:LAYOUT pairs separated by ';'"
        value = {k.strip(): v.strip() for k, v in pairs}
    if not isinstance(value, dict):
        return value, "a mapping of iteration to layout string"
    out = {}
    for k, v in value.items():
        try:
            it = int(k)
        except (TypeError, ValueError):
            return value, f"integer iterations as keys (got {k!r})"
        if it <= 0 or not isinstance(v, str):
            return value, "positive iterations mapped to layout strings"
        out[it] = v
    return out, None


def _apply(obj: Any, key: str, f: dataclasses.Field, value: Any, where: str, name: str) -> None:
    """Set `key` (dotted, relative to `obj`) after its type and check; errors name the
    setting as `name`, its full dotted key (model.num_layers, rebalance.interval)."""
    value, problem = _expect_type(f, value)
    if problem is None and value is not None and f.metadata.get("check"):
        problem = f.metadata["check"](value)
    if problem:
        raise ConfigError(f"{where}: {name}: expected {problem}, got {value!r}")
    target = obj
    for part in key.split(".")[:-1]:
        target = getattr(target, part)
    setattr(target, f.name, value)


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error
    (PyYAML keeps the last silently: two `model:` sections would drop the first)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, (str, int, float, bool)):
                continue  # an unhashable key: PyYAML's own error names it
            if key in seen:
                mark = key_node.start_mark
                raise ConfigError(f"{self.name}:{mark.line + 1}:{mark.column + 1}: key {key!r} "
                                  f"given twice (first on line {seen[key]}); keep one")
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: str) -> dict:
    """The YAML file as a dict; every way it can be unusable is one ConfigError line."""
    if os.path.isdir(path):
        raise ConfigError(f"{path}: cannot read the config file: it is a directory; give the "
                          "YAML file (e.g. configs/demo.yaml)")
    if not os.path.exists(path):
        raise ConfigError(f"{path}: cannot read the config file: no such file")
    try:
        with open(path, "rb") as fh:
            text = fh.read().decode("utf-8-sig")
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the config file: {e.strerror}") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}: {e.object[e.start]:#04x}); "
                          "save the config file as UTF-8") from e
    loader = None
    try:
        loader = _UniqueKeyLoader(text)  # checks the characters: may raise already
        loader.name = path
        data = loader.get_single_data()
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        at = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        what = " ".join(x for x in (e.context, e.problem) if x)
        raise ConfigError(f"{path}{at}: not valid YAML: {what}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {str(e).splitlines()[0]}") from e
    finally:
        if loader is not None:
            loader.dispose()
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level, got {type(data).__name__}")
    return data


def _flatten(data: dict, known: dict, path: str, prefix: str = "") -> dict:
    """{dotted key: value} for a nested YAML mapping; unknown keys, dotted spellings and
    sections given as plain values are errors naming the key in dotted form."""
    flat = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        section = any(n.startswith(key + ".") for n in known)
        if isinstance(k, str) and "." in k:
            parts = key.split(".")
            nested = "".join(f"{p}: {{" for p in parts[:-1]) + f"{parts[-1]}: ...{'}' * (len(parts) - 1)}"
            raise ConfigError(f"{path}: {key}: dotted key names are not read; nest the key "
                              f"instead: {nested}")
        if key in known:
            flat[key] = v
        elif section and v is None:
            continue  # `rebalance:` with every key commented out: an empty section
        elif section and isinstance(v, dict):
            flat.update(_flatten(v, known, path, key + "."))
        elif section:
            children = sorted({n[len(key) + 1:].split(".")[0] for n in known if n.startswith(key + ".")})
            raise ConfigError(f"{path}: {key}: expected a section (a mapping of "
                              f"{', '.join(children)}), got {v!r}")
        else:
            siblings = sorted({n[len(prefix):].split(".")[0] for n in known if n.startswith(prefix)})
            raise ConfigError(f"{path}: {key}: unknown key; expected one of {', '.join(siblings)}")
    return flat


def load_config(args: argparse.Namespace, world_size: int | None = None,
                te_problem: Callable[[], Optional[str]] = None) -> RunConfig:
    """Resolve defaults <- YAML <- flags into a validated `RunConfig`.

    `te_problem` replaces `transformer_engine_problem` (torchrun's pre-spawn check
    passes one that does not import Transformer Engine into the launcher process).

    Raises:
        ConfigError: on any unknown key, wrong type, out-of-range or inconsistent value.
    """
    cfg = RunConfig(config_path=getattr(args, "dynmo_config", None))
    known = {f"model.{k}": (f, d) for k, f, d in _leaf_fields(ModelArgs)}
    known.update({k: (f, d) for k, f, d in _leaf_fields(DynmoConfig)})
    given: dict[str, str] = {}  # key -> where it was set
    if cfg.config_path:
        path = cfg.config_path
        for key, value in _flatten(_read_yaml(path), known, path).items():
            f, _ = known[key]
            _apply(cfg.model if key.startswith("model.") else cfg.dynmo,
                   key.removeprefix("model."), f, value, path, key)
            given[key] = path
    for key, (f, dest) in known.items():
        value = getattr(args, dest, None)
        if value is None or (value is False and f.type == "bool"):
            continue
        if key == "model.pipeline_model_parallel_layout" and not isinstance(value, str):
            value = str(value)  # Megatron-LM's args hold a parsed PipelineParallelLayerLayout
        _apply(cfg.model if key.startswith("model.") else cfg.dynmo,
               key.removeprefix("model."), f, value, f"flag {_flag(f)}", key)
        given[key] = f"flag {_flag(f)}"
    where = cfg.config_path or "command line"
    cfg.model.validate_shape(where, world_size)
    _check_precision(cfg, given)
    _check_forced_layouts(cfg, where)
    _check_dynamism(cfg, given)
    _check_repack(cfg, given)
    _check_interleaved_repack(cfg, where, world_size)
    _check_data(cfg, given)
    _resolve_transformer_impl(cfg, given, te_problem or transformer_engine_problem)
    return cfg


def check_paths(model: ModelArgs) -> None:
    """The launcher's own paths, before anything is built: --output and --save must be
    directories or not exist yet, --load must not be a file. (Whether --load holds a
    checkpoint is read_meta's question: dynmo_plugin.train asks it just as early.)

    Raises:
        ConfigError: a path that training would fail on later, named with the fix.
    """
    for flag, key, path in (("--output", "model.output", model.output),
                            ("--save", "model.save", model.save)):
        if path and os.path.exists(path) and not os.path.isdir(path):
            raise ConfigError(f"flag {flag}: {key}: {path} is a file, not a directory; give a "
                              "directory (it is created if missing)")
    if model.load and os.path.exists(model.load) and not os.path.isdir(model.load):
        raise ConfigError(f"flag --load: model.load: {model.load} is a file, not a directory; "
                          "give the directory --save wrote (it holds "
                          "latest_checkpointed_iteration.txt)")


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


def transformer_engine_problem() -> Optional[str]:
    """None when Transformer Engine and Megatron's TE layer spec import, else why not."""
    try:
        import transformer_engine.pytorch  # noqa: F401
        from megatron.core.models.gpt.gpt_layer_specs import (  # noqa: F401
            get_gpt_layer_with_transformer_engine_spec)
    except Exception as e:  # noqa: BLE001 - any import failure means "not usable here"
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")
    return None


def resolve_transformer_impl(requested: Optional[str], cuda_devices: int, scenario: str,
                             te_problem: Callable[[], Optional[str]],
                             where: str = "--transformer-impl") -> tuple[str, Optional[str]]:
    """(implementation, a note to log or None) for --transformer-impl on this machine.

    Default: transformer_engine where CUDA GPUs are visible, TE imports (`te_problem()`
    is None, called only when it matters) and the scenario's layers support it; local
    otherwise, with a note when TE was usable but the scenario needs local layers.

    Raises:
        ConfigError: transformer_engine asked for without CUDA GPUs, without an
            importable TE, or with a local-only scenario (LOCAL_ONLY_SCENARIOS).
    """
    local_only = LOCAL_ONLY_SCENARIOS.get(scenario)
    if requested == "local" or (requested is None and cuda_devices == 0):
        return "local", None
    if requested is None:
        problem = te_problem()
        if problem is not None:
            return "local", f"Transformer Engine does not import ({problem}); using local layers"
        if local_only:
            return "local", (f"scenario {scenario}: {local_only}; using local layers "
                             "(--transformer-impl local)")
        return "transformer_engine", None
    if cuda_devices == 0:
        raise ConfigError(f"{where}: transformer_engine needs CUDA GPUs and none is visible "
                          "here; use --transformer-impl local (the default without GPUs)")
    if local_only:
        raise ConfigError(f"{where}: transformer_engine cannot build the {scenario} scenario's "
                          f"layers ({local_only}); use --transformer-impl local")
    problem = te_problem()
    if problem is not None:
        raise ConfigError(f"{where}: transformer_engine does not import here ({problem}); "
                          "install it (pip install -c constraints.txt 'transformer-engine[pytorch]' "
                          "or the NGC image, docs/docker.md) or use --transformer-impl local")
    return "transformer_engine", None


def _resolve_transformer_impl(cfg: RunConfig, given: dict[str, str], te_problem) -> None:
    """Fix model.transformer_impl once, so the report records what was built."""
    import torch  # here, not at import: the config module stays light
    source = given.get("model.transformer_impl", "flag --transformer-impl")
    where = source if source.startswith("flag ") else f"{source}: model.transformer_impl"
    impl, note = resolve_transformer_impl(cfg.model.transformer_impl, torch.cuda.device_count(),
                                          cfg.dynmo.dynamism.kind, te_problem, where)
    if note:
        logger.info("%s", note)
    cfg.model.transformer_impl = impl


def _check_precision(cfg: RunConfig, given: dict[str, str]) -> None:
    """One training precision; loss scaling only where it means something (fp16)."""
    m = cfg.model
    if m.bf16 and m.fp16:
        raise ConfigError(f"{given.get('model.fp16', 'command line')}: --bf16 and --fp16 both set; "
                          "choose one precision")
    if m.loss_scale is not None and not m.fp16:
        raise ConfigError(f"{given.get('model.loss_scale', 'command line')}: --loss-scale "
                          f"{m.loss_scale} needs --fp16 (bf16 and fp32 train unscaled)")


# Scenarios whose layers cannot take packed (THD) micro-batches, and why. The others
# (none, gradual_pruning, layer_freezing) keep TransformerLayer's forward, which passes
# packed_seq_params on to the per-document core attention.
_PACKED_REFUSED = {
    "early_exit": "its layers gather the tokens still active at absolute positions and "
                  "refuse packed_seq_params",
    "mixture_of_depths": "its layers route the top tokens of each sequence, which a packed "
                         "row of several documents does not index (they refuse packed_seq_params)",
    "sparse_attention": "its LSH core attention replaces the per-document attention packed "
                        "documents need",
    "moe": "its MoE layers are built from Megatron's MoE spec, whose core attention is not "
           "replaced by the per-document one (not wired)",
}


def _check_data(cfg: RunConfig, given: dict[str, str]) -> None:
    """Packed documents: one packed row per micro-batch, scenarios that keep Megatron's
    attention, and the vocabulary of the dataset's tokenizer."""
    m, d = cfg.model, cfg.model.data
    where = lambda key: given.get(f"model.{key}", key)  # noqa: E731
    if d.path and d.documents != "none":
        raise ConfigError(f"{where('data.documents')}: --data-documents {d.documents} and "
                          "--data-path both choose the documents; give one")
    if not d.packed:
        if d.batching == "adaptive":
            raise ConfigError(f"{where('data.batching')}: --data-batching adaptive batches "
                              "documents by length; give --data-path or --data-documents lognormal")
        return
    if m.micro_batch_size != 1:
        raise ConfigError(f"{where('micro_batch_size')}: packed documents put one row of "
                          f"--seq-length positions in each micro-batch; use --micro-batch-size 1 "
                          f"(got {m.micro_batch_size}) and set --global-batch-size to DP x micro-batches")
    why = _PACKED_REFUSED.get(cfg.dynmo.dynamism.kind)
    if why:
        raise ConfigError(f"{where('data.path') if d.path else where('data.documents')}: packed "
                          f"documents cannot train with dynamism {cfg.dynmo.dynamism.kind!r}: "
                          f"{why}; train it on the synthetic token stream (drop "
                          "--data-path/--data-documents)")
    if d.batching == "adaptive":
        packing = [f for f, on in (("--data-packer wlb", d.packer == "wlb"),
                                   ("--data-outlier-thresholds", bool(d.thresholds())),
                                   ("--data-redistribute", d.redistribute)) if on]
        if packing:
            raise ConfigError(f"{where('data.batching')}: --data-batching adaptive does not "
                              f"pack documents; {', '.join(packing)} apply to packed batching only")
        if d.mem_tokens and d.mem_tokens < m.seq_length:
            raise ConfigError(f"{where('data.mem_tokens')}: --data-mem-tokens ({d.mem_tokens}) "
                              f"must hold one row of --seq-length ({m.seq_length})")
    too_long = [t for t in d.thresholds() if t > m.seq_length]
    if too_long:
        raise ConfigError(f"{where('data.outlier_thresholds')}: thresholds {too_long} exceed "
                          f"--seq-length ({m.seq_length}); no document piece is that long")
    if d.path:
        from dynmo_plugin.data.tokenizer import TokenizerError, load_tokenizer
        missing = [x for x in (d.path + ".bin", d.path + ".idx") if not os.path.isfile(x)]
        if missing:
            raise ConfigError(f"{where('data.path')}: {', '.join(missing)} not found; give the "
                              "prefix of a .bin/.idx pair made by scripts/prepare_data.py")
        try:
            vocab = load_tokenizer(d.path).padded_vocab_size()
        except TokenizerError as e:
            raise ConfigError(f"{where('data.path')}: {e}") from e
        if "model.vocab_size" in given and m.vocab_size < vocab:
            raise ConfigError(f"{where('vocab_size')}: --vocab-size ({m.vocab_size}) is smaller "
                              f"than the dataset tokenizer's ({vocab}); drop --vocab-size")
        m.vocab_size = max(m.vocab_size, vocab) if "model.vocab_size" in given else vocab


def _check_repack(cfg: RunConfig, given: dict[str, str]) -> None:
    rp, cl, pp = cfg.dynmo.repack, cfg.dynmo.cluster, cfg.model.pipeline_model_parallel_size
    if rp.enabled and rp.min_stages > pp:
        raise ConfigError(f"{given.get('repack.min_stages', 'repack.min_stages')}: min_stages "
                          f"({rp.min_stages}) exceeds --pipeline-model-parallel-size ({pp})")
    if rp.enabled and rp.mode == "checkpoint" and not cfg.model.save:
        raise ConfigError(f"{given.get('repack.mode', 'repack.mode')}: mode checkpoint saves the "
                          "state for the restart: give --save DIR")
    if cl.fallback != "none" and cl.fallback == cl.strategy:
        raise ConfigError(f"{given.get('cluster.fallback', 'cluster.fallback')}: the fallback "
                          f"({cl.fallback}) is the strategy itself; choose another or none")


def _check_dynamism(cfg: RunConfig, given: dict[str, str]) -> None:
    """A scenario's keys only make sense with that scenario chosen."""
    kind = cfg.dynmo.dynamism.kind
    for key, where in given.items():
        parts = key.split(".")
        if parts[0] != "dynamism" or len(parts) < 3:
            continue
        if SCENARIO_SECTIONS.get(kind) != parts[1]:
            raise ConfigError(f"{where}: {key}: set, but dynamism.kind is {kind!r}; choose the "
                              f"scenario with --dynmo-dynamism or dynamism.kind, or drop the key")
    p = cfg.dynmo.dynamism.pruning
    if kind == "gradual_pruning" and p.initial_sparsity > p.final_sparsity:
        raise ConfigError(f"{given.get('dynamism.pruning.initial_sparsity', 'dynamism.pruning')}: "
                          f"initial_sparsity ({p.initial_sparsity}) exceeds final_sparsity "
                          f"({p.final_sparsity})")


def _check_interleaved_repack(cfg: RunConfig, where: str, world_size: Optional[int]) -> None:
    """Interleaved repacks keep v chunks per rank on fewer ranks, so Megatron's
    interleaved schedule must still run there: k >= 2 ranks and the micro-batches a
    multiple of k (checked when the world size is known) for forced layouts; the repack
    planner skips such k itself."""
    m, rp = cfg.model, cfg.dynmo.repack
    v, pp = m.num_virtual_stages_per_pipeline_rank, m.pipeline_model_parallel_size
    if v == 1 or not rp.enabled:
        return
    micro = None if world_size is None else m.global_batch_size // (
        m.micro_batch_size * (world_size // (m.tensor_model_parallel_size * pp)))
    fewer = {it: text for it, text in cfg.dynmo.rebalance.forced_layouts.items()
             if Layout.parse(text, None, m.num_layers, v).num_ranks < pp}
    for it, text in fewer.items():
        k = Layout.parse(text, None, m.num_layers, v).num_ranks
        if k < 2 or (micro is not None and micro % k):
            raise ConfigError(
                f"{where}: rebalance.forced_layouts.{it}: layout {text!r} repacks onto {k} "
                f"pipeline rank(s) keeping {v} virtual stages each; Megatron's interleaved "
                f"schedule needs >= 2 ranks and the micro-batches ({micro}) a multiple of the "
                "ranks; give a layout with more ranks, or run without "
                "--num-virtual-stages-per-pipeline-rank")


def _check_forced_layouts(cfg: RunConfig, where: str) -> None:
    m = cfg.model
    pp = m.pipeline_model_parallel_size * m.num_virtual_stages_per_pipeline_rank
    sizes = ("--pipeline-model-parallel-size" if m.num_virtual_stages_per_pipeline_rank == 1 else
             f"--pipeline-model-parallel-size {m.pipeline_model_parallel_size} x "
             f"--num-virtual-stages-per-pipeline-rank {m.num_virtual_stages_per_pipeline_rank}")
    for it, text in cfg.dynmo.rebalance.forced_layouts.items():
        try:
            layout = Layout.parse(text, None, m.num_layers, m.num_virtual_stages_per_pipeline_rank)
        except LayoutError as e:
            raise ConfigError(f"{where}: rebalance.forced_layouts.{it}: {e}") from e
        if layout.num_stages > pp or (layout.num_stages < pp and not cfg.dynmo.repack.enabled):
            raise ConfigError(f"{where}: rebalance.forced_layouts.{it}: layout {text!r} has "
                              f"{layout.num_stages} stages but the pipeline has {pp} ({sizes}); "
                              "fewer stages force a repack, "
                              "which needs repack.enabled (--dynmo-repack)")
        if it > m.train_iters:
            raise ConfigError(f"{where}: rebalance.forced_layouts.{it}: iteration is past "
                              f"--train-iters ({m.train_iters})")

