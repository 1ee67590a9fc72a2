"""Reading `report.json` (written by the launcher's `dynmo_plugin.report.RunReport`), or
the `report.jsonl` log beside it when the run did not complete.

Tolerant of what real runs leave out, strict about what cannot be real:

* user errors (`UserError`, exit 2): an unreadable file, one that is not UTF-8 JSON, not
  an object, or holds no iterations ('iterations' missing, not a list, or without one
  record carrying an iteration number), or 'events' / 'gpus' present but not a list;
  and corrupt numbers: an iteration number that is not a whole number in [0, 2^53], a
  `time_s` that is not a finite number of seconds in [0, 1e150], a negative time or
  byte count or a negative iteration in an event, a GPU count below 1;
* tolerated: a run that crashed, ran without the plugin (no events), or was written by
  an older launcher lacks fields; absent or null optional fields, fields of another type
  (read as absent), and a non-finite loss (a diverged run) are left out, with a warning
  where data is dropped.
"""
from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dynmo_plugin.errors import UserError
from dynmo_plugin.report import LOG_NAME, replay_log, summary_if_complete

__all__ = ["Event", "Report", "load_report", "REPORT_NAME"]

REPORT_NAME = "report.json"
# Iteration numbers are whole numbers a float still counts exactly (plots use floats).
_MAX_ITERATION = 2**53
# Larger magnitudes are out of plotting range (matplotlib's axis arithmetic overflows
# near 1e308), and no run measures 1e150 seconds.
_MAX_PLOTTED = 1e150

log = logging.getLogger(__name__)


def _num(value: Any) -> float | None:
    """A finite number from a JSON value (numeric strings too), else None. JSON true and
    false are not numbers here (Python would read them as 1 and 0)."""
    if isinstance(value, bool):
        return None
    try:
        out = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return out if math.isfinite(out) else None


def _text(value: Any) -> str:
    """A JSON value as text that can be written as UTF-8: JSON may escape lone
    surrogates ("\\ud800") that no UTF-8 file can hold."""
    text = value if isinstance(value, str) else json.dumps(value)
    return text.encode("utf-8", "replace").decode("utf-8")


def _opt_text(value: Any) -> str | None:
    return None if value is None else _text(value)


def _whole(value: float | None, low: int, high: int) -> bool:
    """Whether `value` is a whole number in [low, high] (iteration numbers, GPU counts)."""
    return value is not None and value == int(value) and low <= value <= high


