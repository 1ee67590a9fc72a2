"""`dynmo simulate`: what DynMo buys on a simulated cluster, static versus rebalanced.

Rebalances go through the live plugin's plan -> gate path (`dynmo_plugin.sim.planner`),
so the what-if predicts what the plugin would do with the same gate settings. Compute
is priced by FLOPs (`--hardware a100-flops`, the default), by measured curves
(`--hardware h100`, or a profile file), or by what a live run measured
(`--costs-from RUN_DIR`: the run's per-layer profiles; the model takes the run's shape).
`--from-run RUN_DIR` instead replays that run: its layouts, data parallelism and
freezing as they happened, predicted per stretch beside what it measured, and the
tokens/s ratio across a repack that grew data parallelism (`sim.run_replay`).
"""
from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import replace

from dynmo_plugin.cli._output import show, third_party_output_to_stderr
from dynmo_plugin.errors import UserError
from dynmo_plugin.scenarios import SCENARIOS, canonical_name

__all__ = ["add_parser", "campaign_config", "run"]

# Per-op jitter beyond sigma 2 (a factor e^2 at one standard deviation) is no longer
# noise, and sigmas in the hundreds overflow the simulated costs to infinity.
_MAX_NOISE = 2.0
# Upper bounds that keep a run within memory and the float range (a 10^310-way data
# parallelism overflows the throughput): far beyond the paper's runs (24-48 layers,
# 10,000 iterations), and --pp is bounded by --layers.
_MAX_COUNT = {"--layers": 10_000, "--dp": 1_000_000, "--microbatches": 100_000,
              "--iterations": 100_000_000, "--hidden": 1_000_000, "--heads": 100_000,
              "--seq-length": 10_000_000, "--micro-batch": 100_000}
