"""Where DynMo pays: the simulator's value sweep (issue 29; the table in docs/simulator.md).

    .venv/bin/python scripts/value_sweep.py [--json] [--quick] [--jobs N]

Six scenarios x layers per stage {1, 2, 4, 8} x pp {8, 24} x cost model {FLOPs
(`a100-flops`), measured H100 curves (`h100`)}: dp 8, 10,000 iterations, the exact
balancer, the live gate and repack criteria, default scenario parameters. Every
campaign is built by `dynmo simulate`'s own parser and `campaign_config`, so a row is
what `dynmo simulate ... --json` prints; DynMo and DynMo with repacking share the
baselines (`run_variants`).

Columns (tokens/s over Megatron's uniform split unless said): DynMo/static,
tuned/static (`static_tuned`: the exact split of the initial model, kept),
DynMo/tuned (DynMo from Megatron's split), DynMo started tuned/tuned (`--start-balanced`,
the live `--dynmo-start-balanced-at`), fluid/static (every stage 1/pp of the work), repack stages on average,
tokens per GPU-hour of repacking over static and over DynMo, the stages of
`packed_once` (the repack decision on the initial model, kept) and its tokens per
GPU-hour over static, repacking over packed-once, repacking's tokens/s over static
(a repack must not cost throughput), and how many applied repacks simulated slower
than max_slowdown allows (must be 0).

--quick: FLOPs, pp 8, 2 and 4 layers per stage, freezing and pruning, 3,000 iterations
(a test runs it). --jobs: worker processes (default 2, this machine's cores).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dynmo_plugin.balancing.problem import REL_TOL  # noqa: E402
from dynmo_plugin.cli import build_parser  # noqa: E402
from dynmo_plugin.cli.simulate import campaign_config  # noqa: E402
from dynmo_plugin.sim.campaign import run_variants  # noqa: E402

SCENARIOS = ("gradual_pruning", "layer_freezing", "early_exit", "sparse_attention",
             "mixture_of_depths", "moe")
SHORT = {"gradual_pruning": "prune", "layer_freezing": "freeze", "early_exit": "exit",
         "sparse_attention": "sparse", "mixture_of_depths": "mod", "moe": "moe"}
HARDWARE = {"a100-flops": "FLOP", "h100": "H100"}
DP, ITERATIONS = 8, 10000


def grid(quick: bool) -> list[tuple[str, str, int, int, int]]:
    """(hardware, scenario, layers, pp, iterations) of every campaign, in table order."""
    if quick:
        return [("a100-flops", s, lpp * 8, 8, 3000) for s in ("gradual_pruning", "layer_freezing") for lpp in (2, 4)]
    return [(hw, s, lpp * pp, pp, ITERATIONS) for hw in HARDWARE for s in SCENARIOS
            for pp in (8, 24) for lpp in (1, 2, 4, 8)]


def campaign_row(point: tuple[str, str, int, int, int]) -> dict:
    """One campaign: DynMo and DynMo with repacking over the CLI's baselines."""
    hw, scenario, layers, pp, iterations = point
    args = build_parser().parse_args(["simulate", "--scenario", scenario, "--layers", str(layers),
                                      "--dp", str(DP), "--pp", str(pp), "--hardware", hw,
                                      "--iterations", str(iterations)])
    cfg, _ = campaign_config(args)
    res = run_variants(cfg, {"dynmo": {}, "start": {"start_balanced": True}, "repack": {"repack": True}})
    dyn, start, rep = res["dynmo"].dynmo, res["start"].dynmo, res["repack"].dynmo
    b = res["dynmo"].baselines
    static, tuned, fluid, packed = b["static"], b["static_tuned"], b["fluid"], b["packed_once"]
    limit = cfg.repack_criteria.max_slowdown  # type: ignore[union-attr]
    repacks = [e for e in res["repack"].events if e.applied and e.kind == "repack"]
    per_h = lambda r: r.tokens_per_gpu_s * 3600  # noqa: E731
    return {
        "hw": hw, "scenario": scenario, "layers": layers, "pp": pp, "layers_per_stage": layers // pp,
        "iterations": iterations,
        "dynmo_over_static": dyn.tokens_per_s / static.tokens_per_s,
        "tuned_over_static": tuned.tokens_per_s / static.tokens_per_s,
        "dynmo_over_tuned": dyn.tokens_per_s / tuned.tokens_per_s,
        "dynmo_started_tuned_over_tuned": start.tokens_per_s / tuned.tokens_per_s,
        "fluid_over_static": fluid.tokens_per_s / static.tokens_per_s,
        "repack_stages_avg": rep.gpus_avg / DP,
        "repack_gpuh_over_static": per_h(rep) / per_h(static),
        "repack_gpuh_over_dynmo": per_h(rep) / per_h(dyn),
        "packed_once_stages": packed.gpus_avg / DP,
        "packed_once_gpuh_over_static": per_h(packed) / per_h(static),
        "repack_gpuh_over_packed_once": per_h(rep) / per_h(packed),
        "repack_tokens_s_over_static": rep.tokens_per_s / static.tokens_per_s,
        "repacks_applied": len(repacks),
        "repacks_slower_than_allowed": sum(e.iter_s_after > limit * e.iter_s_before * (1 + REL_TOL)
                                           for e in repacks),
        "tokens_per_gpu_hour": {"static": per_h(static), "static_tuned": per_h(tuned),
                                "packed_once": per_h(packed), "dynmo": per_h(dyn), "repack": per_h(rep)},
    }


