"""A training run replayed by the simulator: `dynmo simulate --from-run RUN_DIR`.

The run's report.json says what happened; the simulator predicts what each stretch of
it should have cost and sets that beside what it measured. From the report:

* the layout in force at every iteration (the initial one, then each applied
  rebalance's `layout_after` from the iteration after its event), the pipeline and
  data-parallel sizes (`world.history`: a repack that grew data parallelism changes
  both), micro-batches per replica (global batch / (micro-batch x dp));
* the freezing schedule as it happened (each `dynamism` event's `frozen_layers`, in
  force from the iteration after it);
* per-layer costs from ONE profile: the last one taken at or before the grow (what the
  run knew when it grew; without a grow, the first). Each layer's forward and backward
  seconds per micro-batch as profiled; a layer frozen at that profile has no measured
  backward, so its dense backward is its forward times the median backward / forward
  of the layers that were training then. A frozen layer costs its forward only
  (freezing is front to back, so nothing before it needs a gradient). The stages'
  extras (embedding on the first stage, output layer + loss on the last) go to the
  first and last stage of every layout, split 1 : 2 into forward and backward;
* the optimizer step from the same profile (`step_s` per stage): elementwise over the
  trainable parameters, so it costs the profile's seconds per trainable gradient byte
  times the gradient bytes a stage trains in the segment (a layer frozen at the
  profile counts its parameter bytes x the training layers' gradient / parameter
  ratio while it still trains), times dp at the profile / dp with the distributed
  optimizer (each replica steps its shard); the simulator runs it after the flush;
* the rest of the step (`rest_s`: the schedule's own host work, data, loss reduction,
  what no layer span holds) as seconds per micro-batch, the mean over the profiled
  stages, added to every stage's micro-batches split 1 : 2 like the extras: on the
  CPU runs this checks most of it is the schedule's work per micro-batch, and it
  stays with the rank, not with the layers;
* the CPU of each rank's other threads (`threads_s`: gloo's transport beside the step),
  the mean over the profiled stages, each the mean of its replicas
  (`PipelineProfile.elementwise_max`): on shared cores they take threads_s x ranks / T
  of them (`_shared_s`), as another process's load does; a device per rank is not
  slowed by them. Not serial work on a stage, which would lengthen the path the last
  stage paces before a grow: cores taken slow the ranks only where they compete for
  cores, most after the grow, when every core is busy (docs/simulator.md, "The ranks'
  other threads").

Each segment (iterations with one layout, one data parallelism and one frozen set) is
one simulated iteration: `sim.iteration` on dedicated devices, and with `cores` given
`sim.shared` (the ranks time-sharing that many CPU cores, replicas splitting them
evenly). Other processes on a shared machine take cores too: given the foreign load
per iteration (cores busy with work not the run's, as scripts/grow_check.py samples
it from /proc), each measured iteration is predicted on the cores they left during it
(`cores` minus theirs, at least MIN_CORES; scripts/validate_sim.py's "loaded" figure)
and the segment's prediction is the median of those, as its measurement is the median
of the iterations' times: like with like, iteration by iteration. Links: the run's configured migration bandwidth (`rebalance.bandwidth_gbps`),
100 us per message on gloo (loopback TCP, scripts/validate_sim.py's assumption).
A report written before the profile held `step_s` and `rest_s` replays without them.

Measured: the median of `time_s - dynmo_s` over the segment's clean iterations: after
the first `warmup`, outside every profiling window, and not an iteration at which an
event happened (a rebalance's migration, a freeze's rebuild). The grow check compares
tokens/s after the grow over before it (the segment ending at the grow, the segment
starting after it): a ratio, so a load that slows both segments alike cancels.
Pure: no torch.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from dynmo_plugin.errors import UserError
from dynmo_plugin.layout import Layout
from dynmo_plugin.sim.cost import Link, PipelineCosts
from dynmo_plugin.sim.from_run import read_run_report
from dynmo_plugin.sim.iteration import simulate_iteration
from dynmo_plugin.sim.shared import shared_iteration_s

__all__ = ["GrowCheck", "RunReplay", "Segment", "WARMUP", "replay_report", "replay_run"]

WARMUP = 2
"""Iterations not measured at the start (allocation, first-touch, the profiler's warm-up)."""
MIN_CORES = 0.1
MAX_CORES = 8192
"""The most `cores` a replay takes: Linux's largest CONFIG_NR_CPUS. A rank uses at most one
core (`sim.shared`), so beyond the run's ranks more cores change nothing."""
EXTRA_FORWARD_SHARE = 1.0 / 3.0
GLOO_LATENCY_S = 1e-4
BISECTION_TOLERANCE = 1e-6
"""Relative width at which `_shared_s` stops: ~25 rounds from a 10x bracket."""


@dataclass(frozen=True)
class Segment:
    """Iterations `first`..`last` with one layout, dp and frozen set: predicted seconds
    per iteration (`predicted_s`: shared cores when the replay has `cores`, else
    dedicated devices; `dedicated_s` always), measured median over `counted`."""

    first: int
    last: int
    cores: float | None
    layout: str
    pp: int
    dp: int
    num_microbatches: int
    frozen: tuple[int, ...]
    tokens_per_iteration: float
    predicted_s: float
    dedicated_s: float
    measured_s: float | None
    counted: tuple[int, ...]

    def tokens_per_s(self, which: str = "predicted") -> float | None:
        s = {"predicted": self.predicted_s, "dedicated": self.dedicated_s,
             "measured": self.measured_s}[which]
        return None if not s else self.tokens_per_iteration / s

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__, frozen=list(self.frozen), counted=list(self.counted),
                    tokens_per_s_predicted=self.tokens_per_s(),
                    tokens_per_s_measured=self.tokens_per_s("measured"))


