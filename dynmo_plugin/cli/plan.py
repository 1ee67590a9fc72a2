"""`dynmo plan`: compute a balancing plan from per-layer costs (no GPU, no processes).

    dynmo plan --costs costs.json --stages 4 --method exact [--memory mem.json
               --capacity 80GiB] [--extras extras.json] [--current-layout 'Ettt|tttL'] [--json]
    dynmo plan costs.json --current-layout 'Ett|tt|tt|ttL' --repack [--min-stages K]
               [--max-slowdown X] [--objective min_stages|throughput_per_gpu] [--json]
    dynmo plan --from-run RUN_DIR [--json]
    dynmo plan --from-profile FILE [--json]

--from-run prints the --pipeline-model-parallel-size and --pipeline-model-parallel-layout
to start a Megatron-LM run with: the exact solver on the profile a run trained with
`--dynmo --dynmo-start-balanced-at N` measured (`cli/_from_run.py`). --from-profile does the
same from a profile file as a run records it (the layout it was profiled under is read
from its layers' stages; no memory cap, no repack: those are the run's settings).

costs.json: a JSON list of per-layer costs, or an object {"costs": [...], "memory":
[...], "move_bytes": [...], "params": [...], "mtp": {"layers": k, "cost": c, "memory": b,
"move_bytes": b}} (all but costs optional; "mtp": the Multi-Token Prediction block, one
unit the exact balancer places on the last rank or standalone, its "m" layers also read
from --current-layout). mem.json: a list
of per-layer bytes. extras.json: a list of per-stage costs, or {"cost": [...],
"memory": [...]}. --capacity: bytes per stage (suffixes KB MB GB TB KiB MiB GiB TiB),
or a comma-separated list, one per stage. The costs file may also be given as the
first argument instead of --costs; --stages may be left out when --current-layout
gives it.

--repack decides whether to consolidate the pipeline onto fewer stages instead
(`dynmo_plugin.balancing.repack`; the exact solver, so no --method): the current
layout is --current-layout, else Megatron's uniform split over --stages; the gate
runs when --gate-iterations is given. With --tokens-per-iteration (micro-batches x
micro-batch size x sequence, one pipeline replica) and costs in seconds, the plan
prints the predicted tokens/s and tokens per GPU-hour before and after.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

from dynmo_plugin.balancing import BALANCERS, BalanceProblem, GateConfig, Plan, solve
from dynmo_plugin.balancing.partition import load_partition_balanced
from dynmo_plugin.balancing.repack import (OBJECTIVES, RepackCriteria, RepackPlan,
                                           plan_repack)
from dynmo_plugin.cli._output import show, third_party_output_to_stderr
from dynmo_plugin.errors import UserError
from dynmo_plugin.layout import Layout

__all__ = ["add_parser", "run"]

# (flag, lowest, highest). The upper bounds are far beyond real pipelines; they keep
# per-stage lists in memory and products like saving x iterations in the float range.
_MAX_STAGES = 100_000
_INT_FLAGS = (("--stages", 1, _MAX_STAGES), ("--microbatches", 1, 10**9), ("--max-rounds", 0, 10**6),
              ("--gate-iterations", 0, 10**12), ("--min-stages", 1, _MAX_STAGES))
# Repack-only flags: (flag, lowest allowed, whether the lowest is allowed).
_REPACK_FLOATS = (("--max-slowdown", 0.0, False), ("--memory-margin", 0.0, True),
                  ("--rebuild-s", 0.0, True), ("--tokens-per-iteration", 0.0, False))
_REPACK_FLAGS = ("--min-stages", "--objective", *(f for f, _, _ in _REPACK_FLOATS))
_UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("plan", help="compute a rebalancing plan from per-layer costs",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("costs_file", nargs="?", metavar="COSTFILE", help="the same as --costs")
    p.add_argument("--costs", help="JSON list of per-layer costs, or an object")
    p.add_argument("--stages", type=int,
                   help="pipeline-parallel size (default: the stages of --current-layout)")
    p.add_argument("--method", choices=BALANCERS, help="balancer (required unless --repack)")
    p.add_argument("--memory", help="JSON list of per-layer bytes")
    p.add_argument("--capacity", help="per-stage memory capacity, e.g. 80GiB or 8e10,8e10,...")
    p.add_argument("--extras", help="JSON per-stage extras: list of costs or {cost, memory}")
    p.add_argument("--current-layout", help="current Megatron layout string, e.g. 'Ettt|tttL'")
    p.add_argument("--allow-empty-stages", action="store_true", help="stages may hold no layer")
    p.add_argument("--microbatches", type=int, default=None,
                   help="micro-batches per iteration (--global-batch-size / (--micro-batch-size "
                        "x DP)): the predicted 1F1B time and --repack's answer depend on it "
                        "(default 1, said in a note on stderr: with 1 the stages never overlap)")
    p.add_argument("--max-rounds", type=int, help="diffusion: round cap")
    p.add_argument("--gate-iterations", type=int,
                   help="evaluate the gate: iterations until the next expected event")
    p.add_argument("--bandwidth", default="1GB", help="gate: migration bandwidth per second (1GB)")
    p.add_argument("--margin", type=float, default=1.2, help="gate: required saving/cost ratio")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--from-run", metavar="RUN_DIR",
                   help="recommend a Megatron-LM layout from a run's start profile (no costs file)")
    p.add_argument("--from-profile", metavar="FILE",
                   help="the same from a profile JSON as a run records it (its report's "
                        "events), without the run")
    _add_repack_flags(p)
    p.set_defaults(func=run)


def _add_repack_flags(p: argparse.ArgumentParser) -> None:
    """--repack and its criteria (defaults: `RepackCriteria`'s, which are the config's)."""
    d = RepackCriteria()
    p.add_argument("--repack", action="store_true",
                   help="decide whether to repack onto fewer stages instead of rebalancing")
    p.add_argument("--min-stages", type=int, help=f"repack: never below this many stages ({d.min_stages})")
    p.add_argument("--max-slowdown", type=float,
                   help=f"repack: predicted iteration may grow at most this factor ({d.max_slowdown:g})")
    p.add_argument("--objective", choices=OBJECTIVES, help=f"repack: what to optimise ({d.objective})")
    p.add_argument("--memory-margin", type=float,
                   help=f"repack: a stage fits if memory x (1 + margin) <= cap ({d.memory_margin:g})")
    p.add_argument("--rebuild-s", type=float,
                   help=f"repack: estimated regroup + rebuild seconds, the gate's fixed cost ({d.rebuild_s:g})")
    p.add_argument("--tokens-per-iteration", type=float, metavar="N",
                   help="repack: tokens one pipeline replica trains per iteration, to print "
                        "predicted tokens/s and tokens per GPU-hour (costs in seconds)")


def _load_json(path: str, what: str) -> Any:
    """Parse one JSON input file; every way it can be unreadable is the user's to fix.

    Raises:
        UserError: the file cannot be read, is not UTF-8, or is not JSON.
    """
    try:
        data = Path(path).read_bytes()
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
        raise UserError(f"cannot read {what} file {path!r}: {getattr(e, 'strerror', None) or e}") from e
    try:
        text = data.decode("utf-8-sig")  # -sig: tolerate the BOM some editors write
    except UnicodeDecodeError as e:
        raise UserError(f"{what} file {path!r} is not UTF-8 text (byte {data[e.start]:#04x} at "
                        f"offset {e.start}); save it as UTF-8 JSON") from e
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{what} file {path!r} is not valid JSON: {e}") from e
    except (ValueError, RecursionError) as e:  # a number of > 4300 digits; [[[[...]]]] nesting
        raise UserError(f"{what} file {path!r} holds JSON too deeply nested or a number too long "
                        "to read; write plain lists of numbers") from e


def _finite(value: Any) -> float | None:
    """A JSON number as a finite float, else None. JSON true/false are not numbers here
    (Python would read them as 1 and 0)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        out = float(value)
    except OverflowError:  # an integer literal beyond the float range
        return None
    return out if math.isfinite(out) else None


