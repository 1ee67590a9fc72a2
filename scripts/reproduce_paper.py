#!/usr/bin/env python
"""The DynMo paper's figures beside the simulator's, with a checkable cause per gap.

Tables (paper value beside ours, per cost model):
* Figure 3: speedup per scenario and layer count (24/32/40/48) over the paper's own
  baseline for that scenario (`dynmo_plugin.sim.paper`), with the paper's rule (the
  better of the by-parameter and by-time balancers) beside ours (exact, by time), and
  DynMo over the same dynamism on a static split; the fluid bound (layers divisible at
  will) and, with repacking, the speedup per GPU;
* the abstract's headline figures; the overhead table; Figure 4 (repacking: tokens/s
  per GPU and average GPUs used in a 10,000-iteration pruning run on 8 GPUs).
Cost models: a100-flops (FLOPs at 45% of an A100's peak) and h100 (measured curves,
dynmo_plugin/sim/profiles/h100.json). Every DynMo decision goes through the live
plugin's plan -> gate path with its default gate.

    .venv/bin/python scripts/reproduce_paper.py [--json] [--layers 24 48]
                     [--hardware a100-flops h100] [--no-figure4]
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from dynmo_plugin.cli._output import third_party_output_to_stderr
from dynmo_plugin.errors import UserError
from dynmo_plugin.sim import paper
from dynmo_plugin.sim.campaign import CampaignConfig, run_variants, work_share
from dynmo_plugin.sim.gpt import GPTShape, Hardware, LayerLoad, flop_layer_costs, layer_costs
from dynmo_plugin.sim.measured import hardware
from dynmo_plugin.scenarios import make_trajectory

# (label, scenario, parameters): pruning at the paper's three final sparsities
ROWS = [
    ("pruning 52%", "gradual_pruning", {"final_sparsity": 0.52}),
    ("pruning 79%", "gradual_pruning", {"final_sparsity": 0.79}),
    ("pruning 90%", "gradual_pruning", {"final_sparsity": 0.90}),
    ("freezing", "layer_freezing", {}),
    ("sparse_attention", "sparse_attention", {}),
    ("early_exit", "early_exit", {}),
    ("mod", "mixture_of_depths", {}),
    ("moe", "moe", {}),
]
VARIANTS = {"exact": {"balancer": "exact"}, "by_parameter": {"balancer": "parameters"},
            "repack": {"balancer": "exact", "repack": True}}
OVER = ("static", "static_best", "no_dynamism")


def _config(name: str, params: dict, layers: int, hw_name: str, head: bool = True,
            dp: int | None = None, pp: int | None = None) -> CampaignConfig:
    scenario = make_trajectory(name, num_layers=layers, **params)
    shape = GPTShape(num_layers=layers, output_layer=head)
    return CampaignConfig(scenario=scenario, dp=dp or scenario.world.dp, pp=pp or scenario.world.pp,
                          shape=shape, hw=hardware(hw_name, shape),
                          baselines=("static", "static_deepspeed", "static_tuned", "no_dynamism",
                                     "fluid"))


def head_layers(hw_name: str) -> float:
    """The output layer + loss in decoder layers at the paper's shape."""
    shape = GPTShape(num_layers=1)
    hw = hardware(hw_name, shape)
    if hw.measured is not None:
        return hw.measured.head_layers
    c = flop_layer_costs(shape, Hardware(), LayerLoad.dense(1))
    return 3 * c.head_fwd_s / float(c.total_s[0])


def layer_cost_range(cfg: CampaignConfig) -> tuple[float, float]:
    """Cheapest and dearest layer over the run, relative to a dense layer (cost model's)."""
    dense = layer_costs(cfg.shape, cfg.hw, LayerLoad.dense(cfg.scenario.num_layers)).total_s[0]
    points = [0, *cfg.scenario.change_points(cfg.iterations)]
    rel = [layer_costs(cfg.shape, cfg.hw, cfg.scenario.load(p)).total_s / dense for p in points]
    return float(min(r.min() for r in rel)), float(max(r.max() for r in rel))


