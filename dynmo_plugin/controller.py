"""The `DynMo` controller: the two calls a training loop adds.

    dynmo = DynMo(config, trainer, report)
    for iteration in range(1, train_iters + 1):
        dynmo.before_step(iteration)          # may migrate layers or open a window
        loss = trainer.train_step(iteration)
        dynmo.after_step(iteration)           # feeds the window; closing it may rebalance

Per trigger: profile window -> gathered profile -> balancer -> gate -> migration ->
report event. Triggers: dynamism events (`notify_event`), a black-box rebalance
interval, profiling-only intervals, and forced layouts (operators, tests). Every rank
makes the same calls and, from the same gathered profile, the same decision.
"""
from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Optional

from dynmo_plugin.balancing import BalanceProblem, GateConfig, Plan, attach_gate, solve
from dynmo_plugin.config import DynmoConfig
from dynmo_plugin.layout import Layout
from dynmo_plugin.profiling.records import PipelineProfile
from dynmo_plugin.report import RunReport

__all__ = ["DynMo", "problem_from_profile"]

logger = logging.getLogger(__name__)
_MEASURE_ITERS = 5  # iterations averaged for measured time before/after a rebalance


@dataclass
class _OpenWindow:
    trigger: str
    opened_at: int
    remaining: int
    rebalance: bool
    window: object


def problem_from_profile(profile: PipelineProfile, current: Layout, config: DynmoConfig,
                         num_microbatches: int) -> BalanceProblem:
    """Per-layer cost = median fwd+bwd per micro-batch; memory counts the 1F1B warm-up
    depth of activations a stage may hold (at most p micro-batches)."""
    p = current.num_stages
    in_flight = min(p, num_microbatches)
    cap = config.rebalance.memory_cap_gb
    return BalanceProblem(
        costs=[x.cost_s for x in profile.layers],
        num_stages=p,
        memory=[x.state_bytes + in_flight * x.act_bytes for x in profile.layers],
        move_bytes=[x.state_bytes for x in profile.layers],
        capacity=cap * 1e9 if cap > 0 else None,
        extras_cost=[s.extra_s for s in profile.stages],
        extras_memory=[s.extra_bytes for s in profile.stages],
        current=current,
        allow_empty_stages=config.rebalance.allow_empty_stages,
        num_microbatches=num_microbatches,
        param_counts=[x.param_bytes for x in profile.layers],
    )