def _numbers(values: Any, name: str, source: str) -> list[float]:
    """`values` as a list of finite floats >= 0, checked here so that the message names
    the file and the entry (BalanceProblem would accept booleans and big integers).

    Raises:
        UserError: not a list, or an entry that is not a finite number >= 0.
    """
    if not isinstance(values, list):
        raise UserError(f"{source}: {name} must be a list of numbers, got {show(values)}")
    out = []
    for i, v in enumerate(values):
        x = _finite(v)
        if x is None or x < 0:
            raise UserError(f"{source}: {name}[{i}] = {show(v)}; {name} must be finite numbers "
                            ">= 0 (not true/false, strings, null, NaN or Infinity)")
        out.append(x)
    if not math.isfinite(sum(out)):
        raise UserError(f"{source}: {name} add up to more than a float can hold; "
                        "give them in a larger unit")
    return out


def _optional_numbers(values: Any, name: str, source: str) -> list[float] | None:
    """Like `_numbers`, but absent / null means "not given"."""
    return None if values is None else _numbers(values, name, source)


def _bytes(text: str, flag: str) -> float:
    """A positive, finite byte count from e.g. '80e9' or '80GiB'."""
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).upper() if m else None
    try:
        if m is None or unit not in _UNITS:
            raise ValueError
        value = float(m.group(1)) * _UNITS[unit]
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise UserError(f"{flag} {text!r}: expected a positive number of bytes like 80e9 or 80GiB")
    return value


