"""Dynamic hash-bucketed (LSH) sparse attention: attention cost per layer changes in training.

Every decoder layer's core attention is `LSHCoreAttention`
(dynmo_plugin.scenarios.sparse_attention.layer): with B buckets, tokens are hashed
each iteration with a random rotation (Reformer's angular LSH), sorted by bucket and
cut into chunks of c = round_up(s/B, chunk_multiple) tokens; a token attends the tokens
of its chunk at or before its position, through fused attention (kernels.py).
B = 1 is dense causal attention through torch's fused SDPA.
Attention then costs ~ s * c instead of ~ s^2, so layers with different
bucket counts cost different amounts, and the pipeline goes out of balance.

Bucket counts (`dynamism.sparse_attention`): every layer starts with `buckets`; a
layer named in `buckets_per_layer` ('1:8,2:32') keeps that count for the whole run
(pinned). With `final_buckets` > 0 the other layers follow a geometric schedule
from `buckets` to `final_buckets` in `rounds` changes, one every `interval`
iterations from `start` (applied after that iteration's step): round k sets
round(buckets * (final_buckets / buckets)^(k / rounds)). The schedule is a pure
function of the configuration and the iteration, so every rank applies the same
change with no communication; each change is a DynamismEvent (the controller
profiles and rebalances). The count is a buffer of each layer's core attention, so
migration, repack and checkpoints carry it.

Work model (`DynamismEvent.work`, {layer: predicted ms of one micro-batch's forward +
backward}): `AttentionCostModel`, the layer's linear part (projections, MLP, norms)
plus its attention, dense `dense_ms` (SDPA) for B = 1, else per hash round
`block_ms * s*c + row_ms + block_overhead_ms * B` with c the chunk length (the chunks'
attention ~ s*c, the hashing, sorting and gathering ~ s, the hash projection ~ B). Its
coefficients are fitted once at start from a timed micro-profile of the core
attention at this run's shapes and the bucket counts the run uses (rank 0 times, all
ranks receive the same model: `control.decide`).
"""
from __future__ import annotations

import itertools
import logging
import math
from dataclasses import asdict, dataclass
from typing import Optional

from dynmo_plugin.config import ConfigError

from dynmo_plugin.scenarios.base import DynamismEvent, Runtime, Scenario
from dynmo_plugin.scenarios.flops import FLOP_FALLBACK, DecoderFlops

__all__ = ["SparseAttention", "AttentionCostModel", "parse_buckets_per_layer", "scheduled_buckets",
           "bucket_table", "change_round", "fit_cost_model"]

logger = logging.getLogger(__name__)
_SECTION = "dynamism.sparse_attention"


# ---- pure helpers (no processes, no Megatron) ---------------------------------------------
def parse_buckets_per_layer(text: str, num_layers: int) -> dict[int, int]:
    """'1:8,2:32' -> {1: 8, 2: 32}; layers 1..num_layers, buckets >= 1.

    Raises:
        ConfigError: a malformed entry, a layer out of range or repeated, buckets < 1."""
    out: dict[int, int] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        try:
            layer_s, buckets_s = item.split(":")
            layer, buckets = int(layer_s), int(buckets_s)
        except ValueError:
            raise ConfigError(f"{_SECTION}.buckets_per_layer: expected 'layer:buckets,...', "
                              f"got {item!r} in {text!r}") from None
        if not 1 <= layer <= num_layers:
            raise ConfigError(f"{_SECTION}.buckets_per_layer: layer {layer} is not in 1..{num_layers}")
        if buckets < 1:
            raise ConfigError(f"{_SECTION}.buckets_per_layer: layer {layer}: buckets must be >= 1, got {buckets}")
        if layer in out:
            raise ConfigError(f"{_SECTION}.buckets_per_layer: layer {layer} given twice in {text!r}")
        out[layer] = buckets
    return out


def scheduled_buckets(start_buckets: int, final_buckets: int, rounds: int, k: int) -> int:
    """Buckets of an unpinned layer after k changes: geometric from start to final
    (k = 0: start; k >= rounds: final; final 0: constant)."""
    if final_buckets <= 0 or k <= 0:
        return start_buckets
    if k >= rounds:
        return final_buckets
    value = start_buckets * (final_buckets / start_buckets) ** (k / rounds)
    return max(1, int(math.floor(value + 0.5)))


