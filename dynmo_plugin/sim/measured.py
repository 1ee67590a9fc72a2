"""Per-layer costs from measured curves: what a layer really costs, not its FLOPs.

Why: on an H100 at the DynMo paper's shape (hidden 1024, sequence 2048, micro-batch 2)
a decoder layer's forward+backward has a launch-bound floor of ~2 ms: processing 12.5%
of the tokens, pruning 90% of the weights or sparsifying attention leaves it at
0.9-1.1x, while the FLOP model says 0.1-0.5x (docs/simulator.md, 'Measured on an H100'). A
what-if that prices dynamism by FLOPs predicts savings the hardware does not give.

A `MeasuredCosts` holds, for ONE model shape (hidden, sequence, micro-batch):
  layer_s: a dense layer's forward+backward seconds per micro-batch;
  fwd_share: the forward's share of it;
  head_layers / embed_layers: output layer + loss, and embedding, in dense layers;
  frozen_forward_only: a frozen-prefix layer (forward only) relative to a dense one;
  curves: knob -> relative layer cost as a function of the knob's value (`KNOBS`),
      piecewise linear between measured points, held at the end values outside them.
A layer is priced by the curve of the knob its scenario sets (`LayerLoad.knob`); a
knob without a curve falls back to the FLOP model's ratio to a dense layer, times the
measured dense layer (`priced_by` says which). Frozen layers (backward 0) cost
`frozen_forward_only`, all of it forward.

Profiles ship as data (`profiles/*.json`, each naming its source), or are built from
a live run's report.json (`from_run`). Pure: numpy and the standard library.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from dynmo_plugin.errors import UserError
from dynmo_plugin.sim.gpt import GPTShape, Hardware, LayerCosts, LayerLoad, flop_layer_costs

__all__ = ["KNOBS", "Curve", "MeasuredCosts", "PROFILES", "hardware", "load_profile_file",
           "profile_entries", "with_measured"]

KNOBS = {
    "tokens": "share of the micro-batch's tokens the layer processes (MoD, early exit)",
    "attention_density": "share of the dense attention core computed (sparse attention)",
    "pruning_unstructured": "share of weights kept, unstructured (masked) pruning",
    "pruning_structured": "share of parameters kept, whole heads and FFN neurons removed",
    "expert_load": "busiest expert's tokens / balanced tokens per expert (MoE)",
}
_PROFILE_DIR = Path(__file__).resolve().parent / "profiles"
PROFILES = ("a100-flops", "h100")  # a100-flops: the FLOP model, no measured curves
GPU_MODELS = ("h100-gpu", "h200-gpu")  # gpu_curves' named models (gpu_check's curves)


@dataclass(frozen=True)
class Curve:
    """Relative cost at measured knob values: points (x, y), x strictly increasing."""

    points: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        xs = [p[0] for p in self.points]
        ok = len(self.points) >= 1 and all(len(p) == 2 for p in self.points) and all(
            math.isfinite(v) for p in self.points for v in p) and all(p[1] > 0 for p in self.points)
        if not ok or any(b <= a for a, b in zip(xs, xs[1:])):
            raise UserError(f"a cost curve needs [x, y] points with x strictly increasing and "
                            f"y > 0, got {list(self.points)!r}")

    def __call__(self, x: np.ndarray) -> np.ndarray:
        xs, ys = zip(*self.points)
        return np.interp(np.asarray(x, dtype=float), xs, ys)


@dataclass(frozen=True, kw_only=True)
class MeasuredCosts:
    """Measured per-layer costs of one model shape (module docstring)."""

    name: str
    source: str
    hidden: int
    seq: int
    micro_batch: int
    vocab: int
    layer_s: float
    fwd_share: float
    head_layers: float
    frozen_forward_only: float
    embed_layers: float = 0.0
    curves: Mapping[str, Curve] = field(default_factory=dict)
    notes: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.curves) - set(KNOBS))
        if unknown:
            raise UserError(f"profile {self.name!r}: unknown curve(s) {unknown}; knobs are "
                            f"{', '.join(KNOBS)}")
        numbers = {"layer_s": self.layer_s, "head_layers": self.head_layers,
                   "embed_layers": self.embed_layers, "frozen_forward_only": self.frozen_forward_only}
        bad = {k: v for k, v in numbers.items() if not (math.isfinite(v) and v >= 0)}
        if bad or not self.layer_s > 0 or not 0 < self.fwd_share <= 1:
            raise UserError(f"profile {self.name!r}: need layer_s > 0, 0 < fwd_share <= 1 and "
                            f"finite values >= 0, got {dict(numbers, fwd_share=self.fwd_share)}")

    @property
    def shape_text(self) -> str:
        return f"hidden {self.hidden}, seq {self.seq}, micro-batch {self.micro_batch}"

    def matches(self, shape: GPTShape) -> bool:
        return (shape.hidden, shape.seq, shape.micro_batch) == (self.hidden, self.seq, self.micro_batch)

    def priced_by(self, knob: str | None) -> str:
        """How layers with `knob` are priced: 'curve' or 'flops (why)'."""
        if knob is None or knob in self.curves:
            return "curve" if knob else "dense layer"
        return f"flops ratio x measured dense layer ({self.notes.get(knob, 'no measured curve')})"

    def layer_costs(self, shape: GPTShape, load: LayerLoad) -> LayerCosts:
        """Per-layer seconds under `load` (module docstring).

        Raises:
            UserError: `shape` is not the measured one.
        """
        if not self.matches(shape):
            raise UserError(f"profile {self.name!r} was measured at {self.shape_text}; the model "
                            f"has hidden {shape.hidden}, seq {shape.seq}, micro-batch "
                            f"{shape.micro_batch}: use that shape or another profile")
        flop = flop_layer_costs(shape, Hardware(), load)
        dense = flop_layer_costs(shape, Hardware(), LayerLoad.dense(1))
        fwd_rel, bwd_rel = flop.fwd_s / dense.fwd_s[0], flop.bwd_s / dense.bwd_s[0]
        if load.knob in self.curves:
            rel = self.curves[load.knob](load.knob_value)
            fwd_rel, bwd_rel = rel, rel * (load.backward > 0)
        frozen = load.backward == 0
        fwd = self.layer_s * np.where(frozen, self.frozen_forward_only, self.fwd_share * fwd_rel)
        bwd = self.layer_s * (1 - self.fwd_share) * np.where(frozen, 0.0, bwd_rel)
        head = self.head_layers * self.layer_s * shape.vocab / self.vocab if shape.output_layer else 0.0
        return LayerCosts(fwd_s=fwd, bwd_s=bwd, head_fwd_s=head / 3,
                          embed_fwd_s=self.embed_layers * self.layer_s / 3)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "source": self.source, "hidden": self.hidden, "seq": self.seq,
                "micro_batch": self.micro_batch, "vocab": self.vocab, "layer_s": self.layer_s,
                "fwd_share": self.fwd_share, "head_layers": self.head_layers,
                "embed_layers": self.embed_layers, "frozen_forward_only": self.frozen_forward_only,
                "curves": {k: [list(p) for p in c.points] for k, c in self.curves.items()},
                "notes": dict(self.notes)}


def _from_entry(name: str, source: str, entry: Mapping[str, Any]) -> MeasuredCosts:
    try:
        return MeasuredCosts(
            name=name, source=source, hidden=int(entry["hidden"]), seq=int(entry["seq"]),
            micro_batch=int(entry["micro_batch"]), vocab=int(entry["vocab"]),
            layer_s=float(entry["layer_s"]), fwd_share=float(entry["fwd_share"]),
            head_layers=float(entry["head_layers"]), embed_layers=float(entry.get("embed_layers", 0.0)),
            frozen_forward_only=float(entry["frozen_forward_only"]),
            curves={k: Curve(tuple((float(x), float(y)) for x, y in v))
                    for k, v in entry.get("curves", {}).items()},
            notes=dict(entry.get("notes", {})))
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"profile {name!r}: a shape entry lacks or mangles {e}; see "
                        "dynmo_plugin/sim/profiles/h100.json for the format") from e


def load_profile_file(path: str | Path) -> list[MeasuredCosts]:
    """Every shape of a profile file (the format of profiles/h100.json).

    Raises:
        UserError: unreadable file, not JSON, or a malformed entry.
    """
    what = (f"hardware profile {str(path)!r} is not a profile: give a JSON object with name, "
            "source and shapes (a list of objects), as dynmo_plugin/sim/profiles/h100.json")
    data = read_json(path, "hardware profile", what)
    return profile_entries(data, what)


def read_json(path: str | Path, kind: str, not_json: str) -> Any:
    """The JSON document in `path`, or a UserError: "cannot read <kind> ..." when the file
    cannot be read, `not_json` (with the decoder's reason) when it is not UTF-8 JSON."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise UserError(f"cannot read {kind} {str(path)!r}: {e.strerror or e}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{not_json} ({type(e).__name__} {e})") from e


def profile_entries(data: Any, what: str = "the profile") -> list[MeasuredCosts]:
    """Every shape of a profile dict ({name, source, shapes: [...]}), checked.

    Raises:
        UserError: `what` is not a profile, or an entry is malformed.
    """
    if not isinstance(data, dict) or not {"name", "source", "shapes"} <= data.keys():
        found = type(data).__name__ if not isinstance(data, dict) else f"keys {sorted(data)}"
        raise UserError(f"{what}; found {found}")
    shapes = data["shapes"]
    if not isinstance(shapes, list) or not all(isinstance(s, dict) for s in shapes):
        raise UserError(f"{what}; its shapes are not a list of objects")
    return [_from_entry(str(data["name"]), str(data["source"]), s) for s in shapes]


def hardware(profile: str, shape: GPTShape, base: Hardware | None = None) -> Hardware:
    """`base` (default `Hardware()`) priced by `profile`: 'a100-flops' (the FLOP model),
    'h100' (shipped), or a path to a profile file; the entry measured at `shape`.

    Raises:
        UserError: unknown profile, or no entry for `shape` (the message lists them).
    """
    base = base or Hardware()
    if profile == "a100-flops":
        return base
    path = _PROFILE_DIR / f"{profile}.json" if profile in PROFILES else Path(profile)
    if profile not in PROFILES and not path.is_file():
        raise UserError(f"unknown hardware profile {profile!r}: give one of "
                        f"{', '.join((*PROFILES, *GPU_MODELS))} or a profile file's path")
    entries = load_profile_file(path)
    for entry in entries:
        if entry.matches(shape):
            return with_measured(base, entry)
    have = "; ".join(e.shape_text for e in entries)
    raise UserError(f"profile {entries[0].name if entries else profile!r} has no curves for hidden "
                    f"{shape.hidden}, seq {shape.seq}, micro-batch {shape.micro_batch}; it has: {have}")


def with_measured(base: Hardware, measured: MeasuredCosts) -> Hardware:
    """`base` with its compute priced by `measured`."""
    return replace(base, measured=measured, name=measured.name)
