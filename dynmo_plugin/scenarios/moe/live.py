"""Mixture of Experts: Megatron-Core's own MoE layers, token-choice top-k routing.

The decoder's MoE layers are Megatron's `MoELayer` (router `TopKRouter` with its
auxiliary load-balancing loss, `SequentialMLP` experts, the `allgather` token
dispatcher), on every `every`-th layer (Megatron's `moe_layer_freq`; the others are
dense). With a capacity factor, an expert takes at most C tokens per micro-batch, C =
tokens x top_k / experts x capacity_factor rounded to the nearest multiple of
`granularity` (64 by default; at least one granule, at most every token: `expert_capacity`),
and the rest of its tokens are dropped (Megatron's "probs" policy: the lowest router
probabilities go). Megatron takes a factor, not a size: the scenario hands it the factor
whose ceiling is exactly C, and every event reports C (`expert_capacity`). Each expert
then computes exactly C rows per micro-batch, its kept tokens padded (Megatron's
moe_pad_expert_input_to_capacity): static GEMM shapes, a multiple of `granularity`, so
the GPU's work is what the capacity says whatever the router does, dispatched by index
with nothing read back and the experts run as batched matmuls
(dynmo_plugin.scenarios.moe.layer: CapacityDispatcher, GroupedExperts) (unpadded, an
untrained router that sends most tokens to two experts computed 56% of the capacity-1.0
rows at capacity 1.0 and 0.69x of that at 0.5; `no_pad` restores that behaviour). The
events' `tokens_per_expert` are rows computed (padding included: the work), `kept` the
share of routed tokens really kept.
Routing changes every iteration as the router learns, so does how many tokens each
layer's experts process, and with it each layer's cost (DynMo's MoE scenario, which
rebalances every iteration).

What the scenario does:
* `configure_model` sets Megatron's MoE fields on the TransformerConfig and
  `layer_spec` gives every layer `MoeTransformerLayer` (dynmo_plugin.scenarios.moe.layer),
  which is MoE or dense by its global number, so a migrated layer is rebuilt as what it
  was. Its router is hooked to count tokens per expert after dropping.
* `attach` (once) times a throw-away MoE layer at two token loads and a dense layer
  (`calibrate`) on every rank; rank 0 takes the medians: the cost model below.
* Every `interval` iterations from `start`, `after_step` gathers every layer's counts
  on the control plane, rank 0 summarises them once, and the scenario reports a
  `DynamismEvent` whose `work` is each layer's predicted cost. The controller
  re-estimates layer costs from its last timed profile scaled by this work (no timing
  window; it re-times every `profiling.retime_every` events) and its gate decides
  whether a move pays.

The work model, in units of one token through one expert (fwd+bwd), per iteration of M
micro-batches, for this DP replica (the busiest replica's number):
    MoE layer:   M x fixed + tokens its experts processed (after dropping)
    dense layer: M x dense
`fixed` is everything of an MoE layer but its experts (norms, attention, router,
dispatch) and `dense` a dense layer, both measured in the same units by `calibrate`.
This is source (a) of imbalance: compute follows the tokens actually processed. Source
(b), expert parallelism, where the busiest expert's rank sets the pace of the layer,
cannot run here (EP = 1); it is derived from the same counts: with EP size P, experts
split into P contiguous groups as Megatron places them, the expert term becomes
P x max over groups of the group's tokens (`ep_expert_tokens`; equal to the plain sum
for P = 1). The balancer sees (a) unless `ep_model` > 1; every event also records (b)
for P = number of experts (one expert per rank, the worst case) in its detail.
"""
from __future__ import annotations

import copy
import logging
import statistics
from dataclasses import asdict, dataclass
from typing import Optional

from dynmo_plugin.config import ConfigError

from dynmo_plugin.scenarios.base import DynamismEvent, Runtime, Scenario
from dynmo_plugin.scenarios.flops import FLOP_FALLBACK, DecoderFlops
from dynmo_plugin.scenarios.shapes import round_nearest

__all__ = ["MixtureOfExperts", "CostModel", "combine_counts", "ep_expert_tokens", "layer_work",
           "cost_model_from_calibrations", "flop_cost_model", "moe_layer_numbers",
           "expert_capacity", "megatron_capacity_factor"]

logger = logging.getLogger(__name__)