class DynMo:
    """Drives profiling and rebalancing of one stage's trainer."""

    def __init__(self, config: DynmoConfig, trainer, report: Optional[RunReport] = None,
                 fault=None):
        self.config, self.trainer, self.report = config, trainer, report
        self._fault = fault  # test-only FaultInjector, see dynmo_plugin.migration.faults
        self._migrator = None
        self._open: Optional[_OpenWindow] = None
        self._pending_events: list[str] = []
        self._recent = deque(maxlen=_MEASURE_ITERS)  # step seconds outside windows
        self._awaiting_after: list[tuple[dict, list[float]]] = []
        self._step_started = 0.0
        self.bandwidth = config.rebalance.bandwidth_gbps * 1e9
        self.last_profile: Optional[PipelineProfile] = None

    # ---- public API ---------------------------------------------------------------------
    def notify_event(self, name: str) -> None:
        """A dynamism event happened (pruning round, freeze, ...): profile, then rebalance."""
        self._pending_events.append(name)

    def before_step(self, iteration: int) -> None:
        if self.config.enabled:
            forced = self.config.rebalance.forced_layouts.get(iteration)
            if forced is not None:
                self._apply_forced(iteration, forced)
            if self._open is None:
                self._maybe_open_window(iteration)
        self._step_started = time.perf_counter()

    def after_step(self, iteration: int) -> None:
        seconds = time.perf_counter() - self._step_started
        if self._open is None:
            self._recent.append(seconds)
            self._feed_measurements(seconds)
            return
        self._open.window.after_iteration()
        self._open.remaining -= 1
        if self._open.remaining == 0:
            self._close_window(iteration)

    # ---- triggers -----------------------------------------------------------------------
    def _maybe_open_window(self, iteration: int) -> None:
        from dynmo_plugin.megatron.profiler import ProfileWindow
        interval, every = self.config.rebalance.interval, self.config.profiling.every
        if self._pending_events:
            trigger, rebalance = "event:" + ",".join(self._pending_events), True
            self._pending_events.clear()
        elif interval and iteration % interval == 0:
            trigger, rebalance = "rebalance_interval", True
        elif every and iteration % every == 0:
            trigger, rebalance = "profile_interval", False
        else:
            return
        self._open = _OpenWindow(trigger, iteration, self.config.profiling.window, rebalance,
                                 ProfileWindow(self.trainer))

    def _close_window(self, iteration: int) -> None:
        opened, self._open = self._open, None
        start = time.perf_counter()
        profile = opened.window.close()
        profiling_s = time.perf_counter() - start  # summary + gather; hook cost is in the steps
        self.last_profile = profile
        event = {"iteration": iteration, "kind": "profile", "trigger": opened.trigger,
                 "window": [opened.opened_at, iteration], "layout": str(self.trainer.layout),
                 "overhead_s": {"profiling": profiling_s}, "profile": profile.to_dict()}
        if opened.rebalance:
            fields = self._rebalance(profile)
            event["overhead_s"].update(fields.pop("overhead_s"))
            event.update(fields)
        self._record(event)

    # ---- decision and migration -----------------------------------------------------------
    def _decide(self, profile: PipelineProfile) -> Plan:
        t = self.trainer
        problem = problem_from_profile(profile, t.layout, self.config, t.num_microbatches)
        plan = solve(problem, self.config.rebalance.balancer)
        gate = GateConfig(iterations_until_next_event=self.config.rebalance.expected_event_gap,
                          bandwidth_bytes_per_s=self.bandwidth, margin=self.config.rebalance.margin,
                          min_relative_gain=self.config.rebalance.min_gain)
        return attach_gate(plan, gate)

    def _rebalance(self, profile: PipelineProfile) -> dict:
        before = self.trainer.layout
        start = time.perf_counter()
        plan = self._decide(profile)
        decision_s = time.perf_counter() - start
        fields = {"kind": "rebalance", "layout_before": str(before), "plan": plan.to_dict(),
                  "stage_loads_before": plan.stage_loads_before,
                  "stage_loads_after": plan.stage_loads_after,
                  "imbalance_before": plan.imbalance_before, "imbalance_after": plan.imbalance_after,
                  "predicted_iter_s_before": plan.predicted_iter_s_before,
                  "predicted_iter_s_after": plan.predicted_iter_s_after}
        if plan.layout == before or not plan.gate.apply:
            reason = "already balanced" if plan.layout == before else plan.gate.reason
            fields.update(applied=False, layout_after=str(before), moves=[], reason=reason)
            fields["overhead_s"] = {"decision": decision_s, "migration": 0.0}
            return fields
        result = self._migrate(plan.layout)
        fields.update(self._migration_fields(result))
        fields["overhead_s"] = {"decision": decision_s, "migration": result.total_s}
        return fields

    def _apply_forced(self, iteration: int, text: str) -> None:
        layout = Layout.parse(text, self.trainer.dims.pp, self.trainer.layout.num_layers)
        before = self.trainer.layout
        result = self._migrate(layout)
        event = {"iteration": iteration, "kind": "rebalance", "trigger": "forced",
                 "layout_before": str(before), **self._migration_fields(result),
                 "overhead_s": {"profiling": 0.0, "decision": 0.0, "migration": result.total_s}}
        self._record(event)

    def _migrate(self, layout: Layout):
        from dynmo_plugin.megatron.migrate import LayerMigrator
        if self._migrator is None:
            self._migrator = LayerMigrator(self.trainer, fault=self._fault)
        result = self._migrator.migrate(layout)
        if result.applied and result.bandwidth_bytes_per_s > 0:
            self.bandwidth = result.bandwidth_bytes_per_s  # the gate's next estimate
        return result

    def _migration_fields(self, result) -> dict:
        fields = {"applied": result.applied, "layout_after": result.layout_after,
                  "moves": result.moves if result.applied else [],
                  "migration": result.to_dict(),
                  "measured_iter_s_before": statistics.fmean(self._recent) if self._recent else None}
        if not result.applied:
            fields["error"] = result.error
        return fields

    # ---- measurements and report ------------------------------------------------------------
    def _feed_measurements(self, seconds: float) -> None:
        for event, samples in self._awaiting_after:
            samples.append(seconds)
            if len(samples) == _MEASURE_ITERS:
                event["measured_iter_s_after"] = statistics.fmean(samples)
                if self.report is not None:
                    self.report.write()
        self._awaiting_after = [(e, s) for e, s in self._awaiting_after if len(s) < _MEASURE_ITERS]

    def _record(self, event: dict) -> None:
        if event.get("applied"):
            self._recent.clear()
            self._awaiting_after.append((event, []))
        if self.report is not None:
            self.report.layout = str(self.trainer.layout)
            self.report.add_event(event)
        if event["kind"] != "rebalance":
            detail = ""
        elif event.get("applied"):
            moved = sum(m["bytes"] for m in event["moves"]) / 1e6
            detail = (f": {event['layout_before']} -> {event['layout_after']} "
                      f"({len(event['moves'])} layers, {moved:.1f} MB)")
        else:
            detail = f": kept {event['layout_before']} ({event.get('reason') or event.get('error')})"
        logger.info("dynmo: iteration %d %s [%s]%s", event["iteration"], event["kind"],
                    event.get("trigger"), detail)
