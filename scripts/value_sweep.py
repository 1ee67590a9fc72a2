"""What DynMo is worth over the best static choice: the simulator's value sweep (issue 38;
the table in docs/simulator.md and the README's "Where it pays").

    .venv/bin/python scripts/value_sweep.py [--json] [--quick] [--jobs N]

Six scenarios x layers per stage {2, 4, 8} x pp {8, 24} x cost model {FLOPs
(`a100-flops`), each GPU-measured model (`sim.gpu_curves`: h100-gpu, h200-gpu) where a
GPU produced passed rows}: dp 8, 10,000 iterations, the exact balancer, the live gate
and repack criteria, default scenario parameters. A GPU model that is "not measured"
(or a scheme whose row did not pass) is listed as such: no campaign, no number. Every
campaign is built by `dynmo simulate`'s own parser and `campaign_config`, so a row is
what `dynmo simulate ... --json` prints.

The bar is the best static choice (`sim.best_static`, by tokens/s): the split tuned once
(exact on the initial model), the pipeline sized once (the live repack decision on the
initial model, and the stage counts above it that the ranks split into) and the GPUs
that frees used as data parallelism from the start (P x dp / K replicas, global batch
unchanged); each candidate is simulated over the whole run and the best kept. DynMo
starts from it (`--start-best-static`) with repacking and `repack.freed` = release,
grow and auto (the live `choose_freed`). Columns: best static's configuration and its
tokens/s over Megatron's uniform split; per DynMo variant tokens/s and tokens per
GPU-hour over the best static; the fluid bound's tokens/s over the best static; and the
best static by tokens per GPU-hour (`best_static_per_gpu`: may release GPUs) over the
bar, so a per-GPU gain that a static release already gives is visible.

--quick: FLOPs, pp 8, 2 and 4 layers per stage, freezing and pruning, 3,000 iterations
(a test runs it). --jobs: worker processes (default 2, this machine's cores).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dynmo_plugin.balancing.problem import REL_TOL  # noqa: E402
from dynmo_plugin.cli import build_parser  # noqa: E402
from dynmo_plugin.cli.simulate import campaign_config  # noqa: E402
from dynmo_plugin.sim.campaign import run_variants  # noqa: E402
from dynmo_plugin.sim.gpu_curves import GPU_MODELS, load_model  # noqa: E402

SCENARIOS = ("gradual_pruning", "layer_freezing", "early_exit", "sparse_attention",
             "mixture_of_depths", "moe")
SHORT = {"gradual_pruning": "prune", "layer_freezing": "freeze", "early_exit": "exit",
         "sparse_attention": "sparse", "mixture_of_depths": "mod", "moe": "moe"}
LABEL = {"a100-flops": "FLOP", "h100-gpu": "H100-gpu", "h200-gpu": "H200-gpu"}
FREED = ("release", "grow", "auto")
DP, ITERATIONS, MOONSHOT = 8, 10000, 1.3


def gpu_models() -> dict[str, dict]:
    """Each named GPU model's document (status, measured scenarios, shape)."""
    return {name: load_model(name) for name in GPU_MODELS}


def grid(quick: bool, models: dict[str, dict]) -> tuple[list[tuple], list[str]]:
    """(campaign points in table order, 'not measured' lines). A point: (hardware,
    scenario, layers, pp, iterations, shape flags)."""
    if quick:
        return [("a100-flops", s, lpp * 8, 8, 3000, ()) for s in ("gradual_pruning", "layer_freezing")
                for lpp in (2, 4)], []
    cells = [(s, pp, lpp) for s in SCENARIOS for pp in (8, 24) for lpp in (2, 4, 8)]
    points = [("a100-flops", s, lpp * pp, pp, ITERATIONS, ()) for s, pp, lpp in cells]
    missing = []
    for name, doc in models.items():
        if doc.get("status") != "measured":
            missing.append(f"{LABEL[name]}: not measured ({doc.get('reason', 'no passed gpu_check rows')})")
            continue
        e = doc["shapes"][0]
        flags = ("--hidden", str(e["hidden"]), "--seq-length", str(e["seq"]), "--micro-batch", str(e["micro_batch"]))
        measured = set(doc.get("measured_scenarios", ()))
        missing += [f"{LABEL[name]} {SHORT[s]}: not measured ({doc['refused'].get(s, {}).get('why', 'no row')})"
                    for s in SCENARIOS if s not in measured]
        points += [(name, s, lpp * pp, pp, ITERATIONS, flags) for s, pp, lpp in cells if s in measured]
    return points, missing


