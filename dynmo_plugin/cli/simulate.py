"""`dynmo simulate`: what DynMo buys on a simulated cluster, static versus rebalanced."""
from __future__ import annotations

import argparse
import json
import math

from dynmo_plugin.cli._output import show, third_party_output_to_stderr
from dynmo_plugin.errors import UserError

__all__ = ["add_parser", "run"]

_SCENARIOS = ("pruning", "freezing", "moe", "mod", "early_exit", "sparse_attention")
# Per-op jitter beyond sigma 2 (a factor e^2 at one standard deviation) is no longer
# noise, and sigmas in the hundreds overflow the simulated costs to infinity.
_MAX_NOISE = 2.0
# Upper bounds that keep a run within memory and the float range (a 10^310-way data
# parallelism overflows the throughput): far beyond the paper's runs (24-48 layers,
# 10,000 iterations), and --pp is bounded by --layers.
_MAX_COUNT = {"--layers": 10_000, "--dp": 1_000_000, "--microbatches": 100_000,
              "--iterations": 100_000_000}


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


def _balancers() -> list[str]:
    """Balancers the simulator can run. `parameters` balances by parameter counts, which
    every simulated GPT layer shares: it would be `uniform` under another name, and the
    planner has no counts to give it."""
    from dynmo_plugin.sim.planner import available_balancers

    return [b for b in available_balancers() if b != "parameters"]


def _check_names(args: argparse.Namespace) -> None:
    """Scenario and balancer are checked here rather than by argparse `choices`, so the
    message lists the valid names like every other error, and `parameters` (valid for
    `dynmo plan`) gets the reason it does not apply here."""
    if args.scenario not in _SCENARIOS:
        raise UserError(f"unknown scenario {show(args.scenario)}; choose one of {', '.join(_SCENARIOS)}")
    choices = _balancers()
    if args.balancer == "parameters":
        raise UserError("--balancer parameters balances by parameter counts, which every simulated "
                        f"layer shares (it would equal uniform); choose one of {', '.join(choices)}")
    if args.balancer not in choices:
        raise UserError(f"unknown balancer {show(args.balancer)}; choose one of {', '.join(choices)}")


def _check_numbers(args: argparse.Namespace) -> None:
    """Range-check every numeric flag here, so the message names the flag (the simulator's
    own checks would name internal fields, or fail inside numpy)."""
    for flag, value in (("--layers", args.layers), ("--dp", args.dp), ("--pp", args.pp),
                        ("--iterations", args.iterations), ("--microbatches", args.microbatches),
                        ("--rebalance-every", args.rebalance_every)):
        high = _MAX_COUNT.get(flag)
        if value is not None and not (1 <= value and (high is None or value <= high)):
            bound = f"between 1 and {high:,}" if high else ">= 1"
            raise UserError(f"{flag} must be an integer {bound}, got {show(value)}")
    if args.pp > args.layers:
        raise UserError(f"--pp {show(args.pp)} is larger than the number of layers (--layers "
                        f"{args.layers}); every stage needs at least one layer")
    if args.seed < 0:
        raise UserError(f"--seed must be an integer >= 0, got {show(args.seed)}")
    if not (math.isfinite(args.noise) and 0 <= args.noise <= _MAX_NOISE):
        raise UserError(f"--noise must be a log-normal sigma between 0 and {_MAX_NOISE:g} "
                        f"(0.1 = about 10% jitter), got {args.noise}")


def _simulate(args: argparse.Namespace):
    """Validate the flags and run the campaign (a CampaignResult)."""
    from dynmo_plugin.sim.campaign import CampaignConfig, run_campaign
    from dynmo_plugin.sim.gpt import GPTShape
    from dynmo_plugin.sim.scenarios import make_scenario

    _check_names(args)
    _check_numbers(args)
    if args.balancer == "partition":
        from dynmo_plugin.balancing.partition import load_partition_balanced

        load_partition_balanced()  # import DeepSpeed while stdout goes to stderr
    scenario = make_scenario(args.scenario, num_layers=args.layers, seed=args.seed)
    cfg = CampaignConfig(scenario=scenario, dp=args.dp, pp=args.pp,
                         num_microbatches=args.microbatches, iterations=args.iterations,
                         balancer=args.balancer, rebalance_every=args.rebalance_every,
                         repack=args.repack, noise_sigma=args.noise, seed=args.seed,
                         shape=GPTShape(num_layers=args.layers, output_layer=not args.no_output_layer))
    return run_campaign(cfg)


def run(args: argparse.Namespace) -> int:
    with third_party_output_to_stderr():
        result = _simulate(args)
        text = json.dumps(result.as_dict(), indent=1, allow_nan=False) if args.json else _text(args, result)
    print(text)
    return 0
