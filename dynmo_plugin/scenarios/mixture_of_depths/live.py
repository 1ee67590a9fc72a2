"""Mixture of Depths (Raposo et al., "Mixture-of-Depths: Dynamically allocating compute
in transformer-based language models", 2024) as a live dynamism scenario.

Every `every`-th decoder layer (global numbers every, 2*every, ...; the paper routes
every other block) becomes a routed block (dynmo_plugin.scenarios.mixture_of_depths.layer): a router
picks the top C tokens of each sequence (expert choice; C = capacity x s rounded to a
multiple of `granularity`, 64 by default, so the block's GEMMs keep GPU-friendly sizes), only
those go through the block, the others ride the residual stream. A small auxiliary
predictor per routed block learns to predict top-C membership causally (what the
paper samples with). Capacity is per layer (`capacity`, overridden by
`capacity_per_layer`) and may follow a schedule: with `final_capacity` > 0, every
routed layer WITHOUT an override moves linearly from `capacity` to `final_capacity`
over `rounds` changes, at iterations start, start+interval, ..., start+(rounds-1)
*interval (each change takes effect from the next iteration); overridden layers keep
their capacity. So block cost differs across layers and over time.

Events. Each capacity change is a `DynamismEvent` (rebalance: True). With a constant
capacity (`final_capacity` 0) the same iterations report the predictor's progress; the
first of them asks for a rebalance (per-layer capacities unbalance the split from the
start), the others only report. An event's detail: the capacities asked for, the tokens
per sequence and the capacities actually used (after rounding) from the next iteration
on, the predictor's accuracy/recall per routed layer in the iteration just trained
(counted in event iterations only, gathered over every rank, summarised once), and the
work model (at the capacities used).

Work (`DynamismEvent.work`, {layer: units}, same on every rank): each layer's cost
per micro-batch in token-equivalents of a plain layer, from a cost model fitted once,
at the first event: rank 0 times a scratch routed layer (the run's own spec and
sizes) at capacities 1, 3/4, 1/2, 1/4, 1/8 (each as rounded: the fit is over the capacities
used) and a scratch plain layer (medians of 5 rounds), and fits
t(c) = fixed + linear*c + quadratic*c^2 (fixed: what does not
shrink with C: router, predictor, gather/scatter over all s tokens, the per-call
overhead of the layer; linear: projections and MLP over C tokens; quadratic:
attention over C x C); the result is decided once (broadcast) so every rank predicts
the same. units(c) = s x b x t(c) / t_plain: a plain layer is s x b, the tokens it
processes. Timed after training has run (not at start): before the first iteration
the heap is cold and big blocks pay page faults that training does not (measured:
a capacity-1 block 33 ms at start, 21-22 ms after 2 iterations and in the profile).
The scratch layers run in the run's precision (megatron.scratch); if the calibration
raises, the same form comes from matmul FLOPs (`WorkModel.from_flops`, source "flops")
and the event says why (`detail.fallbacks`, see dynamism.base).

Skipped tokens do not shrink a routed block's parameters, gradients or optimizer state
("shadow" memory): the profiler reports them unchanged beside the reduced time and
activation bytes, and the balancer sees both.
"""
from __future__ import annotations

import logging
import statistics
from dataclasses import asdict, dataclass
from typing import Optional

import numpy as np

from dynmo_plugin.config import ConfigError
from dynmo_plugin.scenarios.base import DynamismEvent, Runtime, Scenario, current_loss_scale
from dynmo_plugin.scenarios.flops import FLOP_FALLBACK, DecoderFlops

__all__ = ["MixtureOfDepths", "WorkModel", "CapacitySchedule", "parse_capacities",
           "routed_layers", "predictor_summary", "CALIBRATION_CAPACITIES"]

logger = logging.getLogger(__name__)

CALIBRATION_CAPACITIES = (1.0, 0.75, 0.5, 0.25, 0.125)
_CALIBRATION_REPEATS = 5


def routed_layers(num_layers: int, every: int) -> list[int]:
    """Global numbers of the routed layers: every, 2*every, ... (1-based)."""
    return [n for n in range(1, num_layers + 1) if n % every == 0]


