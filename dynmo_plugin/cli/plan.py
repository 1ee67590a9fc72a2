"""`dynmo plan`: compute a balancing plan from per-layer costs (no GPU, no processes).

    dynmo plan --costs costs.json --stages 4 --method exact [--memory mem.json
               --capacity 80GiB] [--extras extras.json] [--current-layout 'Ettt|tttL'] [--json]

costs.json: a JSON list of per-layer costs, or an object {"costs": [...], "memory":
[...], "move_bytes": [...], "params": [...]} (all but costs optional). mem.json: a list
of per-layer bytes. extras.json: a list of per-stage costs, or {"cost": [...],
"memory": [...]}. --capacity: bytes per stage (suffixes KB MB GB TB KiB MiB GiB TiB),
or a comma-separated list, one per stage.
"""
from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from dynmo_plugin.balancing import BALANCERS, BalanceProblem, GateConfig, solve
from dynmo_plugin.errors import UserError
from dynmo_plugin.layout import Layout

__all__ = ["add_parser", "run"]

_UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("plan", help="compute a rebalancing plan from per-layer costs",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--costs", required=True, help="JSON list of per-layer costs, or an object")
    p.add_argument("--stages", required=True, type=int, help="pipeline-parallel size")
    p.add_argument("--method", required=True, choices=BALANCERS)
    p.add_argument("--memory", help="JSON list of per-layer bytes")
    p.add_argument("--capacity", help="per-stage memory capacity, e.g. 80GiB or 8e10,8e10,...")
    p.add_argument("--extras", help="JSON per-stage extras: list of costs or {cost, memory}")
    p.add_argument("--current-layout", help="current Megatron layout string, e.g. 'Ettt|tttL'")
    p.add_argument("--allow-empty-stages", action="store_true", help="stages may hold no layer")
    p.add_argument("--microbatches", type=int, default=1, help="for the predicted 1F1B time")
    p.add_argument("--max-rounds", type=int, help="diffusion: round cap")
    p.add_argument("--gate-iterations", type=int,
                   help="evaluate the gate: iterations until the next expected event")
    p.add_argument("--bandwidth", default="1GB", help="gate: migration bandwidth per second (1GB)")
    p.add_argument("--margin", type=float, default=1.2, help="gate: required saving/cost ratio")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run)


def _load_json(path: str, what: str) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except OSError as e:
        raise UserError(f"cannot read {what} file {path!r}: {e.strerror}") from e
    except json.JSONDecodeError as e:
        raise UserError(f"{what} file {path!r} is not valid JSON: {e}") from e


def _bytes(text: str, flag: str) -> float:
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).upper() if m else None
    try:
        if m is None or unit not in _UNITS:
            raise ValueError
        return float(m.group(1)) * _UNITS[unit]
    except ValueError:
        raise UserError(f"{flag} {text!r}: expected a number of bytes like 80e9 or 80GiB") from None


def _layer_inputs(args: argparse.Namespace) -> dict[str, Any]:
    data = _load_json(args.costs, "costs")
    if isinstance(data, list):
        data = {"costs": data}
    if not isinstance(data, dict) or not isinstance(data.get("costs"), list):
        raise UserError(f"costs file {args.costs!r} must hold a list of numbers or an object "
                        "with a 'costs' list")
    unknown = sorted(set(data) - {"costs", "memory", "move_bytes", "params"})
    if unknown:
        raise UserError(f"costs file {args.costs!r}: unknown keys {unknown}; "
                        "use costs, memory, move_bytes, params")
    out = {"costs": data["costs"], "memory": data.get("memory"),
           "move_bytes": data.get("move_bytes"), "param_counts": data.get("params")}
    if args.memory:
        out["memory"] = _load_json(args.memory, "memory")
    return out


def _extras(args: argparse.Namespace) -> dict[str, Any]:
    if not args.extras:
        return {}
    data = _load_json(args.extras, "extras")
    if isinstance(data, list):
        return {"extras_cost": data}
    if isinstance(data, dict) and set(data) <= {"cost", "memory"}:
        return {"extras_cost": data.get("cost"), "extras_memory": data.get("memory")}
    raise UserError(f"extras file {args.extras!r} must hold a list of per-stage costs or "
                    "an object with 'cost' and/or 'memory' lists")


def _problem(args: argparse.Namespace) -> BalanceProblem:
    layers = _layer_inputs(args)
    capacity = None
    if args.capacity:
        parts = [_bytes(x, "--capacity") for x in args.capacity.split(",")]
        capacity = parts[0] if len(parts) == 1 else parts
    current = None
    if args.current_layout:
        current = Layout.parse(args.current_layout, args.stages, len(layers["costs"]))
    return BalanceProblem(num_stages=args.stages, capacity=capacity, current=current,
                          allow_empty_stages=args.allow_empty_stages,
                          num_microbatches=args.microbatches, **layers, **_extras(args))


def run(args: argparse.Namespace) -> int:
    problem = _problem(args)
    options: dict[str, Any] = {}
    if args.max_rounds is not None:
        if args.method != "diffusion":
            raise UserError("--max-rounds only applies to --method diffusion")
        options["max_rounds"] = args.max_rounds
    if args.gate_iterations is not None:
        options["gate"] = GateConfig(iterations_until_next_event=args.gate_iterations,
                                     bandwidth_bytes_per_s=_bytes(args.bandwidth, "--bandwidth"),
                                     margin=args.margin)
    plan = solve(problem, args.method, **options)
    print(json.dumps(plan.to_dict(), indent=2) if args.json else plan)
    return 0