@dataclass(frozen=True)
class GrowCheck:
    """A repack that grew data parallelism at `iteration`: tokens/s after over before,
    predicted and measured (None when a side has no clean iteration)."""

    iteration: int
    before: Segment
    after: Segment

    def ratio(self, which: str = "predicted") -> float | None:
        a, b = self.after.tokens_per_s(which), self.before.tokens_per_s(which)
        return None if a is None or b is None else a / b

    @property
    def error(self) -> float | None:
        """predicted ratio / measured ratio - 1."""
        p, m = self.ratio(), self.ratio("measured")
        return None if p is None or m is None else p / m - 1.0

    def as_dict(self) -> dict[str, Any]:
        return {"iteration": self.iteration, "before": self.before.as_dict(),
                "after": self.after.as_dict(), "ratio_predicted": self.ratio(),
                "ratio_dedicated": self.ratio("dedicated"), "ratio_measured": self.ratio("measured"),
                "error": self.error}


@dataclass(frozen=True)
class RunReplay:
    run_dir: str
    cores: float | None
    profile_iteration: int
    segments: list[Segment]
    grow: GrowCheck | None
    notes: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"run_dir": self.run_dir, "cores": self.cores, "warmup": WARMUP,
                "profile_iteration": self.profile_iteration,
                "segments": [s.as_dict() for s in self.segments],
                "grow": None if self.grow is None else self.grow.as_dict(), "notes": self.notes}


@dataclass(frozen=True)
class _LayerCosts:
    fwd: dict[int, float]
    bwd_dense: dict[int, float]
    param_bytes: dict[int, float]
    grad_dense: dict[int, float]   # gradient bytes while the layer trains
    embed_s: float
    head_s: float
    embed_grad_bytes: float
    head_grad_bytes: float
    step_per_byte: float           # optimizer step seconds per trainable gradient byte
    rest_per_microbatch: float
    threads_s: float               # per rank and iteration: CPU of its other threads


def _changes(report: dict) -> tuple[list[tuple[int, str]], list[tuple[int, int, int]],
                                     list[tuple[int, tuple[int, ...]]]]:
    """(from iteration, layout), (from iteration, pp, dp), (from iteration, frozen set)."""
    layouts = [(1, report["initial_layout"])]
    frozen: list[tuple[int, tuple[int, ...]]] = [(1, ())]
    for e in report.get("events", []):
        if e.get("kind") == "rebalance" and e.get("applied") and e.get("layout_after"):
            layouts.append((e["iteration"] + 1, e["layout_after"]))
        detail = e.get("detail") or {}
        if e.get("kind") == "dynamism" and "frozen_layers" in detail:
            frozen.append((e["iteration"] + 1, tuple(sorted(int(x) for x in detail["frozen_layers"]))))
    world = report["world"]
    history = world.get("history") or [{"iteration": 0, "pp": world["pp"], "dp": world["dp"]}]
    worlds = [(max(int(h["iteration"]), 0) + 1, int(h["pp"]), int(h["dp"])) for h in history]
    return layouts, worlds, frozen