# (flag, GPTShape field): argparse's dest is the flag without dashes
_SHAPE_FLAGS = (("--hidden", "hidden"), ("--heads", "heads"), ("--seq-length", "seq"),
                ("--micro-batch", "micro_batch"))


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("simulate", help="simulate static vs DynMo training on a cluster",
                              description=__doc__.splitlines()[0])
    p.add_argument("--scenario", metavar="NAME", help=f"one of {', '.join(SCENARIOS)} (or its section key: "
                        f"{', '.join(e.section for e in SCENARIOS.values())}); required unless --from-run")
    p.add_argument("--layers", type=int, help="GPT decoder layers (paper: 24/32/40/48); required unless --from-run")
    p.add_argument("--dp", type=int, help="data-parallel size; required unless --from-run")
    p.add_argument("--pp", type=int, help="pipeline-parallel size; required unless --from-run")
    p.add_argument("--from-run", default=None, metavar="RUN_DIR",
                   help="replay a training run (its report.json): layouts, data parallelism and "
                        "freezing as they happened, predicted beside measured, and the tokens/s "
                        "ratio across a grow (sim.run_replay); takes no campaign flags")
    p.add_argument("--cores", type=float, default=None, metavar="N",
                   help="with --from-run: the ranks time-share N CPU cores (sim.shared; a CPU run "
                        "with more ranks than cores); default: one device per rank")
    p.add_argument("--balancer", default="exact",
                   help="exact | partition | diffusion | parameters | uniform (default exact, as "
                        "the live plugin)")
    p.add_argument("--rebalance-every", type=int, default=None, metavar="N",
                   help="rebalance every N iterations (default: at each dynamism event)")
    p.add_argument("--repack", action="store_true", help="consolidate onto fewer stages when it pays")
    p.add_argument("--start-balanced", action="store_true",
                   help="DynMo starts on the exact split of the initial model (--dynmo-start-balanced-at)")
    p.add_argument("--start-best-static", action="store_true",
                   help="DynMo starts on the best static choice (tuned split, pipeline sized once, "
                        "freed GPUs as data parallelism; sim.best_static)")
    p.add_argument("--freed", default="release", metavar="MODE",
                   help="release | grow | auto: what the ranks a repack frees do (repack.freed)")
    p.add_argument("--repack-objective", default=None, metavar="NAME",
                   help="min_stages | throughput_per_gpu (default: the live default)")
    p.add_argument("--repack-max-slowdown", type=float, default=None, metavar="X",
                   help="min_stages: predicted iteration time may grow at most X (live default 1.0)")
    p.add_argument("--gate-margin", type=float, default=None, metavar="X",
                   help="apply a plan only if its saving exceeds X x its cost (live default)")
    p.add_argument("--min-gain", type=float, default=None, metavar="F",
                   help="refuse plans saving less than this fraction of an iteration (live default)")
    p.add_argument("--event-gap", type=int, default=None, metavar="N",
                   help="gate horizon in iterations (default: until the next rebalance point)")
    costs = p.add_mutually_exclusive_group()
    costs.add_argument("--hardware", default="a100-flops", metavar="NAME",
                       help="a100-flops (FLOP model) | h100 (measured curves, host-bound shapes) | "
                            "h100-gpu | h200-gpu (gpu_check's curves; 'not measured' until a GPU "
                            "produced them) | a profile file")
    costs.add_argument("--costs-from", default=None, metavar="RUN_DIR",
                       help="price layers with a training run's measured profiles (report.json); "
                            "the model takes the run's shape")
    for flag, what in (("--hidden", "hidden size (default 1024)"), ("--heads", "attention heads (default 32)"),
                       ("--seq-length", "sequence length (default 2048)"),
                       ("--micro-batch", "micro-batch size (default 2)")):
        p.add_argument(flag, type=int, default=None, metavar="N",
                       help=f"model {what}; a measured profile needs an entry at this shape")
    p.add_argument("--pruning-granularity", default=None, metavar="G",
                   help="unstructured | structured (pruning; default unstructured, or the run's)")
    p.add_argument("--deepspeed-baseline", action="store_true",
                   help="also run DeepSpeed's static 'parameters' split (imports DeepSpeed)")
    p.add_argument("--iterations", type=int, default=10000, help="training iterations (default 10000)")
    p.add_argument("--microbatches", type=int, default=None, help="per iteration (default 4 x pp)")
    p.add_argument("--no-output-layer", action="store_true",
                   help="leave the output layer's compute out (decoder layers only)")
    p.add_argument("--noise", type=float, default=0.0, help="log-normal sigma of per-op noise")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def _text(args: argparse.Namespace, result, cost_model: dict) -> str:
    s, d = result.static, result.dynmo
    o = d.overhead_s
    applied = [e for e in result.events if e.applied]
    lines = [
        f"scenario {args.scenario}: {args.layers} layers, dp={args.dp} x pp={args.pp} "
        f"({args.dp * args.pp} GPUs), {args.iterations} iterations, balancer {args.balancer}",
        f"cost model: {cost_model['name']} ({cost_model['source']})",
        f"{'':22s}{'static':>14s}{'DynMo':>14s}",
        f"{'tokens/s':22s}{s.tokens_per_s:14,.0f}{d.tokens_per_s:14,.0f}",
        f"{'idleness':22s}{s.idleness:14.1%}{d.idleness:14.1%}",
        f"speedup: {result.speedup:.3f}x over the same dynamism on Megatron's static split",
    ]
    for name, label in (("static_tuned", "the split tuned once at the start (static_tuned)"),
                        ("best_static", "the best static choice (tuned, sized once, freed GPUs as DP)"),
                        ("no_dynamism", "the dense model (no dynamism)"),
                        ("static_best", "the better of Megatron's and DeepSpeed's static splits")):
        if name in result.baselines:
            lines.append(f"speedup: {result.speedup_over(name):.3f}x over {label}")
    lines += _baseline_table(args, result)
    lines += [f"{name}: {what}" for name, what in result.static_choices.items()]
    lines += [
        f"decisions (live plan -> gate path): {len(result.events)} rebalance points, "
        f"{len(applied)} applied ({sum(e.kind == 'repack' for e in applied)} repacks)",
        f"balancing overhead assumed: {sum(o.values()):.2f} s (profiling {o['profiling']:.2f} s, "
        f"decision {o['decision']:.3f} s modelled, migration {o['migration']:.3f} s, "
        f"repack {o['repack']:.1f} s)",
    ]
    if result.repack:
        lines.append(f"GPUs used on average: {d.gpus_avg:.1f} of {args.dp * args.pp}; tokens/s per "
                     f"GPU {d.tokens_per_gpu_s:,.0f} vs static {s.tokens_per_gpu_s:,.0f}")
    return "\n".join(lines)


_LABELS = {"static": "static (Megatron's split)", "static_tuned": "static_tuned (exact, at start)",
           "static_deepspeed": "static_deepspeed", "packed_once": "packed_once (repack at start)",
           "best_static": "best_static (by tokens/s)", "best_static_per_gpu": "best_static_per_gpu",
           "no_dynamism": "no_dynamism (dense)", "fluid": "fluid bound (1/pp each)"}


