"""Static vs DynMo on a live dynamism scenario: one invocation, runs interleaved.

    python scripts/bench_e2e.py --config configs/gradual_pruning.yaml [--json] [--repeats R]
                                [-- <launcher flags that override the config>]

Runs the scenario on PP=2 (one rank per core) as: `static` (Megatron's uniform split,
dynamism on, never rebalanced: the `uniform` balancer, whose plan is the split it
already has) and DynMo with each balancer (`exact`, `partition`, `diffusion`,
`parameters`), same seed, repeated R times interleaved, the order rotated by one each
repeat (no balancer always runs first or last), so machine load affects all alike. Measured over the DYNAMIC
PHASE: from the iteration after the first dynamism event (the same iteration in every
run: events depend only on training state) to the end; before it every run trains
the same split (a scenario without events, e.g. the demo, is measured from iteration
2). Per balancer (medians over repeats):
  tokens_per_s     trained tokens / the phase's time, load-robust: n x the MEDIAN
                   iteration's training time (wall time minus the plugin's own) + ALL
                   of the plugin's own time (profiling, decisions, migrations). On a
                   shared 2-core machine a burst of other load slows whichever run is
                   active for a few iterations; the median ignores it, while every
                   second the plugin spends still counts;
  tokens_per_s_sum the plain one: trained tokens / summed iteration wall time;
  speedup          over static: the median over repeats of this run's throughput over
                   the static run of the SAME repeat (paired: load that drifts over
                   minutes cancels), robust throughputs (`speedup_sum`: plain); the
                   table's "of ideal" is (speedup - 1) / (ideal - 1), shown when
                   the ideal gain exceeds 2% (below that it is noise over noise);
  speedup_whole_run  the same over iterations 2..N;
  ideal_speedup    what the exact partition of the SAME run's profiled per-layer costs
                   predicts over the uniform split in that phase (1F1B model, each
                   profile weighted by the iterations it covers until the next);
  overhead_share   the plugin's own time (profiling, decisions, migration) / training time;
  losses_identical the loss trajectory equals static's bit for bit;
  rebalances, layouts  applied rebalances and the layouts they produced.
With --json: exactly one JSON document on stdout, logs on stderr.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _torchrun import ROOT, torchrun  # noqa: E402

from dynmo_plugin.balancing import BalanceProblem, predicted_iteration_s, solve, stage_loads  # noqa: E402
from dynmo_plugin.layout import Layout  # noqa: E402

BALANCERS = ("static", "exact", "partition", "diffusion", "parameters")


def _log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def _run(config: str, balancer: str, extra: list[str], out: Path) -> dict:
    flags = ["-m", "dynmo_plugin.train", "--dynmo", "--dynmo-config", config,
             "--pipeline-model-parallel-size", "2",
             "--dynmo-balancer", "uniform" if balancer == "static" else balancer,
             *extra, "--output", str(out)]
    torchrun(2, flags)
    return json.loads((out / "report.json").read_text())


def _predicted(profile: dict, layout: Layout, microbatches: int) -> float:
    problem = _problem(profile, layout, microbatches)
    return predicted_iteration_s(stage_loads(problem, layout), microbatches)


def _problem(profile: dict, layout: Layout, microbatches: int) -> BalanceProblem:
    return BalanceProblem(costs=[x["fwd_s"] + x["bwd_s"] for x in profile["layers"]],
                          num_stages=layout.num_stages,
                          extras_cost=[s["extra_s"] for s in profile["stages"]],
                          current=layout, num_microbatches=microbatches)


def phase_start(report: dict) -> int:
    """First iteration of the dynamic phase: after the first dynamism event, else 2."""
    events = [e["iteration"] for e in report["events"] if e.get("kind") == "dynamism"]
    return min(events) + 1 if events else 2


def ideal_speedup(report: dict, start: int = 2) -> float | None:
    """Uniform-split time over exact-partition time from iteration `start` on, predicted
    from the run's profiles (each covering the iterations until the next one)."""
    profiles = [(e["iteration"], e["profile"]) for e in report["events"]
                if e.get("profile") and e["iteration"] >= start - 1]
    if not profiles:
        return None
    layers = len(profiles[0][1]["layers"])
    uniform = Layout.uniform(layers, len(profiles[0][1]["stages"]))
    m = profiles[0][1]["stages"][0]["num_microbatches"] or 1
    last = report["iterations"][-1]["iteration"]
    static_s = ideal_s = 0.0
    for k, (it, profile) in enumerate(profiles):
        begin = max(it, start)
        end = profiles[k + 1][0] if k + 1 < len(profiles) else last + 1
        span = max(0, end - begin)
        best = solve(_problem(profile, uniform, m), "exact").layout
        static_s += span * _predicted(profile, uniform, m)
        ideal_s += span * _predicted(profile, best, m)
    return static_s / ideal_s if ideal_s > 0 else None