def _layer_inputs(args: argparse.Namespace) -> dict[str, Any]:
    data = _load_json(args.costs, "costs")
    if isinstance(data, list):
        data = {"costs": data}
    if not isinstance(data, dict) or not isinstance(data.get("costs"), list):
        raise UserError(f"costs file {args.costs!r} must hold a list of numbers or an object "
                        "with a 'costs' list")
    unknown = sorted(set(data) - {"costs", "memory", "move_bytes", "params", "mtp"})
    if unknown:
        raise UserError(f"costs file {args.costs!r}: unknown keys {show(unknown)}; "
                        "use costs, memory, move_bytes, params, mtp")
    source = f"costs file {args.costs!r}"
    out = {"costs": _numbers(data["costs"], "costs", source),
           "memory": _optional_numbers(data.get("memory"), "memory", source),
           "move_bytes": _optional_numbers(data.get("move_bytes"), "move_bytes", source),
           "param_counts": _optional_numbers(data.get("params"), "params", source)}
    if args.memory:
        out["memory"] = _numbers(_load_json(args.memory, "memory"), "memory",
                                 f"memory file {args.memory!r}")
    out.update(_mtp_inputs(data.get("mtp"), source))
    return out


def _mtp_inputs(data: Any, source: str) -> dict[str, Any]:
    """The costs file's "mtp" object as BalanceProblem fields ({} when absent)."""
    if data is None:
        return {}
    if not isinstance(data, dict) or not set(data) <= {"layers", "cost", "memory", "move_bytes"}:
        raise UserError(f"{source}: mtp must be an object with layers, cost, memory, move_bytes, "
                        f"got {show(data)}")
    k = data.get("layers")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise UserError(f"{source}: mtp.layers must be an integer >= 1 (--mtp-num-layers), "
                        f"got {show(k)}")
    values = _numbers([data.get(f, 0) for f in ("cost", "memory")], "mtp cost/memory", source)
    out = {"mtp_layers": k, "mtp_cost": values[0], "mtp_memory": values[1]}
    if data.get("move_bytes") is not None:
        out["mtp_move_bytes"] = _numbers([data["move_bytes"]], "mtp.move_bytes", source)[0]
    return out


def _extras(args: argparse.Namespace) -> dict[str, Any]:
    if not args.extras:
        return {}
    data = _load_json(args.extras, "extras")
    source = f"extras file {args.extras!r}"
    if isinstance(data, list):
        return {"extras_cost": _numbers(data, "extras", source)}
    if isinstance(data, dict) and set(data) <= {"cost", "memory"}:
        return {"extras_cost": _optional_numbers(data.get("cost"), "cost", source),
                "extras_memory": _optional_numbers(data.get("memory"), "memory", source)}
    raise UserError(f"extras file {args.extras!r} must hold a list of per-stage costs or "
                    "an object with 'cost' and/or 'memory' lists")


def _check_flags(args: argparse.Namespace) -> None:
    """Range-check the numeric flags up front, so that messages name the flag rather
    than a BalanceProblem / GateConfig field.

    Raises:
        UserError: a flag out of range.
    """
    for flag, low, high in _INT_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and not low <= value <= high:
            raise UserError(f"{flag} must be an integer between {low} and {high:,}, got {show(value)}")
    if not (math.isfinite(args.margin) and args.margin >= 0):
        raise UserError(f"--margin must be a finite number >= 0 (1.2 = 20% headroom), got {args.margin}")
    if args.max_rounds is not None and args.method != "diffusion":
        raise UserError("--max-rounds only applies to --method diffusion")
    _check_inputs(args)
    _check_repack_flags(args)