def _baseline_table(args: argparse.Namespace, result) -> list[str]:
    """Every strategy's tokens/s, GPUs and tokens per GPU-hour, DynMo last."""
    rows = [(_LABELS[k], v) for k, v in result.baselines.items() if k in _LABELS]
    rows.append(("DynMo" + (" (repacking)" if result.repack else ""), result.dynmo))
    out = [f"{'':32s}{'tokens/s':>14s}{'GPUs':>8s}{'tok/GPU-hour':>16s}{'vs DynMo':>10s}"]
    for label, r in rows:
        out.append(f"{label:32s}{r.tokens_per_s:14,.0f}{r.gpus_avg:8.1f}"
                   f"{r.tokens_per_gpu_s * 3600:16,.0f}{r.tokens_per_s / result.dynmo.tokens_per_s:9.3f}x")
    return out


def _check_names(args: argparse.Namespace) -> None:
    """Scenario and balancer are checked here rather than by argparse `choices`, so the
    message lists the valid names like every other error."""
    from dynmo_plugin.balancing.grow import FREED_MODES
    from dynmo_plugin.sim.planner import available_balancers

    given = args.scenario
    try:
        args.scenario = canonical_name(given)
    except UserError:
        raise UserError(f"unknown scenario {show(args.scenario)}; choose one of {', '.join(SCENARIOS)}") from None
    choices = available_balancers()
    if args.balancer not in choices:
        raise UserError(f"unknown balancer {show(args.balancer)}; choose one of {', '.join(choices)}")
    if args.pruning_granularity not in (None, "unstructured", "structured"):
        raise UserError(f"--pruning-granularity {show(args.pruning_granularity)}: choose "
                        "unstructured or structured")
    if args.pruning_granularity is not None and args.scenario != "gradual_pruning":
        raise UserError(f"--pruning-granularity applies only to --scenario gradual_pruning, not "
                        f"{given}; drop it")
    if args.repack_objective not in (None, "min_stages", "throughput_per_gpu"):
        raise UserError(f"--repack-objective {show(args.repack_objective)}: choose min_stages or "
                        "throughput_per_gpu")
    if args.freed not in FREED_MODES:
        raise UserError(f"--freed must be one of {', '.join(FREED_MODES)}, got {show(args.freed)}")


def _flag_value(args: argparse.Namespace, flag: str):
    return getattr(args, flag[2:].replace("-", "_"))


def _check_numbers(args: argparse.Namespace) -> None:
    """Range-check every numeric flag here, so the message names the flag (the simulator's
    own checks would name internal fields, or fail inside numpy)."""
    for flag, value in (("--layers", args.layers), ("--dp", args.dp), ("--pp", args.pp),
                        ("--iterations", args.iterations), ("--microbatches", args.microbatches),
                        ("--rebalance-every", args.rebalance_every), ("--event-gap", args.event_gap),
                        *((flag, _flag_value(args, flag)) for flag, _ in _SHAPE_FLAGS)):
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
    for flag, value, ok, want in (
            ("--gate-margin", args.gate_margin, lambda v: 0 <= v <= 1e6, "between 0 and 1e6"),
            ("--min-gain", args.min_gain, lambda v: 0 <= v < 1, "in [0, 1)"),
            ("--repack-max-slowdown", args.repack_max_slowdown, lambda v: 0 < v <= 1e6,
             "in (0, 1e6]")):
        if value is not None and not (math.isfinite(value) and ok(value)):
            raise UserError(f"{flag} must be a number {want}, got {show(value)}")


def _model(args: argparse.Namespace):
    """(GPTShape, Hardware, pruning granularity, cost-model description) from the flags."""
    from dynmo_plugin.sim.from_run import from_run
    from dynmo_plugin.sim.gpt import GPTShape
    from dynmo_plugin.sim.gpu_curves import GPU_MODELS, gpu_hardware
    from dynmo_plugin.sim.measured import hardware

    head = not args.no_output_layer
    given = {attr: _flag_value(args, flag) for flag, attr in _SHAPE_FLAGS}
    given = {k: v for k, v in given.items() if v is not None}
    if args.costs_from is not None:
        if given:
            raise UserError("--costs-from takes the model shape from the run; drop "
                            + ", ".join(f for f, a in _SHAPE_FLAGS if a in given))
        run = from_run(args.costs_from)
        shape = run.shape(args.layers, head)
        hw, granularity = run.hardware(), args.pruning_granularity or run.granularity
    else:
        shape = GPTShape(num_layers=args.layers, output_layer=head, **given)
        named = args.hardware in GPU_MODELS
        hw = gpu_hardware(args.hardware, shape) if named else hardware(args.hardware, shape)
        granularity = args.pruning_granularity
    m = hw.measured
    info = ({"name": hw.name, "source": "FLOPs (Narayanan et al. 2021) at 45% of 312 TFLOP/s"}
            if m is None else {"name": m.name, "source": m.source, "profile": m.to_dict(),
                               "priced_by": {k: m.priced_by(k) for k in _KNOBS[args.scenario]}})
    return shape, hw, granularity or "unstructured", info


