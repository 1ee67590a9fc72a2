"""`dynmo simulate`: what DynMo buys on a simulated cluster, static versus rebalanced."""
from __future__ import annotations

import argparse
import json

from dynmo_plugin.errors import UserError

__all__ = ["add_parser", "run"]

_SCENARIOS = ("pruning", "freezing", "moe", "mod", "early_exit", "sparse_attention")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("simulate", help="simulate static vs DynMo training on a cluster",
                              description=__doc__.splitlines()[0])
    p.add_argument("--scenario", required=True, metavar="NAME", help=f"one of {', '.join(_SCENARIOS)}")
    p.add_argument("--layers", type=int, required=True, help="GPT decoder layers (paper: 24/32/40/48)")
    p.add_argument("--dp", type=int, required=True, help="data-parallel size")
    p.add_argument("--pp", type=int, required=True, help="pipeline-parallel size")
    p.add_argument("--balancer", default="partition",
                   help="exact | partition | diffusion | uniform (default partition)")
    p.add_argument("--rebalance-every", type=int, default=None, metavar="N",
                   help="rebalance every N iterations (default: at each dynamism event)")
    p.add_argument("--repack", action="store_true", help="consolidate onto fewer stages when it pays")
    p.add_argument("--iterations", type=int, default=10000, help="training iterations (default 10000)")
    p.add_argument("--microbatches", type=int, default=None, help="per iteration (default 4 x pp)")
    p.add_argument("--no-output-layer", action="store_true",
                   help="leave the output layer's compute out (decoder layers only)")
    p.add_argument("--noise", type=float, default=0.0, help="log-normal sigma of per-op noise")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def _text(args: argparse.Namespace, result) -> str:
    s, d = result.static, result.dynmo
    o = d.overhead_s
    lines = [
        f"scenario {args.scenario}: {args.layers} layers, dp={args.dp} x pp={args.pp} "
        f"({args.dp * args.pp} GPUs), {args.iterations} iterations, balancer {args.balancer}",
        f"{'':22s}{'static':>14s}{'DynMo':>14s}",
        f"{'tokens/s':22s}{s.tokens_per_s:14,.0f}{d.tokens_per_s:14,.0f}",
        f"{'idleness':22s}{s.idleness:14.1%}{d.idleness:14.1%}",
        f"speedup: {result.speedup:.3f}x",
        f"balancing overhead assumed: {sum(o.values()):.2f} s over {len(result.events)} rebalances "
        f"(profiling {o['profiling']:.2f} s, decision {o['decision']:.3f} s, "
        f"migration {o['migration']:.3f} s)",
    ]
    if result.repack:
        lines.append(f"GPUs used on average: {d.gpus_avg:.1f} of {args.dp * args.pp}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from dynmo_plugin.sim.campaign import CampaignConfig, run_campaign
    from dynmo_plugin.sim.gpt import GPTShape
    from dynmo_plugin.sim.scenarios import make_scenario

    if args.scenario not in _SCENARIOS:
        raise UserError(f"unknown scenario {args.scenario!r}; choose one of {', '.join(_SCENARIOS)}")
    scenario = make_scenario(args.scenario, num_layers=args.layers, seed=args.seed)
    cfg = CampaignConfig(scenario=scenario, dp=args.dp, pp=args.pp,
                         num_microbatches=args.microbatches, iterations=args.iterations,
                         balancer=args.balancer, rebalance_every=args.rebalance_every,
                         repack=args.repack, noise_sigma=args.noise, seed=args.seed,
                         shape=GPTShape(num_layers=args.layers, output_layer=not args.no_output_layer))
    result = run_campaign(cfg)
    print(json.dumps(result.as_dict(), indent=1) if args.json else _text(args, result))
    return 0