# ---- pure helpers (no processes, no Megatron) ---------------------------------------------
def moe_layer_numbers(num_layers: int, every: int, pattern: str = "") -> tuple[int, ...]:
    """Global (1-based) numbers of the MoE layers, as Megatron's `moe_layer_freq` gives
    them: an int N (MoE iff (L - 1) % N == 0, so layer 1 always) or a 0/1 list, one entry
    per layer (`pattern`, which wins)."""
    if not pattern:
        return tuple(n for n in range(1, num_layers + 1) if (n - 1) % every == 0)
    flags = [x.strip() == "1" for x in pattern.split(",")]
    if len(flags) != num_layers:
        raise ConfigError(f"dynamism.moe.pattern has {len(flags)} entries for {num_layers} decoder "
                          f"layers; give one 0 or 1 per layer")
    return tuple(n for n, moe in enumerate(flags, start=1) if moe)


def expert_capacity(tokens: int, top_k: int, experts: int, factor: float, granularity: int) -> int:
    """Tokens one expert may keep per micro-batch: its fair share (tokens x top_k /
    experts) times `factor`, rounded to the nearest multiple of `granularity` (at least
    one granule, at most `tokens`: an expert sees each token once)."""
    return round_nearest(tokens * top_k / experts * factor, granularity, tokens)


def megatron_capacity_factor(capacity: int, tokens: int, top_k: int, experts: int) -> float:
    """The factor for which Megatron's get_capacity (ceil(tokens x top_k / experts x
    factor)) gives exactly `capacity`: half a token below it, so rounding errors of the
    float product cannot reach the next integer."""
    return (capacity - 0.5) / (tokens * top_k / experts)


@dataclass(frozen=True)
class CostModel:
    """A layer's cost per micro-batch in expert-token units (see the module docstring)."""

    fixed: float              # an MoE layer without its experts
    dense: Optional[float]    # a dense layer (None: every layer is MoE)
    per_token_s: float        # seconds of one expert token, fwd+bwd, where calibrated
    source: str = "calibrated"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "CostModel":
        return cls(**d)


def cost_model_from_calibrations(results: list[Optional[dict]]) -> CostModel:
    """Medians over the ranks' `calibrate` results (None: a rank that did not calibrate;
    {"error": why}: a rank whose calibration raised).

    Raises:
        ValueError: no rank has a usable result (the ranks' errors in the message)."""
    usable = [r for r in results if r and "error" not in r and r["per_token_s"] > 0]
    if not usable:
        errors = "; ".join(f"rank {i}: {r['error']}" for i, r in enumerate(results)
                           if r and "error" in r)
        raise ValueError("no rank measured a positive cost per expert token"
                         + (f" ({errors})" if errors else ""))
    fixed = statistics.median(r["fixed_s"] / r["per_token_s"] for r in usable)
    dense = [r["dense_s"] / r["per_token_s"] for r in usable if r.get("dense_s") is not None]
    return CostModel(fixed=round(fixed, 3), dense=round(statistics.median(dense), 3) if dense else None,
                     per_token_s=statistics.median(r["per_token_s"] for r in usable))


def flop_cost_model(config, seq_length: int, micro_batch_size: int) -> CostModel:
    """The fallback cost model from matmul FLOPs (dynamism.flops), in the same units: an
    MoE layer's non-expert part and a dense layer per micro-batch, in expert tokens."""
    from dynmo_plugin.scenarios.moe.layer import flop_fixed_tokens
    tokens = seq_length * micro_batch_size
    expert = DecoderFlops.from_config(config, config.moe_ffn_hidden_size).mlp()
    dense = DecoderFlops.from_config(config)
    return CostModel(fixed=round(flop_fixed_tokens(config, seq_length) * tokens, 3),
                     dense=round(tokens * (dense.linear() + dense.attention(seq_length)) / expert, 3),
                     per_token_s=DecoderFlops.seconds(expert), source="flops")


def ep_expert_tokens(counts: list[int], ep: int) -> int:
    """Expert tokens of a layer as the busiest of `ep` expert-parallel ranks sees them:
    experts split into `ep` contiguous equal groups (Megatron's placement), the layer
    takes as long as the busiest group, i.e. `ep` x its tokens in one-rank units. For
    ep = 1 the plain sum."""
    if ep < 1 or len(counts) % ep:
        raise ValueError(f"expert-parallel size {ep} does not divide {len(counts)} experts")
    size = len(counts) // ep
    return ep * max(sum(counts[i:i + size]) for i in range(0, len(counts), size))


