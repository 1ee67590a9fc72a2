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
* best_static, best_static_per_gpu: the best static choice (`sim.best_static`): split
  tuned once, pipeline sized once, the freed GPUs as data parallelism from the start,
  best by tokens/s and by tokens per GPU-hour;
* no_dynamism: the dense model on Megatron's split (no early exit, dense attention);
* fluid: not a baseline but a bound: the same dynamism with every stage holding exactly
  1/pp of the work (layers divisible at will, no overheads); no layer-granular
  balancer on pp stages beats it.
With repacking, GPUs in use are dp x stages; `tokens_per_gpu_s` counts GPU-seconds.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

from dynmo_plugin.balancing import InfeasibleError, RepackCriteria, plan_repack, solve
from dynmo_plugin.errors import UserError
from dynmo_plugin.layout import Layout
from dynmo_plugin.balancing.grow import FREED_MODES
from dynmo_plugin.balancing.repack import shrink_problem
from dynmo_plugin.sim.best_static import StaticChoice, pick, static_choices
from dynmo_plugin.sim.cost import PipelineCosts
from dynmo_plugin.sim.decision import DecisionTimeModel
from dynmo_plugin.sim.freed import freed_step
from dynmo_plugin.sim.gpt import GPTShape, Hardware, LayerLoad, layer_costs
from dynmo_plugin.sim.iteration import IterationResult, simulate_iteration
from dynmo_plugin.sim.pipeline import simulate_layout
from dynmo_plugin.sim.planner import GateSettings, build_problem, decide, live_repack_criteria
from dynmo_plugin.sim.trajectory import Scenario

__all__ = ["BASELINES", "CampaignConfig", "RunSummary", "RebalanceRecord", "CampaignResult",
           "run_campaign", "run_variants", "VARIANT_FIELDS", "work_share"]

log = logging.getLogger(__name__)
BASELINES = ("static", "static_deepspeed", "static_tuned", "packed_once", "no_dynamism", "fluid",
             "best_static", "best_static_per_gpu")


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
    one profiled iteration is charged), else on Megatron's uniform split;
    start_best_static: DynMo starts on the best static choice by tokens/s (layout and
    data parallelism: configured at launch like the bar itself, nothing charged);
    freed: what the ranks a repack frees do (`balancing.grow.FREED_MODES`, the live
    `repack.freed`; `sim.freed`)."""

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
    start_best_static: bool = False
    freed: str = "release"

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
        if self.freed not in FREED_MODES:
            raise UserError(f"freed must be one of {', '.join(FREED_MODES)}, got {self.freed!r}")
        if self.start_balanced and self.start_best_static:
            raise UserError("start_balanced and start_best_static both set: choose one start")
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
    freed: str = ""
    dp_after: int = 0

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
    static_choices: dict[str, str] = field(default_factory=dict)

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
               "static_choices": dict(self.static_choices),
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
        self.static: dict[str, StaticChoice] | None = None

    def simulate(self, layout: Layout, point: int, load: LayerLoad, tag: str = "",
                 dp: int | None = None, m: int | None = None) -> IterationResult:
        """One iteration of `layout` under `load`, in force from change point `point`, on
        `dp` replicas of `m` micro-batches (default the campaign's); cached by (layout,
        point, tag, dp, m) (tag: another load at the same point)."""
        cfg = self.cfg
        dp, m = dp or cfg.dp, m or cfg.num_microbatches
        key = (layout.counts, point, tag, dp, m)
        if key not in self._cache:
            self._cache[key] = simulate_layout(
                layout=layout, costs=layer_costs(self.shape, cfg.hw, load), load=load,
                shape=self.shape, hw=cfg.hw, dp=dp, num_microbatches=m,  # type: ignore[arg-type]
                noise_sigma=cfg.noise_sigma, seed=cfg.seed + point)
        return self._cache[key]

    def grow_s(self, layout: Layout) -> float:
        """Copying the largest stage's training state to a new replica (`sim.freed`)."""
        most = max(len(layout.rank_layers(r)) for r in range(layout.num_ranks))
        link = self.cfg.hw.p2p
        return most * self.shape.layer_params * self.cfg.hw.state_bytes_per_param / link.bandwidth_Bps + link.latency_s

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
               iterations_left: int, dp: int, m: int) -> tuple[Layout, int, int, RebalanceRecord]:
    """One rebalance point on `dp` replicas of `m` micro-batches: the live decision, then
    (after an applied repack) the live release-or-grow choice (`sim.freed`)."""
    cfg = run.cfg
    before = run.simulate(current, point, load, dp=dp, m=m)
    problem = build_problem(costs=layer_costs(run.shape, cfg.hw, load), load=load, shape=run.shape,
                            hw=cfg.hw, current=current, num_microbatches=m)
    gate = cfg.gate.config(iterations_left, cfg.hw.p2p.bandwidth_Bps)

    def simulated(_problem, layout: Layout) -> float:  # the repack planner's iteration model
        return run.simulate(layout, point, load, dp=dp, m=m).iteration_s

    decision = decide(problem, cfg.balancer, gate, cfg.repack_criteria if cfg.repack else None,
                      cfg.decision_time, simulated)
    overhead = _overheads(run, current, decision, before)
    layout, reason, freed = decision.layout, decision.reason, ""
    applied, new_dp, new_m = decision.applied, dp, m
    if decision.kind == "repack" and decision.applied:
        step = freed_step(
            mode=cfg.freed, objective=cfg.repack_criteria.objective,  # type: ignore[union-attr]
            stages_before=current.num_ranks, layout_after=layout, dp=dp, num_microbatches=m,
            tokens_per_iteration=cfg.tokens_per_iteration,
            iteration_s=lambda d, mb: run.simulate(layout, point, load, dp=d, m=mb).iteration_s)
        freed = step.choice.line()
        if step.refused:  # live: nothing moves, the repack's cost is not paid
            layout, applied, reason = current, False, f"{reason}; {step.choice.reason}"
            overhead = {k: (0.0 if k in ("migration", "repack") else v) for k, v in overhead.items()}
        elif step.grown:
            new_dp, new_m = step.dp, step.num_microbatches
            overhead["migration"] += run.grow_s(layout)
    after = run.simulate(layout, point, load, dp=new_dp, m=new_m)
    record = RebalanceRecord(iteration, decision.kind, applied, reason,
                             current.to_megatron(), layout.to_megatron(),
                             before.iteration_s, after.iteration_s, overhead, freed, new_dp)
    log.debug("rebalance at %d: %s -> %s (%.4f -> %.4f s): %s", iteration, record.layout_before,
              record.layout_after, before.iteration_s, after.iteration_s, reason)
    return layout, new_dp, new_m, record


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


