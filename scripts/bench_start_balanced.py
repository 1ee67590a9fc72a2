"""A tuned start against Megatron's uniform split, live on CPU (issue 29's closing note).

    python scripts/bench_start_balanced.py [--rounds R] [--start-at N] [--json]
                                           [--config FILE ...] [-- <launcher flags for every run>]

Each config runs under torchrun on PP=2 (gloo, one rank per core) twice per round,
interleaved (uniform, tuned, uniform, tuned, ...; the order flips every round so neither
always runs first):
  uniform  `--dynmo --dynmo-balancer uniform`: Megatron's uniform split, never moved
           (the uniform balancer's plan is the split the run already has);
  tuned    the same plus `--dynmo-start-balanced-at N`: the run profiles iteration N
           (one window) and starts on the exact solver's layout for it (gate off for the
           start: `--dynmo-min-gain 0`); later decisions use the uniform balancer, which
           moves back only where the uniform split is predicted faster.
Both runs use the same seed and data. Measured per run: the median iteration time from
the iteration after the tuned run's start window closed plus `--warmup` to the end (the
same iterations in both), wall time with the plugin's own seconds included; and,
load-robust, the 1F1B iteration predicted from each run's last profile (both runs
profile every 6 iterations: per-layer thread CPU time, one thread per rank) for the
layout it ran ("CPU ratio": uniform / tuned, median and min-max over rounds). Printed per
config: each run's median, the ratio uniform / tuned of the medians over rounds (> 1:
the tuned start is faster), the spread (min-max of the per-round ratios), the layouts (the tuned start's
may differ between rounds: each profiles under the load of its moment),
whether the losses of the rounds agree, and the machine's load average before and after.
With --json: one JSON document on stdout, logs on stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _torchrun import torchrun  # noqa: E402

from dynmo_plugin.balancing import predicted_iteration_s, stage_loads  # noqa: E402
from dynmo_plugin.balancing.profile_problem import problem_from_profile  # noqa: E402
from dynmo_plugin.config import DynmoConfig  # noqa: E402
from dynmo_plugin.layout import Layout  # noqa: E402
from dynmo_plugin.profiling.records import PipelineProfile  # noqa: E402

CONFIGS = ("configs/demo.yaml", "configs/moe.yaml")
# per config: launcher flags that keep a run near a minute on a loaded 2-core machine and
# keep the dynamism out of the start window (MoE routing events from iteration 6)
PROFILE_EVERY = 6  # both runs profile (thread CPU time) every 6 iterations: the load-robust column
SHRINK = {"configs/moe.yaml": ["--train-iters", "20", "--dynmo-moe-start", "6"]}


def _log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def _run(config: str, tuned: bool, start_at: int, extra: list[str], out: Path) -> dict:
    flags = ["-m", "dynmo_plugin.train", "--dynmo", "--dynmo-config", config,
             "--pipeline-model-parallel-size", "2", "--dynmo-balancer", "uniform",
             "--dynmo-rebalance-interval", "0", "--dynmo-profile-every", str(PROFILE_EVERY),
             *SHRINK.get(config, []), *extra]
    if tuned:
        flags += ["--dynmo-start-balanced-at", str(start_at), "--dynmo-min-gain", "0"]
    started = time.perf_counter()
    for attempt in (1, 2):  # a loaded machine sometimes loses a rendezvous: retry once
        try:
            torchrun(2, [*flags, "--output", str(out)])
            break
        except subprocess.CalledProcessError as e:
            tail = "\n".join((e.stderr or "").strip().splitlines()[-5:])
            _log(f"{config} {'tuned' if tuned else 'uniform'} run failed (attempt {attempt}):\n{tail}")
            if attempt == 2:
                raise
    report = json.loads((out / "report.json").read_text())
    report["wall_s"] = time.perf_counter() - started
    return report


def _start_layout(report: dict) -> str:
    """The layout the run trained on after its start (the initial one when none moved)."""
    moved = [e for e in report["events"] if e.get("kind") == "rebalance" and e.get("applied")
             and e.get("trigger") == "start"]
    return moved[0]["layout_after"] if moved else report.get("initial_layout", "uniform")


def _measure(report: dict, first: int) -> float:
    times = [i["time_s"] for i in report["iterations"] if i["iteration"] >= first]
    if not times:
        raise SystemExit(f"no iterations from {first} on: give more --train-iters or a smaller --warmup")
    return statistics.median(times)


def _cpu_model_s(report: dict, first: int) -> float | None:
    """Load-robust: the 1F1B iteration predicted from the run's last profile at or after
    `first` (per-layer thread CPU time, one thread per rank) for the layout it ran."""
    found = [e for e in report["events"] if e["iteration"] >= first
             and (e.get("profile") or {}).get("layers")]
    if not found:
        return None
    event = found[-1]
    profile = PipelineProfile.from_dict(event["profile"])
    layout = Layout.parse(event.get("layout") or event["layout_before"])
    m = max(x.num_microbatches for x in profile.stages) or 1
    problem = problem_from_profile(profile, layout, DynmoConfig(), m)
    return predicted_iteration_s(stage_loads(problem, layout), m)


def bench(config: str, rounds: int, start_at: int, warmup: int, extra: list[str]) -> dict:
    window = 2 if config.endswith("demo.yaml") else 1  # profiling.window of the configs
    first = start_at + window + warmup
    medians: dict[str, list[float]] = {"uniform": [], "tuned": []}
    cpu: dict[str, list[float | None]] = {"uniform": [], "tuned": []}
    layouts: dict[str, list[str]] = {"uniform": [], "tuned": []}
    losses, walls = {"uniform": [], "tuned": []}, []
    with tempfile.TemporaryDirectory(prefix="bench_start_") as tmp:
        for r in range(rounds):
            order = ("uniform", "tuned") if r % 2 == 0 else ("tuned", "uniform")
            for name in order:
                report = _run(config, name == "tuned", start_at, extra, Path(tmp) / f"{name}{r}")
                medians[name].append(_measure(report, first))
                cpu[name].append(_cpu_model_s(report, first))
                layouts[name].append(_start_layout(report))
                losses[name].append([i["loss"] for i in report["iterations"]])
                walls.append(report["wall_s"])
                _log(f"{config} round {r + 1}/{rounds} {name}: median {medians[name][-1] * 1e3:.1f} ms "
                     f"from iteration {first} ({report['wall_s']:.0f} s, layout {layouts[name][-1]})")
    ratios = [u / t for u, t in zip(medians["uniform"], medians["tuned"])]
    cpu_ratios = [u / t for u, t in zip(cpu["uniform"], cpu["tuned"]) if u and t]
    return {"config": config, "measured_from": first, "medians_s": medians, "cpu_model_s": cpu,
            "cpu_ratio": statistics.median(cpu_ratios) if cpu_ratios else None,
            "cpu_ratio_min": min(cpu_ratios, default=None), "cpu_ratio_max": max(cpu_ratios, default=None),
            "ratio": statistics.median(medians["uniform"]) / statistics.median(medians["tuned"]),
            "ratio_min": min(ratios), "ratio_max": max(ratios), "ratios": ratios,
            "layouts": layouts, "run_wall_s_max": max(walls),
            "losses_repeat": all(x == losses[n][0] for n in losses for x in losses[n])}


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _table(results: list[dict], load: tuple, rounds: int) -> str:
    lines = [f"load average before {load[0]:.1f}, after {load[1]:.1f} (2 cores); {rounds} rounds, "
             "interleaved", f"{'config':<20} {'uniform ms':>11} {'tuned ms':>9} {'ratio':>6} "
             f"{'spread':>13} {'CPU ratio':>9} {'CPU spread':>13}  layouts (uniform -> tuned)"]
    for x in results:
        u, t = (statistics.median(x["medians_s"][n]) * 1e3 for n in ("uniform", "tuned"))
        lines.append(f"{x['config']:<20} {u:>11.1f} {t:>9.1f} {x['ratio']:>6.3f} "
                     f"{x['ratio_min']:>6.3f}-{x['ratio_max']:<6.3f} {_num(x['cpu_ratio']):>9} "
                     f"{_num(x['cpu_ratio_min']):>6}-{_num(x['cpu_ratio_max']):<6}  "
                     f"{', '.join(sorted(set(x['layouts']['uniform'])))} -> "
                     f"{', '.join(sorted(set(x['layouts']['tuned'])))}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="interleaved repeats per config")
    ap.add_argument("--start-at", type=int, default=2, help="--dynmo-start-balanced-at")
    ap.add_argument("--warmup", type=int, default=2, help="iterations after the start window left out")
    ap.add_argument("--config", action="append", help=f"configs (default {', '.join(CONFIGS)})")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if args.rounds < 1 or args.start_at < 1 or args.warmup < 0:
        ap.error("need --rounds >= 1, --start-at >= 1 and --warmup >= 0")
    before = os.getloadavg()[0]
    results = []
    for config in args.config or CONFIGS:
        results.append(bench(config, args.rounds, args.start_at, args.warmup, extra))
        _log(_table(results[-1:], (before, os.getloadavg()[0]), args.rounds))
    load = (before, os.getloadavg()[0])
    if args.json:
        print(json.dumps({"load_average": load, "rounds": args.rounds, "results": results}))
    else:
        print(_table(results, load, args.rounds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