def _at(changes: list, iteration: int):
    return [c for c in changes if c[0] <= iteration][-1]


def _grow_event(report: dict) -> dict | None:
    for e in report.get("events", []):
        repack = e.get("repack") or {}
        if e.get("applied") and repack.get("applied") and \
                int(repack.get("dp_after") or 0) > int(repack.get("dp_before") or 0):
            return e
    return None


def _profile(report: dict, at: int | None, run_dir: str) -> tuple[int, dict]:
    found = sorted(((int((e.get("window") or [e["iteration"]])[0]), e["profile"])
                    for e in report.get("events", [])
                    if (e.get("profile") or {}).get("layers") and (e.get("profile") or {}).get("stages")),
                   key=lambda x: x[0])
    if not found:
        raise UserError(f"--from-run {run_dir!r}: report.json holds no per-layer profile; train "
                        "with --dynmo and --dynmo-profile-every N (or a dynamism scenario)")
    if at is None:
        return found[0]
    before = [f for f in found if f[0] <= at]
    return before[-1] if before else found[0]


def _layer_costs(profile: dict, frozen_then: tuple[int, ...]) -> _LayerCosts:
    layers = {int(x["layer"]): x for x in profile["layers"]}
    training = [x for i, x in layers.items() if i not in frozen_then and x["fwd_s"] > 0]
    ratio = statistics.median(x["bwd_s"] / x["fwd_s"] for x in training) if training else 2.0
    bwd = {i: (ratio * x["fwd_s"] if i in frozen_then else x["bwd_s"]) for i, x in layers.items()}
    params = {i: float(x.get("param_bytes", 0)) for i, x in layers.items()}
    with_grads = [x for x in training if x.get("grad_bytes") and x.get("param_bytes")]
    grad_ratio = statistics.median(x["grad_bytes"] / x["param_bytes"] for x in with_grads) if with_grads else 1.0
    grads = {i: (grad_ratio * params[i] if i in frozen_then else float(x.get("grad_bytes", 0)))
             for i, x in layers.items()}
    stages = sorted(profile["stages"], key=lambda s: s["stage"])
    embed = 0.0 if len(stages) == 1 else float(stages[0]["extra_s"])
    trained = sum(grads[i] for i in layers if i not in frozen_then) \
        + sum(float(s.get("extra_grad_bytes", 0)) for s in stages)
    step = sum(float(s.get("step_s", 0.0)) for s in stages)
    rest = statistics.fmean(float(s.get("rest_s", 0.0)) / max(int(s.get("num_microbatches") or 1), 1)
                            for s in stages)
    return _LayerCosts(fwd={i: float(x["fwd_s"]) for i, x in layers.items()}, bwd_dense=bwd,
                       param_bytes=params, grad_dense=grads, embed_s=embed,
                       head_s=float(stages[-1]["extra_s"]),
                       embed_grad_bytes=0.0 if len(stages) == 1 else float(stages[0].get("extra_grad_bytes", 0)),
                       head_grad_bytes=float(stages[-1].get("extra_grad_bytes", 0)),
                       step_per_byte=step / trained if trained > 0 else 0.0,
                       rest_per_microbatch=rest,
                       threads_s=statistics.fmean(float(s.get("threads_s", 0.0)) for s in stages))


def _pipeline_costs(c: _LayerCosts, layout: Layout, frozen: tuple[int, ...], dp: int, m: int,
                    act_bytes: float, link: Link, step_scale: float) -> PipelineCosts:
    """The segment's costs; `step_scale`: the step per byte at this dp over the profile's
    (dp at the profile / dp with the distributed optimizer, else 1)."""
    fwd, bwd, grads, steps = [], [], [], []
    last = layout.num_stages - 1
    for s in range(layout.num_stages):
        layers = layout.layers_of(s)
        extra = (c.embed_s if s == 0 else 0.0) + (c.head_s if s == last else 0.0) + c.rest_per_microbatch
        fwd.append(sum(c.fwd[i] for i in layers) + EXTRA_FORWARD_SHARE * extra)
        bwd.append(sum(c.bwd_dense[i] for i in layers if i not in frozen)
                   + (1 - EXTRA_FORWARD_SHARE) * extra)
        grads.append(sum(c.param_bytes[i] for i in layers if i not in frozen)
                     + (c.head_grad_bytes if s == last else 0.0))
        trained = (sum(c.grad_dense[i] for i in layers if i not in frozen)
                   + (c.embed_grad_bytes if s == 0 else 0.0) + (c.head_grad_bytes if s == last else 0.0))
        steps.append(c.step_per_byte * trained * step_scale)
    return PipelineCosts(fwd_s=fwd, bwd_s=bwd, num_microbatches=m, act_bytes=act_bytes, p2p=link,
                         dp=dp, grad_bytes=grads, dp_link=link, tail_s=steps)