def figure3_cell(name: str, params: dict, layers: int, hw_name: str) -> dict:
    """Every figure of one (scenario, layers, cost model)."""
    cfg = _config(name, params, layers, hw_name)
    base = cfg.scenario.paper_baseline
    res = run_variants(cfg, VARIANTS)
    dec = run_variants(_config(name, params, layers, hw_name, head=False), {"exact": VARIANTS["exact"]})
    ex, bp, rp = res["exact"], res["by_parameter"], res["repack"]
    return {
        "exact": ex.speedup_over(base), "by_parameter": bp.speedup_over(base),
        "paper_rule": max(ex.speedup_over(base), bp.speedup_over(base)),
        "vs_same_dynamism_static": ex.speedup, "vs_static_tuned": ex.speedup_over("static_tuned"),
        "paper_rule_over": {b: max(ex.speedup_over(b), bp.speedup_over(b)) for b in OVER},
        "decoder_only_exact": dec["exact"].speedup_over(base),
        "fluid_bound": ex.baselines["fluid"].tokens_per_s / ex.baselines[base].tokens_per_s,
        "repack_per_gpu": rp.speedup_over(base, per_gpu=True), "repack_gpus_avg": rp.dynmo.gpus_avg,
        "overhead_pct": 100 * sum(ex.dynmo.overhead_s.values()) / ex.dynmo.time_s,
        "rebalances_applied": sum(e.applied for e in ex.events), "rebalance_points": len(ex.events),
        "gpus": cfg.dp * cfg.pp, "work_share": work_share(cfg),
        "layer_cost_range": list(layer_cost_range(cfg)),
    }


def _cause(paper_value, cell: dict, layers: int, pp: int, head: float) -> str:
    """One line a reader can check against the row's other columns."""
    ours, fluid, rp = cell["paper_rule"], cell["fluid_bound"], cell["repack_per_gpu"]
    if paper_value is None:
        return "the paper gives no figure at this layer count"
    lo, hi = (paper_value, paper_value) if isinstance(paper_value, float) else paper_value
    if 0.9 * lo <= ours <= 1.1 * hi:
        return f"within 10% of the paper ({ours / hi:.2f} of it)"
    if ours > 1.1 * hi:
        return f"above the paper by {ours / hi - 1:.0%}: our scenario's imbalance exceeds the paper's"
    cheapest = cell["layer_cost_range"][0]
    if cheapest >= 0.9:
        return (f"cost model: no layer under this dynamism costs less than {cheapest:.2f} of a dense "
                f"one (launch-bound floor, shared/notes/h100-measured.md), so DynMo's {ours:.2f}x is "
                f"the output layer's rebalancing ({cell['vs_static_tuned']:.2f}x over a split "
                "tuned once)")
    if fluid < 0.9 * lo:
        need = (f"per-GPU accounting with repacking reaches {rp:.2f}x, so the paper's figure fits "
                "only if it counts throughput per GPU after releasing GPUs") if rp >= 0.9 * lo else (
            f"the run keeps {cell['work_share']:.0%} of the dense model's work; the paper's figure "
            "needs the dynamism to remove more (a lower survival/density/keep, or layers priced "
            "below this cost model)")
        return f"unreachable under this cost model: even layers divisible at will give {fluid:.2f}x; {need}"
    if layers == pp:
        return (f"granularity: {layers} layers on {pp} stages is one layer per stage, no contiguous "
                f"re-split exists (fluid bound {fluid:.2f}x)")
    if cell["decoder_only_exact"] >= 0.9 * lo:
        return (f"output layer: it costs {head:.1f} decoder layers and stays on the last stage; "
                f"without it DynMo reaches {cell['decoder_only_exact']:.2f}x")
    return (f"granularity: {layers / pp:.3g} layers per stage; whole-layer moves reach {ours:.2f}x "
            f"of a {fluid:.2f}x fluid bound (output layer = {head:.1f} layers on the last stage)")


def figure3(layers: list[int], models: list[str]) -> list[dict]:
    rows = []
    for label, name, params in ROWS:
        values, paper_base, ours_base = paper.FIGURE3[name]
        pp = make_trajectory(name, num_layers=max(layers), **params).world.pp
        for n in layers:
            row = {"row": label, "scenario": name, "layers": n, "paper": values.get(n),
                   "paper_baseline": paper_base, "our_baseline": ours_base, "ours": {}, "cause": {}}
            for model in models:
                cell = figure3_cell(name, params, n, model)
                row["ours"][model] = cell
                row["cause"][model] = _cause(row["paper"], cell, n, pp, head_layers(model))
            print(f"  figure 3: {label} {n} layers done", file=sys.stderr, flush=True)
            rows.append(row)
    return rows