def layer_work(counts: Optional[list[int]], model: CostModel, micro_batches: int, ep: int = 1) -> float:
    """Predicted cost of one layer for one iteration (counts None: a dense layer)."""
    if counts is None:
        return round(micro_batches * (model.dense if model.dense is not None else model.fixed), 3)
    return round(micro_batches * model.fixed + ep_expert_tokens(counts, ep), 3)


def combine_counts(gathered: list[dict]) -> tuple[dict[int, Optional[list[int]]],
                                                  dict[int, Optional[list[int]]]]:
    """Every rank's {"tp", "dp", "layers": {layer: counts or None}} -> (counts summed over
    data-parallel replicas, counts of the replica whose experts processed the most
    tokens) per layer; tensor-parallel ranks route identically (rank 0's are read);
    a dense layer maps to None in both."""
    total: dict[int, Optional[list[int]]] = {}
    busiest: dict[int, Optional[list[int]]] = {}
    for part in sorted((g for g in gathered if g["tp"] == 0), key=lambda g: g["dp"]):
        for layer, counts in part["layers"].items():
            n = int(layer)
            if counts is None:
                total[n] = busiest[n] = None
                continue
            acc = total.get(n)
            total[n] = list(counts) if acc is None else [a + c for a, c in zip(acc, counts)]
            if busiest.get(n) is None or sum(counts) > sum(busiest[n]):
                busiest[n] = list(counts)
    return dict(sorted(total.items())), dict(sorted(busiest.items()))