def _clean(report: dict) -> set[int]:
    """Iterations at which something other than training ran (module docstring)."""
    out = set(range(1, WARMUP + 1))
    for e in report.get("events", []):
        out.add(int(e["iteration"]))
        if e.get("window"):
            out.update(range(int(e["window"][0]), int(e["window"][1]) + 1))
    return out


def replay_report(report: dict, run_dir: str = "", cores: float | None = None,
                  foreign_cores: Mapping[int, float] | None = None) -> RunReplay:
    """The replay of `report` (a run's report.json as read): module docstring.
    `foreign_cores`: iteration -> cores other processes kept busy during it (needs `cores`).

    Raises:
        UserError: no per-layer profile, an interleaved layout, a report that lacks or
            mangles a field the replay reads, or cores outside (0, MAX_CORES].
    """
    if cores is not None and not 0 < cores <= MAX_CORES:  # NaN fails both
        raise UserError(f"--cores must be a number of CPU cores in (0, {MAX_CORES}], got {cores}; "
                        "for one device per rank omit --cores")
    if foreign_cores is not None and cores is None:
        raise UserError("a foreign load needs the cores it shares (cores=N)")
    try:
        run = _read(report, run_dir)
    except UserError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, ArithmeticError) as e:
        raise UserError(f"--from-run {run_dir!r}: its report lacks or mangles what the replay reads "
                        f"({type(e).__name__}: {e}); pass the report.json a training run wrote") from e
    segments: list[Segment] = []
    for (layout_text, pp, dp, frozen_set), pc, group in run.groups:
        counted = [(it, s) for it, s in group if it not in run.skip]
        dedicated = simulate_iteration(pc).iteration_s
        lefts = [_cores_left(cores, foreign_cores, it) for it, _ in counted or group]
        threads = run.threads_s * pp * dp
        on = {c: _shared_s(pc, c, threads) for c in set(lefts) if c is not None}  # ~25 simulations each
        predicted = statistics.median(dedicated if c is None else on[c] for c in lefts)
        measured = statistics.median(s for _, s in counted) if counted else None
        left = None if cores is None else statistics.fmean(lefts)  # type: ignore[arg-type]
        segments.append(Segment(group[0][0], group[-1][0], left, layout_text, pp, dp,
                                pc.num_microbatches, frozen_set,
                                run.tokens_per_iteration, predicted, dedicated, measured,
                                tuple(it for it, _ in counted)))
    check = None
    if run.grow is not None:
        before = [s for s in segments if s.first <= run.grow <= s.last]
        after = [s for s in segments if s.first == run.grow + 1]
        if before and after:
            check = GrowCheck(run.grow, before[0], after[0])
    return RunReplay(run_dir, cores, run.start, segments, check)


@dataclass(frozen=True)
class _Run:
    """What `replay_report` reads from a report: each segment's iterations (key, its
    simulated costs, (iteration, measured seconds)), the clean iterations' complement,
    the profile's first iteration and the grow's."""

    groups: list[tuple[tuple, PipelineCosts, list[tuple[int, float]]]]
    skip: set[int]
    threads_s: float
    start: int
    grow: int | None
    tokens_per_iteration: float


