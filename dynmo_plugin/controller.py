"""The `DynMo` controller: the two calls a training loop adds.

    dynmo = DynMo(config, trainer, report)
    for iteration in range(1, train_iters + 1):
        dynmo.before_step(iteration)          # may open a window or migrate layers
        loss = trainer.train_step(iteration)
        dynmo.after_step(iteration)           # feeds the window; closes it -> event

Per trigger: profile window -> gathered profile -> balancer -> gate -> migration ->
report event. Triggers: explicit dynamism events (`notify_event`), a black-box
interval, periodic profiling, and forced layouts (operators, tests).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Optional

from dynmo_plugin.config import DynmoConfig
from dynmo_plugin.profiling.records import PipelineProfile
from dynmo_plugin.report import RunReport

__all__ = ["DynMo"]

logger = logging.getLogger(__name__)


@dataclass
class _OpenWindow:
    trigger: str
    opened_at: int
    remaining: int
    window: object


class DynMo:
    """Drives profiling and rebalancing of one stage's trainer; same calls on every rank."""

    def __init__(self, config: DynmoConfig, trainer, report: Optional[RunReport] = None):
        self.config, self.trainer, self.report = config, trainer, report
        self._open: Optional[_OpenWindow] = None
        self._pending_events: list[str] = []
        self.last_profile: Optional[PipelineProfile] = None

    # ---- public API ---------------------------------------------------------------------
    def notify_event(self, name: str) -> None:
        """A dynamism event happened (pruning round, freeze, ...): profile and rebalance."""
        self._pending_events.append(name)

    def before_step(self, iteration: int) -> None:
        if not self.config.enabled or self._open is not None:
            return
        trigger = self._trigger(iteration)
        if trigger is not None:
            self._open_window(iteration, trigger)

    def after_step(self, iteration: int) -> None:
        if self._open is None:
            return
        self._open.window.after_iteration()
        self._open.remaining -= 1
        if self._open.remaining == 0:
            self._close_window(iteration)

    # ---- internals ----------------------------------------------------------------------
    def _trigger(self, iteration: int) -> Optional[str]:
        if self._pending_events:
            return "event:" + ",".join(self._pending_events)
        every = self.config.profiling.every
        if every and iteration % every == 0:
            return "profile_interval"
        return None

    def _open_window(self, iteration: int, trigger: str) -> None:
        from dynmo_plugin.megatron.profiler import ProfileWindow
        self._pending_events.clear()
        self._open = _OpenWindow(trigger=trigger, opened_at=iteration,
                                 remaining=self.config.profiling.window,
                                 window=ProfileWindow(self.trainer))

    def _close_window(self, iteration: int) -> None:
        opened, self._open = self._open, None
        start = time.perf_counter()
        profile = opened.window.close()
        self.last_profile = profile
        seconds = time.perf_counter() - start  # summary + gather; hook cost is in the steps
        self._record({"iteration": iteration, "kind": "profile", "trigger": opened.trigger,
                      "window": [opened.opened_at, iteration], "layout": str(self.trainer.layout),
                      "overhead_s": {"profiling": seconds}, "profile": profile.to_dict()})

    def _record(self, event: dict) -> None:
        if self.report is not None:
            self.report.add_event(event)
        logger.info("dynmo event at iteration %d: %s (%s)", event["iteration"], event["kind"],
                    event.get("trigger"))