def _type_name(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(value), "a number")


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
    scenario: str | None = None  # dynamism events: which scenario changed the work
    stages_before: int | None = None  # repacks: pipeline stages before/after
    stages_after: int | None = None
    reason: str | None = None          # why the decision went as it did (flags named)
    planned_layout: str | None = None  # the plan's layout, applied or not
    repack_reason: str | None = None   # a repack considered and not applied: why
    mtp: str | None = None             # the profile's MTP block, as one line

    @property
    def label(self) -> str:
        """Legend text: the scenario for dynamism events, else the kind."""
        return f"{self.kind}: {self.scenario}" if self.scenario else self.kind

    @classmethod
    def from_json(cls, raw: dict) -> "Event":
        it = _num(raw.get("iteration"))
        moves = raw.get("moves") if isinstance(raw.get("moves"), list) else []
        overhead = raw.get("overhead_s") if isinstance(raw.get("overhead_s"), dict) else {}
        applied = raw.get("applied")
        repack = raw.get("repack")
        kind = _text(raw.get("kind", "event"))
        if isinstance(repack, dict) and repack.get("applied") is True:
            kind = "repack"  # a live rebalance that shrank the pipeline
        return cls(
            # a fractional iteration stays as read, for impossible() to name it
            iteration=None if it is None else int(it) if it == int(it) else it, kind=kind,
            trigger=_opt_text(raw.get("trigger")),
            applied=applied if isinstance(applied, bool) else None,
            layout_before=_opt_text(raw.get("layout_before")),
            layout_after=_opt_text(raw.get("layout_after")),
            loads_before=_nums(raw.get("stage_loads_before")),
            loads_after=_nums(raw.get("stage_loads_after")),
            imbalance_before=_num(raw.get("imbalance_before")),
            imbalance_after=_num(raw.get("imbalance_after")),
            measured_before=_num(raw.get("measured_iter_s_before")),
            measured_after=_num(raw.get("measured_iter_s_after")),
            predicted_before=_num(raw.get("predicted_iter_s_before")),
            predicted_after=_num(raw.get("predicted_iter_s_after")),
            overhead_s={_text(k): v for k, v in ((k, _num(v)) for k, v in overhead.items())
                        if v is not None},
            num_moves=len(moves),
            moved_bytes=sum(_num(m.get("bytes")) or 0.0 for m in moves if isinstance(m, dict)),
            scenario=_opt_text(raw.get("scenario")),
            stages_before=_stage_count(repack, "stages_before"),
            stages_after=_stage_count(repack, "stages_after"),
            reason=_opt_text(raw.get("error") or raw.get("reason") or raw.get("cancelled")),
            planned_layout=_opt_text(raw.get("planned_layout")),
            repack_reason=_opt_text((raw.get("repack_considered") or {}).get("reason")
                                    if isinstance(raw.get("repack_considered"), dict) else None),
            mtp=_mtp_line(raw.get("profile")))

    def impossible(self) -> tuple[str, float] | None:
        """The first field holding a value no run produces (negative seconds or bytes,
        seconds beyond 1e150, an iteration number that is not a whole number >= 0), as
        (field, value); else None."""
        if self.iteration is not None and not _whole(self.iteration, 0, _MAX_ITERATION):
            return "iteration", self.iteration
        fields = [("stage_loads_before", v) for v in self.loads_before or []]
        fields += [("stage_loads_after", v) for v in self.loads_after or []]
        fields += [(f"overhead_s.{k}", v) for k, v in self.overhead_s.items()]
        fields += [("measured_iter_s_before", self.measured_before),
                   ("measured_iter_s_after", self.measured_after),
                   ("predicted_iter_s_before", self.predicted_before),
                   ("predicted_iter_s_after", self.predicted_after)]
        bad = next(((k, v) for k, v in fields if v is not None and not 0 <= v <= _MAX_PLOTTED), None)
        return bad or (("moves[].bytes", self.moved_bytes) if self.moved_bytes < 0 else None)


def _mtp_line(profile: Any) -> str | None:
    """The profiled MTP block (`PipelineProfile.mtp`) in one line, or None."""
    mtp = profile.get("mtp") if isinstance(profile, dict) else None
    if not isinstance(mtp, dict):
        return None
    fwd, bwd = _num(mtp.get("fwd_s")) or 0.0, _num(mtp.get("bwd_s")) or 0.0
    state = sum(_num(mtp.get(k)) or 0.0 for k in ("param_bytes", "grad_bytes", "optim_bytes"))
    return (f"{_text(mtp.get('layer'))} layer(s) on stage {_text(mtp.get('stage'))}: "
            f"{1e3 * (fwd + bwd):.3f} ms fwd+bwd per micro-batch, {state / 1e6:.2f} MB state, "
            f"{(_num(mtp.get('act_bytes')) or 0.0) / 1e6:.2f} MB activations per micro-batch")


def _stage_count(repack: Any, key: str) -> int | None:
    value = _num(repack.get(key)) if isinstance(repack, dict) else None
    return int(value) if _whole(value, 1, _MAX_ITERATION) else None


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
    complete: bool = True       # False: the run did not finish (its log was replayed)
    train_iters: int | None = None  # iterations the run was asked for (config)
    repeated: int = 0           # records of a killed run that its resume ran again (left out)

    def steady_times(self, iteration: int, count: int = 5) -> tuple[float | None, float | None]:
        """Mean iteration time over up to `count` iterations before `iteration` and
        after it, leaving out `iteration` itself (the change happens in it) and the first
        one after (still slow: new communicators, caches), so the gain is not understated."""
        pts = [(i, t) for i, t in zip(self.iterations, self.times) if t is not None]
        before = [t for i, t in pts if i < iteration][-count:]
        after = [t for i, t in pts if i > iteration + 1][:count]
        mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
        return mean(before), mean(after)