def _range(values: list) -> tuple[float, float]:
    flat = [x for v in values for x in ((v,) if isinstance(v, float) else v)]
    return min(flat), max(flat)


def verdicts(rows: list[dict], models: list[str]) -> list[dict]:
    """Per scenario and cost model: does our paper-rule speedup over the paper's baseline
    land within the paper's range (all layer counts run)?"""
    out = []
    for name, (values, _, base) in paper.FIGURE3.items():
        lo, hi = _range(list(values.values()))
        for model in models:
            ours = [r["ours"][model]["paper_rule"] for r in rows if r["scenario"] == name]
            if not ours:
                continue
            inside = [lo * 0.995 <= x <= hi * 1.005 for x in ours]
            near = [r for r in rows if r["scenario"] == name and r["paper"] is not None]
            close = sum(r["cause"][model].startswith("within 10%") for r in near)
            out.append({"scenario": name, "cost_model": model, "paper_range": [lo, hi],
                        "ours_range": [min(ours), max(ours)], "baseline": base,
                        "within": all(inside), "overlaps": any(inside),
                        "rows_within_10pct": [close, len(near)]})
    return out


def abstract(rows: list[dict], models: list[str]) -> list[dict]:
    out = []
    for name, (value, base) in paper.ABSTRACT.items():
        entry = {"scenario": name, "paper": value, "paper_baseline": "static Megatron-LM",
                 "our_baseline": base, "ours_max": {}}
        for model in models:
            ours = [r["ours"][model]["paper_rule_over"][base] for r in rows if r["scenario"] == name]
            entry["ours_max"][model] = max(ours) if ours else None
        out.append(entry)
    packed = [(r["ours"][m]["repack_gpus_avg"] / r["ours"][m]["gpus"], m) for r in rows for m in models]
    out.append({"scenario": "repacking", "paper": paper.ABSTRACT_REPACK,
                "ours_max_gpu_reduction": {m: 1 - min(x for x, mm in packed if mm == m) for m in models},
                "see": "figure4"})
    return out


def overhead(rows: list[dict], models: list[str]) -> list[dict]:
    out = []
    for name, (text, lo, hi) in paper.OVERHEAD.items():
        for model in models:
            cells = [r["ours"][model] for r in rows if r["scenario"] == name]
            if not cells:
                continue
            ours = [c["overhead_pct"] for c in cells]
            points = max(c["rebalance_points"] for c in cells)
            cause = (f"ours: {points} rebalance points in 10,000 iterations, each 10% of one "
                     "iteration of profiling + modelled decision + migration of the moved layers")
            if max(ours) < lo:
                cause += ("; the paper's share implies far more frequent rebalancing (its routing "
                          "and attention change every iteration) or costlier profiling")
            out.append({"scenario": name, "cost_model": model, "paper": text, "paper_pct": [lo, hi],
                        "ours_pct": [min(ours), max(ours)], "within": lo <= max(ours) <= hi or
                        (lo == 0 and max(ours) <= hi), "cause": cause})
    return out


