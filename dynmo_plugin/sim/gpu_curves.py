"""GPU cost curves from the GPU check: a cost model the simulator loads by name.

`scripts/gpu_check.py` times each scheme at PP=1 in bf16 at a GPU-bound shape (its
`scenario_cost[...]` rows; their figures are what `scenario_costs.json` holds under
"scenarios"). `gpu_cost_model` turns those figures into a hardware profile (the format
of profiles/h100.json, read by `sim.measured`) from the rows that PASSED only: a row that
failed its check (or says nothing about passing) is refused, never priced, and listed
under "refused" with its ratio. The model carries its provenance: the GPU, the date, the
source commit, and each entry's shape; "measured_scenarios" names the schemes a passed
row priced (the value table says "not measured" for the others).

A named model ships as profiles/<name>.json (`GPU_MODELS`). Until a GPU has produced a
passed row, its file says {"status": "not measured"} and loading it is an error naming
that (`NotMeasured`): no number stands in for a measurement. Pure: the standard library.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

from dynmo_plugin.errors import UserError
from dynmo_plugin.sim.gpt import GPTShape, Hardware
from dynmo_plugin.sim.measured import GPU_MODELS, profile_entries, read_json, with_measured
from dynmo_plugin.sim.profile_builder import build_profile

__all__ = ["GPU_MODELS", "NotMeasured", "cost_rows", "dump", "gpu_cost_model", "gpu_hardware", "load_model",
           "model_name"]

_DIR = Path(__file__).resolve().parent / "profiles"
# the simulator's knob value at each scheme's measured setting (gpu_check's SCENARIOS);
# MoE is left out: its row compares capacity factors of a wider FFN, not a dense layer
_KNOB_AT = {"gradual_pruning": lambda f: 1 - 0.67, "layer_freezing": None,
            "mixture_of_depths": lambda f: 0.125,
            "early_exit": lambda f: 1 - f["exited_fraction"], "sparse_attention": lambda f: 1 / 16}


class NotMeasured(UserError):
    """A named GPU cost model no GPU has produced a passed row for yet."""


def model_name(gpu: str) -> str:
    """The model's name for a device string ('NVIDIA H200' -> 'h200-gpu').

    Raises:
        UserError: a GPU without a named model.
    """
    for name in GPU_MODELS:
        if name.split("-")[0] in gpu.lower():
            return name
    raise UserError(f"no named GPU cost model for {gpu!r}; known: {', '.join(GPU_MODELS)}")


def _flag(model: list[str], name: str, default: int) -> int:
    at = [i for i, token in enumerate(model[:-1]) if token == name]
    return int(model[at[-1] + 1]) if at else default


def cost_rows(costs: Mapping[str, Mapping[str, Any]]) -> list[dict]:
    """The profile builder's rows (`sim.profile_builder`) from the PASSED scenario figures
    only: per scheme its ratio at its knob, per shape (hidden, sequence, micro-batch) one
    dense row timed by the mean of the passed rows' reference layers. The vocabulary is
    left at the builder's default: these rows do not time the output layer (early exit's
    run uses a 16-token vocabulary), so the head is priced by the FLOP ratio."""
    rows, refs = [], {}
    for kind, f in costs.items():
        if f.get("passed") is not True or kind not in _KNOB_AT:
            continue
        model = list(f["model"])
        shape = {"hidden": _flag(model, "--hidden-size", 0), "seq": _flag(model, "--seq-length", 0),
                 "micro_batch": _flag(model, "--micro-batch-size", 0)}
        row = {"scenario": kind, "shape": shape, "ratio": float(f["ratio"]), "source": kind}
        knob = _KNOB_AT[kind]
        if knob is not None:
            row["knob_value"] = knob(f)
        if kind == "gradual_pruning":
            row["granularity"] = "structured"
        rows.append(row)
        refs.setdefault(tuple(shape.values()), (shape, []))[1].append((kind, float(f["reference_cost_s"])))
    dense = [{"scenario": "dense", "shape": shape, "ratio": 1.0,
              "layer_s": sum(s for _, s in ref) / len(ref),
              "source": "mean of the reference layers of " + ", ".join(k for k, _ in ref)}
             for shape, ref in refs.values()]
    return dense + rows


def gpu_cost_model(costs: Mapping[str, Mapping[str, Any]], *, name: str, gpu: str, date: str,
                   commit: str) -> dict[str, Any]:
    """The named cost model from gpu_check's scenario figures (module docstring): a
    profile of the passed rows, or {"status": "not measured"} when none passed."""
    refused = {k: {"ratio": f.get("ratio"), "threshold": f.get("threshold"),
                   "why": "row failed its check" if f.get("passed") is False else "no pass verdict"}
               for k, f in costs.items() if f.get("passed") is not True}
    measured = sorted(k for k in costs if k not in refused and k in _KNOB_AT)
    head = {"name": name, "gpu": gpu, "date": date, "commit": commit, "refused": refused,
            "source": f"scripts/gpu_check.py scenario_cost rows that passed, on {gpu}, {date}, "
                      f"commit {commit}"}
    rows = cost_rows(costs)
    if not measured:
        return {**head, "status": "not measured", "measured_scenarios": [], "shapes": []}
    profile = build_profile(rows, name, head["source"])
    profile_entries(profile)  # the loader's own checks
    return {**head, **profile, "status": "measured", "measured_scenarios": measured}


def load_model(name: str) -> dict[str, Any]:
    """The named model's document (profiles/<name>.json).

    Raises:
        UserError: an unknown name or an unreadable file.
    """
    if name not in GPU_MODELS:
        raise UserError(f"unknown GPU cost model {name!r}; one of {', '.join(GPU_MODELS)}")
    path = _DIR / f"{name}.json"
    return read_json(path, "GPU cost model", f"GPU cost model {str(path)!r} is not JSON")


def gpu_hardware(name: str, shape: GPTShape, base: Hardware | None = None) -> Hardware:
    """`base` priced by the named GPU model's entry at `shape`.

    Raises:
        NotMeasured: no GPU has produced a passed row for this model yet.
        UserError: no entry at `shape` (the message lists the measured shapes).
    """
    doc = load_model(name)
    if doc.get("status") != "measured":
        raise NotMeasured(f"GPU cost model {name!r}: not measured (no passed gpu_check scenario_cost "
                          f"row yet; {doc.get('reason', 'run scripts/gpu_check.sh on that GPU')})")
    entries = profile_entries(doc, f"GPU cost model {name!r}")
    for entry in entries:
        if entry.matches(shape):
            return with_measured(base or Hardware(), entry)
    have = "; ".join(e.shape_text for e in entries)
    raise UserError(f"GPU cost model {name!r} has no entry at hidden {shape.hidden}, seq {shape.seq}, "
                    f"micro-batch {shape.micro_batch}; measured: {have} (pass --hidden/--seq-length/"
                    "--micro-batch)")


def dump(model: Mapping[str, Any]) -> str:
    """The model as written to profiles/<name>.json."""
    return json.dumps(model, indent=1) + "\n"
