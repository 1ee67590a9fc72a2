#!/usr/bin/env python
"""Our simulated DynMo speedups next to the DynMo paper's Figure 3, with the gaps explained.

For each scenario and layer count (24/32/40/48) the simulator runs the paper's cluster
(30 x 24 = 720 GPUs; MoE/MoD 8 x 16 = 128 GPUs), static Megatron layout versus DynMo
rebalancing at each dynamism event, twice: decoder layers only ("dec") and with the
GPT output layer on the last stage ("+head"). Usage:

    .venv/bin/python scripts/reproduce_paper.py [--balancer exact] [--layers 24 48] [--repack]
"""
from __future__ import annotations

import argparse
import sys
import time

from dynmo_plugin.errors import UserError
from dynmo_plugin.sim.campaign import CampaignConfig, run_campaign
from dynmo_plugin.sim.gpt import GPTShape
from dynmo_plugin.sim.scenarios import make_scenario

# (label, scenario, parameters, the paper's Figure 3 figure as quoted in our issue)
ROWS = [
    ("pruning 52%", "pruning", {"final_sparsity": 0.52}, "up to 3.18x (all sparsities)"),
    ("pruning 79%", "pruning", {"final_sparsity": 0.79}, "up to 3.18x"),
    ("pruning 90%", "pruning", {"final_sparsity": 0.90}, "up to 3.18x"),
    ("freezing", "freezing", {}, "up to 1.69x over Egeria (2.23x)"),
    ("moe", "moe", {}, "1.21-1.23x"),
    ("mod", "mod", {}, "~1.17x"),
    ("early_exit", "early_exit", {}, "up to 4.52x"),
    ("sparse_attention", "sparse_attention", {}, "2.71-4.02x"),
]

GAPS = """\
Why our numbers differ from the paper's (read with the table):
* Granularity. DynMo moves whole decoder layers between contiguous stages. With 24
  stages, 24 layers leave one layer per stage: no contiguous re-split exists, so the
  decoder-only speedup is 1.00x by construction; 48 layers give only 2 per stage, and
  any stage taking a third layer carries >= 3 layer costs. The paper's larger gains
  need finer-grained work units (or per-layer costs that differ by far more than
  in our models) than our layer-granular balancer can exploit at these depths.
* The output layer (+head column). With hidden 1024 and a 50k vocabulary the output
  layer costs about 3-4 decoder layers; the static uniform split puts it on an already
  full last stage, so the first DynMo rebalance also removes that static imbalance.
  That explains most of the +head gains (MoE/MoD at 32-48 layers on 16 stages). With
  24 stages and <= 40 layers the last stage already holds a single layer, so the head
  stage stays the bottleneck whatever the balancer does (1.00x): with the head counted,
  the head, not dynamism, sets the pace. The paper's treatment of the output layer is
  not known to us.
* Pruning. We assume the attention core is not pruned (only linear layers shrink, with
  ideal sparse kernels); per-layer sparsity differs only as much as our prunability
  spread (0.25) makes it. Both bound the cost spread the balancer can exploit.
* Freezing. Our baseline is static Megatron with the same Egeria-like freezing (so
  the comparison is "over Egeria"); frozen layers keep their forward, which the paper
  may also skip (activation caching), so our frozen layers stay heavier.
* MoE / MoD. ~25% / ~18% imbalance spread over 2-3 layers per stage is largely
  averaged out inside a stage; the paper's 1.2x probably reflects expert-level
  stragglers we do not model (EP all-to-all waits).
* Early exit / sparse attention. Our survival curve ends at 10% of tokens at the last
  layer and densities in [5%, 50%] on an attention core worth ~35% of a layer at
  s=2048, h=1024; the paper's 2.7-4.5x require the dynamic part to dominate layer time.
* Throughput, not cost: with --repack our gains show as fewer GPUs (gpus column) at
  equal tokens/s rather than as speedup.
"""


def _campaign(name: str, params: dict, layers: int, head: bool, args) -> "object":
    scenario = make_scenario(name, num_layers=layers, **params)
    world = scenario.world
    cfg = CampaignConfig(scenario=scenario, dp=world.dp, pp=world.pp, balancer=args.balancer,
                         repack=args.repack, shape=GPTShape(num_layers=layers, output_layer=head))
    return run_campaign(cfg)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--balancer", default="exact")
    parser.add_argument("--layers", type=int, nargs="+", default=[24, 32, 40, 48])
    parser.add_argument("--repack", action="store_true", help="also repack; adds GPUs used")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    header = f"{'scenario':18s} {'L':>3s} {'world':>6s} {'dec':>7s} {'+head':>7s} {'idle dec':>15s}"
    header += f" {'gpus':>6s}" if args.repack else ""
    print(header + "   paper (Figure 3)")
    try:
        for label, name, params, paper in ROWS:
            for layers in args.layers:
                dec = _campaign(name, params, layers, False, args)
                head = _campaign(name, params, layers, True, args)
                w = make_scenario(name, num_layers=layers).world
                idle = f"{dec.static.idleness:.0%}->{dec.dynmo.idleness:.0%}"
                line = (f"{label:18s} {layers:3d} {w.dp:>2d}x{w.pp:<3d} {dec.speedup:6.2f}x "
                        f"{head.speedup:6.2f}x {idle:>15s}")
                line += f" {dec.dynmo.gpus_avg:6.0f}" if args.repack else ""
                print(line + f"   {paper}", flush=True)
    except UserError as e:
        print(f"reproduce_paper: error: {e}", file=sys.stderr)
        return 2
    print(f"\n(balancer {args.balancer}; {time.perf_counter() - started:.0f} s)\n")
    print(GAPS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