def _read_json(path: Path) -> Any:
    """The parsed file; every way it can be unreadable is a user error.

    Raises:
        UserError: no such file, unreadable, not UTF-8, or not JSON.
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError as e:
        raise UserError(f"no run report at {path}; pass the --output directory of a training run") from e
    except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
        raise UserError(f"cannot read run report {path}: {getattr(e, 'strerror', None) or e}") from e
    try:
        return json.loads(data.decode("utf-8-sig"))
    except UnicodeDecodeError as e:
        raise UserError(f"run report {path} is not UTF-8 text (byte {data[e.start]:#04x} at offset "
                        f"{e.start}); it is not a run report written by dynmo") from e
    except json.JSONDecodeError as e:
        raise UserError(f"run report {path} is not valid JSON ({e}); a run killed while writing "
                        "it leaves report.json.tmp: check that file") from e
    except (ValueError, RecursionError) as e:  # a number of > 4300 digits; [[[[...]]]] nesting
        raise UserError(f"run report {path} holds JSON nested too deeply or a number too long "
                        "to read; it is not a run report written by dynmo") from e


def _read_raw(path: Path) -> tuple[Any, Path]:
    """(the report document, the file it came from): the summary when its run completed
    or there is no log beside it (older launchers, hand-written files), else the log
    replayed (a run that crashed or is still running: its summary lags behind).

    Raises:
        UserError: see `_read_json` and `dynmo_plugin.report.replay_log`.
    """
    log_path = path.with_name(LOG_NAME)
    if not log_path.is_file():
        return _read_json(path), path
    summary = summary_if_complete(path)
    if summary is not None:
        return summary, path
    if path.exists():
        log.warning("%s is not the final report (the run did not finish); read %s instead",
                    path, log_path)
    else:
        log.warning("the run did not finish (no %s yet); read its log %s", path.name, log_path)
    return replay_log(log_path), log_path


def _list_field(raw: dict, key: str, path: Path) -> list:
    """raw[key] as a list ([] if absent or null).

    Raises:
        UserError: the field is there but is not a list.
    """
    value = raw.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise UserError(f"{path}: '{key}' must be a list of records, got {_type_name(value)}; "
                        "the file is not a run report written by dynmo")
    return value


def _records(values: list, key: str, required: str) -> list[tuple[int, dict]]:
    """(index, record) for the entries that are objects with a numeric `required` field;
    the others are skipped with a warning (a partial record does not spoil the report)."""
    out = [(i, r) for i, r in enumerate(values) if isinstance(r, dict) and _num(r.get(required)) is not None]
    if len(out) < len(values):
        log.warning("%s: skipped %d of %d entries that are not objects with a numeric '%s'",
                    key, len(values) - len(out), len(values), required)
    return out


def _corrupt(path: Path, where: str, name: str, value: Any, rule: str) -> UserError:
    """The error for a value no run writes: plotting it would present it as measured."""
    return UserError(f"{path}: {where} has {name} = {json.dumps(value)[:40]}; {rule}, so the "
                     "report is corrupt: re-run, or fix or drop that entry")


def _iteration_number(path: Path, i: int, record: dict) -> int:
    """The record's iteration number; a negative or fractional one marks a corrupt file."""
    it = _num(record["iteration"])
    if not _whole(it, 0, _MAX_ITERATION):
        raise _corrupt(path, f"iterations[{i}]", "iteration", record["iteration"],
                       "iteration numbers are whole numbers >= 0")
    return int(it)  # type: ignore[arg-type]


def _iteration_time(path: Path, i: int, it: int, record: dict) -> float | None:
    """time_s may be absent (not recorded); when given it must be a real duration."""
    value = record.get("time_s")
    if value is None:
        return None
    t = _num(value)
    if t is None or not 0 <= t <= _MAX_PLOTTED:
        raise _corrupt(path, f"iteration {it} (iterations[{i}])", "time_s", value,
                       "iteration times are finite numbers of seconds >= 0 (and below 1e150)")
    return t


def _losses(records: list[tuple[int, dict]]) -> list[float | None]:
    """Losses; unusable ones (NaN after a divergence, out of plotting range) are left out."""
    out = [_num(r.get("loss")) for _, r in records]
    out = [v if v is not None and abs(v) <= _MAX_PLOTTED else None for v in out]
    dropped = [r["iteration"] for (_, r), v in zip(records, out) if v is None and r.get("loss") is not None]
    if dropped:
        log.warning("left out %d loss value(s) that are not finite numbers within +-1e150 "
                    "(first at iteration %s)", len(dropped), dropped[0])
    return out


