"""The run report: `<output>/report.json`, written by rank 0 (see docs/report.md).

Holds the config, the world shape, the initial and final layout, per-iteration loss
and time, and one entry per plugin event (profile, rebalance, repack). The file is
rewritten atomically after every event and at the end, so a crashed run still leaves
what it had.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RunReport"]


@dataclass
class RunReport:
    path: str
    config: dict
    world: dict
    initial_layout: str
    layout: str = ""
    iterations: list[dict] = field(default_factory=list)
    events: list = field(default_factory=list)
    enabled: bool = True  # False on ranks other than 0: recording stays cheap and local

    def __post_init__(self) -> None:
        self.layout = self.layout or self.initial_layout

    def add_iteration(self, iteration: int, loss: float, time_s: float, **extra: Any) -> None:
        self.iterations.append({"iteration": iteration, "loss": loss, "time_s": time_s, **extra})

    def add_event(self, event) -> None:
        """`event`: a typed event (dynmo_plugin.events) or a plain dict; kept by reference,
        so fields filled in later (measured time after a rebalance) reach the file."""
        self.events.append(event)
        self.write()

    def to_dict(self) -> dict:
        events = [e if isinstance(e, dict) else e.to_dict() for e in self.events]
        # GPUs (ranks) in use over time, as the report's plots read it; changes on repacks
        gpus = [{"iteration": h["iteration"], "gpus": h["world_size"]}
                for h in self.world.get("history", [])]
        if gpus and self.iterations and self.iterations[-1]["iteration"] > gpus[-1]["iteration"]:
            gpus.append({"iteration": self.iterations[-1]["iteration"], "gpus": gpus[-1]["gpus"]})
        return {"config": self.config, "world": self.world, "initial_layout": self.initial_layout,
                "layout": self.layout, "iterations": self.iterations, "events": events,
                "gpus": gpus}

    def write(self) -> None:
        if not self.enabled:
            return
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(self.to_dict(), fh, indent=1)
        os.replace(tmp, self.path)