def figure4(layers: list[int], models: list[str]) -> list[dict]:
    """Pruning (90%) on 8 GPUs (1 x 8): DynMo with and without repacking."""
    fig = paper.FIGURE4
    out = []
    for model in models:
        for n in layers:
            cfg = _config("gradual_pruning", {"final_sparsity": 0.90}, n, model, dp=1, pp=fig["gpus"])
            res = run_variants(cfg, {"rebalance": VARIANTS["exact"], "repack": VARIANTS["repack"]})
            base = res["rebalance"].baselines["static_best"]
            plain, packed = res["rebalance"].dynmo, res["repack"].dynmo
            # control: the same model without pruning, repacked the same way
            dense_cfg = _config("gradual_pruning", {"final_sparsity": 0.0}, n, model, dp=1, pp=fig["gpus"])
            dense = run_variants(dense_cfg, {"repack": VARIANTS["repack"]})["repack"].dynmo
            s_plain = plain.tokens_per_gpu_s / base.tokens_per_gpu_s
            s_pack = packed.tokens_per_gpu_s / base.tokens_per_gpu_s
            out.append({
                "cost_model": model, "layers": n, "paper_gpus_avg": list(fig["gpus_avg"]),
                "paper_repack_share": list(fig["repack_share_of_speedup"]),
                "static_tokens_per_gpu_s": base.tokens_per_gpu_s,
                "dynmo_tokens_per_gpu_s": plain.tokens_per_gpu_s,
                "repack_tokens_per_gpu_s": packed.tokens_per_gpu_s,
                "gpus_avg": packed.gpus_avg, "gpus_avg_without_pruning": dense.gpus_avg,
                "speedup_per_gpu": s_pack,
                "repack_share": (s_pack - s_plain) / s_pack if s_pack > 0 else 0.0,
                "repacks": sum(e.kind == "repack" for e in res["repack"].events)})
            print(f"  figure 4: {model} {n} layers done", file=sys.stderr, flush=True)
    return out


NOTES = [
    "Baselines: 'static' keeps the scenario's dynamism on Megatron's uniform split (what "
    "rebalancing alone adds); 'static_best' is the faster of that and DeepSpeed's static "
    "'parameters' split; 'no_dynamism' is the dense model (the paper's 'no early exit', "
    "'dense attention'). Egeria (freezing) is modelled as 'static': the same freezing "
    "schedule without rebalancing; Tutel (MoE) is not modelled.",
    "'static tuned once' is the same dynamism on the split exact gives the initial model, "
    "never changed: it removes the output layer's static imbalance, so DynMo over it is what "
    "following the dynamism adds. The output layer costs 2.7 decoder layers in the FLOP "
    "model and 5.8 measured on the H100.",
    "Figure 4's 'without pruning' repacks the same model with no pruning: GPUs it releases "
    "are idle because the output layer's stage sets the pace, not because pruning freed them.",
    "MoE: the paper's models are Mixtral 8x7B and LLaMA-MoE-3.5B (32 decoder layers each); "
    "ours is the GPT shape above with the MoE scenario's routing imbalance, so only the "
    "32-layer row has a paper figure.",
    "Paper rule: the better of DynMo by time (exact) and by parameters (DeepSpeed's "
    "partition of the counted parameters: kept weights when pruning, trainable ones when "
    "freezing; equal otherwise, so it keeps the uniform split).",
    "Every DynMo decision runs the live plan -> gate path with the live defaults (margin "
    "1.0, noise floor 5%, horizon = iterations to the next event); plans gaining < 5% are "
    "refused, as the plugin would.",
    "The paper leaves unstated: which sparsity Figure 3 shows, how the output layer is "
    "placed, per-layer sparsity/density/survival spreads, and whether throughput counts "
    "GPUs released by repacking; each changes the figures (see the causes).",
]


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, (tuple, list)):
        return " / ".join(f"{v:.2f}" for v in x)
    return f"{x:.2f}"