def _iterations(raw: dict, path: Path) -> tuple[list[int], list[float | None], list[float | None]]:
    """(iteration numbers, losses, times): the one part every report needs.

    Raises:
        UserError: no iteration records, or a corrupt one.
    """
    if raw.get("iterations") is None:
        raise UserError(f"{path} holds no iterations ('iterations' is missing): the run stopped "
                        "before its first iteration, or this is not a run report written by dynmo")
    records = _records(_list_field(raw, "iterations", path), "iterations", "iteration")
    if not records:
        raise UserError(f"{path} holds no iterations: 'iterations' has no record with an "
                        "'iteration' number, so there is nothing to plot")
    records = [(i, r) for i, r in records if r.get("repeated") is not True]  # ran again later
    numbers = [_iteration_number(path, i, r) for i, r in records]
    times = [_iteration_time(path, i, it, r) for (i, r), it in zip(records, numbers)]
    return numbers, _losses(records), times


def _events(raw: dict, path: Path) -> list[Event]:
    """Plugin events; absent in a run without the plugin.

    Raises:
        UserError: 'events' is not a list, or an event holds an impossible number.
    """
    values = _list_field(raw, "events", path)
    out = []
    for i, record in enumerate(values):
        if not isinstance(record, dict):
            log.warning("events: skipped entry %d, which is not an object", i)
            continue
        event = Event.from_json(record)
        bad = event.impossible()
        if bad is not None:
            raise _corrupt(path, f"events[{i}] (iteration {event.iteration})", bad[0], bad[1],
                           "times, bytes and iteration numbers are never negative (and times "
                           "stay below 1e150 s)")
        out.append(event)
    return out


def _gpus(raw: dict, path: Path) -> list[tuple[int, int]]:
    """(iteration, GPUs in use) points; optional (runs that repack).

    Raises:
        UserError: 'gpus' is not a list, or a count / iteration that cannot be real.
    """
    out = []
    for i, g in _records(_list_field(raw, "gpus", path), "gpus", "gpus"):
        it, n = _num(g.get("iteration")), _num(g["gpus"])
        if not _whole(it, 0, _MAX_ITERATION) or not _whole(n, 1, _MAX_ITERATION):
            raise _corrupt(path, f"gpus[{i}]", "gpus/iteration", [g.get("iteration"), g["gpus"]],
                           "GPU counts are whole numbers >= 1 at whole iteration numbers >= 0")
        out.append((int(it), int(n)))  # type: ignore[arg-type]
    return out


def _dict_field(raw: dict, key: str) -> dict:
    value = raw.get(key)
    return value if isinstance(value, dict) else {}


def load_report(run_dir: str | Path) -> Report:
    """Load `RUN_DIR/report.json` (or the file itself if a file is given; its log
    `report.jsonl` names its run: the summary when the run finished, else the log).

    Raises:
        UserError: the file is missing, unreadable, holds no iterations or is corrupt
            (see the module docstring).
    """
    path = Path(run_dir)
    if path.is_dir():
        path = path / REPORT_NAME
    elif path.name == LOG_NAME:
        path = path.with_name(REPORT_NAME)
    raw, path = _read_raw(path)
    if not isinstance(raw, dict):
        raise UserError(f"{path} is not a run report (expected a JSON object, got {_type_name(raw)})")
    iterations, losses, times = _iterations(raw, path)
    repeated = sum(1 for r in raw["iterations"] if isinstance(r, dict) and r.get("repeated") is True)
    model = _dict_field(_dict_field(raw, "config"), "model")
    train_iters = _num(model.get("train_iters"))
    world = {_text(k): v if isinstance(v, (int, float)) else _text(v)
             for k, v in _dict_field(raw, "world").items() if not isinstance(v, (list, dict))}
    return Report(path=path, world=world, initial_layout=_opt_text(raw.get("initial_layout")),
                  layout=_opt_text(raw.get("layout")), iterations=iterations, losses=losses,
                  times=times, events=_events(raw, path), gpus=_gpus(raw, path),
                  config=_dict_field(raw, "config"), complete=raw.get("complete") is not False,
                  train_iters=int(train_iters) if _whole(train_iters, 1, _MAX_ITERATION) else None,
                  repeated=repeated)
