#!/usr/bin/env python
"""Predicted (simulator) versus measured (real launcher run) iteration time on this CPU.

One source of truth: the launcher's own profiler. Each run is
`torchrun --nproc-per-node P -m dynmo_plugin.train ... --dynmo --dynmo-profile-every E
--dynmo-profile-window K`; its report.json holds both sides of the comparison:

* stage costs (prediction input): the `profile` events' per-layer fwd/bwd medians per
  micro-batch and per-stage extras (embedding, head + loss), in thread CPU time, one
  thread per rank. Medians over the run's profile events (those after warm-up).
* measured iteration: `time_s - dynmo_s` (the training step, controller share removed)
  of the iterations outside profiling windows and after warm-up; median.

Not profiled by the launcher and measured here instead: the optimizer step (Megatron's
fallback optimizer on CPU is `torch.optim.AdamW`), timed in this process with
`time.thread_time` on one fp32 tensor per layer (plus one for the stage's extras) of
the sizes the profile reports. It is the per-rank tail after the pipeline flush.

Two predictions from the same costs:

* dedicated: `dynmo_plugin.sim.simulate_iteration`, one device per stage;
* shared: the same Megatron 1F1B orders and dependencies, but the P ranks run on C
  cores under processor sharing (each runnable rank progresses at min(1, C / runnable)
  CPU-seconds per second; a rank blocked on a neighbour uses no CPU; the OS scheduler's
  fair share, idealised: no context-switch or cache cost). With P <= C it equals the
  dedicated prediction.

Stage cost per micro-batch (--costs): `timers` (default) = the schedule's own
forward/backward compute timers (compute_s / m, split fwd:bwd in the ratio of the
stage's layers) -- exactly the ops the simulator schedules; `layers` = sum of the
per-layer hook medians + extras (what the balancer sees; a few % below the timers,
which also hold the forward-step glue and the loss function).

The measured wall time also holds other sessions' load on this shared machine; the
script prints the load average before and after each run, waits (bounded) until the
1-minute load is below --max-load or no other process has a runnable thread, samples
other processes' runnable threads during the run, and can repeat runs (--repeats) to
take medians. Per stage it also prints the CPU time the layer costs predict against
the compute timers, the predicted blocked time against the measured p2p wait
(wait_s), and what the step spends outside both ("rest").

Live scenarios (`--scenarios CONFIG ...`): each scenario YAML runs twice on PP=2 as
scripts/bench_e2e.py runs it, static (the `uniform` balancer: dynamism on, split never
changed) and DynMo (`exact`). Measured speedup: bench_e2e's load-robust tokens/s of the
dynamic phase (after the first dynamism event), DynMo over static. Predicted speedup:
the simulator replays the phase from the DynMo run's own per-layer profiles (each
covering the iterations until the next): every iteration is one simulated 1F1B
iteration of the layout in force (static: the initial split; DynMo: the layout after
each applied rebalance), its stage costs the profiled layers + extras; the plugin's
measured time in the phase is added to DynMo's side, as the measured tokens/s charges
it. So the prediction checks the schedule model and the layouts, not the profiler.

    .venv/bin/python scripts/validate_sim.py                # PP=2 and PP=4, ~2-3 min
    .venv/bin/python scripts/validate_sim.py --pp 2 --repeats 3
    .venv/bin/python scripts/validate_sim.py --pp --scenarios configs/gradual_pruning.yaml
With --json: one JSON document on stdout, the text report on stderr.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dynmo_plugin.cli._output import third_party_output_to_stderr
from dynmo_plugin.layout import Layout
from dynmo_plugin.sim import Link, PipelineCosts, simulate_iteration
from dynmo_plugin.sim.shared import SharedResult, simulate_shared

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _procs import descendants  # noqa: E402

# gloo over loopback TCP on this machine: ~100 us per message, ~1 GB/s (assumed, not
# fitted; at the default shapes one activation is 0.5 MB, ~0.6 ms per transfer).
P2P = Link(latency_s=1e-4, bandwidth_Bps=1e9)


# ---- reading the launcher's report -------------------------------------------------------
@dataclass(frozen=True)
class StageCosts:
    """Per stage, seconds per micro-batch: fwd/bwd as layers + extras (the per-layer hook
    costs the balancer sees), and as the schedule's compute timers (compute_s / m, split
    in the layers' fwd:bwd ratio); plus what the profile measured per iteration."""

    fwd_s: list[float]
    bwd_s: list[float]
    timer_fwd_s: list[float]
    timer_bwd_s: list[float]
    extra_s: list[float]
    param_counts: list[list[int]]   # per stage: one entry per layer, then the extras
    compute_s: list[float]          # measured: schedule compute timers per iteration
    wait_s: list[float]             # measured: p2p recv wall time per iteration
    num_microbatches: int
    profile_events: int
    profiled_step_s: float = float("nan")  # measured step of the profiled iterations


