"""Reading `report.json` (written by the launcher's `dynmo_plugin.report.RunReport`).

Tolerant by design: a run that crashed, ran without the plugin, or was written by an
older launcher lacks fields; every optional field may be absent and the report still
renders. Only an unreadable file or one that is not a JSON object is a user error.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dynmo_plugin.errors import UserError

__all__ = ["Event", "Report", "load_report", "REPORT_NAME"]

REPORT_NAME = "report.json"


def _num(value: Any) -> float | None:
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None


def _nums(values: Any) -> list[float] | None:
    if not isinstance(values, list):
        return None
    out = [_num(v) for v in values]
    return None if any(v is None for v in out) else out  # type: ignore[return-value]


@dataclass(frozen=True)
class Event:
    """One plugin event; fields absent from the file are None / empty."""

    iteration: int | None
    kind: str
    trigger: str | None = None
    applied: bool | None = None
    layout_before: str | None = None
    layout_after: str | None = None
    loads_before: list[float] | None = None
    loads_after: list[float] | None = None
    imbalance_before: float | None = None
    imbalance_after: float | None = None
    measured_before: float | None = None
    measured_after: float | None = None
    predicted_before: float | None = None
    predicted_after: float | None = None
    overhead_s: dict[str, float] = field(default_factory=dict)
    num_moves: int = 0
    moved_bytes: float = 0.0

    @classmethod
    def from_json(cls, raw: dict) -> "Event":
        it = _num(raw.get("iteration"))
        moves = raw.get("moves") if isinstance(raw.get("moves"), list) else []
        overhead = raw.get("overhead_s") if isinstance(raw.get("overhead_s"), dict) else {}
        return cls(
            iteration=None if it is None else int(it), kind=str(raw.get("kind", "event")),
            trigger=raw.get("trigger"), applied=raw.get("applied"),
            layout_before=raw.get("layout_before"), layout_after=raw.get("layout_after"),
            loads_before=_nums(raw.get("stage_loads_before")),
            loads_after=_nums(raw.get("stage_loads_after")),
            imbalance_before=_num(raw.get("imbalance_before")),
            imbalance_after=_num(raw.get("imbalance_after")),
            measured_before=_num(raw.get("measured_iter_s_before")),
            measured_after=_num(raw.get("measured_iter_s_after")),
            predicted_before=_num(raw.get("predicted_iter_s_before")),
            predicted_after=_num(raw.get("predicted_iter_s_after")),
            overhead_s={k: v for k, v in ((k, _num(v)) for k, v in overhead.items()) if v is not None},
            num_moves=len(moves),
            moved_bytes=sum(_num(m.get("bytes")) or 0.0 for m in moves if isinstance(m, dict)))


@dataclass(frozen=True)
class Report:
    """What the plots and the summary need from one run."""

    path: Path
    world: dict
    initial_layout: str | None
    layout: str | None
    iterations: list[int]
    losses: list[float | None]
    times: list[float | None]
    events: list[Event]
    gpus: list[tuple[int, int]]
    config: dict


def _records(raw: Any) -> list[dict]:
    return [r for r in raw if isinstance(r, dict)] if isinstance(raw, list) else []


def load_report(run_dir: str | Path) -> Report:
    """Load `RUN_DIR/report.json` (or the file itself if a file is given)."""
    path = Path(run_dir)
    if path.is_dir():
        path = path / REPORT_NAME
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise UserError(f"no run report at {path}; pass the --output directory of a training run") from e
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read run report {path}: {e}") from e
    if not isinstance(raw, dict):
        raise UserError(f"{path} is not a run report (expected a JSON object)")
    its = [r for r in _records(raw.get("iterations")) if _num(r.get("iteration")) is not None]
    gpus = [(int(_num(g.get("iteration"))), int(_num(g.get("gpus"))))  # type: ignore[arg-type]
            for g in _records(raw.get("gpus"))
            if _num(g.get("iteration")) is not None and _num(g.get("gpus")) is not None]
    return Report(path=path, world=raw.get("world") if isinstance(raw.get("world"), dict) else {},
                  initial_layout=raw.get("initial_layout"), layout=raw.get("layout"),
                  iterations=[int(_num(r["iteration"])) for r in its],  # type: ignore[arg-type]
                  losses=[_num(r.get("loss")) for r in its], times=[_num(r.get("time_s")) for r in its],
                  events=[Event.from_json(e) for e in _records(raw.get("events"))], gpus=gpus,
                  config=raw.get("config") if isinstance(raw.get("config"), dict) else {})