def parse_capacities(text: str, routed: list[int], where: str = "dynamism.mod.capacity_per_layer"
                     ) -> dict[int, float]:
    """'2:0.25,4:0.75' -> {2: 0.25, 4: 0.75}; every layer must be routed, every capacity in (0, 1].

    Raises:
        ConfigError: malformed text, a layer that is not routed, a capacity out of range.
    """
    out: dict[int, float] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        try:
            layer_text, cap_text = item.split(":")
            layer, cap = int(layer_text), float(cap_text)
        except ValueError as e:
            raise ConfigError(f"{where}: expected 'layer:capacity,...' (e.g. '2:0.25,4:0.75'), "
                              f"got {item!r}") from e
        if layer not in routed:
            raise ConfigError(f"{where}: layer {layer} is not routed (routed layers: {routed}; "
                              "see dynamism.mod.every)")
        if not 0 < cap <= 1:
            raise ConfigError(f"{where}: capacity of layer {layer} must be in (0, 1], got {cap}")
        if layer in out:
            raise ConfigError(f"{where}: layer {layer} given twice")
        out[layer] = cap
    return out


@dataclass(frozen=True)
class CapacitySchedule:
    """Per-layer capacities over training (pure; see the module docstring)."""

    initial: dict            # {routed layer: capacity before any change}
    scheduled: tuple         # routed layers that follow the schedule (no override)
    final: float             # 0: constant
    start: int
    interval: int
    rounds: int

    @classmethod
    def from_config(cls, mod, num_layers: int) -> "CapacitySchedule":
        """Raises:
            ConfigError: no routed layer, a bad override, a capacity of 0."""
        routed = routed_layers(num_layers, mod.every)
        if not routed:
            raise ConfigError(f"dynamism.mod.every: {mod.every} routes no layer of {num_layers}")
        if mod.capacity <= 0:
            raise ConfigError("dynamism.mod.capacity: must be in (0, 1], got 0")
        overrides = parse_capacities(mod.capacity_per_layer, routed)
        initial = {n: overrides.get(n, mod.capacity) for n in routed}
        return cls(initial, tuple(n for n in routed if n not in overrides), mod.final_capacity,
                   mod.start, mod.interval, mod.rounds)

    @property
    def constant(self) -> bool:
        return self.final == 0

    def event_index(self, iteration: int) -> Optional[int]:
        """k (1..rounds) if iteration is the k-th event iteration, else None."""
        if iteration < self.start or (iteration - self.start) % self.interval:
            return None
        k = (iteration - self.start) // self.interval + 1
        return k if k <= self.rounds else None

    def capacities(self, changes: int) -> dict[int, float]:
        """{routed layer: capacity} after `changes` schedule changes."""
        if self.constant:
            return dict(self.initial)
        frac = min(changes, self.rounds) / self.rounds
        return {n: round(c + (self.final - c) * frac, 9) if n in self.scheduled else c
                for n, c in self.initial.items()}


@dataclass(frozen=True)
class WorkModel:
    """Seconds per micro-batch (fwd+bwd) of a layer: a routed layer at capacity c costs
    fixed + linear*c + quadratic*c^2 (fitted), a plain layer plain_s (timed)."""

    fixed_s: float
    linear_s: float
    quadratic_s: float
    plain_s: float
    seq_length: int
    micro_batch_size: int
    source: str = "timed"  # or "flops": the fallback when the calibration failed

    @classmethod
    def from_flops(cls, flops, predictor_width: int, seq_length: int,
                   micro_batch_size: int) -> "WorkModel":
        """The same form from matmul FLOPs (dynamism.flops): fixed = router and predictor
        over all s tokens, linear = projections and MLP over C tokens, quadratic =
        attention of C queries over C keys; a plain layer is the block over all s."""
        s, h, p = seq_length, flops.hidden, predictor_width
        tokens = s * micro_batch_size
        fixed = tokens * (2 * h + 2 * (h * p + p))
        return cls(flops.seconds(fixed), flops.seconds(tokens * flops.linear()),
                   flops.seconds(tokens * flops.attention(s)),
                   flops.seconds(tokens * (flops.linear() + flops.attention(s))),
                   seq_length, micro_batch_size, source="flops")

    @classmethod
    def fit(cls, samples: list[tuple[float, float]], plain_s: float, seq_length: int,
            micro_batch_size: int) -> "WorkModel":
        """Least squares over (capacity, seconds) samples, coefficients kept >= 0 (a
        negative one, which only noise can make, is dropped and the rest refitted)."""
        caps = np.array([c for c, _ in samples], dtype=float)
        secs = np.array([t for _, t in samples], dtype=float)
        columns = [np.ones_like(caps), caps, caps ** 2]
        active = [0, 1, 2]
        coef = np.zeros(3)
        while active:
            a = np.stack([columns[i] for i in active], axis=1)
            sol = np.linalg.lstsq(a, secs, rcond=None)[0]
            if (sol >= 0).all():
                coef[active] = sol
                break
            active = [i for i, v in zip(active, sol) if v >= 0] if (sol > 0).any() else []
        if coef[1] + coef[2] <= 0:  # nothing usable: cost proportional to tokens
            coef = np.array([0.0, max(float(secs.max()), 1e-9), 0.0])
        if plain_s <= 0:  # nothing usable: a plain layer as a routed one at capacity 1
            plain_s = float(coef.sum())
        return cls(float(coef[0]), float(coef[1]), float(coef[2]), float(plain_s), seq_length,
                   micro_batch_size)

    def seconds(self, capacity: Optional[float]) -> float:
        """Predicted seconds per micro-batch; capacity None: a plain (not routed) layer."""
        if capacity is None:
            return self.plain_s
        return self.fixed_s + self.linear_s * capacity + self.quadratic_s * capacity ** 2

    def units(self, capacity: Optional[float]) -> float:
        """Token-equivalents of a plain layer: s x b for a plain layer."""
        return self.seq_length * self.micro_batch_size * self.seconds(capacity) / self.plain_s

    def work(self, num_layers: int, capacities: dict[int, float]) -> dict[int, float]:
        """{every global layer: units} (routed layers at their capacity)."""
        return {n: round(self.units(capacities.get(n)), 3) for n in range(1, num_layers + 1)}

    def to_dict(self) -> dict:
        return asdict(self)


