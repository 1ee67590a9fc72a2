"""The configuration's schema: every setting of the plugin and its launcher as a field of
a keyword-only dataclass.

A field's metadata (`fields.opt`) gives the flag that sets it, the help text and a
check of the value alone; checks across fields live in `config.checks`, flag
generation in `config.flags`, YAML reading and resolution in `config.load`. Pure:
imports neither torch nor megatron and reads no file; the balancer and repack objective
names, the repack defaults and the cluster strategies are their owners' own
(`balancing.solve.BALANCERS`, `balancing.repack`, `cluster.release.STRATEGIES`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from dynmo_plugin.balancing.grow import FREED_MODES
from dynmo_plugin.balancing.repack import OBJECTIVES, RepackCriteria
from dynmo_plugin.balancing.solve import BALANCERS
from dynmo_plugin.cluster.release import STRATEGIES
from dynmo_plugin.config.fields import (ascending_lengths, below_one, layer_count, non_negative, one_of, opt,
                                        positive)
from dynmo_plugin.scenarios import SCENARIOS

__all__ = ["DataConfig", "ModelArgs", "ProfilingConfig", "RebalanceConfig", "DynamismConfig",
           "RepackConfig", "CLUSTER_STRATEGIES", "ClusterConfig", "DynmoConfig", "RunConfig",
           "BALANCER_NAMES"]

BALANCER_NAMES = BALANCERS  # --dynmo-balancer's choices: the solver's registry, not a copy
_PLANNER = RepackCriteria()  # the repack planner's defaults, which RepackConfig's are


# ---- the launcher's data (dynmo_plugin.data) -----------------------------------------------
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
        "--data-outlier-thresholds", ascending_lengths))
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

    num_layers: int = field(default=8, metadata=opt("decoder layers", check=layer_count))
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
    weight_decay: float = field(default=0.0, metadata=opt(
        "weight decay coefficient for L2 regularization, as Megatron-LM's (whose default is 0.01; "
        "0 here, so runs made before it existed train the same)", check=non_negative))
    clip_grad: float = field(default=0.0, metadata=opt("gradient clipping norm (0 = off; Megatron-LM defaults to 1.0)", check=non_negative))
    hidden_dropout: float = field(default=0.0, metadata=opt(
        "dropout after each layer's attention and MLP (Megatron's bias-dropout-add; 0 = off, "
        "Megatron-LM defaults to 0.1): each layer draws its masks from its own stream, so a "
        "move keeps them bit for bit (--dynmo-rank-rng: the rank's, as Megatron's)", check=below_one))
    bf16: bool = field(default=False, metadata=opt("bf16 weights and activations, fp32 master weights in the optimizer"))
    fp16: bool = field(default=False, metadata=opt("fp16 weights and activations, fp32 master weights, dynamic loss scaling"))
    loss_scale: Optional[float] = field(default=None, metadata=opt("static loss scale for --fp16 (default: dynamic)", check=positive))
    initial_loss_scale: float = field(default=2.0**32, metadata=opt("initial dynamic loss scale for --fp16", check=positive))
    use_distributed_optimizer: bool = field(default=False, metadata=opt("shard optimizer state and fp32 master weights over data-parallel ranks"))
    seed: int = field(default=1234, metadata=opt("seed for weights and data", check=non_negative))
    log_interval: int = field(default=1, metadata=opt("iterations between log lines", check=positive))
    manual_gc: bool = field(default=False, metadata=opt(
        "as Megatron-LM's: Python's cyclic garbage collector off for the run, collecting once "
        "at the start and then only every --manual-gc-interval iterations, between steps, at "
        "the same iteration on every rank (a collection of a large heap takes 0.2 s of CPU and "
        "otherwise lands in whichever step the allocations decide, on each rank apart)"))
    manual_gc_interval: int = field(default=0, metadata=opt(
        "iterations between --manual-gc collections (0: only the one at the start)",
        check=non_negative))
    recompute_granularity: Optional[str] = field(default=None, metadata=opt(
        "activation recompute, as Megatron-LM's: full (whole layers, with --recompute-method "
        "and --recompute-num-layers) or selective (the core attention)", check=one_of("full", "selective")))
    recompute_method: Optional[str] = field(default=None, metadata=opt(
        "with full recompute: uniform (every layer, in chunks of --recompute-num-layers) or block "
        "(the first --recompute-num-layers layers of each stage)", check=one_of("uniform", "block")))
    recompute_num_layers: Optional[int] = field(default=None, metadata=opt(
        "with full recompute: layers per chunk (uniform) or per stage (block)", check=positive))
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
    attention_backend: str = field(default="unfused", metadata=opt(
        "core attention of --transformer-impl local: unfused (Megatron's DotProductAttention) or "
        "sdpa (torch's fused SDPA kernels: FlashAttention / memory-efficient on CUDA); "
        "Transformer Engine layers use TE's own", check=one_of("unfused", "sdpa")))
    pipeline_model_parallel_layout: Optional[str] = field(default=None, metadata=opt("Megatron layout string, e.g. 'Ett|ttL'"))
    mtp_num_layers: Optional[int] = field(default=None, metadata=opt(
        "Multi-Token Prediction layers after the decoder (Megatron-Core's MTP block; 'm' in "
        "the layout: on the last rank by default, or standalone on an earlier one)",
        check=positive))
    untie_embeddings_and_output_weights: bool = field(default=False, metadata=opt("separate output-layer weights"))
    output: str = field(default="runs/latest", metadata=opt("directory for report.json"))
    save: Optional[str] = field(default=None, metadata=opt("checkpoint directory to save to"))
    save_interval: int = field(default=0, metadata=opt(
        "iterations between checkpoints, the last iteration saved too (0 = only at a checkpoint repack)",
        check=non_negative))
    load: Optional[str] = field(default=None, metadata=opt("checkpoint directory to resume from (any pipeline split)"))
    exit_signal_handler: bool = field(default=False, metadata=opt(
        "on SIGTERM/SIGINT, save a checkpoint (with --save) at the iteration boundary before "
        "exiting, as Megatron-LM's; without it the run still stops there, saving nothing"))
    data: DataConfig = field(default_factory=DataConfig)


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
        "profile's measured dispersion if larger (docs/profiling.md; 0 = no floor; below 1: "
        "no plan saves the whole iteration)", "--dynmo-min-gain", below_one))
    expected_event_gap: int = field(default=100, metadata=opt(
        "iterations a new layout is expected to last (gate horizon)", "--dynmo-event-gap", positive))
    memory_cap_gb: float = field(default=0.0, metadata=opt(
        "per-stage memory cap for plans in GB (0 = none)", "--dynmo-memory-cap-gb", non_negative))
    bandwidth_gbps: float = field(default=1.0, metadata=opt(
        "assumed migration bandwidth in GB/s until one is measured", "--dynmo-bandwidth-gbps", positive))
    migration_timeout_s: float = field(default=300.0, metadata=opt(
        "seconds any plugin collective or transfer may block before the peer counts as lost",
        "--dynmo-migration-timeout", positive))


# Which workload change runs during training (active with or without --dynmo: a static
# baseline trains the same scenario on a split that never changes): `kind`, and one
# section per scenario of the registry (`dynamism.pruning`, `dynamism.mod`, ...). Types
# are written as strings, as `from __future__ import annotations` makes every other
# field's, which is what the flag generation reads.
DynamismConfig = dataclasses.make_dataclass(
    "DynamismConfig",
    [("kind", "str", field(default="none", metadata=opt(
        "dynamism scenario", "--dynmo-dynamism", one_of("none", *SCENARIOS))))]
    + [(e.section, e.config.__name__, field(default_factory=e.config)) for e in SCENARIOS.values()],
    kw_only=True)
DynamismConfig.__module__ = __name__
DynamismConfig.__doc__ = ("Which workload change runs during training: `kind` (a scenario of "
                          "dynmo_plugin.scenarios.SCENARIOS, or none) and each scenario's section.")


@dataclass(kw_only=True)
class RepackConfig:
    """Consolidating the pipeline onto fewer stages once the work has shrunk. The planner's
    criteria take the planner's defaults (`balancing.repack.RepackCriteria`)."""

    enabled: bool = field(default=False, metadata=opt(
        "consider repacking onto fewer pipeline stages", "--dynmo-repack"))
    min_stages: int = field(default=_PLANNER.min_stages, metadata=opt(
        "never repack below this many pipeline stages", "--dynmo-repack-min-stages", positive))
    max_slowdown: float = field(default=_PLANNER.max_slowdown, metadata=opt(
        "every objective: the predicted iteration time may grow at most this factor over "
        "the current one", "--dynmo-repack-max-slowdown", positive))
    objective: str = field(default=_PLANNER.objective, metadata=opt(
        "min_stages (fewest stages within max_slowdown) or throughput_per_gpu",
        "--dynmo-repack-objective", one_of(*OBJECTIVES)))
    trigger: str = field(default="event", metadata=opt(
        "event: consider repacking after dynamism events; rebalance: after every rebalance "
        "decision (interval ones too)", "--dynmo-repack-trigger", one_of("event", "rebalance")))
    mode: str = field(default="live", metadata=opt(
        "live (shrink the running job) or checkpoint (save, exit, restart with fewer ranks)",
        "--dynmo-repack-mode", one_of("live", "checkpoint")))
    memory_margin: float = field(default=_PLANNER.memory_margin, metadata=opt(
        "a stage fits if its predicted memory x (1 + margin) is within the cap",
        "--dynmo-repack-memory-margin", non_negative))
    rebuild_s: float = field(default=_PLANNER.rebuild_s, metadata=opt(
        "estimated seconds to regroup and rebuild (the gate's cost, besides moving layers)",
        "--dynmo-repack-rebuild-s", non_negative))
    freed: str = field(default="release", metadata=opt(
        "the ranks a repack frees: release (leave the job), grow (stay as data-parallel "
        "replicas of the new stages) or auto (the objective picks)", "--dynmo-repack-freed",
        one_of(*FREED_MODES)))


CLUSTER_STRATEGIES = STRATEGIES  # what dynmo_plugin.cluster can do, not a copy


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
    rank_rng: bool = field(default=False, metadata=opt(
        "layers draw dropout masks and MoE jitter from their rank's random streams, as "
        "Megatron's own do (a run without the plugin's masks; a move then changes them), "
        "not each layer from its own (docs/megatron-lm.md \"What a move changes\")",
        "--dynmo-rank-rng"))
    native_grad_reduce: bool = field(default=False, metadata=opt(
        "reduce gradients with Megatron's own collectives (NCCL's or gloo's ring order: at "
        "DP >= 3, and for the norms all-reduced over TP >= 3, a move then changes the reduced "
        "gradients' last bits), not each element in rank order (docs/megatron-lm.md \"What "
        "a move changes\")",
        "--dynmo-native-grad-reduce"))
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
    # one-line notices found while resolving (printed by rank 0; not part of the report)
    notices: list = field(default_factory=list, compare=False, repr=False)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        del out["notices"]
        return out
