"""A whole training run, static versus DynMo, on a simulated cluster.

The scenario's load is piecewise constant, so the run is cut into segments at its
change points and at rebalance points; each distinct (load, layout) pair is simulated
once. Static keeps Megatron's uniform layout throughout. DynMo re-plans at each
rebalance point (every scenario event by default, or every N iterations: black-box
mode) and pays, once per rebalance, the assumed overheads:

* profiling: `profiling_iterations` iterations run `profiling_slowdown` slower
  (per-layer timers); default 1 iteration, 10%;
* decision: modelled, not measured (`dynmo_plugin.sim.decision`): a per-balancer
  formula in layers and stages, so identical configurations give identical results;
* migration: the stage sending or receiving most state moves it at p2p bandwidth
  (18 bytes/parameter per layer: `Hardware.state_bytes_per_param`).

With repacking, after balancing DynMo tries fewer stages (same data parallelism and
micro-batches) and keeps the smallest count whose predicted iteration time stays within
`repack_tolerance` of the balanced full pipeline and whose memory fits; GPUs in use are
then dp x stages.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from dynmo_plugin.errors import UserError
from dynmo_plugin.layout import Layout
from dynmo_plugin.sim.decision import DecisionTimeModel
from dynmo_plugin.sim.gpt import GPTShape, Hardware, LayerLoad, layer_costs
from dynmo_plugin.sim.iteration import IterationResult
from dynmo_plugin.sim.pipeline import simulate_layout, stage_memory_bytes
from dynmo_plugin.sim.planner import Planner, PlanRequest, make_planner
from dynmo_plugin.sim.scenarios import Scenario

__all__ = ["CampaignConfig", "RunSummary", "RebalanceRecord", "CampaignResult", "run_campaign"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class CampaignConfig:
    """scenario: load trajectory; dp, pp: cluster shape (GPUs = dp * pp);
    num_microbatches: per iteration (default 4 * pp, our reading of the paper's "4
    micro-batches per GPU"); iterations: run length; balancer: name for make_planner;
    rebalance_every: None = at scenario events, else every N iterations; repack: allow
    fewer stages; repack_tolerance: accepted slowdown when repacking; noise_sigma,
    seed: per-op log-normal noise; profiling_*: assumed profiling overhead;
    decision_time: modelled seconds per balancing decision (the balancer's wall clock
    is never charged: it would make identical runs differ)."""

    scenario: Scenario
    dp: int
    pp: int
    num_microbatches: int | None = None
    iterations: int = 10000
    balancer: str = "partition"
    rebalance_every: int | None = None
    repack: bool = False
    repack_tolerance: float = 0.05
    shape: GPTShape | None = None
    hw: Hardware = field(default_factory=Hardware)
    noise_sigma: float = 0.0
    seed: int = 0
    profiling_iterations: int = 1
    profiling_slowdown: float = 0.10
    decision_time: DecisionTimeModel = field(default_factory=DecisionTimeModel)

    def __post_init__(self) -> None:
        L = self.scenario.num_layers
        if self.dp < 1 or self.pp < 1:
            raise UserError(f"need dp >= 1 and pp >= 1, got dp={self.dp}, pp={self.pp}")
        if self.pp > L:
            raise UserError(f"pp ({self.pp}) is larger than the number of layers ({L}); "
                            "every stage needs at least one layer")
        if self.iterations < 1:
            raise UserError(f"iterations must be >= 1, got {self.iterations}")
        if self.rebalance_every is not None and self.rebalance_every < 1:
            raise UserError(f"rebalance_every must be >= 1, got {self.rebalance_every}")
        if self.num_microbatches is None:
            object.__setattr__(self, "num_microbatches", 4 * self.pp)
        if self.num_microbatches < 1:
            raise UserError(f"num_microbatches must be >= 1, got {self.num_microbatches}")
        if self.shape is None:
            object.__setattr__(self, "shape", GPTShape(num_layers=L))
        elif self.shape.num_layers != L:
            raise UserError(f"model has {self.shape.num_layers} layers, scenario {L}")

    @property
    def tokens_per_iteration(self) -> int:
        return self.dp * self.num_microbatches * self.shape.tokens_per_microbatch  # type: ignore[union-attr,operator]


@dataclass(frozen=True)
class RunSummary:
    """One strategy over the whole run. idleness: time-weighted bubble ratio."""

    tokens_per_s: float
    idleness: float
    time_s: float
    overhead_s: dict[str, float]
    gpus_avg: float

    def as_dict(self) -> dict:
        return {"tokens_per_s": self.tokens_per_s, "idleness": self.idleness,
                "time_s": self.time_s, "overhead_s": self.overhead_s, "gpus_avg": self.gpus_avg}


@dataclass(frozen=True)
class RebalanceRecord:
    iteration: int
    layout_before: str
    layout_after: str
    iter_s_before: float
    iter_s_after: float
    overhead_s: dict[str, float]

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class CampaignResult:
    static: RunSummary
    dynmo: RunSummary
    events: list[RebalanceRecord]
    repack: bool

    @property
    def speedup(self) -> float:
        return self.dynmo.tokens_per_s / self.static.tokens_per_s

    def as_dict(self) -> dict:
        out = {"static": self.static.as_dict(), "dynmo": self.dynmo.as_dict(),
               "speedup": self.speedup, "events": [e.as_dict() for e in self.events]}
        if self.repack:
            out["gpus_avg"] = self.dynmo.gpus_avg
        return out


class _Run:
    """Mutable bookkeeping of one campaign (kept private)."""

    def __init__(self, cfg: CampaignConfig, planner: Planner) -> None:
        self.cfg = cfg
        self.planner = planner
        self.shape: GPTShape = cfg.shape  # type: ignore[assignment]
        self._cache: dict[tuple, IterationResult] = {}

    # ---- simulation ---------------------------------------------------------------
    def simulate(self, layout: Layout, point: int, load: LayerLoad) -> IterationResult:
        key = (layout.counts, point)
        if key not in self._cache:
            cfg = self.cfg
            self._cache[key] = simulate_layout(
                layout=layout, costs=layer_costs(self.shape, cfg.hw, load), load=load,
                shape=self.shape, hw=cfg.hw, dp=cfg.dp, num_microbatches=cfg.num_microbatches,
                noise_sigma=cfg.noise_sigma, seed=cfg.seed + point)  # type: ignore[arg-type]
        return self._cache[key]

    # ---- planning -----------------------------------------------------------------
    def request(self, load: LayerLoad, stages: int, current: Layout | None) -> PlanRequest:
        cfg, shape = self.cfg, self.shape
        costs = layer_costs(shape, cfg.hw, load)
        state = shape.layer_params * cfg.hw.state_bytes_per_param
        acts = 34.0 * shape.seq * shape.micro_batch * shape.hidden * min(stages, cfg.num_microbatches)
        emb = shape.vocab * shape.hidden * cfg.hw.state_bytes_per_param
        extras_mem = [0.0] * stages
        extras_mem[0] += emb
        extras_mem[-1] += emb
        return PlanRequest(costs=costs.total_s.tolist(), num_stages=stages,
                           extras_cost=costs.extras_s(stages), num_microbatches=cfg.num_microbatches,  # type: ignore[arg-type]
                           current=current if current is not None and current.num_stages == stages else None,
                           memory=[state + acts] * shape.num_layers, extras_memory=extras_mem,
                           capacity=cfg.hw.memory_bytes, move_bytes=[state] * shape.num_layers)

    def migration_s(self, before: Layout, after: Layout) -> float:
        moved = before.moved_layers(after)
        if not moved:
            return 0.0
        per_layer = self.shape.layer_params * self.cfg.hw.state_bytes_per_param
        traffic: dict[int, float] = {}
        for _, src, dst in moved:
            traffic[src] = traffic.get(src, 0.0) + per_layer
            traffic[dst] = traffic.get(dst, 0.0) + per_layer
        link = self.cfg.hw.p2p
        return max(traffic.values()) / link.bandwidth_Bps + len(moved) * link.latency_s

    def fits(self, layout: Layout) -> bool:
        mem = stage_memory_bytes(layout, self.shape, self.cfg.hw, self.cfg.num_microbatches)  # type: ignore[arg-type]
        return bool(np.all(mem <= self.cfg.hw.memory_bytes))


def _repack(run: _Run, balanced: Layout, point: int, load: LayerLoad) -> tuple[Layout, float]:
    """Fewest stages whose predicted time is within tolerance of the full balanced pipeline."""
    cfg = run.cfg
    limit = run.simulate(balanced, point, load).iteration_s * (1 + cfg.repack_tolerance)
    best, decision = balanced, 0.0
    for q in range(balanced.num_stages - 1, 0, -1):
        try:
            outcome = run.planner(run.request(load, q, None))
        except UserError:  # infeasible on q stages (memory)
            break
        decision += outcome.decision_s
        if not run.fits(outcome.layout) or run.simulate(outcome.layout, point, load).iteration_s > limit:
            break
        best = outcome.layout
    return best, decision


def _rebalance(run: _Run, current: Layout, point: int, load: LayerLoad,
               iteration: int) -> tuple[Layout, RebalanceRecord]:
    cfg = run.cfg
    before = run.simulate(current, point, load)
    outcome = run.planner(run.request(load, cfg.pp, current))
    layout, decision = outcome.layout, outcome.decision_s
    if cfg.repack:
        layout, extra = _repack(run, layout, point, load)
        decision += extra
    after = run.simulate(layout, point, load)
    if after.iteration_s > before.iteration_s and layout.num_stages == current.num_stages:
        layout, after = current, before  # the gate: never apply a plan predicted slower
    overhead = {"profiling": cfg.profiling_iterations * cfg.profiling_slowdown * before.iteration_s,
                "decision": decision, "migration": run.migration_s(current, layout)}
    record = RebalanceRecord(iteration, current.to_megatron(), layout.to_megatron(),
                             before.iteration_s, after.iteration_s, overhead)
    log.debug("rebalance at %d: %s -> %s (%.4f -> %.4f s); decision %.4f s modelled, "
              "%.4f s measured here (not charged)", iteration, record.layout_before,
              record.layout_after, before.iteration_s, after.iteration_s, outcome.decision_s,
              outcome.measured_s)
    return layout, record


def _boundaries(cfg: CampaignConfig) -> tuple[list[int], list[int], set[int]]:
    changes = sorted(p for p in cfg.scenario.change_points(cfg.iterations) if 0 < p < cfg.iterations)
    if cfg.rebalance_every is None:
        rebalance = set(changes)
    else:
        rebalance = set(range(cfg.rebalance_every, cfg.iterations, cfg.rebalance_every))
    cuts = sorted({0, cfg.iterations, *changes, *rebalance})
    return cuts, changes, rebalance


def run_campaign(cfg: CampaignConfig, planner: Planner | None = None) -> CampaignResult:
    """Simulate the run both ways; `planner` defaults to
    `make_planner(cfg.balancer, cfg.decision_time)`."""
    run = _Run(cfg, planner or make_planner(cfg.balancer, cfg.decision_time))
    cuts, changes, rebalance = _boundaries(cfg)
    static_layout = Layout.uniform(cfg.scenario.num_layers, cfg.pp)
    layout = static_layout
    totals = {"static": [0.0, 0.0], "dynmo": [0.0, 0.0]}  # time, busy-weighted idleness
    overhead = {"profiling": 0.0, "decision": 0.0, "migration": 0.0}
    gpu_seconds, events = 0.0, []
    for a, b in zip(cuts, cuts[1:]):
        point = max([0] + [c for c in changes if c <= a])
        load = cfg.scenario.load(a)
        if a in rebalance:
            layout, record = _rebalance(run, layout, point, load, a)
            events.append(record)
            for k, v in record.overhead_s.items():
                overhead[k] += v
        n = b - a
        for name, lay in (("static", static_layout), ("dynmo", layout)):
            r = run.simulate(lay, point, load)
            totals[name][0] += n * r.iteration_s
            totals[name][1] += n * r.iteration_s * r.bubble_ratio
        gpu_seconds += n * run.simulate(layout, point, load).iteration_s * cfg.dp * layout.num_stages
    tokens = cfg.iterations * cfg.tokens_per_iteration
    t_static, t_dyn = totals["static"][0], totals["dynmo"][0] + sum(overhead.values())
    static = RunSummary(tokens / t_static, totals["static"][1] / t_static, t_static,
                        {k: 0.0 for k in overhead}, float(cfg.dp * cfg.pp))
    dynmo = RunSummary(tokens / t_dyn, totals["dynmo"][1] / totals["dynmo"][0], t_dyn, overhead,
                       gpu_seconds / totals["dynmo"][0])
    return CampaignResult(static, dynmo, events, cfg.repack)