def campaign_row(point: tuple) -> dict:
    """One campaign: DynMo from the best static choice, freed ranks released, grown, auto."""
    hw, scenario, layers, pp, iterations, flags = point
    args = build_parser().parse_args(["simulate", "--scenario", scenario, "--layers", str(layers),
                                      "--dp", str(DP), "--pp", str(pp), "--hardware", hw,
                                      "--iterations", str(iterations), *flags])
    cfg, _ = campaign_config(args)
    res = run_variants(cfg, {f: {"repack": True, "start_best_static": True, "freed": f} for f in FREED})
    b = res["release"].baselines
    best, per_gpu, static, fluid = b["best_static"], b["best_static_per_gpu"], b["static"], b["fluid"]
    limit = cfg.repack_criteria.max_slowdown  # type: ignore[union-attr]
    per_h = lambda r: r.tokens_per_gpu_s * 3600  # noqa: E731
    row = {"hw": hw, "scenario": scenario, "layers": layers, "pp": pp, "layers_per_stage": layers // pp,
           "iterations": iterations, "best_static": res["release"].static_choices["best_static"],
           "best_static_per_gpu": res["release"].static_choices["best_static_per_gpu"],
           "best_over_static": best.tokens_per_s / static.tokens_per_s,
           "fluid_over_best": fluid.tokens_per_s / best.tokens_per_s,
           "per_gpu_bar_gpuh_over_best": per_h(per_gpu) / per_h(best),
           "tokens_per_gpu_hour": {"static": per_h(static), "best_static": per_h(best),
                                   "best_static_per_gpu": per_h(per_gpu)}}
    for f in FREED:
        r = res[f]
        repacks = [e for e in r.events if e.applied and e.kind == "repack"]
        row[f"{f}_tokens_s"] = r.dynmo.tokens_per_s / best.tokens_per_s
        row[f"{f}_gpuh"] = per_h(r.dynmo) / per_h(best)
        row[f"{f}_gpuh_over_per_gpu_bar"] = per_h(r.dynmo) / per_h(per_gpu)
        row[f"{f}_gpus_avg"] = r.dynmo.gpus_avg
        row[f"{f}_repacks"] = len(repacks)
        row[f"{f}_grows"] = sum(e.freed.startswith("freed ranks: grow") for e in repacks)
        row[f"{f}_grow_refused"] = sum("do not split" in e.reason or "do not split" in e.freed
                                       for e in r.events if e.kind == "repack")
        row[f"{f}_slower_than_allowed"] = sum(
            e.iter_s_after > limit * e.iter_s_before * (1 + REL_TOL) for e in repacks if e.dp_after
            and not e.freed.startswith("freed ranks: grow"))
        row["tokens_per_gpu_hour"][f] = per_h(r.dynmo)
    return row


COLUMNS = [("best/static tok/s", "best_over_static"),
           ("release tok/s", "release_tokens_s"), ("release tok/GPU-h", "release_gpuh"),
           ("grow tok/s", "grow_tokens_s"), ("grow tok/GPU-h", "grow_gpuh"),
           ("auto tok/s", "auto_tokens_s"), ("auto tok/GPU-h", "auto_gpuh"),
           ("fluid tok/s", "fluid_over_best"), ("static per-GPU bar tok/GPU-h", "per_gpu_bar_gpuh_over_best")]


def _short(desc: str) -> str:
    """'grown_4: 4 stages x dp 16, ...' -> 'grown_4 4x16'."""
    name, rest = desc.split(": ", 1)
    stages, dp = rest.split(" stages x dp ")[0], rest.split(" stages x dp ")[1].split(",")[0]
    return f"{name} {stages}x{dp}"


def _span(rows: list[dict], key: str) -> str:
    values = [r[key] for r in rows]
    return f"{min(values):.2f}-{max(values):.2f}" if values else "-"


