"""Build a hardware profile (the format of profiles/h100.json) from per-scenario cost rows.

    python -m dynmo_plugin.sim.profile_builder ROWS.json [ROWS.json ...] --name h200 \\
        --source "gpu_check on one H200, 2026-11-26" --out h200.json
    dynmo simulate ... --hardware h200.json [--hidden 2048 --micro-batch 1]

A cost-row file is a JSON list of rows, or an object whose "rows" holds the list (what
a GPU check writes: scripts/gpu_check.py --out). A row (docs/simulator.md, "Cost rows"):

    {"scenario": str, "shape": {"hidden": int, "seq": int, "micro_batch": int,
     "vocab": int (optional, 50257)}, "ratio": float, "knob_value": float,
     "layer_s": float, "fwd_share": float, "granularity": str, "source": str}

`ratio` is the layer's cost relative to a dense layer of the same shape. By scenario:
"dense" needs `layer_s` (seconds of one dense layer's forward+backward per micro-batch;
`fwd_share` optional, default 1/3) and sets the shape's base; "head": the output layer
+ loss in dense layers; "embedding": the embedding in dense layers. A scenario row names
the scenario (`dynmo_plugin.scenarios.SCENARIOS`, or its section key): "layer_freezing":
a frozen-prefix layer (forward only); "mixture_of_depths" and "early_exit": `knob_value`
= share of tokens processed; "sparse_attention": share of the dense attention core
computed; "gradual_pruning": share of weights kept, `granularity` unstructured (default)
or structured; "moe": busiest expert's tokens over the balanced share. Rows of one shape
and knob make a curve (several rows at one knob value are averaged). A shape without a
"dense" row is an error; without "head" it takes the FLOP model's ratio, without
"layer_freezing" 1/3 (both said in the profile's notes). Unknown keys are ignored, so a
row may carry more (timings, spreads). Pure: the standard library and numpy.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

from dynmo_plugin.errors import UserError
from dynmo_plugin.scenarios import canonical_name
from dynmo_plugin.sim.gpt import GPTShape, Hardware, LayerLoad, flop_layer_costs
from dynmo_plugin.sim.measured import profile_entries, read_json

__all__ = ["SCENARIO_KNOBS", "build_profile", "load_rows", "main"]

# scenario -> the curve knob it measures (`measured.KNOBS`); pruning by granularity
SCENARIO_KNOBS = {"mixture_of_depths": "tokens", "early_exit": "tokens",
                  "sparse_attention": "attention_density", "moe": "expert_load",
                  "gradual_pruning": "pruning_{granularity}"}
_ROWS = ("dense", "head", "embedding")
# the fixed costs of a profile: the rows above and a frozen layer's forward-only share
_FIXED = (*_ROWS, "freezing")
_FIXED_SCENARIOS = {"layer_freezing": "freezing"}
_VOCAB = 50257


def load_rows(path: str | Path) -> list[dict[str, Any]]:
    """The rows of one cost-row file (a list, or an object with "rows").

    Raises:
        UserError: unreadable, not JSON, or not a list of objects.
    """
    data = read_json(path, "cost rows", f"cost rows {str(path)!r} are not JSON")
    rows = data.get("rows") if isinstance(data, dict) else data
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise UserError(f"cost rows {str(path)!r}: give a JSON list of row objects, or an object "
                        "with \"rows\" (docs/simulator.md, 'Cost rows')")
    return rows


def _number(row: dict, key: str, where: str, positive: bool = True) -> float:
    value = row.get(key)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        and (value > 0 if positive else value >= 0)
    if not ok:
        raise UserError(f"{where}: {key!r} must be a finite number {'> 0' if positive else '>= 0'}, "
                        f"got {value!r}")
    return float(value)


def _shape_key(row: dict, where: str) -> tuple[int, int, int, int]:
    shape = row.get("shape")
    if not isinstance(shape, dict):
        raise UserError(f"{where}: 'shape' must be an object with hidden, seq and micro_batch")
    try:
        key = tuple(int(shape[k]) for k in ("hidden", "seq", "micro_batch")) + (int(shape.get("vocab", _VOCAB)),)
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{where}: 'shape' needs integer hidden, seq and micro_batch ({e})") from e
    if min(key) < 1:
        raise UserError(f"{where}: shape values must be >= 1, got {shape}")
    return key  # type: ignore[return-value]


def _knob(row: dict, where: str) -> str:
    scenario = row.get("scenario")
    if scenario in _ROWS:
        return scenario
    try:
        scenario = canonical_name(scenario) if isinstance(scenario, str) else ""
    except UserError:
        scenario = ""
    if scenario in _FIXED_SCENARIOS:
        return _FIXED_SCENARIOS[scenario]
    if scenario not in SCENARIO_KNOBS:
        raise UserError(f"{where}: unknown scenario {row.get('scenario')!r}; one of "
                        f"{', '.join(_ROWS + tuple(_FIXED_SCENARIOS) + tuple(SCENARIO_KNOBS))}")
    granularity = row.get("granularity", "unstructured")
    if scenario == "gradual_pruning" and granularity not in ("unstructured", "structured"):
        raise UserError(f"{where}: pruning granularity must be unstructured or structured, "
                        f"got {granularity!r}")
    return SCENARIO_KNOBS[scenario].format(granularity=granularity)


def _flop_head_layers(hidden: int, seq: int, micro_batch: int, vocab: int) -> float:
    heads = next(h for h in (32, 16, 8, 4, 2, 1) if hidden % h == 0)
    shape = GPTShape(num_layers=1, hidden=hidden, heads=heads, seq=seq, micro_batch=micro_batch,
                     vocab=vocab)
    c = flop_layer_costs(shape, Hardware(), LayerLoad.dense(1))
    return 3 * c.head_fwd_s / float(c.total_s[0])


def _entry(key: tuple[int, int, int, int], rows: list[tuple[str, dict, str]]) -> dict[str, Any]:
    """One shape's profile entry from its rows (knob, row, where)."""
    hidden, seq, mb, vocab = key
    fixed = {k: [(r, w) for kk, r, w in rows if kk == k] for k in _FIXED}
    if not fixed["dense"]:
        raise UserError(f"cost rows: shape hidden {hidden}, seq {seq}, micro-batch {mb} has no "
                        "'dense' row with layer_s (seconds of one dense layer's fwd+bwd)")
    dense, where = fixed["dense"][0]
    notes: dict[str, str] = {}
    mean = lambda k: sum(_number(r, "ratio", w) for r, w in fixed[k]) / len(fixed[k])  # noqa: E731
    head = mean("head") if fixed["head"] else _flop_head_layers(*key)
    if not fixed["head"]:
        notes["head_layers"] = "no 'head' row: the FLOP model's ratio"
    frozen = mean("freezing") if fixed["freezing"] else 1 / 3
    if not fixed["freezing"]:
        notes["frozen_forward_only"] = "no 'freezing' row: the FLOP ratio 1/3"
    points: dict[str, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    for knob, r, w in rows:
        if knob not in _FIXED:
            points[knob][_number(r, "knob_value", w, positive=False)].append(_number(r, "ratio", w))
    curves = {k: [[x, sum(ys) / len(ys)] for x, ys in sorted(v.items())] for k, v in points.items()}
    return {"hidden": hidden, "seq": seq, "micro_batch": mb, "vocab": vocab,
            "layer_s": _number(dense, "layer_s", where),
            "fwd_share": float(dense.get("fwd_share", 1 / 3)), "head_layers": head,
            "embed_layers": mean("embedding") if fixed["embedding"] else 0.0,
            "frozen_forward_only": frozen, "curves": curves, "notes": notes}


def build_profile(rows: Iterable[dict[str, Any]], name: str, source: str) -> dict[str, Any]:
    """A profile dict (profiles/h100.json's format), one entry per shape in `rows`.

    Raises:
        UserError: a malformed row (the message says which and why), or a shape
            without a 'dense' row.
    """
    by_shape: dict[tuple[int, int, int, int], list[tuple[str, dict, str]]] = defaultdict(list)
    for i, row in enumerate(rows):
        where = f"cost row {i}"
        by_shape[_shape_key(row, where)].append((_knob(row, where), row, where))
    if not by_shape:
        raise UserError("cost rows: none given")
    return {"name": name, "source": source, "shapes": [_entry(k, v) for k, v in sorted(by_shape.items())]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dynmo_plugin.sim.profile_builder",
                                description=__doc__.splitlines()[0])
    p.add_argument("rows", nargs="+", metavar="ROWS.json", help="cost-row files (module docstring)")
    p.add_argument("--name", required=True, help="the profile's name (cost_model.name)")
    p.add_argument("--source", default=None, help="where the rows come from (default: the files)")
    p.add_argument("--out", default=None, help="write the profile here (default: stdout)")
    args = p.parse_args(argv)
    try:
        rows = [r for path in args.rows for r in load_rows(path)]
        profile = build_profile(rows, args.name, args.source or "cost rows " + ", ".join(args.rows))
        profile_entries(profile)  # the loader's own checks
    except UserError as e:
        print(f"profile_builder: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    text = json.dumps(profile, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