def bucket_table(settings, num_layers: int, k: int) -> dict[int, int]:
    """{global layer: buckets} after k schedule changes (pinned layers never change)."""
    pinned = parse_buckets_per_layer(settings.buckets_per_layer, num_layers)
    value = scheduled_buckets(settings.buckets, settings.final_buckets, settings.rounds, k)
    return {n: pinned.get(n, value) for n in range(1, num_layers + 1)}


def change_round(settings, iteration: int) -> int:
    """The schedule round (1..rounds) applied after `iteration`, or 0 if none is."""
    if settings.final_buckets <= 0 or iteration < settings.start:
        return 0
    offset = iteration - settings.start
    if offset % settings.interval:
        return 0
    k = offset // settings.interval + 1
    return k if k <= settings.rounds else 0


@dataclass(frozen=True)
class AttentionCostModel:
    """Predicted ms of one micro-batch's forward + backward of a layer (module docstring).

    seq_length, hashes, chunk_multiple: the run's; linear_ms: everything but the core
    attention; dense_ms: SDPA causal; block_ms per query-key pair of the chunks (times
    s*c, c = kernels.chunk_tokens), row_ms per hash round, block_overhead_ms per bucket."""

    seq_length: int
    hashes: int
    linear_ms: float
    dense_ms: float
    block_ms: float
    row_ms: float
    block_overhead_ms: float
    source: str = "timed"  # or "flops": the fallback when the calibration failed
    chunk_multiple: int = 64

    @classmethod
    def from_flops(cls, flops, seq_length: int, micro_batch_size: int,
                   hashes: int, chunk_multiple: int = 64) -> "AttentionCostModel":
        """The fallback from matmul FLOPs (dynamism.flops): block_ms per query-key pair
        of a block, dense attention over s keys per query; hashing, sorting and
        gathers (row_ms, block_overhead_ms) are not matmuls and count 0."""
        s, b = seq_length, micro_batch_size
        ms = lambda f: round(1e3 * flops.seconds(f), 9)  # noqa: E731
        return cls(s, hashes, ms(s * b * flops.linear()), ms(s * b * flops.attention(s)),
                   ms(b * flops.attention(1)), 0.0, 0.0, source="flops",
                   chunk_multiple=chunk_multiple)

    def attention_ms(self, buckets: int) -> float:
        if buckets <= 1:
            return self.dense_ms
        return self.hashes * sum(c * f for c, f in zip(self._coefficients(),
                                                       _features(self.seq_length, buckets,
                                                                 self.chunk_multiple)))

    def layer_ms(self, buckets: int) -> float:
        return self.linear_ms + self.attention_ms(buckets)

    def work(self, table: dict[int, int]) -> dict[int, float]:
        """{layer: predicted ms} for a bucket table: DynamismEvent.work."""
        return {n: round(self.layer_ms(b), 4) for n, b in sorted(table.items())}

    def _coefficients(self) -> tuple[float, float, float]:
        return self.block_ms, self.row_ms, self.block_overhead_ms

    def to_dict(self) -> dict:
        return asdict(self)


def _chunk(s: int, buckets: int, multiple: int) -> int:
    """kernels.chunk_tokens, restated here (a pure wing imports no torch)."""
    return min(s, multiple * math.ceil(s / buckets / multiple))


def _features(s: int, buckets: int, multiple: int) -> tuple[float, float, float]:
    """The LSH round's cost terms: query-key pairs in chunks, one, buckets."""
    return float(s * _chunk(s, buckets, multiple)), 1.0, float(buckets)