COLUMNS = [("DynMo/static", "dynmo_over_static"), ("tuned/static", "tuned_over_static"),
           ("DynMo/tuned", "dynmo_over_tuned"), ("**DynMo started tuned/tuned**", "dynmo_started_tuned_over_tuned"),
           ("fluid/static", "fluid_over_static"),
           ("repack stages avg", "repack_stages_avg"), ("tok/GPU-h: repack/static", "repack_gpuh_over_static"),
           ("repack/DynMo", "repack_gpuh_over_dynmo"), ("packed-once stages", "packed_once_stages"),
           ("packed-once/static", "packed_once_gpuh_over_static"),
           ("repack/packed-once", "repack_gpuh_over_packed_once"),
           ("repack tok/s / static", "repack_tokens_s_over_static")]


def _cell(key: str, value: float) -> str:
    return f"{value:.0f}" if key == "packed_once_stages" else (
        f"{value:.1f}" if key == "repack_stages_avg" else f"{value:.2f}")


def _span(rows: list[dict], key: str) -> str:
    values = [r[key] for r in rows]
    return f"{min(values):.2f}-{max(values):.2f}" if values else "-"


def summary(rows: list[dict]) -> dict:
    """The figures the 'Reading it' notes quote."""
    at_least_2 = [r for r in rows if r["layers_per_stage"] >= 2]
    pays = [f"{HARDWARE[r['hw']]} {SHORT[r['scenario']]} {r['layers']}/{r['pp']}: "
            f"{r['dynmo_started_tuned_over_tuned']:.2f}" for r in rows
            if r["dynmo_started_tuned_over_tuned"] >= 1.2]
    repack_wins = [f"{HARDWARE[r['hw']]} {SHORT[r['scenario']]} {r['layers']}/{r['pp']}: "
                   f"{r['repack_gpuh_over_packed_once']:.2f}" for r in rows
                   if r["repack_gpuh_over_packed_once"] >= 1.05]
    return {
        "campaigns": len(rows),
        "tuned_over_static_from_2_layers_per_stage": _span(at_least_2, "tuned_over_static"),
        "dynmo_over_tuned": _span(rows, "dynmo_over_tuned"),
        "dynmo_started_tuned_over_tuned": _span(rows, "dynmo_started_tuned_over_tuned"),
        "dynmo_started_tuned_over_tuned_at_least_1.2": pays,
        "packed_once_gpuh_over_static": _span(rows, "packed_once_gpuh_over_static"),
        "repack_over_packed_once_at_least_1.05": repack_wins,
        "repack_tokens_s_over_static": _span(rows, "repack_tokens_s_over_static"),
        "repacks_applied": sum(r["repacks_applied"] for r in rows),
        "repacks_slower_than_allowed": sum(r["repacks_slower_than_allowed"] for r in rows),
    }


def markdown(rows: list[dict], summ: dict) -> str:
    head = "| hw | scen | L/pp | " + " | ".join(c for c, _ in COLUMNS) + " |"
    lines = [head, "|" + "---|" * (3 + len(COLUMNS))]
    for r in rows:
        cells = [HARDWARE[r["hw"]], SHORT[r["scenario"]], f"{r['layers']}/{r['pp']}"]
        lines.append("| " + " | ".join(cells + [_cell(k, r[k]) for _, k in COLUMNS]) + " |")
    lines += ["", *(f"- {k}: {v if not isinstance(v, list) else '; '.join(v) or 'none'}"
                    for k, v in summ.items())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--quick", action="store_true", help="a small grid (for a test)")
    p.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    args = p.parse_args(argv)
    if args.jobs < 1:
        p.error(f"--jobs must be >= 1, got {args.jobs}")
    points = grid(args.quick)
    started = time.perf_counter()
    if args.jobs == 1:
        rows = [campaign_row(pt) for pt in points]
    else:
        with ProcessPoolExecutor(args.jobs) as pool:
            rows = list(pool.map(campaign_row, points))
    print(f"value_sweep: {len(rows)} campaigns in {time.perf_counter() - started:.0f} s",
          file=sys.stderr)
    summ = summary(rows)
    print(json.dumps({"rows": rows, "summary": summ}, indent=1) if args.json else markdown(rows, summ))
    return 0


if __name__ == "__main__":
    sys.exit(main())
