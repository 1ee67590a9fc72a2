"""The run report, written by rank 0 (see docs/usage.md, "The run report").

Two files in the output directory:

* `report.jsonl`, the log: one JSON object per line, appended as the run goes — a
  header (config, world, initial layout), then one line per iteration, per event and
  per change of layout or world. Appending costs the same at iteration 10 and at
  iteration 10^6, and a crashed or killed run leaves every line it flushed.
* `report.json`, the summary (the same document as ever: config, world, layouts,
  iterations, events, gpus). Rewriting it costs time proportional to the run, so it is
  written at the start, at the end (`close`, with `"complete": true`) and in between
  only after the log has doubled since the last rewrite (at least `snapshot_every`
  lines): amortised, a constant cost per line.

`read_report` gives the document either way: the summary of a finished run, else the
log replayed (a crashed run, whose summary lags behind its log).

A run resumed from a checkpoint (its world history starts after iteration 0) into the
same output directory continues the log instead of truncating it: a `resume` line, then
the new segment. The summary holds every iteration of every segment: each record
carries `segment` (0, 1, ...), the old segment's iterations after the checkpoint are
marked `"repeated": true` (the new segment ran them again: those count), and a
`kind: "resume"` event records where and what was repeated. A fresh run into a
directory that holds a log moves that log aside (`report.jsonl.1`, ...): nothing
is overwritten.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Optional

from dynmo_plugin.errors import UserError

__all__ = ["RunReport", "read_report", "replay_log", "summary_if_complete", "SUMMARY_NAME",
           "LOG_NAME"]

SUMMARY_NAME = "report.json"
LOG_NAME = "report.jsonl"


@dataclass
class RunReport:
    path: str                      # the summary, <output>/report.json; the log lies beside it
    config: dict
    world: dict
    initial_layout: str
    layout: str = ""
    iterations: list[dict] = field(default_factory=list)
    events: list = field(default_factory=list)
    enabled: bool = True  # False on ranks other than 0: recording stays cheap and local
    snapshot_every: int = 256      # the fewest log lines between two rewrites of the summary

    def __post_init__(self) -> None:
        self.layout = self.layout or self.initial_layout
        self.segment = 0
        self._log: Optional[IO[str]] = None
        self._lines = 0                 # log lines written
        self._next_snapshot = self.snapshot_every
        self._logged_state = (self.layout, len(self.world.get("history", [])))
        if self.enabled:
            self._open()

    @property
    def log_path(self) -> str:
        return os.path.join(os.path.dirname(os.path.abspath(self.path)), LOG_NAME)

    def add_iteration(self, iteration: int, loss: float, time_s: float, **extra: Any) -> None:
        record = {"iteration": iteration, "loss": loss, "time_s": time_s, **extra}
        if self.segment:
            record["segment"] = self.segment
        self.iterations.append(record)
        self._append({"kind": "iteration", "record": record})

    def add_event(self, event) -> None:
        """`event`: a typed event (dynmo_plugin.events) or a plain dict; kept by reference,
        so fields filled in later reach the summary; `update_event` logs them."""
        self.events.append(event)
        self._append({"kind": "event", "index": len(self.events) - 1, "record": _as_dict(event)})

    def update_event(self, event) -> None:
        """Log an event again after fields were filled in (the measured time after a
        rebalance); the replay keeps the last line of each event."""
        index = next((i for i in range(len(self.events) - 1, -1, -1) if self.events[i] is event), None)
        if index is None:  # never added: it is new
            self.add_event(event)
            return
        self._append({"kind": "event", "index": index, "record": _as_dict(event)})

    def to_dict(self) -> dict:
        return _summary(self.config, self.world, self.initial_layout, self.layout,
                        self.iterations, [_as_dict(e) for e in self.events])

    def write(self, complete: bool = False) -> None:
        """Rewrite the summary (atomically: a reader never sees half a file)."""
        if not self.enabled:
            return
        # json.dumps without indent runs the C encoder (json.dump, or any indent, runs
        # the pure-Python one: 5-10x slower on a long run's summary)
        text = json.dumps({**self.to_dict(), "complete": complete})
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, self.path)

    def close(self) -> None:
        """The run ended: log the final layout, write the complete summary."""
        if not self.enabled:
            return
        self._log_state()
        self.write(complete=True)
        if self._log is not None:
            self._log.close()
            self._log = None

    # ---- the log --------------------------------------------------------------------------
    def _open(self) -> None:
        """Start the log, or continue it when resuming (see the module docstring)."""
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        history = self.world.get("history") or [{}]
        resumed_at = history[0].get("iteration") or 0
        if resumed_at > 0 and os.path.isfile(self.log_path):
            self._continue(resumed_at)
            return
        _move_aside(self.log_path)
        self._open_fresh()

    def _continue(self, resumed_at: int) -> None:
        """Append a new segment to the log of the run this one resumes."""
        _drop_cut_line(self.log_path)
        try:
            old = replay_log(self.log_path)
        except UserError:  # not a log we can extend: keep it, start a new one
            _move_aside(self.log_path)
            return self._open_fresh()
        self.segment = 1 + sum(1 for e in old["events"] if isinstance(e, dict) and e.get("kind") == "resume")
        repeated = _mark_repeated(old["iterations"], resumed_at)
        self.iterations[:0] = old["iterations"]
        self.events[:0] = old["events"]
        self.world["history"][:0] = old["world"].get("history", [])
        self.initial_layout = old["initial_layout"] or self.initial_layout
        self._logged_state = (self.layout, len(self.world.get("history", [])))
        self._log = open(self.log_path, "a", encoding="utf-8")
        self._line({"kind": "resume", "iteration": resumed_at, "segment": self.segment,
                    "config": self.config, "world": self.world, "layout": self.layout})
        self.add_event({"kind": "resume", "iteration": resumed_at, "segment": self.segment,
                        "layout": self.layout, "repeated": repeated})
        self.write()

    def _open_fresh(self) -> None:
        self._log = open(self.log_path, "w", encoding="utf-8")
        self._line({"kind": "header", "config": self.config, "world": self.world,
                    "initial_layout": self.initial_layout})
        self.write()

    def _line(self, obj: dict) -> None:
        self._log.write(json.dumps(obj) + "\n")  # type: ignore[union-attr]
        self._log.flush()  # in the OS's hands: a killed process loses nothing it logged
        self._lines += 1

    def _log_state(self) -> None:
        """A 'state' line when the layout or the world (a repack) changed since the last."""
        state = (self.layout, len(self.world.get("history", [])))
        if state != self._logged_state and self._log is not None:
            self._logged_state = state
            self._line({"kind": "state", "layout": self.layout, "world": self.world})

    def _append(self, obj: dict) -> None:
        if not self.enabled or self._log is None:
            return
        self._log_state()
        self._line(obj)
        if self._lines >= self._next_snapshot:
            self.write()
            self._next_snapshot = self._lines + max(self.snapshot_every, self._lines)


def _move_aside(log: str) -> None:
    """Rename an existing log to the first free `<log>.N`: a new run never overwrites one."""
    if not os.path.exists(log):
        return
    n = 1
    while os.path.exists(f"{log}.{n}"):
        n += 1
    os.replace(log, f"{log}.{n}")


def _drop_cut_line(log: str) -> None:
    """Cut a last line left without its newline by a kill, so appending stays JSON lines."""
    with open(log, "rb+") as fh:
        data = fh.read()
        if data and not data.endswith(b"\n"):
            fh.truncate(data.rfind(b"\n") + 1)


def _mark_repeated(iterations: list, resumed_at: int) -> Optional[list[int]]:
    """Mark the records after the checkpoint `repeated`; [first, last] of them, or None."""
    marked = [r for r in iterations if isinstance(r, dict) and isinstance(r.get("iteration"), (int, float))
              and r["iteration"] > resumed_at and not r.get("repeated")]
    for r in marked:
        r["repeated"] = True
    return [marked[0]["iteration"], marked[-1]["iteration"]] if marked else None


def _as_dict(event) -> dict:
    return event if isinstance(event, dict) else event.to_dict()


def _summary(config: dict, world: dict, initial_layout: str, layout: str,
             iterations: list[dict], events: list[dict]) -> dict:
    """report.json's document; `gpus` (ranks in use over time, for the plots) changes on
    repacks."""
    gpus = [{"iteration": h["iteration"], "gpus": h["world_size"]} for h in world.get("history", [])]
    if gpus and iterations and iterations[-1]["iteration"] > gpus[-1]["iteration"]:
        gpus.append({"iteration": iterations[-1]["iteration"], "gpus": gpus[-1]["gpus"]})
    return {"config": config, "world": world, "initial_layout": initial_layout,
            "layout": layout, "iterations": iterations, "events": events, "gpus": gpus}


def _log_lines(path: Path) -> list[dict]:
    """The log's objects; a last line cut short by a kill is dropped.

    Raises:
        UserError: unreadable, or a line other than the last is not a JSON object.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read run log {path}: {e}") from e
    lines = text.split("\n")
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError) as e:
            if number == len(lines):  # no newline after it: the write was cut short
                break
            raise UserError(f"{path}: line {number} is not JSON ({e}); the log is corrupt") from e
        if not isinstance(obj, dict):
            raise UserError(f"{path}: line {number} is not a JSON object; the log is corrupt")
        out.append(obj)
    return out