def _check_inputs(args: argparse.Namespace) -> None:
    """One costs file (COSTFILE or --costs) and a stage count (--stages or the layout).

    Raises:
        UserError: none or two costs files; no way to know the stage count.
    """
    if args.costs_file is not None and args.costs is not None and args.costs_file != args.costs:
        raise UserError(f"two costs files given ({args.costs_file!r} and --costs {args.costs!r}); "
                        "give one")
    args.costs = args.costs if args.costs is not None else args.costs_file
    if args.costs is None:
        raise UserError("no costs file: give it as the first argument or with --costs")
    if args.stages is None and not args.current_layout:
        raise UserError("give --stages or --current-layout (the pipeline's stage count)")


def _check_repack_flags(args: argparse.Namespace) -> None:
    """--method xor --repack; the repack criteria flags only with --repack, in range.

    Raises:
        UserError: a missing, misplaced or out-of-range flag.
    """
    if not args.repack:
        given = [f for f in _REPACK_FLAGS if getattr(args, f[2:].replace("-", "_")) is not None]
        if given:
            raise UserError(f"{given[0]} only applies with --repack")
        if args.method is None:
            raise UserError(f"--method is required ({', '.join(BALANCERS)}), or give --repack")
        return
    if args.method not in (None, "exact"):
        raise UserError(f"--repack always uses the exact solver; drop --method {args.method}")
    if args.max_rounds is not None:
        raise UserError("--max-rounds does not apply to --repack")
    for flag, low, low_ok in _REPACK_FLOATS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and not (math.isfinite(value) and (value >= low if low_ok else value > low)):
            raise UserError(f"{flag} must be a finite number {'>=' if low_ok else '>'} {low:g}, got {value}")


def _current_layout(args: argparse.Namespace, num_layers: int) -> Layout | None:
    """Parse --current-layout. Repeat counts are bounded first: 't*99999999999' would
    otherwise be expanded in memory before it could be found wrong (any count above
    layers + stages makes too many 't' or '|' anyway)."""
    if not args.current_layout:
        return None
    limit = num_layers + (args.stages if args.stages is not None else _MAX_STAGES)
    for digits in re.findall(r"\*(\d+)", args.current_layout):
        if len(digits) > 9 or int(digits) > limit:
            count = digits if len(digits) <= 12 else digits[:12] + "..."
            raise UserError(f"--current-layout {args.current_layout[:40]!r}: repeat count {count} "
                            f"is more than the {num_layers} layers and {limit - num_layers} stages "
                            "can hold")
    # Counts checked here, not by Layout.parse: its messages name the launcher's flags
    # (--num-layers, --pipeline-model-parallel-size), which plan does not have.
    layout = Layout.parse(args.current_layout)
    shown = args.current_layout[:40]
    if args.stages is not None and layout.num_stages != args.stages:
        raise UserError(f"--current-layout {shown!r} has {layout.num_stages} stages but --stages "
                        f"is {args.stages}; make them agree, or drop --stages (the layout gives it)")
    if layout.num_layers != num_layers:
        raise UserError(f"--current-layout {shown!r} holds {layout.num_layers} decoder layers ('t') "
                        f"but costs file {args.costs!r} has {num_layers} per-layer costs; make them agree")
    if layout.num_stages > _MAX_STAGES:
        raise UserError(f"--current-layout has {layout.num_stages:,} stages; at most {_MAX_STAGES:,}")
    return layout


def _problem(args: argparse.Namespace) -> BalanceProblem:
    layers = _layer_inputs(args)
    capacity = None
    if args.capacity:
        parts = [_bytes(x, "--capacity") for x in args.capacity.split(",")]
        capacity = parts[0] if len(parts) == 1 else parts
    current = _current_layout(args, len(layers["costs"]))
    stages = args.stages if current is None else current.num_stages
    _check_mtp(args, layers, current)
    if args.repack and current is None and layers["costs"]:
        current = Layout.uniform(len(layers["costs"]), stages,  # Megatron's static split
                                 mtp_layers=layers.get("mtp_layers", 0))
    return BalanceProblem(num_stages=stages, capacity=capacity, current=current,
                          allow_empty_stages=args.allow_empty_stages,
                          num_microbatches=args.microbatches or 1, **layers, **_extras(args),
                          tokens_per_iteration=args.tokens_per_iteration)