# ---- the scenario -----------------------------------------------------------------------------
class MixtureOfExperts(Scenario):
    """dynamism.kind 'moe' (config: dynamism.moe); see the module docstring."""

    name = "moe"

    def __init__(self, config) -> None:
        super().__init__(config)
        self.settings = config.moe
        self.ep_model = self.settings.ep_model  # the EP size the work assumes (1: source (a))
        self.cost_model: Optional[CostModel] = None
        self.tokens: Optional[int] = None  # per micro-batch, known from layer_spec on
        self.capacity: Optional[int] = None  # tokens per expert per micro-batch (None: no dropping)
        s = self.settings
        if s.top_k > s.num_experts:
            raise ConfigError(f"dynamism.moe.top_k ({s.top_k}) exceeds dynamism.moe.num_experts "
                              f"({s.num_experts}); a token picks distinct experts")
        if s.num_experts % self.ep_model:
            raise ConfigError(f"dynamism.moe.ep_model ({self.ep_model}) must divide "
                              f"dynamism.moe.num_experts ({s.num_experts})")

    # ---- model ----------------------------------------------------------------------------
    def layer_spec(self, spec, model_args):
        from dynmo_plugin.megatron.training.te_names import bind_missing_te_names
        from dynmo_plugin.scenarios.moe.layer import moe_layer_spec
        bind_missing_te_names()  # the router reads te_general_gemm; unbound without TE
        self.tokens = model_args.seq_length * model_args.micro_batch_size
        return moe_layer_spec(spec, _moe_spec(spec, self.settings.num_experts),
                              self._moe_layers(model_args.num_layers))

    def _moe_layers(self, num_layers: int) -> tuple[int, ...]:
        return moe_layer_numbers(num_layers, self.settings.every, self.settings.pattern)

    def configure_model(self, config) -> None:
        s = self.settings
        config.num_moe_experts = s.num_experts
        config.moe_router_topk = s.top_k
        config.moe_router_load_balancing_type = "aux_loss"
        config.moe_aux_loss_coeff = s.aux_loss_coeff
        config.moe_expert_capacity_factor = self._capacity_factor()
        config.moe_token_drop_policy = "probs"
        # every expert computes exactly its capacity (a multiple of the granularity): the
        # GPU's work follows the capacity, not how (im)balanced the router is just now
        config.moe_pad_expert_input_to_capacity = self.capacity is not None and not s.no_pad
        moe = self._moe_layers(config.num_layers)
        config.moe_layer_freq = [int(n in moe) for n in range(1, config.num_layers + 1)]
        config.moe_grouped_gemm = False
        # alltoall creates a CUDA stream when built; allgather is exact and fine at EP = 1
        config.moe_token_dispatcher_type = "allgather"
        # Megatron's expert MLP adds its bias in place on a view (autograd refuses)
        config.add_bias_linear = False
        if config.moe_ffn_hidden_size is None:  # what __post_init__ would have derived
            config.moe_ffn_hidden_size = config.ffn_hidden_size
        if s.top_k == 1:  # softmax over one selected logit has zero gradient
            config.moe_router_pre_softmax = True
        if config.variable_seq_lengths:
            raise ConfigError("MoE's allgather dispatcher does not support variable sequence "
                              "lengths (another scenario set them)")

    def _capacity_factor(self) -> Optional[float]:
        """Megatron's factor for the rounded capacity (None: no dropping)."""
        s = self.settings
        if s.capacity_factor <= 0:
            self.capacity = None
            return None
        if self.tokens is None:
            raise RuntimeError("MixtureOfExperts.configure_model needs layer_spec first "
                               "(the tokens per micro-batch set the expert capacity)")
        self.capacity = expert_capacity(self.tokens, s.top_k, s.num_experts, s.capacity_factor,
                                        s.granularity)
        return megatron_capacity_factor(self.capacity, self.tokens, s.top_k, s.num_experts)

    # ---- lifecycle --------------------------------------------------------------------------
    def attach(self, runtime: Runtime) -> None:
        super().attach(runtime)
        if self.cost_model is None:
            self._calibrate()

    def _calibrate(self) -> None:
        from dynmo_plugin.scenarios.moe.layer import calibrate
        t, control = self.runtime.trainer, self.runtime.control
        try:
            self.inject_fault("moe-calibration")
            mine = calibrate(t, self._moe_layers(t.config.num_layers), seed=t.args.seed)
        except Exception as e:  # noqa: BLE001 - the other ranks' numbers may still do
            logger.warning("MoE cost calibration failed on rank %d: %r", t.dims.rank, e)
            mine = {"error": f"{type(e).__name__}: {e}"}
        gathered = control.all_gather(mine, "moe-calibration")
        errors = [f"rank {i}: {r['error']}" for i, r in enumerate(gathered) if r and "error" in r]
        if errors:  # every rank knows: the next event says so, even if others' numbers do
            self.note_fallback("moe-calibration", "; ".join(errors),
                               "the cost model from the ranks that calibrated (or matmul FLOPs)")
        model = self.decide_or_fallback(
            lambda: cost_model_from_calibrations(gathered).to_dict(), "moe-cost-model",
            lambda: flop_cost_model(t.config, t.args.seq_length, t.args.micro_batch_size).to_dict(),
            FLOP_FALLBACK)
        self.cost_model = CostModel.from_dict(model)
        if t.dims.rank == 0:
            logger.info("MoE cost model: an MoE layer's non-expert part = %.0f expert tokens, "
                        "a dense layer = %s, per micro-batch of %d tokens (%.2f us per expert token)",
                        model["fixed"], model["dense"], t.args.seq_length * t.args.micro_batch_size,
                        model["per_token_s"] * 1e6)

    def state_dict(self) -> dict:
        return {"cost_model": self.cost_model.to_dict() if self.cost_model else None}

    def load_state_dict(self, state: dict) -> None:
        if state.get("cost_model"):
            self.cost_model = CostModel.from_dict(state["cost_model"])

    def _layers(self):
        return self.runtime.trainer.layers

    def before_step(self, iteration: int) -> None:
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker
        clear_aux_losses_tracker()  # it sums forever otherwise; read per iteration below
        for layer in self._layers():
            layer.reset_counts()  # a layer that arrived by migration starts from zero anyway

    def rerun_started(self, iteration: int) -> None:
        """The rerun routes the same tokens again: start the step's counts over (they
        were twice the tokens)."""
        self.before_step(iteration)

    def is_event(self, iteration: int) -> bool:
        s = self.settings
        return iteration >= s.start and (iteration - s.start) % s.interval == 0

    def after_step(self, iteration: int) -> Optional[DynamismEvent]:
        return self.with_fallbacks(iteration, self._event(iteration))

    def _event(self, iteration: int) -> Optional[DynamismEvent]:
        if not self.is_event(iteration):
            return None
        t, control = self.runtime.trainer, self.runtime.control
        gathered = control.all_gather(self._local_report(), "moe-counts")
        detail, work = self.decide_or_fallback(
            lambda: self._summarise(gathered), "moe-event", lambda: ({}, None),
            "no routing statistics for this event (the controller times a window)")
        if work is None:
            return DynamismEvent(self.name, iteration, detail)
        if t.dims.rank == 0 and logger.isEnabledFor(logging.DEBUG):
            logger.debug("moe: iteration %d kept %s", iteration, detail["kept"])
        return DynamismEvent(self.name, iteration, detail,
                             work={int(k): v for k, v in work.items()})

    # ---- per-iteration statistics -----------------------------------------------------------
    def _local_report(self) -> dict:
        from megatron.core.transformer.moe.moe_utils import (MoEAuxLossAutoScaler,
                                                             get_moe_layer_wise_logging_tracker)
        t = self.runtime.trainer
        tracker = get_moe_layer_wise_logging_tracker().get("load_balancing_loss")
        layers, kept, aux = {}, {}, {}
        for layer in self._layers():
            n = layer.layer_number
            kept[n] = layer.take_kept()
            layers[n] = layer.take_counts()
            if layers[n] is not None and tracker is not None:
                aux[n] = float(tracker["values"][n - 1]) / t.num_microbatches
        scale = MoEAuxLossAutoScaler.main_loss_backward_scale
        tp_rank = t.dims.groups.tp.rank() if t.dims.tp > 1 else 0
        return {"tp": tp_rank, "dp": t.dims.dp_rank, "layers": layers, "kept": kept, "aux_loss": aux,
                "aux_loss_scale": None if scale is None else float(scale)}

    def _summarise(self, gathered: list[dict]) -> tuple[dict, dict]:
        t, s = self.runtime.trainer, self.settings
        total, busiest = combine_counts(gathered)
        kept, _ = combine_counts([{**p, "layers": p["kept"]} for p in gathered])
        m = t.num_microbatches
        routed = m * t.args.micro_batch_size * t.args.seq_length * s.top_k * t.dims.dp
        work = {n: layer_work(c, self.cost_model, m, self.ep_model) for n, c in busiest.items()}
        straggler = {n: layer_work(c, self.cost_model, m, s.num_experts)
                     for n, c in busiest.items() if c is not None}
        aux = {}
        for part in gathered:
            if part["tp"] == 0:
                for n, v in part["aux_loss"].items():
                    aux.setdefault(int(n), []).append(v)
        scales = {p["aux_loss_scale"] for p in gathered if p["aux_loss_scale"] is not None}
        detail = {
            "tokens_per_expert": {n: c for n, c in total.items() if c is not None},
            "kept": {n: round(sum(c) / routed, 6) for n, c in kept.items() if c is not None},
            "padded_to_capacity": self.capacity is not None and not s.no_pad,
            "aux_loss": {n: round(statistics.fmean(v), 6) for n, v in sorted(aux.items())},
            "aux_loss_scale": sorted(scales),
            "ep_straggler": {"ep": s.num_experts, "work": straggler},
            "ep_model": self.ep_model,
            "expert_capacity": self.capacity,
            "cost_model": self.cost_model.to_dict(),
        }
        return detail, work


def _moe_spec(spec, num_experts: int):
    """The MoE variant of `spec`: Megatron's local MoE layer spec with `GroupedExperts`
    (dynmo_plugin.scenarios.moe.layer; MoeTransformerLayer then swaps in its dispatcher),
    or Transformer Engine's own when `spec` is a TE spec (CUDA)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs
    try:
        qkv = spec.submodules.self_attention.submodules.linear_qkv
    except AttributeError:
        qkv = None
    te = "transformer_engine" in getattr(qkv, "__module__", "")
    if te:
        return specs.get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts,
                                                                moe_grouped_gemm=False)
    from dynmo_plugin.scenarios.moe.layer import GroupedExperts
    spec = specs.get_gpt_layer_local_spec(num_experts=num_experts, moe_grouped_gemm=False)
    mlp = copy.copy(spec.submodules.mlp)  # the local spec's own objects may be shared
    mlp.submodules = copy.copy(mlp.submodules)
    mlp.submodules.experts = copy.copy(mlp.submodules.experts)
    mlp.submodules.experts.module = GroupedExperts
    spec.submodules = copy.copy(spec.submodules)
    spec.submodules.mlp = mlp
    return spec
