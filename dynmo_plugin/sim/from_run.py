"""A measured cost profile from a live run (`dynmo simulate --costs-from RUN_DIR`).

The run's report.json holds per-layer profiles (forward and backward seconds per
micro-batch of every decoder layer, and each stage's extras) taken by the plugin's
profiler, and the dynamism events that changed the layers. From them:

* the dense layer: the FIRST profile's median layer (fwd+bwd) and its forward share;
  if that profile came after a dynamism event, its layers stand in for dense ones
  (said in `notes`: train with `--dynmo-profile-every N` to profile before it);
* the output layer + loss (last stage's extras) and the embedding (first stage's), in
  those layers; with one stage both are on it and all of it counts as the head;
* a curve for the knob the run's scenario changed, when its events say per layer what
  changed: gradual pruning's per-layer sparsity -> `pruning_<granularity>` (one point
  per profile: median share kept, median layer cost relative to the dense one).
  Other scenarios give no curve yet; their knob falls back to the FLOP ratio times the
  measured layer (`MeasuredCosts.priced_by` says so).

The simulated model then takes the run's shape (hidden, heads, sequence, micro-batch,
vocabulary); only the number of layers and the cluster are the what-if's.
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dynmo_plugin.errors import UserError
from dynmo_plugin.report import SUMMARY_NAME, read_report
from dynmo_plugin.sim.gpt import GPTShape, Hardware
from dynmo_plugin.sim.measured import Curve, MeasuredCosts, with_measured

__all__ = ["RunCosts", "from_run", "read_run_report"]


@dataclass(frozen=True)
class RunCosts:
    """What a run measured: its cost profile, model shape and scenario."""

    measured: MeasuredCosts
    model: dict[str, Any]
    scenario: str | None
    granularity: str | None

    def shape(self, num_layers: int, output_layer: bool = True) -> GPTShape:
        m = self.model
        return GPTShape(num_layers=num_layers, hidden=m["hidden_size"], heads=m["num_attention_heads"],
                        seq=m["seq_length"], micro_batch=m["micro_batch_size"], vocab=m["vocab_size"],
                        output_layer=output_layer)

    def hardware(self, base: Hardware | None = None) -> Hardware:
        return with_measured(base or Hardware(), self.measured)


def read_run_report(run_dir: str | Path, flag: str = "--costs-from") -> dict:
    """The run's report: its summary, or its log replayed when the run did not finish;
    its shape checked once here for every reader (`_shape_problem`).

    Raises:
        UserError: naming `flag` and the file, when there is no readable report or it is
            not shaped like one.
    """
    path = Path(run_dir)
    path = path / SUMMARY_NAME if path.is_dir() else path
    where = f"{flag} {str(run_dir)!r}"
    try:
        report = read_report(run_dir)
    except UserError:  # a log that cannot be replayed: its own line
        raise
    except OSError as e:
        raise UserError(f"{where}: cannot read {path} ({e.strerror or e}); "
                        "pass a training run's --output directory") from e
    except UnicodeDecodeError as e:
        raise UserError(f"{where}: {path} is not UTF-8 text ({e.reason} at byte {e.start}); "
                        "pass the report.json a training run wrote") from e
    except (ValueError, RecursionError) as e:  # json.JSONDecodeError is a ValueError
        raise UserError(f"{where}: {path} is not JSON ({e})") from e
    problem = _shape_problem(report)
    if problem:
        raise UserError(f"{where}: {path} is not a run's report: {problem}; pass the "
                        "report.json a training run wrote (its --output directory)")
    return report


_EVENT_TEXT = ("kind", "trigger", "reason", "layout", "layout_before", "layout_after")
# The profile fields the readers of a report use (this module, sim.run_replay, and
# `PipelineProfile.from_dict` for `dynmo plan --from-run`): name -> required. Each is a
# number >= 0 (`profiling.records`; not imported here: its package pulls torch).
_LAYER_FIELDS = {"layer": True, "stage": False, "fwd_s": True, "bwd_s": True,
                 "param_bytes": False, "grad_bytes": False}
_STAGE_FIELDS = {"stage": True, "extra_s": True, "extra_grad_bytes": False, "step_s": False,
                 "rest_s": False, "num_microbatches": False, "threads_s": False}


def _kind(value: Any) -> str:
    named = {dict: "an object", list: "a list", str: "a string"}.get(type(value))
    return named or json.dumps(value)


def _shape_problem(report: Any) -> str | None:
    """What makes `report` not a run's report, or None: an object whose events (when
    present) are a list of objects; an event's iteration (an integer), window ([first,
    last]), texts (`_EVENT_TEXT`) and profile are each optional; a profile is an object
    whose layers and stages are lists of objects holding the fields above."""
    if not isinstance(report, dict):
        return f"it holds {_kind(report)}, not an object"
    events = report.get("events", [])
    if not isinstance(events, list):
        return f"events is {_kind(events)}, not a list"
    for i, event in enumerate(events):
        if not isinstance(event, dict):
            return f"events[{i}] is {_kind(event)}, not an object"
        if not _is_int(event.get("iteration", 0)):
            return f"events[{i}].iteration is {_kind(event['iteration'])}, not an integer"
        text = next((k for k in _EVENT_TEXT if not isinstance(event.get(k), (str, type(None)))), None)
        if text:
            return f"events[{i}].{text} is {_kind(event[text])}, not a string"
        window = event.get("window")
        if window is not None and not (isinstance(window, list) and len(window) == 2
                                       and all(_is_int(x) for x in window)):
            return f"events[{i}].window is {_kind(window)}, not [first, last] iterations"
        profile = event.get("profile")
        if profile is None:
            continue
        if not isinstance(profile, dict):
            return f"events[{i}].profile is {_kind(profile)}, not an object"
        for part, spec in (("layers", _LAYER_FIELDS), ("stages", _STAGE_FIELDS)):
            problem = _records_problem(profile.get(part, []), spec, f"events[{i}].profile.{part}")
            if problem:
                return problem
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _records_problem(records: Any, spec: dict[str, bool], name: str) -> str | None:
    if not isinstance(records, list):
        return f"{name} is {_kind(records)}, not a list"
    for j, record in enumerate(records):
        if not isinstance(record, dict):
            return f"{name}[{j}] is {_kind(record)}, not an object"
        for key, required in spec.items():
            if key not in record:
                if required:
                    return f"{name}[{j}] lacks {key}"
                continue
            value = record[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value < 0:
                return f"{name}[{j}].{key} is {_kind(value)}, not a number >= 0"
    return None


def _profiles(report: dict, run_dir: str | Path) -> list[tuple[int, dict]]:
    """(first profiled iteration, profile) of every event with a per-layer profile."""
    out = []
    for e in report.get("events", []):
        profile = e.get("profile") or {}
        if profile.get("layers") and profile.get("stages"):
            start = (e.get("window") or [e.get("iteration", 0)])[0]
            out.append((int(start), profile))
    if not out:
        raise UserError(f"--costs-from {str(run_dir)!r}: report.json holds no per-layer profile; "
                        "train with --dynmo and --dynmo-profile-every N (or a dynamism scenario)")
    return sorted(out, key=lambda x: x[0])


def _totals(profile: dict) -> list[float]:
    return [x["fwd_s"] + x["bwd_s"] for x in profile["layers"]]


def _pruning_curve(report: dict, profiles: list[tuple[int, dict]], layer_s: float) -> Curve | None:
    """Median share kept vs median relative layer cost, one point per profile."""
    events = [e for e in report.get("events", [])
              if e.get("kind") == "dynamism" and "sparsity" in (e.get("detail") or {})]
    if not events:
        return None
    points: dict[float, list[float]] = {}
    for start, profile in profiles:
        before = [e for e in events if e["iteration"] < start]
        kept = 1.0 if not before else statistics.median(
            1.0 - float(s) for s in before[-1]["detail"]["sparsity"].values())
        points.setdefault(round(kept, 4), []).append(statistics.median(_totals(profile)) / layer_s)
    return Curve(tuple((x, statistics.median(ys)) for x, ys in sorted(points.items())))


def from_run(run_dir: str | Path) -> RunCosts:
    """The cost profile of the run in `run_dir` (module docstring).

    Raises:
        UserError: no readable report.json, or no per-layer profile in it.
    """
    report = read_run_report(run_dir)
    try:
        return _costs(report, run_dir)
    except UserError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, ArithmeticError) as e:
        raise UserError(f"--costs-from {str(run_dir)!r}: its report lacks or mangles what the cost "
                        f"profile needs ({type(e).__name__}: {e}); pass the report.json a "
                        "training run wrote") from e


_MODEL_FIELDS = ("hidden_size", "num_attention_heads", "seq_length", "micro_batch_size", "vocab_size")


def _costs(report: dict, run_dir: str | Path) -> RunCosts:
    """`from_run` of a report read and shape-checked (`read_run_report`)."""
    profiles = _profiles(report, run_dir)
    first_it, first = profiles[0]
    totals = _totals(first)
    layer_s = statistics.median(totals)
    if not layer_s > 0:
        raise UserError(f"--costs-from {str(run_dir)!r}: the first profile's layers cost "
                        f"{layer_s} s (median fwd+bwd): nothing to price the layers by")
    fwd_share = statistics.median(x["fwd_s"] / t for x, t in zip(first["layers"], totals) if t > 0)
    stages = sorted(first["stages"], key=lambda s: s["stage"])
    model = report["config"]["model"]
    bad = [k for k in _MODEL_FIELDS if isinstance(model.get(k), bool) or not isinstance(model.get(k), int)
           or model[k] < 1]
    if bad:
        raise UserError(f"--costs-from {str(run_dir)!r}: its config.model lacks {', '.join(bad)} as "
                        "integers >= 1 (the simulated model takes the run's shape)")
    dyn = report["config"].get("dynamism") or report["config"].get("dynmo", {}).get("dynamism", {})
    kind = dyn.get("kind", "none")
    notes = {}
    head, embed = stages[-1]["extra_s"] / layer_s, stages[0]["extra_s"] / layer_s
    if len(stages) == 1:
        embed = 0.0
        notes["head_layers"] = "one stage: its extras (embedding + output layer + loss) count as the head"
    curves = {}
    scenario = None if kind == "none" else kind
    granularity = (dyn.get("pruning") or {}).get("granularity") if scenario == "gradual_pruning" else None
    dynamism_before = [e for e in report.get("events", [])
                       if e.get("kind") == "dynamism" and e["iteration"] < first_it]
    if dynamism_before:
        notes["layer_s"] = (f"the first profile (iteration {first_it}) came after a dynamism event: "
                            "its layers stand in for dense ones (profile before the first event "
                            "with --dynmo-profile-every N)")
    if scenario == "gradual_pruning":
        curve = _pruning_curve(report, profiles, layer_s)
        if curve is not None:
            curves[f"pruning_{granularity}"] = curve
    elif scenario is not None:
        notes[scenario] = "this scenario's events do not give per-layer state: no curve from the run"
    clock = stages[0].get("clock", "?")
    source = (f"report.json of {run_dir}: {len(profiles)} profile(s) from iteration {first_it}, "
              f"clock {clock}, backend {report.get('world', {}).get('backend', '?')}, "
              f"pp {report.get('world', {}).get('pp', '?')}")
    measured = MeasuredCosts(
        name=f"run:{Path(run_dir).name}", source=source, hidden=model["hidden_size"],
        seq=model["seq_length"], micro_batch=model["micro_batch_size"], vocab=model["vocab_size"],
        layer_s=layer_s, fwd_share=fwd_share, head_layers=head, embed_layers=embed,
        frozen_forward_only=1.0 / 3.0, curves=curves,
        notes=dict(notes, frozen_forward_only="not measured by the run: the FLOP ratio 1/3"))
    return RunCosts(measured, model, scenario, granularity)