def fit_cost_model(seq_length: int, hashes: int, linear_ms: float, dense_ms: float,
                   lsh_ms: dict[int, float], chunk_multiple: int = 64) -> AttentionCostModel:
    """Fit block_ms, row_ms, block_overhead_ms >= 0 to measured {buckets: ms of `hashes`
    rounds}, minimising relative error (every subset of the three terms is tried; the
    best non-negative least-squares solution wins)."""
    import numpy as np
    points = sorted((b, ms / hashes) for b, ms in lsh_ms.items() if b > 1)
    if not points:
        return AttentionCostModel(seq_length, hashes, linear_ms, dense_ms, 0.0, 0.0, 0.0,
                                  chunk_multiple=chunk_multiple)
    x = np.array([_features(seq_length, b, chunk_multiple) for b, _ in points], dtype=float)
    y = np.array([ms for _, ms in points], dtype=float)
    w = 1.0 / np.maximum(y, 1e-9)
    best, best_err = (0.0, 0.0, 0.0), math.inf
    for size in (1, 2, 3):
        for cols in itertools.combinations(range(3), size):
            if len(points) < size:
                continue
            a = x[:, cols] * w[:, None]
            coef, *_ = np.linalg.lstsq(a, y * w, rcond=None)
            if (coef < 0).any():
                continue
            full = np.zeros(3)
            full[list(cols)] = coef
            err = float(np.sum(((x @ full - y) * w) ** 2))
            if err < best_err - 1e-12:
                best, best_err = tuple(float(v) for v in full), err
    return AttentionCostModel(seq_length, hashes, linear_ms, dense_ms, *best,
                              chunk_multiple=chunk_multiple)


def calibration_buckets(used: set[int], seq_length: int) -> list[int]:
    """The LSH bucket counts to time: those the run uses, widened to at least three
    distinct values (so all three cost terms are determined) within 2..seq_length."""
    values = {b for b in used if b > 1}
    candidates = [2, 4, 8, 16, 32, 64, 128, 256]
    for b in sorted(candidates, key=lambda c: min((abs(math.log2(c / v)) for v in values), default=0)):
        if len(values) >= 3:
            break
        if b <= seq_length:
            values.add(b)
    return sorted(values)