_KNOBS = {"gradual_pruning": ("pruning_unstructured", "pruning_structured"), "layer_freezing": (),
          "moe": ("expert_load",), "mixture_of_depths": ("tokens",), "early_exit": ("tokens",),
          "sparse_attention": ("attention_density",)}


def campaign_config(args: argparse.Namespace):
    """Validate the flags: (CampaignConfig, cost-model description). scripts/value_sweep.py
    builds its campaigns here, so they are exactly the CLI's."""
    from dynmo_plugin.sim.campaign import CampaignConfig
    from dynmo_plugin.sim.planner import GateSettings, live_repack_criteria
    from dynmo_plugin.scenarios import make_trajectory

    missing = [f for f in ("--scenario", "--layers", "--dp", "--pp") if _flag_value(args, f) is None]
    if missing:
        raise UserError(f"dynmo simulate needs {', '.join(missing)} (or --from-run RUN_DIR to "
                        "replay a training run)")
    if args.cores is not None:
        raise UserError("--cores applies only to --from-run RUN_DIR; drop it")
    _check_names(args)
    _check_numbers(args)
    if args.balancer in ("partition", "parameters") or args.deepspeed_baseline:
        from dynmo_plugin.balancing.partition import load_partition_balanced

        load_partition_balanced()  # import DeepSpeed while stdout goes to stderr
    shape, hw, granularity, info = _model(args)
    params = {"granularity": granularity} if args.scenario == "gradual_pruning" else {}
    scenario = make_trajectory(args.scenario, num_layers=args.layers, seed=args.seed, **params)
    live = GateSettings()
    gate = GateSettings(margin=live.margin if args.gate_margin is None else args.gate_margin,
                        min_gain=live.min_gain if args.min_gain is None else args.min_gain,
                        horizon=args.event_gap)
    criteria = live_repack_criteria()
    criteria = replace(criteria, **{k: v for k, v in (("objective", args.repack_objective),
                                                      ("max_slowdown", args.repack_max_slowdown))
                                    if v is not None})
    baselines = ("static", "static_tuned", "packed_once", "best_static", "best_static_per_gpu",
                 "no_dynamism", "fluid") + (
        ("static_deepspeed",) if args.deepspeed_baseline else ())
    cfg = CampaignConfig(scenario=scenario, dp=args.dp, pp=args.pp,
                         num_microbatches=args.microbatches, iterations=args.iterations,
                         balancer=args.balancer, rebalance_every=args.rebalance_every,
                         repack=args.repack, repack_criteria=criteria, gate=gate, baselines=baselines,
                         start_balanced=args.start_balanced, start_best_static=args.start_best_static,
                         freed=args.freed,
                         noise_sigma=args.noise, seed=args.seed, shape=shape, hw=hw)
    return cfg, info


def _simulate(args: argparse.Namespace):
    """Validate the flags and run the campaign: (CampaignResult, cost-model description)."""
    from dynmo_plugin.balancing import InfeasibleError
    from dynmo_plugin.sim.campaign import run_campaign

    cfg, info = campaign_config(args)
    try:
        return run_campaign(cfg), info
    except InfeasibleError as e:
        raise _does_not_fit(e, cfg.hw, args.costs_from is not None) from e


# The fix the balancers' messages end with; `dynmo plan` has --capacity, simulate has not.
_CAPACITY_FIX = re.compile(r"[;:] raise (the capacity|--capacity)\b.*$")


def _does_not_fit(e: Exception, hw, run_shape: bool) -> UserError:
    """A balancer's "no layout fits the memory" in simulate's terms: the capacity is the
    simulated GPU's memory, the fix is a smaller model shape (unless --costs-from fixed
    it) or more stages."""
    detail = _CAPACITY_FIX.sub("", str(e))
    if detail == str(e):  # not about memory: the message stands
        return UserError(str(e))
    fix = "raise --pp" if run_shape else "lower --hidden, --seq-length or --micro-batch, or raise --pp"
    return UserError(f"the model does not fit the simulated GPU's {hw.memory_bytes:.4g} bytes "
                     f"({detail}); {fix}")


def run(args: argparse.Namespace) -> int:
    if args.from_run is not None:
        from dynmo_plugin.cli._simulate_run import run_from_run

        return run_from_run(args)
    with third_party_output_to_stderr():
        result, info = _simulate(args)
        if args.json:
            text = json.dumps(dict(result.as_dict(), cost_model=info), indent=1, allow_nan=False)
        else:
            text = _text(args, result, info)
    print(text)
    return 0
