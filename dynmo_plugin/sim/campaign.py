"""A whole training run, baselines versus DynMo, on a simulated cluster.

The scenario's load is piecewise constant, so the run is cut into segments at its
change points and at rebalance points; each distinct (load, layout) pair is simulated
once. DynMo decides at each rebalance point (every scenario event by default, or every
N iterations: black-box mode) through the live plugin's decision path
(`planner.decide`: plan -> gate, repack first when enabled) and pays, once per
rebalance point, the assumed overheads:

* profiling: `profiling_iterations` iterations run `profiling_slowdown` slower
  (per-layer timers); default 1 iteration, 10%;
* decision: modelled, not measured (`dynmo_plugin.sim.decision`), so identical
  configurations give identical results;
* migration (when a plan applies): the stage sending or receiving most state moves it
  at p2p bandwidth (18 bytes/parameter per layer: `Hardware.state_bytes_per_param`);
* repack (when one applies): the repack criteria's `rebuild_s`, what the gate assumed.

Baselines (`BASELINES`), each over the same iterations and tokens:
* static: the same dynamism on Megatron's uniform split (what DynMo itself adds);
* static_deepspeed: the same dynamism on DeepSpeed's static 'parameters' split of the
  initial model (imports DeepSpeed: opt-in); "static_best" is the faster of the two;
* static_tuned: the same dynamism on the split `exact` gives the initial model, kept
  for the whole run (what a user setting Megatron's pipeline layout once by hand
  would get: it fixes the output layer's imbalance, not the dynamism's);
* packed_once: the repack decision (`plan_repack` with the campaign's repack criteria,
  default the live ones, priced by the simulated iteration) taken on the initial model
  over Megatron's split, without a gate (nothing moves before training starts), then
  kept: a pipeline made smaller once at the start; when no smaller K qualifies, the
  static_tuned split on all pp stages;
* no_dynamism: the dense model on Megatron's split (no early exit, dense attention);
* fluid: not a baseline but a bound: the same dynamism with every stage holding exactly
  1/pp of the work (layers divisible at will, no overheads); no layer-granular
  balancer on pp stages beats it.
With repacking, GPUs in use are dp x stages; `tokens_per_gpu_s` counts GPU-seconds.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

from dynmo_plugin.balancing import RepackCriteria, plan_repack, solve
from dynmo_plugin.errors import UserError
from dynmo_plugin.layout import Layout
from dynmo_plugin.sim.cost import PipelineCosts
from dynmo_plugin.sim.decision import DecisionTimeModel
from dynmo_plugin.sim.gpt import GPTShape, Hardware, LayerLoad, layer_costs
from dynmo_plugin.sim.iteration import IterationResult, simulate_iteration
from dynmo_plugin.sim.pipeline import simulate_layout
from dynmo_plugin.sim.planner import GateSettings, build_problem, decide, live_repack_criteria
from dynmo_plugin.sim.trajectory import Scenario

__all__ = ["BASELINES", "CampaignConfig", "RunSummary", "RebalanceRecord", "CampaignResult",
           "run_campaign", "run_variants", "VARIANT_FIELDS", "work_share"]

log = logging.getLogger(__name__)
BASELINES = ("static", "static_deepspeed", "static_tuned", "packed_once", "no_dynamism", "fluid")


@dataclass(frozen=True, kw_only=True)
class CampaignConfig:
    """scenario: load trajectory; dp, pp: cluster shape (GPUs = dp * pp);
    num_microbatches: per iteration (default 4 * pp, our reading of the paper's "4
    micro-batches per GPU"); iterations: run length; balancer: a
    `dynmo_plugin.balancing` method (default exact, the live default); rebalance_every:
    None = at scenario events, else every N iterations; repack: also consider fewer
    stages (`plan_repack`); repack_criteria: its criteria (default: the live
    `RepackConfig`'s); gate: the rebalance gate (`planner.GateSettings`); baselines:
    which of `BASELINES` to run besides "static"; noise_sigma, seed: per-op log-normal
    noise; profiling_*: assumed profiling overhead; decision_time: modelled seconds per
    decision (the balancer's wall clock is never charged); start_balanced: DynMo starts
    on the exact split of the initial model (the live `--dynmo-start-balanced-at`; its
    one profiled iteration is charged), else on Megatron's uniform split."""

    scenario: Scenario
    dp: int
    pp: int
    num_microbatches: int | None = None
    iterations: int = 10000
    balancer: str = "exact"
    rebalance_every: int | None = None
    repack: bool = False
    repack_criteria: RepackCriteria | None = None
    gate: GateSettings = field(default_factory=GateSettings)
    baselines: tuple[str, ...] = ("static", "no_dynamism")
    shape: GPTShape | None = None
    hw: Hardware = field(default_factory=Hardware)
    noise_sigma: float = 0.0
    seed: int = 0
    profiling_iterations: int = 1
    profiling_slowdown: float = 0.10
    decision_time: DecisionTimeModel = field(default_factory=DecisionTimeModel)
    start_balanced: bool = False

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
        unknown = sorted(set(self.baselines) - set(BASELINES))
        if unknown:
            raise UserError(f"unknown baseline(s) {unknown}; choose from {', '.join(BASELINES)}")
        self.decision_time.cost_of(self.balancer)  # a balancer without a model fails here
        if self.num_microbatches is None:
            object.__setattr__(self, "num_microbatches", 4 * self.pp)
        if self.num_microbatches < 1:
            raise UserError(f"num_microbatches must be >= 1, got {self.num_microbatches}")
        if self.shape is None:
            object.__setattr__(self, "shape", GPTShape(num_layers=L))
        elif self.shape.num_layers != L:
            raise UserError(f"model has {self.shape.num_layers} layers, scenario {L}")
        if self.repack and self.repack_criteria is None:
            object.__setattr__(self, "repack_criteria", live_repack_criteria())

    @property
    def tokens_per_iteration(self) -> int:
        return self.dp * self.num_microbatches * self.shape.tokens_per_microbatch  # type: ignore[union-attr,operator]


@dataclass(frozen=True)
class RunSummary:
    """One strategy over the whole run. idleness: time-weighted bubble ratio;
    gpus_avg: time-weighted GPUs in use; tokens_per_gpu_s: tokens per GPU-second."""

    tokens_per_s: float
    idleness: float
    time_s: float
    overhead_s: dict[str, float]
    gpus_avg: float

    @property
    def tokens_per_gpu_s(self) -> float:
        return self.tokens_per_s / self.gpus_avg

    def as_dict(self) -> dict:
        return {"tokens_per_s": self.tokens_per_s, "tokens_per_gpu_s": self.tokens_per_gpu_s,
                "idleness": self.idleness, "time_s": self.time_s, "overhead_s": self.overhead_s,
                "gpus_avg": self.gpus_avg}


@dataclass(frozen=True)
class RebalanceRecord:
    """One rebalance point: what the decision path chose and why."""

    iteration: int
    kind: str
    applied: bool
    reason: str
    layout_before: str
    layout_after: str
    iter_s_before: float
    iter_s_after: float
    overhead_s: dict[str, float]

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class CampaignResult:
    """static: the same dynamism on Megatron's split; baselines: every baseline run
    (static included; "static_best" added when static_deepspeed ran)."""

    static: RunSummary
    dynmo: RunSummary
    events: list[RebalanceRecord]
    repack: bool
    baselines: dict[str, RunSummary] = field(default_factory=dict)

    @property
    def speedup(self) -> float:
        return self.dynmo.tokens_per_s / self.static.tokens_per_s

    def speedup_over(self, baseline: str, per_gpu: bool = False) -> float:
        """DynMo's tokens/s (per GPU-second with per_gpu) over `baseline`'s.

        Raises:
            UserError: that baseline was not run.
        """
        if baseline not in self.baselines:
            raise UserError(f"baseline {baseline!r} was not run (ran: {', '.join(self.baselines)}); "
                            "add it to CampaignConfig.baselines")
        base = self.baselines[baseline]
        if per_gpu:
            return self.dynmo.tokens_per_gpu_s / base.tokens_per_gpu_s
        return self.dynmo.tokens_per_s / base.tokens_per_s

    def as_dict(self) -> dict:
        out = {"static": self.static.as_dict(), "dynmo": self.dynmo.as_dict(),
               "speedup": self.speedup,
               "baselines": {k: v.as_dict() for k, v in self.baselines.items()},
               "speedup_over": {k: self.speedup_over(k) for k in self.baselines},
               "events": [e.as_dict() for e in self.events]}
        if self.repack:
            out["gpus_avg"] = self.dynmo.gpus_avg
            out["speedup_per_gpu_over"] = {k: self.speedup_over(k, per_gpu=True) for k in self.baselines}
        return out


class _Run:
    """Mutable bookkeeping of one campaign (kept private)."""

    def __init__(self, cfg: CampaignConfig) -> None:
        self.cfg = cfg
        self.shape: GPTShape = cfg.shape  # type: ignore[assignment]
        self._cache: dict[tuple, IterationResult] = {}

    def simulate(self, layout: Layout, point: int, load: LayerLoad, tag: str = "") -> IterationResult:
        """One iteration of `layout` under `load`, in force from change point `point`;
        cached by (layout, point, tag) (tag: another load at the same point)."""
        key = (layout.counts, point, tag)
        if key not in self._cache:
            cfg = self.cfg
            self._cache[key] = simulate_layout(
                layout=layout, costs=layer_costs(self.shape, cfg.hw, load), load=load,
                shape=self.shape, hw=cfg.hw, dp=cfg.dp, num_microbatches=cfg.num_microbatches,
                noise_sigma=cfg.noise_sigma, seed=cfg.seed + point)  # type: ignore[arg-type]
        return self._cache[key]

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


def _overheads(run: _Run, current: Layout, decision, before: IterationResult) -> dict[str, float]:
    cfg = run.cfg
    out = {"profiling": cfg.profiling_iterations * cfg.profiling_slowdown * before.iteration_s,
           "decision": decision.decision_s, "migration": 0.0, "repack": 0.0}
    if decision.kind == "repack":
        out["migration"] = run.migration_s(current, decision.repack.intermediate_layout())
        out["repack"] = cfg.repack_criteria.rebuild_s  # type: ignore[union-attr]
    elif decision.applied:
        out["migration"] = run.migration_s(current, decision.layout)
    return out


def _rebalance(run: _Run, current: Layout, point: int, load: LayerLoad, iteration: int,
               iterations_left: int) -> tuple[Layout, RebalanceRecord]:
    cfg = run.cfg
    before = run.simulate(current, point, load)
    problem = build_problem(costs=layer_costs(run.shape, cfg.hw, load), load=load, shape=run.shape,
                            hw=cfg.hw, current=current, num_microbatches=cfg.num_microbatches)  # type: ignore[arg-type]
    gate = cfg.gate.config(iterations_left, cfg.hw.p2p.bandwidth_Bps)

    def simulated(_problem, layout: Layout) -> float:  # the repack planner's iteration model
        return run.simulate(layout, point, load).iteration_s

    decision = decide(problem, cfg.balancer, gate, cfg.repack_criteria if cfg.repack else None,
                      cfg.decision_time, simulated)
    after = run.simulate(decision.layout, point, load)
    record = RebalanceRecord(iteration, decision.kind, decision.applied, decision.reason,
                             current.to_megatron(), decision.layout.to_megatron(),
                             before.iteration_s, after.iteration_s,
                             _overheads(run, current, decision, before))
    log.debug("rebalance at %d: %s -> %s (%.4f -> %.4f s): %s", iteration, record.layout_before,
              record.layout_after, before.iteration_s, after.iteration_s, decision.reason)
    return decision.layout, record


def _boundaries(cfg: CampaignConfig) -> tuple[list[int], list[int], set[int]]:
    changes = sorted(p for p in cfg.scenario.change_points(cfg.iterations) if 0 < p < cfg.iterations)
    if cfg.rebalance_every is None:
        rebalance = set(changes)
    else:
        rebalance = set(range(cfg.rebalance_every, cfg.iterations, cfg.rebalance_every))
    cuts = sorted({0, cfg.iterations, *changes, *rebalance})
    return cuts, changes, rebalance


def _segments(cfg: CampaignConfig):
    """(start, end, change point in force, load) of every segment of the run."""
    cuts, changes, _ = _boundaries(cfg)
    for a, b in zip(cuts, cuts[1:]):
        yield a, b, max([0] + [c for c in changes if c <= a]), cfg.scenario.load(a)


_NO_OVERHEAD = {"profiling": 0.0, "decision": 0.0, "migration": 0.0, "repack": 0.0}


def _fixed_summary(cfg: CampaignConfig, time_s: float, idle_s: float, gpus: int) -> RunSummary:
    """A run without DynMo: no overheads, the same GPUs throughout."""
    tokens = cfg.iterations * cfg.tokens_per_iteration
    return RunSummary(tokens / time_s, idle_s / time_s, time_s, dict(_NO_OVERHEAD), float(gpus))


def _fixed_layout_run(run: _Run, layout: Layout, dense: bool = False) -> RunSummary:
    """The run on a layout that never changes (a static baseline)."""
    cfg = run.cfg
    time_s = idle = 0.0
    for a, b, point, load in _segments(cfg):
        if dense:
            load, point = LayerLoad.dense(cfg.scenario.num_layers), 0
        r = run.simulate(layout, point, load, "dense" if dense else "")
        time_s += (b - a) * r.iteration_s
        idle += (b - a) * r.iteration_s * r.bubble_ratio
    return _fixed_summary(cfg, time_s, idle, cfg.dp * layout.num_stages)


def work_share(cfg: CampaignConfig) -> float:
    """Compute the run keeps, as a share of the dense model's (layers + extras, weighted
    by iterations): the bound on any speedup over the dense model at equal balance."""
    shape, kept = cfg.shape, 0.0
    dense = layer_costs(shape, cfg.hw, LayerLoad.dense(cfg.scenario.num_layers))  # type: ignore[arg-type]
    total = dense.total_s.sum() + 3 * (dense.head_fwd_s + dense.embed_fwd_s)
    for a, b, _, load in _segments(cfg):
        c = layer_costs(shape, cfg.hw, load)  # type: ignore[arg-type]
        kept += (b - a) * (c.total_s.sum() + 3 * (c.head_fwd_s + c.embed_fwd_s))
    return kept / (cfg.iterations * total)


def _fluid_run(run: _Run) -> RunSummary:
    """Every stage holds exactly 1/pp of the work (module docstring: the bound)."""
    cfg, shape = run.cfg, run.shape
    time_s = idle = 0.0
    p = cfg.pp
    for a, b, _, load in _segments(cfg):
        c = layer_costs(shape, cfg.hw, load)
        fwd = (c.fwd_s.sum() + c.head_fwd_s + c.embed_fwd_s) / p
        bwd = (c.bwd_s.sum() + 2 * (c.head_fwd_s + c.embed_fwd_s)) / p
        params = (load.trainable.sum() * shape.layer_params + 2 * shape.vocab * shape.hidden) / p
        r = simulate_iteration(PipelineCosts(
            fwd_s=[fwd] * p, bwd_s=[bwd] * p, num_microbatches=cfg.num_microbatches,  # type: ignore[arg-type]
            act_bytes=shape.act_bytes, p2p=cfg.hw.p2p, dp=cfg.dp,
            grad_bytes=[params * cfg.hw.grad_bytes_per_param] * p, dp_link=cfg.hw.dp_link))
        time_s += (b - a) * r.iteration_s
        idle += (b - a) * r.iteration_s * r.bubble_ratio
    return _fixed_summary(cfg, time_s, idle, cfg.dp * p)


def _initial_problem(run: _Run):
    """The balancing problem of the initial model on Megatron's uniform split."""
    cfg = run.cfg
    load = cfg.scenario.load(0)
    uniform = Layout.uniform(cfg.scenario.num_layers, cfg.pp)
    return build_problem(costs=layer_costs(run.shape, cfg.hw, load), load=load, shape=run.shape,
                         hw=cfg.hw, current=uniform, num_microbatches=cfg.num_microbatches)  # type: ignore[arg-type]


def _initial_split(run: _Run, method: str) -> Layout:
    """`method`'s split of the initial model (through `solve`): DeepSpeed's
    'parameters' or the exact split of the initial costs."""
    return solve(_initial_problem(run), method).layout


def _packed_once_layout(run: _Run) -> Layout:
    """The repack decision on the initial model, without a gate (module docstring)."""
    cfg = run.cfg
    load = cfg.scenario.load(0)
    criteria = cfg.repack_criteria or live_repack_criteria()
    plan = plan_repack(_initial_problem(run), criteria,
                       iteration_model=lambda _p, layout: run.simulate(layout, 0, load).iteration_s)
    return plan.layout_after if plan.apply else _initial_split(run, "exact")


def _baselines(run: _Run) -> dict[str, RunSummary]:
    cfg = run.cfg
    uniform = Layout.uniform(cfg.scenario.num_layers, cfg.pp)
    out = {"static": _fixed_layout_run(run, uniform)}
    if "static_deepspeed" in cfg.baselines:
        out["static_deepspeed"] = _fixed_layout_run(run, _initial_split(run, "parameters"))
        out["static_best"] = max(out["static"], out["static_deepspeed"], key=lambda r: r.tokens_per_s)
    if "static_tuned" in cfg.baselines:
        out["static_tuned"] = _fixed_layout_run(run, _initial_split(run, "exact"))
    if "packed_once" in cfg.baselines:
        out["packed_once"] = _fixed_layout_run(run, _packed_once_layout(run))
    if "no_dynamism" in cfg.baselines:
        out["no_dynamism"] = _fixed_layout_run(run, uniform, dense=True)
    if "fluid" in cfg.baselines:
        out["fluid"] = _fluid_run(run)
    return out


def _dynmo_run(run: _Run) -> tuple[RunSummary, list[RebalanceRecord]]:
    cfg = run.cfg
    _, _, rebalance = _boundaries(cfg)
    points = sorted(rebalance) + [cfg.iterations]
    layout = Layout.uniform(cfg.scenario.num_layers, cfg.pp)
    overhead = dict(_NO_OVERHEAD)
    if cfg.start_balanced:
        tuned = _initial_split(run, "exact")
        first = run.simulate(layout, 0, cfg.scenario.load(0))
        overhead["profiling"] += cfg.profiling_iterations * cfg.profiling_slowdown * first.iteration_s
        overhead["migration"] += run.migration_s(layout, tuned)
        layout = tuned
    time_s = idle = gpu_s = 0.0
    events = []
    for a, b, point, load in _segments(cfg):
        if a in rebalance:
            left = min(p for p in points if p > a) - a
            layout, record = _rebalance(run, layout, point, load, a, left)
            events.append(record)
            for k, v in record.overhead_s.items():
                overhead[k] += v
        r = run.simulate(layout, point, load)
        time_s += (b - a) * r.iteration_s
        idle += (b - a) * r.iteration_s * r.bubble_ratio
        gpu_s += (b - a) * r.iteration_s * cfg.dp * layout.num_stages
    total = time_s + sum(overhead.values())
    tokens = cfg.iterations * cfg.tokens_per_iteration
    summary = RunSummary(tokens / total, idle / time_s, total, overhead, gpu_s / time_s)
    return summary, events


def run_campaign(cfg: CampaignConfig) -> CampaignResult:
    """Simulate DynMo and the configured baselines over the whole run."""
    return run_variants(cfg, {"": {}})[""]


# what a variant may change: how DynMo decides, never what an iteration costs
VARIANT_FIELDS = frozenset({"balancer", "repack", "repack_criteria", "gate", "decision_time",
                            "rebalance_every", "profiling_iterations", "profiling_slowdown",
                            "start_balanced"})


def run_variants(cfg: CampaignConfig, variants: dict[str, dict]) -> dict[str, CampaignResult]:
    """Several DynMo variants of one campaign (e.g. by-time and by-parameter balancers),
    sharing its baselines and simulated iterations: `variants` maps a name to
    CampaignConfig overrides among `VARIANT_FIELDS`.

    Raises:
        UserError: an override outside VARIANT_FIELDS (it would change the costs).
    """
    run = _Run(cfg)
    baselines = _baselines(run)
    out = {}
    for name, overrides in variants.items():
        bad = sorted(set(overrides) - VARIANT_FIELDS)
        if bad:
            raise UserError(f"variant {name!r}: {bad} change what an iteration costs; run a "
                            f"separate campaign (a variant may set {', '.join(sorted(VARIANT_FIELDS))})")
        run.cfg = replace(cfg, **overrides)
        dynmo, events = _dynmo_run(run)
        out[name] = CampaignResult(baselines["static"], dynmo, events, run.cfg.repack, baselines)
    return out