# ---- the scenario -----------------------------------------------------------------------------
class SparseAttention(Scenario):
    """`dynamism.kind: sparse_attention` (settings: `dynamism.sparse_attention`)."""

    name = "sparse_attention"

    def __init__(self, config) -> None:
        super().__init__(config)
        self.settings = config.sparse_attention
        self.round = 0           # schedule changes applied so far (same on every rank)
        self.model: Optional[AttentionCostModel] = None
        self.num_layers = 0

    # ---- Scenario interface ---------------------------------------------------------------
    def layer_spec(self, spec, model_args):
        from dynmo_plugin.scenarios.sparse_attention.layer import lsh_attention_spec
        self.num_layers = model_args.num_layers
        initial = bucket_table(self.settings, self.num_layers, 0)  # validates the overrides
        too_many = {n: b for n, b in self._all_tables().items() if b > model_args.seq_length}
        if too_many:
            raise ConfigError(f"{_SECTION}: more buckets than tokens per sample "
                              f"({model_args.seq_length}): {too_many}")
        return lsh_attention_spec(spec, seed=model_args.seed, initial_buckets=initial,
                                  hashes=self.settings.hashes,
                                  chunk_multiple=self.settings.chunk_multiple)

    def attach(self, runtime: Runtime) -> None:
        super().attach(runtime)
        if self.model is None:  # once per run (a repack re-attaches: keep the model)
            t = runtime.trainer
            self.num_layers = t.config.num_layers
            self.model = AttentionCostModel(**self._fit_once())
            if t.dims.rank == 0:
                logger.info("sparse attention: cost model %s; layer ms at each bucket count %s",
                            self.model, {b: round(self.model.layer_ms(b), 2)
                                         for b in sorted(set(self._all_tables().values()))})

    def state_dict(self) -> dict:
        return {"round": self.round, "model": self.model.to_dict() if self.model else None}

    def load_state_dict(self, state: dict) -> None:
        self.round = state.get("round", 0)
        if state.get("model"):
            self.model = AttentionCostModel(**state["model"])

    def before_step(self, iteration: int) -> None:
        t = self.runtime.trainer
        first = t.dims.dp_rank * t.num_microbatches  # global micro-batch index: DP-split invariant
        for attention in self._attentions():
            attention.begin_iteration(iteration, first)

    def after_step(self, iteration: int) -> Optional[DynamismEvent]:
        return self.with_fallbacks(iteration, self._event(iteration))

    def _event(self, iteration: int) -> Optional[DynamismEvent]:
        k = change_round(self.settings, iteration)
        if not k:
            return None
        before = self.table()
        self.round = k
        table = self.table()
        for attention in self._attentions():
            attention.set_buckets(table[attention.layer_number])
        seq = self.runtime.trainer.args.seq_length
        detail = {"round": k, "buckets": table,
                  "changed": sorted(n for n in table if table[n] != before[n]),
                  # the chunk lengths actually run (s/B rounded up to chunk_multiple; s: dense)
                  "chunk_tokens": {n: _chunk(seq, b, self.settings.chunk_multiple) if b > 1 else seq
                                   for n, b in table.items()}}
        if k == 1:
            detail["cost_model"] = self.model.to_dict()
        if self.runtime.trainer.dims.rank == 0:
            logger.info("sparse attention: iteration %d, round %d/%d, buckets %s", iteration, k,
                        self.settings.rounds, table)
        return DynamismEvent(self.name, iteration, detail, work=self.model.work(table))

    # ---- helpers ------------------------------------------------------------------------------
    def table(self) -> dict[int, int]:
        """{global layer: buckets} now (what every layer's buffer holds)."""
        return bucket_table(self.settings, self.num_layers, self.round)

    def work(self) -> dict[int, float]:
        """The work model's prediction for the current table."""
        return self.model.work(self.table())

    def _all_tables(self) -> dict[int, int]:
        """Every (layer, buckets) the schedule ever uses, as {index: buckets}."""
        rounds = self.settings.rounds if self.settings.final_buckets > 0 else 0
        values = [b for k in range(rounds + 1) for b in bucket_table(self.settings, self.num_layers, k).values()]
        return dict(enumerate(values))

    def _attentions(self):
        from dynmo_plugin.scenarios.sparse_attention.layer import core_attentions
        return [a for chunk in self.runtime.trainer.chunks for a in core_attentions(chunk)]

    def _fit_once(self) -> dict:
        """The cost model, fitted on rank 0 and broadcast. Rank 0's whole tensor-parallel
        group (first stage, first replica) times the throwaway layer together, since a
        TP layer's forward runs TP collectives; the other ranks wait in the broadcast."""
        d = self.runtime.trainer.dims
        fitted: object = None
        if d.pp_rank == 0 and d.dp_rank == 0:
            try:
                fitted = self._calibrate()
            except Exception as e:  # noqa: BLE001 - rank 0 reports it to every rank below
                fitted = e

        def result():
            if isinstance(fitted, Exception):
                raise fitted
            return fitted

        t = self.runtime.trainer
        return self.decide_or_fallback(
            result, "sparse-attention-calibration",
            lambda: AttentionCostModel.from_flops(DecoderFlops.from_config(t.config), t.args.seq_length,
                                                  t.args.micro_batch_size, self.settings.hashes,
                                                  self.settings.chunk_multiple).to_dict(),
            FLOP_FALLBACK)

    def _calibrate(self) -> dict:
        """Rank 0: time a throwaway layer built from this run's spec without attention and
        at every bucket count the run uses; fit the model to the differences."""
        from dynmo_plugin.scenarios.sparse_attention.layer import time_layer
        self.inject_fault("sparse-attention-calibration")
        t, s = self.runtime.trainer, self.settings
        args, decoder = t.args, t.model.decoder
        seq = args.seq_length
        counts = [1] + calibration_buckets(set(self._all_tables().values()), seq)
        ms = {k: 1e3 * v for k, v in time_layer(t.spec, t.config, decoder.pg_collection, decoder.vp_stage,
                                                seq, args.micro_batch_size, counts,
                                                device=t.dims.device).items()}
        linear = ms.pop(0)
        attention = {k: max(v - linear, 0.0) for k, v in ms.items()}
        dense = attention.pop(1)
        model = fit_cost_model(seq, s.hashes, linear, dense, attention, s.chunk_multiple)
        logger.info("sparse attention calibration (ms, fwd+bwd per micro-batch): linear part %.2f, "
                    "dense attention %.2f, LSH attention %s", linear, dense,
                    {k: round(v, 2) for k, v in attention.items()})
        return model.to_dict()