def _where(r: dict) -> str:
    return f"{LABEL[r['hw']]} {SHORT[r['scenario']]} {r['layers']}/{r['pp']}"


def moonshot(rows: list[dict]) -> dict:
    """Rows reaching MOONSHOT x tokens per GPU-hour over the best static, else the best
    figure and where (the 'Reading it' notes say what limits it)."""
    cells = [(r[f"{f}_gpuh"], f, r) for r in rows for f in FREED]
    hits = [f"{_where(r)} freed={f}: {v:.2f}x (tokens/s {r[f'{f}_tokens_s']:.2f}x)"
            for v, f, r in sorted(cells, key=lambda c: -c[0]) if v >= MOONSHOT]
    if not cells:
        return {"reached": False, "best": "no campaigns"}
    v, f, r = max(cells, key=lambda c: c[0])
    fair = max(((r2[f"{f2}_gpuh_over_per_gpu_bar"], f2, r2) for r2 in rows for f2 in FREED),
               key=lambda c: c[0])
    return {"reached": bool(hits), "rows": hits,
            "best": f"{_where(r)} freed={f}: {v:.2f}x tokens per GPU-hour, {r[f'{f}_tokens_s']:.2f}x tokens/s",
            "best_over_per_gpu_bar": f"{_where(fair[2])} freed={fair[1]}: {fair[0]:.2f}x"}


def summary(rows: list[dict], missing: list[str]) -> dict:
    """The figures the 'Reading it' notes quote."""
    return {
        "campaigns": len(rows),
        "not_measured": missing,
        "best_over_static": _span(rows, "best_over_static"),
        "best_static_configurations": sorted({_short(r["best_static"]).split(" ")[0] for r in rows}),
        **{f"{f}_tokens_s": _span(rows, f"{f}_tokens_s") for f in FREED},
        **{f"{f}_gpuh": _span(rows, f"{f}_gpuh") for f in FREED},
        "fluid_over_best": _span(rows, "fluid_over_best"),
        "per_gpu_bar_gpuh_over_best": _span(rows, "per_gpu_bar_gpuh_over_best"),
        "repacks": {f: sum(r[f"{f}_repacks"] for r in rows) for f in FREED},
        "grows_applied": {f: sum(r[f"{f}_grows"] for r in rows) for f in FREED},
        "grow_refused_uneven_split": sum(r["grow_grow_refused"] for r in rows),
        "repacks_slower_than_allowed": sum(r[f"{f}_slower_than_allowed"] for r in rows for f in FREED),
        "moonshot": moonshot(rows),
    }


def markdown(rows: list[dict], summ: dict) -> str:
    head = "| hw | scen | L/pp | best static | " + " | ".join(c for c, _ in COLUMNS) + " |"
    lines = [head, "|" + "---|" * (4 + len(COLUMNS))]
    for r in rows:
        cells = [LABEL[r["hw"]], SHORT[r["scenario"]], f"{r['layers']}/{r['pp']}", _short(r["best_static"])]
        lines.append("| " + " | ".join(cells + [f"{r[k]:.2f}" for _, k in COLUMNS]) + " |")
    for k, v in summ.items():
        text = "; ".join(v) if isinstance(v, list) else v
        lines.append(f"- {k}: {text if text != '' else 'none'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--quick", action="store_true", help="a small grid (for a test)")
    p.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    args = p.parse_args(argv)
    if args.jobs < 1:
        p.error(f"--jobs must be >= 1, got {args.jobs}")
    points, missing = grid(args.quick, gpu_models())
    started, load = time.perf_counter(), os.getloadavg()[0]
    if args.jobs == 1:
        rows = [campaign_row(pt) for pt in points]
    else:
        with ProcessPoolExecutor(args.jobs) as pool:
            rows = list(pool.map(campaign_row, points))
    print(f"value_sweep: {len(rows)} campaigns in {time.perf_counter() - started:.0f} s "
          f"(--jobs {args.jobs}, load average {load:.1f} at the start, {os.cpu_count()} CPUs)",
          file=sys.stderr)
    summ = summary(rows, missing)
    print(json.dumps({"rows": rows, "summary": summ}, indent=1) if args.json else markdown(rows, summ))
    return 0


if __name__ == "__main__":
    sys.exit(main())