def replay_log(path: str | Path) -> dict:
    """report.json's document rebuilt from a log (`report.jsonl`), with "complete": false.

    Raises:
        UserError: unreadable or corrupt, or without its header line.
    """
    path = Path(path)
    lines = _log_lines(path)
    if not lines or lines[0].get("kind") != "header":
        raise UserError(f"{path} does not start with a header line; it is not a run log "
                        "written by dynmo")
    head = lines[0]
    world, layout = head.get("world") or {}, head.get("initial_layout")
    iterations: list[dict] = []
    events: dict[int, dict] = {}
    for obj in lines[1:]:
        kind = obj.get("kind")
        if kind == "iteration":
            iterations.append(obj.get("record"))
        elif kind == "event" and isinstance(obj.get("index"), int):
            events[obj["index"]] = obj.get("record")
        elif kind == "state":
            world, layout = obj.get("world") or world, obj.get("layout", layout)
        elif kind == "resume" and isinstance(obj.get("iteration"), int):
            _mark_repeated(iterations, obj["iteration"])
            world, layout = obj.get("world") or world, obj.get("layout", layout)
    records = [r for r in iterations if isinstance(r, dict)]
    usable = [r for r in records if isinstance(r.get("iteration"), (int, float))]
    summary = _summary(head.get("config") or {}, world, head.get("initial_layout"), layout,
                       usable, [events[i] for i in sorted(events)])
    summary["iterations"] = iterations  # the reader judges odd records, as in a summary
    return {**summary, "complete": False}


def read_report(run_dir: str | Path) -> dict:
    """report.json's document for a run directory (or a report.json path): the summary
    when the run completed or left no log (an older launcher, a hand-written file),
    else the log replayed. For scripts and tests; `dynmo report` reads through
    dynmo_plugin.reporting, which judges every field.

    Raises:
        UserError: the log cannot be replayed (see `replay_log`).
        OSError, ValueError: no log, and the summary is missing or not JSON.
    """
    path = Path(run_dir)
    if path.is_dir():
        path = path / SUMMARY_NAME
    log = path.with_name(LOG_NAME)
    if not log.is_file():
        return json.loads(path.read_text(encoding="utf-8"))
    summary = summary_if_complete(path)
    return summary if summary is not None else replay_log(log)


def summary_if_complete(path: Path) -> Optional[dict]:
    """The summary at `path` if the run that wrote it completed, else None."""
    try:
        summary = json.loads(path.read_text(encoding="utf-8-sig"))
    except (OSError, ValueError, RecursionError):
        return None
    return summary if isinstance(summary, dict) and summary.get("complete") is True else None