def profile_windows(report: dict, measured_only: bool = False) -> list[tuple[int, int]]:
    """Every profiling window's iterations; `measured_only`: those of windows that gave a
    profile (not the cancelled ones)."""
    return [tuple(e["window"]) for e in report.get("events", [])
            if e.get("kind") == "profile" and (e.get("profile") or not measured_only)]


def measured_steps(report: dict, warmup: int) -> list[float]:
    """Training-step seconds (time_s - dynmo_s) of iterations after warm-up and outside
    every profiling window, a cancelled one included (a window the run ended inside is one
    since DynMo.finish; older reports have no event for it: every iteration from the
    first multiple of `every` past the last window is dropped too)."""
    windows = profile_windows(report)
    every = report.get("config", {}).get("dynmo", {}).get("profiling", {}).get("every", 0)
    last = max((r["iteration"] for r in report["iterations"]), default=0)
    unclosed = last + 1
    if every:
        after = max((hi for _, hi in windows), default=0)
        unclosed = (after // every + 1) * every

    def profiled(i: int) -> bool:
        return i >= unclosed or any(lo <= i <= hi for lo, hi in windows)

    return [r["time_s"] - r.get("dynmo_s", 0.0) for r in report["iterations"]
            if r["iteration"] > warmup and not profiled(r["iteration"])]


def profiled_step_s(report: dict, warmup: int) -> float:
    """Median training-step seconds of the profiled iterations after warm-up (the ones
    whose compute_s and wait_s the profile reports)."""
    measured = profile_windows(report, measured_only=True)
    windows = [w for w in measured if w[0] > warmup] or measured
    steps = [r["time_s"] - r.get("dynmo_s", 0.0) for r in report["iterations"]
             if any(lo <= r["iteration"] <= hi for lo, hi in windows)]
    return float(statistics.median(steps)) if steps else float("nan")


def stage_costs(report: dict, pp: int, warmup: int) -> StageCosts:
    """Medians over the profile events after warm-up (all events if none is)."""
    events = [e for e in report.get("events", []) if e.get("kind") == "profile" and e.get("profile")]
    late = [e for e in events if e["window"][0] > warmup] or events
    if not late:
        raise SystemExit("report.json has no profile events: was the launcher run with "
                         "--dynmo --dynmo-profile-every N?")
    profiles = [e["profile"] for e in late]

    def med(values: list[float]) -> float:
        return float(statistics.median(values))

    layer_ids = sorted({x["layer"] for p in profiles for x in p["layers"]})
    fwd, bwd, extra = [0.0] * pp, [0.0] * pp, [0.0] * pp
    lfwd, lbwd = [0.0] * pp, [0.0] * pp
    params: list[list[int]] = [[] for _ in range(pp)]
    for lid in layer_ids:
        rows = [x for p in profiles for x in p["layers"] if x["layer"] == lid]
        s = rows[-1]["stage"]
        lfwd[s] += med([x["fwd_s"] for x in rows])
        lbwd[s] += med([x["bwd_s"] for x in rows])
        params[s].append(rows[-1]["param_bytes"] // 4)
    compute, wait = [0.0] * pp, [0.0] * pp
    tfwd, tbwd = [0.0] * pp, [0.0] * pp
    m = 0
    for s in range(pp):
        rows = [x for p in profiles for x in p["stages"] if x["stage"] == s]
        extra[s] = med([x["extra_s"] for x in rows])
        compute[s] = med([x["compute_s"] for x in rows])
        wait[s] = med([x["wait_s"] for x in rows])
        m = rows[-1]["num_microbatches"]
        # extra_bytes = params + fp32 grads + two Adam moments: 16 bytes per parameter
        params[s].append(rows[-1]["extra_bytes"] // 16)
        # extra_s is fwd+bwd together: split it in the ratio of the stage's layers
        share = lfwd[s] / (lfwd[s] + lbwd[s]) if lfwd[s] + lbwd[s] > 0 else 1 / 3
        fwd[s] = lfwd[s] + share * extra[s]
        bwd[s] = lbwd[s] + (1 - share) * extra[s]
        tfwd[s], tbwd[s] = share * compute[s] / m, (1 - share) * compute[s] / m
    return StageCosts(fwd, bwd, tfwd, tbwd, extra, params, compute, wait, m, len(late),
                      profiled_step_s(report, warmup))


# ---- the optimizer tail ------------------------------------------------------------------
def optimizer_step_s(param_counts: list[int], repeats: int = 7) -> float:
    """Median thread CPU seconds of one AdamW step over fp32 tensors of these sizes."""
    import torch

    torch.set_num_threads(1)
    params = [torch.nn.Parameter(torch.randn(n)) for n in param_counts if n > 0]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4)
    samples = []
    for _ in range(repeats + 1):  # the first step allocates the moments: dropped
        start = time.thread_time()
        opt.step()
        samples.append(time.thread_time() - start)
    return float(statistics.median(samples[1:]))


# ---- processor sharing: P ranks on C cores: dynmo_plugin.sim.shared ----------------------


# ---- running the launcher ----------------------------------------------------------------
def _is_kernel_thread(proc: Path) -> bool:
    """Kernel threads (kworker, rcu, ...) have an empty command line."""
    try:
        return not (proc / "cmdline").read_bytes()
    except OSError:
        return True


def foreign_runnable(own: set[int]) -> int:
    """Threads in state R of user processes not in `own` (other sessions' work competing
    for the cores; our ranks' gloo threads and kernel threads are excluded)."""
    count = 0
    for d in Path("/proc").glob("[0-9]*"):
        if int(d.name) in own or _is_kernel_thread(d):
            continue
        for task in d.glob("task/*/stat"):
            try:
                state = task.read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            count += state == "R"
    return count


def wait_for_quiet(max_load: float, max_wait_s: float) -> float:
    """Wait, at most `max_wait_s`, until the 1-minute load is at most `max_load` or no
    other process had a runnable thread in 5 of 6 samples over 3 s (the 1-minute
    average lags a minute behind the end of our own previous run)."""
    deadline = time.monotonic() + max_wait_s
    own = {os.getpid()}
    while os.getloadavg()[0] > max_load and time.monotonic() < deadline:
        samples = []
        for _ in range(6):
            samples.append(foreign_runnable(own))
            time.sleep(0.5)
        if sum(x == 0 for x in samples) >= 5:
            break
        time.sleep(min(10.0, max(0.0, deadline - time.monotonic())))
    return os.getloadavg()[0]


def _machine_busy_s() -> float:
    """CPU seconds all cores spent busy since boot (/proc/stat: all but idle, iowait)."""
    fields = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


class ForeignLoad:
    """What other sessions took from the cores while our run went on: mean cores busy
    with work that is neither this script nor its launcher's ranks (machine busy time
    minus our children's and our own CPU time, over the wall time), and the mean count
    of their runnable threads (sampled every 0.5 s)."""

    def __init__(self, launcher_pid: int, period_s: float = 0.5):
        import resource
        import threading
        self._resource = resource
        self.launcher_pid = launcher_pid
        self.samples: list[int] = []
        self._t0, self._busy0, self._ours0 = time.monotonic(), _machine_busy_s(), self._our_cpu()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(period_s,), daemon=True)
        self._thread.start()

    def _our_cpu(self) -> float:
        r = self._resource
        return sum(u.ru_utime + u.ru_stime for u in (r.getrusage(r.RUSAGE_SELF),
                                                     r.getrusage(r.RUSAGE_CHILDREN)))

    def _loop(self, period_s: float) -> None:
        own = {os.getpid()}
        while not self._stop.wait(period_s):
            own |= {self.launcher_pid, *descendants(self.launcher_pid)}
            self.samples.append(foreign_runnable(own))

    def stop(self) -> tuple[float, float]:
        """(mean foreign cores, mean foreign runnable threads); call after the launcher
        was waited for, so its ranks' CPU time is in RUSAGE_CHILDREN."""
        self._stop.set()
        self._thread.join()
        wall = time.monotonic() - self._t0
        foreign = (_machine_busy_s() - self._busy0) - (self._our_cpu() - self._ours0)
        threads = float(np.mean(self.samples)) if self.samples else float("nan")
        return max(0.0, foreign / wall), threads


def run_launcher(a: argparse.Namespace, pp: int, out: str) -> tuple[dict, tuple[float, float]]:
    """One launcher run; returns its report.json and ForeignLoad.stop()'s figures."""
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--nproc-per-node", str(pp), "--master-port", str(a.port + pp),
           "-m", "dynmo_plugin.train",
           "--num-layers", str(a.layers), "--hidden-size", str(a.hidden),
           "--num-attention-heads", str(a.heads), "--seq-length", str(a.seq),
           "--micro-batch-size", str(a.mbs), "--global-batch-size", str(a.gbs),
           "--train-iters", str(a.iters), "--pipeline-model-parallel-size", str(pp),
           "--vocab-size", str(a.vocab), "--output", out,
           "--dynmo", "--dynmo-profile-every", str(a.profile_every),
           "--dynmo-profile-window", str(a.profile_window)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sampler = ForeignLoad(proc.pid)
    _, stderr = proc.communicate()
    foreign = sampler.stop()
    if proc.returncode != 0:
        sys.exit(f"launcher failed ({proc.returncode}): {' '.join(cmd)}\n{stderr[-3000:]}")
    return json.loads((Path(out) / "report.json").read_text()), foreign


@dataclass(frozen=True)
class RunResult:
    load: tuple[float, float]
    foreign: tuple[float, float]  # other sessions during the run: (cores, runnable threads)
    measured_s: float
    samples: int
    costs: StageCosts
    tail_s: list[float]
    dedicated: object        # dynmo_plugin.sim IterationResult
    dedicated_blocked: np.ndarray
    shared: SharedResult
    loaded: SharedResult     # shared on the cores other sessions left (cores - foreign)


def one_run(a: argparse.Namespace, pp: int) -> RunResult:
    before = wait_for_quiet(a.max_load, a.max_wait_s)
    if a.keep:
        report, foreign = run_launcher(a, pp, tempfile.mkdtemp(prefix=f"pp{pp}-", dir=a.keep))
    else:
        with tempfile.TemporaryDirectory() as out:
            report, foreign = run_launcher(a, pp, out)
    after = os.getloadavg()[0]
    steps = measured_steps(report, a.warmup)
    if not steps:
        sys.exit("no iteration outside profiling windows after warm-up: raise --iters")
    sc = stage_costs(report, pp, a.warmup)
    tail = [optimizer_step_s(c) for c in sc.param_counts]
    fwd, bwd = (sc.timer_fwd_s, sc.timer_bwd_s) if a.costs == "timers" else (sc.fwd_s, sc.bwd_s)
    costs = PipelineCosts(fwd_s=fwd, bwd_s=bwd, num_microbatches=sc.num_microbatches,
                          act_bytes=4.0 * a.seq * a.mbs * a.hidden, p2p=P2P, tail_s=tail)
    dedicated = simulate_iteration(costs)
    return RunResult((before, after), foreign, float(statistics.median(steps)), len(steps), sc, tail,
                     dedicated, blocked_before_last_op(dedicated), simulate_shared(costs, a.cores),
                     simulate_shared(costs, max(a.cores - foreign[0], 0.1)))


def blocked_before_last_op(result) -> np.ndarray:
    """Per rank, seconds without compute from the iteration start to its last op's end
    (what the schedule's p2p recv timers see; after its last op a rank waits elsewhere)."""
    return np.array([r[-1].end - sum(o.end - o.start for o in r) for r in result.timeline.ops])


def report_pp(a: argparse.Namespace, pp: int) -> dict:
    runs = [one_run(a, pp) for _ in range(a.repeats)]
    r = runs[-1]
    sc, m = r.costs, r.costs.num_microbatches
    print(f"\n== PP={pp}: {a.layers} layers, hidden {a.hidden}, seq {a.seq}, mbs {a.mbs}, {m} "
          f"micro-batches, {pp} ranks on {a.cores} cores; {a.repeats} run(s), last shown ==")
    print(f"stage costs ({a.costs}) from {sc.profile_events} profile event(s) of the run "
          "(thread CPU time); optimizer step timed here (AdamW)")
    print(" stage   fwd/mb   bwd/mb  extra/mb  optim |  CPU/iter: layers    compute_s     | "
          "blocked/iter: dedicated  shared  wait_s | rest")
    for s in range(pp):
        cpu = m * (sc.fwd_s[s] + sc.bwd_s[s])
        print(f" {s:5d} {sc.fwd_s[s] * 1e3:7.1f}ms {sc.bwd_s[s] * 1e3:7.1f}ms {sc.extra_s[s] * 1e3:7.1f}ms "
              f"{r.tail_s[s] * 1e3:5.1f}ms |  {cpu:8.3f}s {sc.compute_s[s]:8.3f}s ({cpu / sc.compute_s[s] - 1:+.1%}) | "
              f"{r.dedicated_blocked[s]:8.3f}s {r.shared.blocked_s[s]:8.3f}s {sc.wait_s[s]:7.3f}s | "
              f"{sc.profiled_step_s - sc.compute_s[s] - sc.wait_s[s]:6.3f}s")
    print(" rest = measured step of the profiled iterations - compute_s - wait_s: wall time outside "
          "the compute timers and p2p receives (optimizer, gradient/loss all-reduces, sends, "
          "schedule glue; with more ranks than cores also time-sharing of the compute)")
    rows = []
    for i, x in enumerate(runs):
        ded = x.dedicated.iteration_s / x.measured_s - 1
        sh = x.shared.iteration_s / x.measured_s - 1
        ld = x.loaded.iteration_s / x.measured_s - 1
        rows.append({"pp": pp, "measured_s": x.measured_s, "dedicated_s": x.dedicated.iteration_s,
                     "shared_s": x.shared.iteration_s, "loaded_s": x.loaded.iteration_s,
                     "dedicated_err": ded, "shared_err": sh, "loaded_err": ld,
                     "load_before": x.load[0], "load_after": x.load[1], "foreign_cores": x.foreign[0],
                     "foreign_runnable": x.foreign[1],
                     "samples": x.samples})
        print(f" run {i + 1}: measured {x.measured_s:.3f}s (median of {x.samples})  predicted: "
              f"dedicated {x.dedicated.iteration_s:.3f}s ({ded:+.1%}), shared on {a.cores} cores "
              f"{x.shared.iteration_s:.3f}s ({sh:+.1%})  load {x.load[0]:.2f} -> {x.load[1]:.2f}, "
              f"other sessions: {x.foreign[0]:.2f} cores busy, {x.foreign[1]:.1f} runnable threads; "
              f"shared on the {a.cores - x.foreign[0]:.2f} cores left {x.loaded.iteration_s:.3f}s ({ld:+.1%})")
    key = "shared_err" if pp > a.cores else "dedicated_err"
    errs = [row[key] for row in rows]
    label = f"shared ({pp} ranks / {a.cores} cores)" if pp > a.cores else "dedicated"
    print(f" agreement PP={pp} ({label}): median predicted/measured - 1 = "
          f"{statistics.median(errs):+.1%} over {len(errs)} run(s)"
          f"{'  [within 10%]' if abs(statistics.median(errs)) <= 0.10 else '  [MISSES 10%]'}")
    loaded = statistics.median(row["loaded_err"] for row in rows)
    print(f" sharing only the cores other sessions left (measured): median {loaded:+.1%}")
    return {"pp": pp, "runs": rows, "median_err": statistics.median(errs), "compared": label,
            "median_loaded_err": loaded}


# ---- live scenarios: predicted vs measured speedup of DynMo over static ----------------------
def _profile_costs(profile: dict, layout: Layout) -> tuple[list[float], list[float]]:
    """Per stage of `layout`, fwd and bwd seconds per micro-batch: its layers' profiled
    medians plus the stage's extras, split in the ratio of its layers (as `stage_costs`)."""
    layers = {x["layer"]: x for x in profile["layers"]}
    extras = {x["stage"]: x["extra_s"] for x in profile["stages"]}
    fwd, bwd = [], []
    b = layout.boundaries
    for s in range(layout.num_stages):
        f = sum(layers[i]["fwd_s"] for i in range(b[s] + 1, b[s + 1] + 1))
        w = sum(layers[i]["bwd_s"] for i in range(b[s] + 1, b[s + 1] + 1))
        share = f / (f + w) if f + w > 0 else 1 / 3
        fwd.append(f + share * extras.get(s, 0.0))
        bwd.append(w + (1 - share) * extras.get(s, 0.0))
    return fwd, bwd


def _layouts(report: dict) -> list[tuple[int, Layout]]:
    """(first iteration it is in force, layout): the initial one, then each applied
    rebalance's, from the iteration after its event."""
    out = [(0, Layout.parse(report["initial_layout"]))]
    for e in report["events"]:
        if e.get("kind") == "rebalance" and e.get("applied"):
            out.append((e["iteration"] + 1, Layout.parse(e["layout_after"])))
    return out


def predicted_phase_s(report: dict, start: int, static: bool, a: argparse.Namespace) -> float:
    """Simulated seconds of iterations >= start (module docstring), one per iteration."""
    profiles = sorted(((e["iteration"], e["profile"]) for e in report["events"] if e.get("profile")),
                      key=lambda x: x[0])
    if not profiles:
        raise SystemExit("the DynMo run has no per-layer profile: nothing to predict from")
    layouts = _layouts(report)
    m = profiles[0][1]["stages"][0]["num_microbatches"] or 1
    model = report["config"]["model"]
    act = 4.0 * model["seq_length"] * model["micro_batch_size"] * model["hidden_size"]  # fp32
    cache: dict[tuple, float] = {}
    total = 0.0
    for row in report["iterations"]:
        it = row["iteration"]
        if it < start:
            continue
        k = max([i for i, (p_it, _) in enumerate(profiles) if p_it <= it], default=0)
        layout = layouts[0][1] if static else [lay for first, lay in layouts if first <= it][-1]
        key = (k, layout.counts)
        if key not in cache:
            fwd, bwd = _profile_costs(profiles[k][1], layout)
            costs = PipelineCosts(fwd_s=fwd, bwd_s=bwd, num_microbatches=m, p2p=P2P, act_bytes=act)
            cache[key] = (simulate_iteration(costs).iteration_s if layout.num_stages <= a.cores
                          else simulate_shared(costs, a.cores).iteration_s)
        total += cache[key]
    return total


def scenario_speedup(a: argparse.Namespace, config: str) -> dict:
    """Static and DynMo runs of one scenario YAML: measured vs predicted speedup."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_e2e  # the benchmark's own runs and measurement: one way to measure

    with tempfile.TemporaryDirectory(prefix="validate_sim_") as tmp:
        static = bench_e2e._run(config, "static", [], Path(tmp) / "static")
        dynmo = bench_e2e._run(config, "exact", [], Path(tmp) / "dynmo")
    start = bench_e2e.phase_start(static)
    measured = (bench_e2e.summarise(dynmo, start)["tokens_per_s"]
                / bench_e2e.summarise(static, start)["tokens_per_s"])
    plugin = sum(r.get("dynmo_s", 0.0) for r in dynmo["iterations"] if r["iteration"] >= start)
    static_s = predicted_phase_s(dynmo, start, True, a)
    dynmo_s = predicted_phase_s(dynmo, start, False, a)
    predicted = static_s / (dynmo_s + plugin)
    applied = [e["layout_after"] for e in dynmo["events"] if e.get("kind") == "rebalance" and e.get("applied")]
    row = {"config": config, "scenario": dynmo["config"]["dynmo"]["dynamism"]["kind"],
           "phase_start": start, "measured_speedup": measured, "predicted_speedup": predicted,
           "predicted_compute_only": static_s / dynmo_s, "plugin_s": plugin,
           "error": predicted / measured - 1, "layouts": applied}
    print(f" {row['scenario']:18s} measured {measured:.3f}x  predicted {predicted:.3f}x "
          f"({row['error']:+.1%}; compute only {row['predicted_compute_only']:.3f}x)  layouts {applied}")
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", type=int, nargs="*", default=[2, 4],
                   help="pipeline sizes to check (default 2 4; none: only --scenarios)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--mbs", type=int, default=2)
    p.add_argument("--gbs", type=int, default=16)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--iters", type=int, default=16)
    p.add_argument("--warmup", type=int, default=3, help="iterations dropped (also their profiles)")
    p.add_argument("--profile-every", type=int, default=3,
                   help="a profiled iteration every N: costs sampled between the measured ones")
    p.add_argument("--profile-window", type=int, default=1)
    p.add_argument("--repeats", type=int, default=1, help="runs per PP; medians over runs")
    p.add_argument("--max-load", type=float, default=3.0, help="wait while the 1-min load is above")
    p.add_argument("--max-wait-s", type=float, default=300.0, help="longest wait for a quiet machine")
    p.add_argument("--port", type=int, default=29623)
    p.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    p.add_argument("--costs", choices=("timers", "layers"), default="timers",
                   help="stage cost per micro-batch: the schedule's compute timers (compute_s / m) "
                        "or the sum of the per-layer hook costs + extras")
    p.add_argument("--keep", default=None, metavar="DIR", help="keep each run's report.json under DIR")
    p.add_argument("--scenarios", nargs="*", default=[], metavar="CONFIG",
                   help="scenario YAMLs: predicted vs measured speedup of DynMo over static (PP=2)")
    p.add_argument("--json", action="store_true", help="one JSON document on stdout (text on stderr)")
    a = p.parse_args(argv)
    with third_party_output_to_stderr() if a.json else contextlib.nullcontext():
        print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())} "
              f"(1, 5, 15 min) on {a.cores} cores")
        results = {"pipelines": [report_pp(a, pp) for pp in a.pp]}
        if a.scenarios:
            print("\n== live scenarios, PP=2: DynMo (exact) over static, dynamic phase ==")
            results["scenarios"] = [scenario_speedup(a, c) for c in a.scenarios]
        print(f"\nload average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if a.json:
        print(json.dumps(results, indent=1, allow_nan=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