def predictor_summary(per_rank: list[dict]) -> dict[int, dict]:
    """{layer: [tokens, selected, predicted, predicted & selected, right]} from every rank
    -> {layer: accuracy, recall (of the top C), precision, baseline (always 'skip')}.
    Replicas of a layer (DP, TP) are summed."""
    sums: dict[int, list[float]] = {}
    for stats in per_rank:
        for layer, values in stats.items():
            acc = sums.setdefault(layer, [0.0] * 5)
            for i, v in enumerate(values):
                acc[i] += float(v)
    out = {}
    for layer, (tokens, sel, pred, both, right) in sorted(sums.items()):
        out[layer] = {"accuracy": round(right / tokens, 4) if tokens else 0.0,
                      "recall": round(both / sel, 4) if sel else 0.0,
                      "precision": round(both / pred, 4) if pred else 0.0,
                      "baseline": round(1 - sel / tokens, 4) if tokens else 0.0}
    return out


class MixtureOfDepths(Scenario):
    """`dynamism.kind: mixture_of_depths` (settings: `dynamism.mod`, a ModConfig)."""

    name = "mixture_of_depths"

    def __init__(self, config) -> None:
        super().__init__(config)
        self.settings = config.mod
        self.schedule: Optional[CapacitySchedule] = None
        self.work_model: Optional[WorkModel] = None
        self.changes = 0  # schedule changes applied so far
        self._num_layers = 0
        self._collect = False  # count the predictor's hits this iteration (an event's)

    # ---- Scenario interface ---------------------------------------------------------------
    def layer_spec(self, spec, model_args):
        """Raises:
            ConfigError: see CapacitySchedule.from_config."""
        from dynmo_plugin.scenarios.mixture_of_depths.layer import mod_spec
        self._num_layers = model_args.num_layers
        self.schedule = CapacitySchedule.from_config(self.settings, model_args.num_layers)
        return mod_spec(spec, self.schedule.capacities(0), _predictor_width(model_args.hidden_size),
                        self.settings.granularity)

    def attach(self, runtime: Runtime) -> None:
        super().attach(runtime)
        if runtime.control.rank == 0:
            logger.info("mixture of depths: routed layers %s, capacities %s",
                        list(self.schedule.initial), self.schedule.capacities(self.changes))
        self._bind(reset=False)

    def state_dict(self) -> dict:
        return {"changes": self.changes,
                "work_model": self.work_model.to_dict() if self.work_model else None}

    def load_state_dict(self, state: dict) -> None:
        self.changes = int(state.get("changes", 0))
        if state.get("work_model"):
            self.work_model = WorkModel(**state["work_model"])
        self._apply_capacities()  # the checkpoint's buffers hold these already

    def before_step(self, iteration: int) -> None:
        self._collect = self.schedule.event_index(iteration) is not None
        self._bind(reset=True)

    def after_layout_change(self) -> None:
        self._bind(reset=False)  # layers received in a migration start without a context

    def after_step(self, iteration: int) -> Optional[DynamismEvent]:
        return self.with_fallbacks(iteration, self._event(iteration))

    def _event(self, iteration: int) -> Optional[DynamismEvent]:
        k = self.schedule.event_index(iteration)
        if k is None:
            return None
        if self.work_model is None:  # once, with the allocator warm from training
            self.work_model = WorkModel(**self.decide_or_fallback(
                self._calibrate, "mod-calibration", self._flop_model, FLOP_FALLBACK))
            if self.runtime.control.rank == 0:
                logger.info("mixture of depths: work model %s", self.work_model)
        predictor = self._predictor_stats()
        before = self.schedule.capacities(self.changes)
        if not self.schedule.constant:
            self.changes = k
            self._apply_capacities()
        capacities = self.schedule.capacities(self.changes)
        tokens = self._tokens(capacities)
        seq = self.runtime.trainer.args.seq_length
        used = {n: round(c / seq, 6) for n, c in tokens.items()}
        detail = {"change": self.changes, "rounds": self.schedule.rounds,
                  "capacity_before": before, "capacity": capacities,
                  "granularity": self.settings.granularity, "tokens_per_sample": tokens,
                  "capacity_used": used, "predictor": predictor,
                  "work_model": self.work_model.to_dict()}
        rebalance = (not self.schedule.constant) or k == 1
        if self.runtime.control.rank == 0:
            logger.info("mixture of depths: iteration %d, capacities %s, predictor accuracy %s",
                        iteration, capacities, {n: p["accuracy"] for n, p in predictor.items()})
        return DynamismEvent(self.name, iteration, detail, rebalance=rebalance,
                             work=self.work_model.work(self._num_layers, used))

    # ---- helpers ------------------------------------------------------------------------------
    def _layers(self):
        return self.runtime.trainer.layers

    def _tokens(self, capacities: dict[int, float]) -> dict[int, int]:
        """{routed layer: tokens per sequence} its block processes at these capacities."""
        from dynmo_plugin.scenarios.mixture_of_depths.layer import tokens_for
        seq, g = self.runtime.trainer.args.seq_length, self.settings.granularity
        return {n: tokens_for(c, seq, g) for n, c in capacities.items()}

    def _bind(self, reset: bool) -> None:
        from dynmo_plugin.scenarios.mixture_of_depths.layer import ModContext
        t = self.runtime.trainer
        loss_scale = current_loss_scale(t)
        context = ModContext(self.settings.predictor_loss_weight, loss_scale / t.num_microbatches,
                             collect_stats=self._collect)
        for layer in self._layers():
            layer.mod_context = context
            if reset:
                layer.reset_mod_stats()

    def _apply_capacities(self) -> None:
        capacities = self.schedule.capacities(self.changes)
        for layer in self._layers():
            if layer.routed:
                layer.set_capacity(capacities[layer.layer_number])

    def _predictor_stats(self) -> dict:
        """The iteration's predictor counts from every rank, summarised once."""
        local = {layer.layer_number: layer.mod_counts() for layer in self._layers()
                 if layer.routed}
        gathered = self.runtime.control.all_gather(local, "mod-predictor-stats")
        return self.decide_or_fallback(lambda: predictor_summary(gathered), "mod-predictor",
                                       dict, "no predictor statistics for this event")

    def _calibrate(self) -> dict:
        """Rank 0: time scratch layers (plain, routed at CALIBRATION_CAPACITIES), fit."""
        from dynmo_plugin.scenarios.mixture_of_depths.layer import time_scratch_layers
        from dynmo_plugin.profiling.clock import clock_for
        self.inject_fault("mod-calibration")
        t = self.runtime.trainer
        samples = time_scratch_layers(t, clock_for(t.dims.device), CALIBRATION_CAPACITIES,
                                      _CALIBRATION_REPEATS)
        medians = {c: statistics.median(secs) for c, secs in samples.items()}
        plain = medians.pop(None)
        s, g = t.args.seq_length, self.settings.granularity
        from dynmo_plugin.scenarios.mixture_of_depths.layer import tokens_for
        used = [(tokens_for(c, s, g) / s, v) for c, v in medians.items()]  # what ran
        model = WorkModel.fit(used, plain, s, t.args.micro_batch_size)
        logger.info("mixture of depths: calibration ms: plain %.2f, routed by capacity %s",
                    plain * 1e3, {c: round(v * 1e3, 2) for c, v in medians.items()})
        return model.to_dict()

    def _flop_model(self) -> dict:
        """The fallback work model (same on every rank: a function of the config)."""
        t = self.runtime.trainer
        return WorkModel.from_flops(DecoderFlops.from_config(t.config),
                                    _predictor_width(t.config.hidden_size), t.args.seq_length,
                                    t.args.micro_batch_size).to_dict()


def _predictor_width(hidden_size: int) -> int:
    """The auxiliary predictor's hidden width: small next to the block (h/8, at least 8)."""
    return max(8, hidden_size // 8)