def _fixed_layout_run(run: _Run, layout: Layout, dense: bool = False, dp: int | None = None,
                      m: int | None = None) -> RunSummary:
    """The run on a layout that never changes (a static baseline), on `dp` replicas of
    `m` micro-batches each (default the campaign's)."""
    cfg = run.cfg
    time_s = idle = 0.0
    for a, b, point, load in _segments(cfg):
        if dense:
            load, point = LayerLoad.dense(cfg.scenario.num_layers), 0
        r = run.simulate(layout, point, load, "dense" if dense else "", dp=dp, m=m)
        time_s += (b - a) * r.iteration_s
        idle += (b - a) * r.iteration_s * r.bubble_ratio
    return _fixed_summary(cfg, time_s, idle, (dp or cfg.dp) * layout.num_stages)


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


def _split_at(run: _Run, k: int) -> Layout | None:
    """The exact split of the initial model on k stages (None: no layout fits)."""
    try:
        return solve(shrink_problem(_initial_problem(run), k), "exact").layout
    except InfeasibleError:
        return None


def _static_choices(run: _Run) -> dict[str, StaticChoice]:
    """The best static choice's candidates (`sim.best_static`), simulated once per run."""
    if run.static is None:
        cfg = run.cfg
        run.static = static_choices(
            uniform=Layout.uniform(cfg.scenario.num_layers, cfg.pp), tuned=_initial_split(run, "exact"),
            packed=_packed_once_layout(run), dp=cfg.dp, num_microbatches=cfg.num_microbatches,  # type: ignore[arg-type]
            run_fixed=lambda layout, dp, m: _fixed_layout_run(run, layout, dp=dp, m=m),
            split_at=lambda k: _split_at(run, k))
    return run.static


def _best_static(run: _Run) -> dict[str, StaticChoice]:
    choices = _static_choices(run)
    return {"best_static": pick(choices, "tokens_per_s"),
            "best_static_per_gpu": pick(choices, "tokens_per_gpu_hour")}


def _baselines(run: _Run) -> dict[str, RunSummary]:
    cfg = run.cfg
    uniform = Layout.uniform(cfg.scenario.num_layers, cfg.pp)
    out = {"static": _fixed_layout_run(run, uniform)}
    for name, choice in _best_static(run).items():
        if name in cfg.baselines:
            out[name] = choice.summary
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
    dp, m = cfg.dp, cfg.num_microbatches
    overhead = dict(_NO_OVERHEAD)
    if cfg.start_balanced:
        tuned = _initial_split(run, "exact")
        first = run.simulate(layout, 0, cfg.scenario.load(0))
        overhead["profiling"] += cfg.profiling_iterations * cfg.profiling_slowdown * first.iteration_s
        overhead["migration"] += run.migration_s(layout, tuned)
        layout = tuned
    elif cfg.start_best_static:
        best = _best_static(run)["best_static"]
        layout, dp, m = best.layout, best.dp, best.num_microbatches
    time_s = idle = gpu_s = 0.0
    events = []
    for a, b, point, load in _segments(cfg):
        if a in rebalance:
            left = min(p for p in points if p > a) - a
            layout, dp, m, record = _rebalance(run, layout, point, load, a, left, dp, m)  # type: ignore[arg-type]
            events.append(record)
            for k, v in record.overhead_s.items():
                overhead[k] += v
        r = run.simulate(layout, point, load, dp=dp, m=m)
        time_s += (b - a) * r.iteration_s
        idle += (b - a) * r.iteration_s * r.bubble_ratio
        gpu_s += (b - a) * r.iteration_s * dp * layout.num_stages  # type: ignore[operator]
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
                            "start_balanced", "start_best_static", "freed"})


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
        choices = ({k: c.describe() for k, c in _best_static(run).items()}
                   if run.static is not None else {})
        out[name] = CampaignResult(baselines["static"], dynmo, events, run.cfg.repack, baselines, choices)
    return out