def _check_mtp(args: argparse.Namespace, layers: dict[str, Any], current: Layout | None) -> None:
    """The costs file's mtp.layers and the current layout's 'm' agree; a layout's 'm'
    alone gives the block (cost 0). Repacks do not carry MTP yet: refused.

    Raises:
        UserError: they disagree, or --repack with MTP.
    """
    in_file = layers.get("mtp_layers")
    in_layout = current.mtp_layers if current is not None else None
    if in_file is not None and in_layout is not None and in_file != in_layout:
        raise UserError(f"--current-layout holds {in_layout} MTP layers ('m') but the costs "
                        f"file's mtp.layers is {in_file}; make them agree")
    if in_file is None and in_layout:
        layers["mtp_layers"] = in_layout
    if args.repack and layers.get("mtp_layers"):
        raise UserError("--repack does not carry MTP layers yet; plan a rebalance (--method "
                        "exact) instead")


def _gate(args: argparse.Namespace) -> GateConfig | None:
    if args.gate_iterations is None:
        return None
    return GateConfig(iterations_until_next_event=args.gate_iterations,
                      bandwidth_bytes_per_s=_bytes(args.bandwidth, "--bandwidth"), margin=args.margin)


def _criteria(args: argparse.Namespace) -> RepackCriteria:
    """The repack criteria from the flags given, `RepackCriteria`'s defaults otherwise."""
    given = {name: getattr(args, name) for name in
             ("min_stages", "max_slowdown", "objective", "memory_margin", "rebuild_s")
             if getattr(args, name) is not None}
    return RepackCriteria(**given)


def _solve(args: argparse.Namespace) -> Plan | RepackPlan:
    """Build the problem and solve it (inputs validated, DeepSpeed imported untimed)."""
    _check_flags(args)
    problem = _problem(args)
    if args.repack:
        return plan_repack(problem, _criteria(args), _gate(args))
    options: dict[str, Any] = {}
    if args.max_rounds is not None:
        options["max_rounds"] = args.max_rounds
    if args.gate_iterations is not None:
        options["gate"] = _gate(args)
    if args.method == "partition":
        load_partition_balanced()  # seconds of torch/DeepSpeed import: not solve time
    return solve(problem, args.method, **options)


def _as_json(plan: Plan | RepackPlan) -> str:
    """The plan as strict JSON (no NaN/Infinity, which json parsers other than Python's reject)."""
    try:
        return json.dumps(plan.to_dict(), indent=2, allow_nan=False)
    except ValueError as e:
        raise UserError("the plan's numbers overflow the float range (costs x --microbatches "
                        "too large); give costs in a larger unit") from e


def _from_recorded(args: argparse.Namespace) -> str:
    """--from-run / --from-profile: everything comes from the recording."""
    from dynmo_plugin.cli import _from_run

    flag = "--from-run" if args.from_run is not None else "--from-profile"
    extra = [f for f in ("costs_file", "costs", "method", "current_layout") if getattr(args, f)]
    if args.from_run is not None and args.from_profile is not None:
        raise UserError("give --from-run or --from-profile, not both")
    if extra or args.repack:
        raise UserError(f"{flag} takes everything from the recording; drop "
                        + ", ".join(["--repack"] * args.repack + [f"--{f.replace('_', '-')}" for f in extra]))
    if args.from_run is not None:
        return _from_run.render(_from_run.recommend(args.from_run), args.json)
    return _from_run.render_profile(_from_run.recommend_from_profile(args.from_profile), args.json)


def run(args: argparse.Namespace) -> int:
    if args.from_run is not None or args.from_profile is not None:
        print(_from_recorded(args))
        return 0
    with third_party_output_to_stderr():
        plan = _solve(args)
        text = _as_json(plan) if args.json else str(plan)
    if args.microbatches is None:
        print(f"dynmo plan: note: {ASSUMED_ONE_MICROBATCH}", file=sys.stderr)
    print(text)
    return 0


# The assumption `dynmo plan` makes without --microbatches, said every time it makes it:
# with one micro-batch 1F1B never overlaps stages, so the iteration is the sum of all
# stages' work whatever the split, and a repack onto one stage looks free (x1.000).
ASSUMED_ONE_MICROBATCH = ("assuming 1 micro-batch per iteration (give --microbatches M, M = "
                          "--global-batch-size / (--micro-batch-size x DP)); with 1 the stages "
                          "never overlap, so predicted times ignore the pipeline and --repack "
                          "finds fewer stages free")