def _read(report: dict, run_dir: str) -> _Run:
    """The report's fields the replay uses. Raises KeyError, TypeError, ValueError, ... on a
    report that lacks or mangles them (`replay_report` names the run)."""
    layouts, worlds, frozen = _changes(report)
    grow_event = _grow_event(report)
    grow = None if grow_event is None else int(grow_event["iteration"])
    start, profile = _profile(report, grow, run_dir)
    costs = _layer_costs(profile, _at(frozen, start)[1])
    model = report["config"]["model"]
    element = 2 if model.get("bf16") or model.get("fp16") else 4
    act = float(model["seq_length"] * model["micro_batch_size"] * model["hidden_size"] * element)
    gbps = float(((report["config"].get("dynmo") or {}).get("rebalance") or {}).get("bandwidth_gbps", 1.0))
    gloo = report["world"].get("backend") == "gloo"
    link = Link(latency_s=GLOO_LATENCY_S if gloo else 0.0, bandwidth_Bps=gbps * 1e9)
    profile_dp, distributed = _at(worlds, start)[2], bool(model.get("use_distributed_optimizer"))
    rows: list[tuple[tuple, int, float]] = []
    for row in report["iterations"]:
        it = int(row["iteration"])
        _, layout, = _at(layouts, it)
        _, pp, dp = _at(worlds, it)
        key = (layout, pp, dp, _at(frozen, it)[1])
        seconds = float(row["time_s"]) - float(row.get("dynmo_s", 0.0))
        if not math.isfinite(seconds):
            raise ValueError(f"iteration {it}'s time_s - dynmo_s is {seconds}")
        rows.append((key, it, seconds))
    if not all(math.isfinite(x) for x in (act, gbps, model["global_batch_size"] * model["seq_length"])):
        raise ValueError("config.model's sizes or the rebalance bandwidth are not finite")
    groups = []
    for key, group in _group(rows):
        layout_text, pp, dp, _ = key
        layout = Layout.parse(layout_text)
        if layout.interleaved or layout.num_stages != pp:
            raise UserError(f"--from-run {run_dir!r}: layout {layout_text} on pp {pp}: the replay "
                            "models the non-interleaved 1F1B schedule only")
        m = int(model["global_batch_size"]) // (int(model["micro_batch_size"]) * dp)
        if m < 1:
            raise UserError(f"--from-run {run_dir!r}: config.model's global batch "
                            f"{model['global_batch_size']} < micro-batch x dp on dp {dp}: no micro-batch")
        groups.append((key, _pipeline_costs(costs, layout, key[3], dp, m, act, link,
                                            profile_dp / dp if distributed else 1.0), group))
    return _Run(groups, _clean(report), costs.threads_s, start, grow,
                float(model["global_batch_size"] * model["seq_length"]))


def _shared_s(pc: PipelineCosts, cores: float, threads_s: float) -> float:
    """Seconds per iteration T on `cores` shared cores while the ranks' other threads use
    `threads_s` CPU seconds per iteration: they take threads_s / T cores, as another
    process's load does (`_cores_left`), so T = f(max(cores - threads_s / T, MIN_CORES))
    with f = shared_iteration_s. f falls as cores grow, so T - f(...) rises with T: one
    root, bracketed by f(cores) (the threads take nothing) and f(MIN_CORES) (they take
    all), found by bisection. (A fixed-point iteration of T = f(...) oscillates once the
    threads' CPU nears the ranks' own: 1 core, 96 ms of work and 96 ms of threads gave
    107 ms where 192 ms is the answer.)"""
    low = shared_iteration_s(pc, cores)
    if threads_s <= 0 or low <= 0:
        return low
    high = shared_iteration_s(pc, MIN_CORES)
    if high <= low:  # cores <= MIN_CORES: the threads can take none
        return low
    while high - low > BISECTION_TOLERANCE * low:
        mid = (low + high) / 2
        if mid < shared_iteration_s(pc, max(cores - threads_s / mid, MIN_CORES)):
            low = mid
        else:
            high = mid
    return (low + high) / 2


def _cores_left(cores: float | None, foreign: Mapping[int, float] | None, iteration: int) -> float | None:
    if cores is None or foreign is None:
        return cores
    return max(cores - foreign.get(iteration, 0.0), MIN_CORES)


def _group(rows: list[tuple[tuple, int, float]]) -> list[tuple[tuple, list[tuple[int, float]]]]:
    out: list[tuple[tuple, list[tuple[int, float]]]] = []
    for key, it, s in rows:
        if out and out[-1][0] == key:
            out[-1][1].append((it, s))
        else:
            out.append((key, [(it, s)]))
    return out


def replay_run(run_dir: str | Path, cores: float | None = None,
               foreign_cores: Mapping[int, float] | None = None) -> RunReplay:
    """`replay_report` of the run in `run_dir` (its report.json, or its log replayed)."""
    return replay_report(read_run_report(run_dir, "--from-run"), str(run_dir), cores, foreign_cores)
