"""`dynmo simulate --from-run RUN_DIR [--cores N] [--json]`: a training run replayed.

What the simulator predicts for each stretch of the run (one layout, one data
parallelism, one frozen set) beside what the run measured, and across a repack that
grew data parallelism the tokens/s ratio after / before, predicted and measured
(`dynmo_plugin.sim.run_replay` says how). The run fixes the model, the cluster and
the schedule, so no campaign flag applies.
"""
from __future__ import annotations

import argparse
import json

from dynmo_plugin.errors import UserError

__all__ = ["render", "run_from_run"]

_OWN = ("from_run", "cores", "json", "func", "command")


def _check_flags(args: argparse.Namespace) -> None:
    """Every flag but --cores and --json left at its default (one line naming the rest)."""
    from dynmo_plugin.cli import build_parser

    defaults = vars(build_parser().parse_args(["simulate", "--from-run", args.from_run]))
    given = sorted(k for k, v in vars(args).items() if k not in _OWN and v != defaults.get(k))
    if given:
        flags = ", ".join("--" + k.replace("_", "-") for k in given)
        raise UserError(f"--from-run replays the run's own model, cluster and schedule; drop {flags}")


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e3:9.1f}"


def render(replay) -> str:
    """The replay as text: one row per segment, then the grow line."""
    from dynmo_plugin.sim.run_replay import WARMUP

    model = (f"the ranks sharing {replay.cores:g} CPU core(s)" if replay.cores
             else "one device per rank")
    lines = [f"run {replay.run_dir}: predicted with the profile of iteration "
             f"{replay.profile_iteration}, {model}; measured = median of time_s - dynmo_s over "
             f"clean iterations (after {WARMUP} warm-up, no profiling window, no event)",
             f"{'iterations':>12s}  {'layout':16s}{'pp':>3s}{'dp':>3s}{'m':>4s}{'frozen':>7s}"
             f"{'cores':>6s}{'pred ms':>10s}{'dedic. ms':>10s}{'meas ms':>10s}{'n':>4s}"]
    for s in replay.segments:
        cores = "-" if s.cores is None else f"{s.cores:.2f}"
        lines.append(f"{s.first:5d}-{s.last:<6d}  {s.layout:16s}{s.pp:3d}{s.dp:3d}"
                     f"{s.num_microbatches:4d}{len(s.frozen):7d}{cores:>6s} {_ms(s.predicted_s)} "
                     f"{_ms(s.dedicated_s)} {_ms(s.measured_s)}{len(s.counted):4d}")
    g = replay.grow
    if g is None:
        lines.append("no repack grew data parallelism in this run: no grow ratio")
        return "\n".join(lines)
    head = (f"grow at iteration {g.iteration} (pp {g.before.pp} -> {g.after.pp}, dp {g.before.dp} "
            f"-> {g.after.dp}): tokens/s after / before")
    p, m, d = g.ratio(), g.ratio("measured"), g.ratio("dedicated")
    if m is None:
        lines.append(f"{head}: predicted {p:.3f}x; not measured (no clean iteration on one side)")
    else:
        lines.append(f"{head}: predicted {p:.3f}x, measured {m:.3f}x (medians of "
                     f"{len(g.before.counted)} and {len(g.after.counted)} iterations): "
                     f"predicted / measured {p / m:.3f} ({g.error:+.1%})")
    if replay.cores:
        lines.append(f"one device per rank would give {d:.3f}x")
    return "\n".join(lines)


def run_from_run(args: argparse.Namespace) -> int:
    from dynmo_plugin.sim.run_replay import replay_run

    _check_flags(args)
    replay = replay_run(args.from_run, cores=args.cores)
    print(json.dumps(replay.as_dict(), indent=1, allow_nan=False) if args.json else render(replay))
    return 0