def _tokens_per_s(report: dict, start: int) -> dict[str, float]:
    """Over iterations >= start: tokens/s (robust and plain; see the module docstring)
    and the plugin's overhead share of the summed wall time."""
    cfg = report["config"]["model"]
    its = [i for i in report["iterations"] if i["iteration"] >= start]
    seconds = sum(i["time_s"] for i in its)
    plugin = sum(i.get("dynmo_s", 0.0) for i in its)
    training = statistics.median(i["time_s"] - i.get("dynmo_s", 0.0) for i in its)
    tokens = cfg["global_batch_size"] * cfg["seq_length"] * len(its)
    return {"robust": tokens / (len(its) * training + plugin), "sum": tokens / seconds,
            "overhead": plugin / seconds}


def summarise(report: dict, start: int) -> dict:
    phase = _tokens_per_s(report, start)
    applied = [e for e in report["events"] if e["kind"] == "rebalance" and e.get("applied")]
    return {"tokens_per_s": phase["robust"], "tokens_per_s_sum": phase["sum"],
            "tokens_per_s_whole_run": _tokens_per_s(report, 2)["robust"],
            "overhead_share": phase["overhead"],
            "ideal_speedup": ideal_speedup(report, start),
            "losses": [i["loss"] for i in report["iterations"]],
            "rebalances": len(applied), "layouts": [e["layout_after"] for e in applied],
            "scenario": report["config"]["dynmo"]["dynamism"]["kind"]}


def _paired(runs: list[dict], static: list[dict], key: str) -> float:
    """Median over repeats of run / static of the same repeat."""
    return statistics.median(x[key] / s[key] for x, s in zip(runs, static))


def bench(config: str, extra: list[str], repeats: int) -> dict:
    runs: dict[str, list[dict]] = {b: [] for b in BALANCERS}
    start = None  # the dynamic phase, from the first (static) run's events
    with tempfile.TemporaryDirectory(prefix="bench_e2e_") as tmp:
        for r in range(repeats):
            for b in BALANCERS[r % len(BALANCERS):] + BALANCERS[:r % len(BALANCERS)]:
                _log(f"bench_e2e: repeat {r + 1}/{repeats}: {b}")
                report = _run(config, b, extra, Path(tmp) / f"{b}{r}")
                start = phase_start(report) if start is None else start
                runs[b].append(summarise(report, start))
    static_tps = statistics.median(x["tokens_per_s"] for x in runs["static"])
    static = runs["static"]
    static_losses = runs["static"][0]["losses"]
    out = []
    for b in BALANCERS:
        xs = runs[b]
        ideals = [x["ideal_speedup"] for x in xs if x["ideal_speedup"] is not None]
        tps = statistics.median(x["tokens_per_s"] for x in xs)
        out.append({"balancer": b, "tokens_per_s": tps, "speedup": _paired(xs, static, "tokens_per_s"),
                    "speedup_sum": _paired(xs, static, "tokens_per_s_sum"),
                    "tokens_per_s_repeats": [x["tokens_per_s"] for x in xs],
                    "speedup_whole_run": _paired(xs, static, "tokens_per_s_whole_run"),
                    "ideal_speedup": statistics.median(ideals) if ideals else None,
                    "overhead_share": statistics.median(x["overhead_share"] for x in xs),
                    "losses_identical": all(x["losses"] == static_losses for x in xs),
                    "rebalances": xs[0]["rebalances"], "layouts": xs[0]["layouts"]})
    noise = [x["tokens_per_s"] / static_tps for x in runs["static"]]
    return {"scenario": runs["static"][0]["scenario"], "config": config, "repeats": repeats,
            "phase_start": start,
            "static_noise": [min(noise), max(noise)], "runs": out}


def _table(result: dict) -> str:
    head = (f"scenario {result['scenario']} ({result['config']}), PP=2, {result['repeats']} repeat(s), "
            f"measured from iteration {result['phase_start']}; "
            f"static tokens/s spread over repeats {result['static_noise'][0]:.3f}-"
            f"{result['static_noise'][1]:.3f}x")
    rows = [f"{'balancer':<11}{'tokens/s':>10}{'speedup':>9}{'ideal':>8}{'of ideal':>10}"
            f"{'overhead':>10}{'losses==':>10}{'moves':>7}{'whole run':>11}{'sum':>9}"]
    for r in result["runs"]:
        ideal = r["ideal_speedup"]
        share = (r["speedup"] - 1) / (ideal - 1) if ideal and ideal > 1.02 else None
        rows.append(f"{r['balancer']:<11}{r['tokens_per_s']:>10.0f}{r['speedup']:>8.3f}x"
                    f"{(f'{ideal:.3f}x' if ideal else '-'):>8}"
                    f"{(f'{100 * share:.0f}%' if share is not None else '-'):>10}"
                    f"{100 * r['overhead_share']:>9.2f}%{str(r['losses_identical']):>10}"
                    f"{r['rebalances']:>7}{r['speedup_whole_run']:>10.3f}x{r['speedup_sum']:>8.3f}x")
    return "\n".join([head, *rows])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="a scenario YAML, e.g. configs/gradual_pruning.yaml")
    parser.add_argument("--repeats", type=int, default=1, help="interleaved repeats (medians)")
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout")
    args = parser.parse_args(own)
    if not (ROOT / args.config).is_file() and not Path(args.config).is_file():
        parser.error(f"--config {args.config}: no such file")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    result = bench(args.config, extra, args.repeats)
    if args.json:
        json.dump(result, sys.stdout)
        sys.stdout.write("\n")
    else:
        print(_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