def render(doc: dict) -> str:
    models = doc["cost_models"]
    out = ["## Figure 3: speedup over the paper's baseline (ours: exact | paper rule | vs same-"
           "dynamism static | vs static tuned once | fluid bound | per GPU with repack)", ""]
    for r in doc["figure3"]:
        for m in models:
            c = r["ours"][m]
            out.append(f"{r['row']:18s} {r['layers']:3d}L {m:10s} paper {_fmt(r['paper']):>11s} | "
                       f"{c['exact']:5.2f} {c['paper_rule']:5.2f} {c['vs_same_dynamism_static']:5.2f} "
                       f"{c['vs_static_tuned']:5.2f} {c['fluid_bound']:5.2f} {c['repack_per_gpu']:5.2f} "
                       f"| {r['cause'][m]}")
    out += ["", "## Verdict per scenario (paper-rule speedup over the paper's baseline)", ""]
    for v in doc["verdicts"]:
        out.append(f"{v['scenario']:18s} {v['cost_model']:10s} paper {_fmt(v['paper_range'])}  ours "
                   f"{_fmt(v['ours_range'])}  within: {'yes' if v['within'] else 'no'}"
                   f"{' (overlaps)' if v['overlaps'] and not v['within'] else ''}; rows within 10% "
                   f"of the paper: {v['rows_within_10pct'][0]} of {v['rows_within_10pct'][1]}")
    out += ["", "## Abstract (over static Megatron-LM)", ""]
    for a in doc["abstract"]:
        if "ours_max" in a:
            ours = "  ".join(f"{m} {_fmt(x)}" for m, x in a["ours_max"].items())
            out.append(f"{a['scenario']:18s} paper {a['paper']}  ours (max) {ours}")
        else:
            ours = "  ".join(f"{m} {x:.0%}" for m, x in a["ours_max_gpu_reduction"].items())
            out.append(f"{a['scenario']:18s} paper: {a['paper']}; ours: GPU use down by up to {ours} "
                       "(Figure 3's repack runs, live criteria: predicted no slower)")
    out += ["", "## Overhead (% of training time)", ""]
    for o in doc["overhead"]:
        out.append(f"{o['scenario']:18s} {o['cost_model']:10s} paper {o['paper']:40s} ours "
                   f"{o['ours_pct'][0]:.3f}-{o['ours_pct'][1]:.3f}% | {o['cause']}")
    if doc["figure4"]:
        out += ["", "## Figure 4: repacking, pruning 90% on 8 GPUs (paper: 5.4-7.2 GPUs on "
                "average; repacking 4-11% of the speedup)", ""]
        for f in doc["figure4"]:
            out.append(f"{f['cost_model']:10s} {f['layers']:3d}L  tokens/s/GPU static "
                       f"{f['static_tokens_per_gpu_s']:,.0f}  DynMo {f['dynmo_tokens_per_gpu_s']:,.0f}  "
                       f"+repack {f['repack_tokens_per_gpu_s']:,.0f}  GPUs avg {f['gpus_avg']:.2f} "
                       f"(without pruning {f['gpus_avg_without_pruning']:.2f})  "
                       f"repack share {f['repack_share']:.1%}")
    out += ["", *[f"* {n}" for n in doc["notes"]], "", f"({doc['seconds']:.0f} s)"]
    return "\n".join(out)


def build(args: argparse.Namespace) -> dict:
    started = time.perf_counter()
    rows = figure3(args.layers, args.hardware)
    doc = {"cost_models": args.hardware, "layers": args.layers,
           "setup": {"shape": "GPT hidden 1024, 32 heads, seq 2048, micro-batch 2, 4 micro-batches "
                              "per pipeline stage, 10,000 iterations",
                     "worlds": {"pruning, freezing, sparse_attention, early_exit": "30 x 24",
                                "moe, mod": "8 x 16"}, "baselines": paper.BASELINE_TEXT},
           "paper": {"figure3": {k: {"values": {str(n): v for n, v in vals.items()}, "baseline": b}
                                 for k, (vals, b, _) in paper.FIGURE3.items()},
                     "abstract": {k: v for k, (v, _) in paper.ABSTRACT.items()},
                     "abstract_repack": paper.ABSTRACT_REPACK,
                     "overhead": {k: t for k, (t, _, _) in paper.OVERHEAD.items()},
                     "figure4": paper.FIGURE4},
           "figure3": rows, "verdicts": verdicts(rows, args.hardware),
           "abstract": abstract(rows, args.hardware), "overhead": overhead(rows, args.hardware),
           "figure4": [] if args.no_figure4 else figure4(args.layers, args.hardware),
           "notes": NOTES}
    doc["seconds"] = time.perf_counter() - started
    return doc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=list(paper.LAYERS),
                        choices=paper.LAYERS, help="layer counts (default: all four)")
    parser.add_argument("--hardware", nargs="+", default=["a100-flops", "h100"],
                        choices=["a100-flops", "h100"], help="cost models (default: both)")
    parser.add_argument("--no-figure4", action="store_true", help="skip the repacking figure")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args(argv)
    try:
        with third_party_output_to_stderr():
            doc = build(args)
            text = json.dumps(doc, indent=1, allow_nan=False) if args.json else render(doc)
    except UserError as e:
        print(f"reproduce_paper: error: {e}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
