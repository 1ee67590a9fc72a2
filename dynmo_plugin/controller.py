"""The `DynMo` controller: the two calls a training loop adds.

    parts = assemble(cfg, stage, ...)        # dynmo_plugin.assembly: DynMo(config, stage,
    dynmo = parts.dynmo                       #   control, migrator, report, repacker=...)
    for iteration in range(1, train_iters + 1):
        dynmo.before_step(iteration)          # may migrate layers or open a window
        loss = stage.train_step(iteration)
        dynmo.step_done()                     # optional: the step ends here, not at after_step
        dynmo.after_step(iteration)           # feeds the window; closing it may rebalance

`stage` is a `dynmo_plugin.stage.StageHandle` (the launcher's StageTrainer or the
Megatron-LM stage).

Per trigger: profile window -> gathered profile -> decision on rank 0, broadcast ->
migration -> report event. Triggers: dynamism events (`notify_event`), a black-box
rebalance interval, profiling-only intervals, forced layouts (operators, tests), and
the start (`profiling.start_at`): one window early in the run, then the exact solver's
layout for it, so the run starts balanced before any dynamism (trigger "start";
`dynmo plan --from-run` prints the same layout for a Megatron-LM user); with repacking
on, the start also considers fewer stages (the repack decision, released ranks leave).
No rank ever recomputes a decision from its own measurements: what leads to a
collective is decided once (`ControlPlane.decide`), so ranks cannot diverge. Nothing a
balancer or a migration can raise stops training: an infeasible or failed plan is an
event with `applied: false` and its reason. Only a lost peer (`PeerFailure`) ends the
run, with a message naming it.
"""
from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Optional

from dynmo_plugin.balancing import (BalanceProblem, GateConfig, InfeasibleError, Plan, ProblemError,
                                   solve)
from dynmo_plugin.balancing.decide import decide, repack_considered
from dynmo_plugin.balancing.repack import IterationModel
from dynmo_plugin.balancing.profile_problem import memory_calibration, problem_from_profile
from dynmo_plugin.config import DynmoConfig
from dynmo_plugin.config.checks import recompute_block
from dynmo_plugin.consensus import ControlPlane, DecisionFailed
from dynmo_plugin.decision_lines import describe, explain, repack_considered_record
from dynmo_plugin.events import Decision, ProfileEvent, RebalanceEvent
from dynmo_plugin.layout import Layout, LayoutError
from dynmo_plugin.profiling.records import PipelineProfile
from dynmo_plugin.report import RunReport
from dynmo_plugin.stage import StageHandle

__all__ = ["DynMo", "memory_calibration", "problem_from_profile", "repack_iteration_model",
           "scale_profile"]

logger = logging.getLogger(__name__)
_MEASURE_ITERS = 5  # iterations averaged for measured time before/after a rebalance


@dataclass
class _OpenWindow:
    trigger: str
    opened_at: int
    remaining: int
    rebalance: bool
    window: object


def scale_profile(profile: PipelineProfile, base: dict, now: dict) -> PipelineProfile:
    """`profile` with each layer's fwd/bwd time scaled by now[layer] / base[layer]: the
    cost a scenario's work predictor implies, anchored to a measurement. Memory (gradient
    bytes too, so each layer's share of the optimizer step), the step and the stages'
    extras stay as measured: the scenarios that pass work (MoE, MoD, sparse attention)
    change how much a layer computes, not what it holds; a freeze or a prune changes
    what it holds and is timed in a window instead (`DynamismEvent.work` is None)."""
    layers = [dataclasses.replace(x, fwd_s=x.fwd_s * now[x.layer] / base[x.layer],
                                  bwd_s=x.bwd_s * now[x.layer] / base[x.layer])
              for x in profile.layers]
    return dataclasses.replace(profile, layers=layers, stages=list(profile.stages))


class DynMo:
    """Drives profiling and rebalancing of one stage's trainer."""

    def __init__(self, config: DynmoConfig, trainer, control: ControlPlane, migrator,
                 report: Optional[RunReport] = None, profile_noise=None, repacker=None,
                 streams=None):
        """`control`: the control plane every rank shares; `migrator`: applies layouts
        (dynmo_plugin.megatron.migration.migrate.LayerMigrator); `repacker(layout, iteration,
        info)`: repacks onto a layout of fewer stages, returns (the event's `repack`
        record, megatron.repack.RepackResult) and rebinds this controller to the shrunk
        world (dynmo_plugin.megatron.migration.repack.Repacker.run); `streams`: each
        layer's own random streams, told of every step once its layers are in place
        (dynmo_plugin.megatron.training.layer_streams); `profile_noise`: test-only
        (dynmo_plugin.faults.ProfileNoise)."""
        self.config, self.trainer, self.report, self.streams = config, trainer, report, streams
        self.control, self._migrator, self._repacker = control, migrator, repacker
        self._noise = profile_noise
        self._layout_listeners: list = []
        self._open: Optional[_OpenWindow] = None
        self._pending_events: list[str] = []
        self._recent = deque(maxlen=_MEASURE_ITERS)  # step seconds outside windows
        self._awaiting_after: list[tuple[RebalanceEvent, list[float]]] = []
        self._step_started = 0.0
        self._step_ended: Optional[float] = None
        self._rerun = False  # Megatron-LM ran this step again in place (`rerun_started`)
        self._start_again = False  # the balanced start's window was dropped (`_requeue`)
        self._work_now: dict[int, float] = {}          # latest work reported by the scenario
        self._work_base: Optional[dict[int, float]] = None  # work during the last timed window
        self._estimated = 0                             # estimated decisions since that window
        self._timed_profile: Optional[PipelineProfile] = None  # the last measured one
        # (profile, window) -> profile: a timed profile re-costed before deciding, the same
        # on every rank (data.calibration.mix_adjuster: to the run's document-length mix)
        self.cost_adjuster = None
        self.bandwidth = config.rebalance.bandwidth_gbps * 1e9
        self.last_profile: Optional[PipelineProfile] = None
        if config.enabled and config.rebalance.balancer in ("partition", "parameters"):
            # DeepSpeed's first import takes seconds: pay it here, not in a decision
            from dynmo_plugin.balancing.partition import load_partition_balanced
            load_partition_balanced()

    # ---- public API ---------------------------------------------------------------------
    def rebind(self, trainer, control: ControlPlane, migrator) -> None:
        """Drive a rebuilt stage (after a repack shrank the world)."""
        self.trainer, self.control, self._migrator = trainer, control, migrator
        if self.streams is not None:
            self.streams.stage = trainer

    def add_layout_listener(self, callback) -> None:
        """`callback()` runs on every rank after a migration changed the layout."""
        self._layout_listeners.append(callback)

    def notify_event(self, name: str, work: Optional[dict] = None) -> None:
        """A dynamism event happened (pruning round, freeze, ...): profile, then rebalance.

        `work` ({layer: units}, the scenario's cost predictor): with it, and a timed
        profile taken under known work, the controller decides at this iteration's end
        from that profile scaled by the work ratio — no timing window — for up to
        `profiling.retime_every` events in a row, then times a window again.
        Call it on every rank with the same arguments at the same iteration (dynamism
        decisions are themselves taken once and broadcast)."""
        if work is not None:
            self._work_now = {int(k): float(v) for k, v in work.items()}
        self._pending_events.append(name)

    def before_step(self, iteration: int) -> None:
        if self.config.enabled:
            forced = self.config.rebalance.forced_layouts.get(iteration)
            if forced is not None:
                if self._open is not None:
                    self._cancel_window(iteration, iteration - 1, f"forced layout at iteration {iteration}")
                self._apply_forced(iteration, forced)
            if self._open is None:
                self._maybe_open_window(iteration)
        if self._open is not None:
            self._open.window.before_iteration()
        if self.streams is not None:  # after any migration: its layers are the step's
            self.streams.step(iteration)
        self._step_started = time.perf_counter()

    def step_done(self) -> None:
        """Optional, right after the training step: what the loop does between it and
        `after_step` (a scenario's hooks, a freezing check's rebuild, data fitting) is
        then not the step's time, neither in a window's rest of the step nor in the
        iterations a profile's prediction is held to."""
        self._step_ended = time.perf_counter()
        if self._open is not None:
            self._open.window.step_done()

    def rerun_started(self, iteration: int) -> None:
        """Megatron-LM runs this step again in place (its rerun state machine): the step's
        time is two runs', and a window open over it would time the layers twice. Dropped
        at the step's end (`after_step`), not mid-step, where the window's hooks are live.
        The layers draw again what they drew in the first run (`streams`)."""
        self._rerun = True
        if self.streams is not None:
            self.streams.step(iteration)

    def after_step(self, iteration: int) -> None:
        ended, self._step_ended = self._step_ended, None
        seconds = (ended if ended is not None else time.perf_counter()) - self._step_started
        rerun, self._rerun = self._rerun, False
        if rerun and self._open is not None:
            self._cancel_window(iteration, iteration, f"Megatron-LM ran iteration {iteration} again "
                                "in place (its rerun state machine): the window timed it twice")
        if self._open is None:
            if not rerun:
                self._recent.append(seconds)
                self._feed_measurements(seconds)
            if self.config.enabled and self._pending_events and self._can_estimate():
                self._rebalance_estimated(iteration)
            return
        self._open.window.after_iteration()
        self._open.remaining -= 1
        if self._open.remaining == 0:
            self._close_window(iteration)

    # ---- triggers -----------------------------------------------------------------------
    def _maybe_open_window(self, iteration: int) -> None:
        from dynmo_plugin.megatron.profiling.profiler import ProfileWindow
        interval, every = self.config.rebalance.interval, self.config.profiling.every
        if self._pending_events and self._can_estimate():
            return  # decided from work estimates at this iteration's end, untimed
        if self._pending_events:
            trigger, rebalance = "event:" + ",".join(self._pending_events), True
            self._pending_events.clear()
        elif iteration == self.config.profiling.start_at or self._start_again:
            trigger, rebalance, self._start_again = "start", True, False
        elif interval and iteration % interval == 0:
            trigger, rebalance = "rebalance_interval", True
        elif every and iteration % every == 0:
            trigger, rebalance = "profile_interval", False
        else:
            return
        self._open = _OpenWindow(trigger, iteration, self.config.profiling.window, rebalance,
                                 ProfileWindow(self.trainer, outside_s=list(self._recent)))

    # ---- cost updates from the scenario's work, without timing ---------------------------
    def _can_estimate(self) -> bool:
        timed = self._timed_profile
        layers = [x.layer for x in timed.layers] if timed is not None else []
        return (0 < self.config.profiling.retime_every and self._work_base is not None
                and self._estimated < self.config.profiling.retime_every and bool(layers)
                and all(self._work_base.get(n, 0) > 0 and n in self._work_now for n in layers))

    def _rebalance_estimated(self, iteration: int) -> None:
        start = time.perf_counter()
        trigger = "event:" + ",".join(self._pending_events)
        self._pending_events.clear()
        self._estimated += 1
        estimate = scale_profile(self._timed_profile, self._work_base, self._work_now)
        self._rebalance(iteration, trigger, None, estimate, start, source="estimated")

    def finish(self, last_iteration: int) -> None:
        """The run ends (normally or on an exception): a window still open, opened fewer
        than `profiling.window` iterations before the end or left by a failed step, is
        dropped and recorded as cancelled. That ends its hooks, its CUDA profiler and its
        collector pause with the run, not after it: Megatron-LM evaluates and saves after
        train(), and scripts/gpu_check_worker.py trains again in the same process.
        `last_iteration`: the last one completed; a window opened after it (at an
        iteration whose step never ran or never ended) measured nothing and is dropped
        unrecorded. Local, no collective; idempotent."""
        if self.streams is not None:
            self.streams.detach()
        if self._open is None:
            return
        if self._open.opened_at > last_iteration:
            opened, self._open = self._open, None
            opened.window.cancel()
            self._requeue(opened)
            return
        self._cancel_window(last_iteration, last_iteration, "the run ended inside the window")

    def _cancel_window(self, at: int, last: int, why: str) -> None:
        """Drop an open window without gathering, at iteration `at`: what it measured is
        about to move, or the run ends. `last`: the last iteration the window ran over."""
        opened, self._open = self._open, None
        opened.window.cancel()
        self._record(ProfileEvent(at, opened.trigger, [opened.opened_at, last],
                                  str(self.trainer.layout), {"profiling": 0.0}, cancelled=why))
        self._requeue(opened)

    def _requeue(self, opened: _OpenWindow) -> None:
        """An event trigger a dropped window carried waits for the next window; so does
        the balanced start (it would never come again: its iteration has passed)."""
        if opened.rebalance and opened.trigger.startswith("event:"):
            self._pending_events.append(opened.trigger.removeprefix("event:"))
        self._start_again = self._start_again or opened.trigger == "start"

    def _close_window(self, iteration: int) -> None:
        opened, self._open = self._open, None
        start = time.perf_counter()
        perturb = None
        if self._noise is not None:
            perturb = lambda p: self._noise.perturb(p, self.trainer.dims.rank)  # noqa: E731
        gathered = opened.window.close(perturb)
        window = [opened.opened_at, iteration]
        # the work the window ran under: what later estimates scale from
        self._work_base, self._estimated = (dict(self._work_now) if self._work_now else None), 0
        if not opened.rebalance:
            profile = self.control.decide(gathered.to_dict, "profile")
            self.last_profile = self._timed_profile = PipelineProfile.from_dict(profile)
            plan, reason = self._profile_plan(self.last_profile)
            memory = _memory_record(self.last_profile, self.trainer, _cap_bytes(self.config), plan)
            self._record(ProfileEvent(iteration, opened.trigger, window, str(self.trainer.layout),
                                      {"profiling": time.perf_counter() - start}, profile,
                                      memory=memory, plan=plan, reason=reason))
            return
        if self.cost_adjuster is not None:
            gathered = self.cost_adjuster(gathered, window)
        self._rebalance(iteration, opened.trigger, window, gathered, start)

    def _profile_plan(self, profile: PipelineProfile) -> tuple[Optional[Plan], str]:
        """A profile-only window (--dynmo-profile-every): the exact solver's plan for it,
        never applied, so the run still gives a table, a picture and a layout
        (`dynmo plan --from-run`); and why nothing moved. Rank 0 only (the report's)."""
        why = ("profile only: nothing moves (--dynmo-profile-every); --dynmo-rebalance-interval N "
               "rebalances, `dynmo plan --from-run` prints the layout for Megatron-LM")
        if self.trainer.dims.rank != 0:
            return None, why
        t = self.trainer
        try:
            problem = problem_from_profile(profile, t.layout, self.config, t.num_microbatches,
                                           peak_microbatches=t.peak_microbatches,
                                           layer_block=recompute_block(t.args))
            return solve(problem, "exact"), why
        except (InfeasibleError, ProblemError) as e:
            return None, f"{why}; no feasible plan: {e}"

    # ---- decision and migration -----------------------------------------------------------
    def _decide(self, profile: PipelineProfile, trigger: str) -> Decision:
        """Rank 0 only: the one decision path (balancing.decide), which the simulator
        shares. An impossible plan is a decision not to move, never an exception."""
        t, rb = self.trainer, self.config.rebalance
        cap = _cap_bytes(self.config)
        try:
            problem = problem_from_profile(profile, t.layout, self.config, t.num_microbatches,
                                           pin_mtp=_pins_mtp(t), peak_microbatches=t.peak_microbatches,
                                           layer_block=recompute_block(t.args))
        except (InfeasibleError, ProblemError) as e:
            memory = _memory_record(profile, t, cap, None)
            return Decision(profile.to_dict(), None, False,
                            _memory_hint(f"no feasible plan: {e}", memory), memory=memory)
        gate = GateConfig(iterations_until_next_event=rb.expected_event_gap,
                          bandwidth_bytes_per_s=self.bandwidth, margin=rb.margin,
                          min_relative_gain=rb.min_gain, measured_dispersion=profile.dispersion())
        balancer = "exact" if trigger == "start" else rb.balancer  # the start: the optimum
        criteria = self._repack_criteria(problem, trigger)
        model = None if criteria is None else repack_iteration_model(self.trainer, self.bandwidth)
        choice = decide(problem, balancer, gate, criteria, iteration_model=model)
        memory = _memory_record(profile, t, cap, choice.plan)
        return Decision(profile.to_dict(), choice.plan, choice.apply,
                        choice.reason if choice.apply else _memory_hint(choice.reason, memory),
                        repack=choice.repack, memory=memory)

    def _repack_criteria(self, problem: BalanceProblem, trigger: str):
        """The criteria when a repack may be considered now, else None (min_stages:
        `balancing.decide.repack_considered`, the guard `decide` applies too)."""
        rp = self.config.repack
        # the start chooses the pipeline size too (the smallest within max_slowdown)
        wanted = rp.trigger == "rebalance" or trigger.startswith("event:") or trigger == "start"
        if self._repacker is None or not rp.enabled or not wanted or problem.mtp_layers:
            return None  # MTP: forced repacks only (the repack planner does not place the block)
        from dynmo_plugin.balancing.repack import RepackCriteria
        criteria = RepackCriteria.from_config(rp)
        return criteria if repack_considered(problem, criteria) else None

    def _rebalance(self, iteration: int, trigger: str, window: Optional[list[int]],
                   gathered: PipelineProfile, start: float, source: str = "timed") -> None:
        before = self.trainer.layout
        profiling_s = time.perf_counter() - start
        start = time.perf_counter()
        try:
            decision, freed = self.control.decide(
                lambda: self._decide_with_freed(gathered, trigger), "decision")
        except DecisionFailed as e:
            decision, freed = Decision(gathered.to_dict(), None, False, f"balancer failed: {e}"), None
        decision_s = time.perf_counter() - start
        self.last_profile = PipelineProfile.from_dict(decision.profile)
        if source == "timed":
            self._timed_profile = self.last_profile
        event = RebalanceEvent(iteration, trigger, str(before), str(before), False,
                               {"profiling": profiling_s, "decision": decision_s, "migration": 0.0},
                               reason=explain(decision.reason), plan=decision.plan, window=window,
                               profile=decision.profile, profile_source=source,
                               measured_iter_s_before=self._measured_before(),
                               memory=decision.memory)
        if decision.repack is not None and not (decision.repack.apply and decision.apply):
            event.repack_considered = repack_considered_record(decision.repack, decision.apply)
        if decision.repack is not None and decision.repack.apply and decision.apply:
            r = decision.repack
            info = {"method": r.method, "predicted_iter_s_before": r.predicted_iter_s_before,
                    "predicted_iter_s_after": r.predicted_iter_s_after, "reason": r.reason,
                    "plan": r.to_dict(), "freed": freed}
            self._run_repack(event, r.layout_after, iteration, info)  # retiring ranks leave here
        elif decision.apply:
            self._attach_migration(event, self._migrate(decision.plan.layout))
        self._record(event)

    def _run_repack(self, event: RebalanceEvent, layout: Layout, iteration: int, info: dict) -> None:
        start = time.perf_counter()
        event.repack, result = self._repacker(layout, iteration, info)
        if result.migration is not None:
            self._attach_migration(event, result.migration)
        event.layout_after, event.applied = result.layout_after, event.layout_after != event.layout_before
        event.overhead_s["repack"] = time.perf_counter() - start
        if result.error:
            event.error = result.error
        if event.applied:
            for callback in self._layout_listeners:
                callback()

    def _apply_forced(self, iteration: int, text: str) -> None:
        before = self.trainer.layout
        pp = self.trainer.dims.pp * before.num_chunks  # (virtual) stages
        try:
            layout = Layout.parse(text, None, before.num_layers, before.num_chunks)
            if layout.num_stages > pp or (layout.num_stages < pp and self._repacker is None):
                raise LayoutError(f"forced layout {text!r} has {layout.num_stages} stages, the "
                                  f"pipeline {pp}; fewer stages repack, which needs repack.enabled")
        except LayoutError as e:  # validated at start; a repack may since have changed PP
            self._record(RebalanceEvent(iteration, "forced", str(before), str(before), False,
                                        {"profiling": 0.0, "decision": 0.0, "migration": 0.0},
                                        reason="forced layout", error=str(e)))
            return
        if layout.num_stages < pp:
            event = RebalanceEvent(iteration, "forced", str(before), str(before), False,
                                   {"profiling": 0.0, "decision": 0.0, "migration": 0.0},
                                   reason="forced repack", measured_iter_s_before=self._measured_before())
            self._run_repack(event, layout, iteration, {"method": "forced", "reason": "forced repack",
                                                        "freed": self._forced_freed(layout)})
            self._record(event)
            return
        event = RebalanceEvent(iteration, "forced", str(before), str(before), False,
                               {"profiling": 0.0, "decision": 0.0, "migration": 0.0},
                               reason="forced layout", measured_iter_s_before=self._measured_before())
        self._attach_migration(event, self._migrate(layout))
        self._record(event)

    def _decide_with_freed(self, profile: PipelineProfile, trigger: str) -> tuple[Decision, Optional[dict]]:
        """Rank 0: the decision and, for a repack, what its freed ranks do (None: release)."""
        decision = self._decide(profile, trigger)
        plan = decision.repack
        if plan is None or not plan.apply or not decision.apply or self.config.repack.freed == "release":
            return decision, None
        return decision, self._freed_choice(profile, plan)

    def _freed_choice(self, profile: PipelineProfile, plan) -> Optional[dict]:
        """Rank 0: what the ranks a planned repack frees do (`balancing.grow`), timed by
        the repack's own iteration model: release as planned, grow as the same layout
        at the larger DP with the micro-batches split over its replicas. The optimizer
        step goes with them: with the plain optimizer each replica still steps all its
        parameters, so the profiled step is spread over the fewer micro-batches a
        grown replica runs; the distributed one's shard shrinks as they do."""
        from dynmo_plugin.balancing.grow import grow_iteration_s, grown_dp
        from dynmo_plugin.sim.problem_model import live_iteration_model
        t, k = self.trainer, plan.stages_after
        m, new_dp = t.num_microbatches, grown_dp(t.dims.pp, k, t.dims.dp)
        sharded = getattr(t.args, "use_distributed_optimizer", False)
        step_m = m if sharded or new_dp is None else m * t.dims.dp // new_dp
        problem = problem_from_profile(profile, t.layout, self.config, m, pin_mtp=_pins_mtp(t),
                                       step_microbatches=max(step_m, 1),  # as _decide
                                       layer_block=recompute_block(t.args))
        iter_grow = grow_iteration_s(problem, plan.layout_after, t.dims.dp, lambda dp: live_iteration_model(
            t.args, dp=dp, bandwidth_Bps=self.bandwidth))
        return self._log_freed(k, plan.predicted_iter_s_after, iter_grow)

    def _forced_freed(self, layout: Layout) -> Optional[dict]:
        """A forced repack: the configured choice without predictions (auto releases)."""
        if self.config.repack.freed == "release":
            return None
        return self._log_freed(layout.num_ranks, 0.0, None)

    def _log_freed(self, k: int, iter_release: float, iter_grow: Optional[float]) -> dict:
        from dynmo_plugin.balancing.grow import choose_freed
        t, rp = self.trainer, self.config.repack
        choice = choose_freed(rp.freed, rp.objective, stages_before=t.dims.pp, stages_after=k,
                              ranks_per_stage=t.dims.world_size // t.dims.pp, dp=t.dims.dp,
                              num_microbatches=t.num_microbatches,
                              iter_s_release=iter_release, iter_s_grow=iter_grow,
                              tokens_per_iteration=float(t.args.global_batch_size * t.args.seq_length),
                              unsupported=_GROW_PACKED if t.args.data.packed else None)
        if t.dims.rank == 0:
            logger.info("dynmo: %s", choice.line())
        return choice.to_dict()

    def _attach_migration(self, event: RebalanceEvent, result) -> None:
        event.migration, event.applied = result, result.applied
        event.layout_after = result.layout_after
        event.overhead_s["migration"] = result.total_s
        if not result.applied:
            event.error = result.error

    def _migrate(self, layout: Layout):
        result = self._migrator.migrate(layout)
        if result.applied and result.bandwidth_bytes_per_s > 0:
            self.bandwidth = result.bandwidth_bytes_per_s  # the gate's next estimate (max over ranks)
        if result.applied:
            for callback in self._layout_listeners:
                callback()
        return result

    # ---- measurements and report ------------------------------------------------------------
    def _measured_before(self) -> Optional[float]:
        return statistics.fmean(self._recent) if self._recent else None

    def _feed_measurements(self, seconds: float) -> None:
        for event, samples in self._awaiting_after:
            samples.append(seconds)
            if len(samples) == _MEASURE_ITERS:
                event.measured_iter_s_after = statistics.fmean(samples)
                if self.report is not None:
                    self.report.update_event(event)
        self._awaiting_after = [(e, s) for e, s in self._awaiting_after if len(s) < _MEASURE_ITERS]

    def _record(self, event) -> None:
        if getattr(event, "applied", False):
            self._recent.clear()
            self._awaiting_after.append((event, []))
        if self.report is not None:
            self.report.layout = str(self.trainer.layout)
            self.report.add_event(event)
        logger.info("dynmo: iteration %d %s [%s]%s", event.iteration, event.kind, event.trigger,
                    describe(event))


_GROW_PACKED = ("cannot grow data parallelism with packed documents (--data-path / --data-documents): "
                "their stream is split per replica at start; use repack.freed: release")


def repack_iteration_model(trainer, bandwidth_Bps: float) -> IterationModel:
    """How the live repack decision predicts iteration times: the simulator's iteration
    (`sim.problem_model`: 1F1B order, p2p transfers on the critical path, the DP
    all-reduce of each rank's gradients, which grows as the stages get fewer) on the
    profiled problem, so a live repack keeps `max_slowdown` as a simulated one does;
    from what the run knows: its DP size, its Megatron args (the hidden state a stage
    sends) and the link bandwidth."""
    from dynmo_plugin.sim.problem_model import live_iteration_model
    return live_iteration_model(trainer.args, dp=trainer.dims.dp, bandwidth_Bps=bandwidth_Bps)


def _pins_mtp(stage) -> bool:
    """Whether the MTP block stays on its rank: live moves of it need one chunk per rank
    and a stage handle that can feed it on any rank (`mtp_moves_live`: Megatron-LM's once
    every rank has batches, integrations/megatron_lm_data; megatron.migration.mtp_move);
    decoder layers move around it."""
    layout = stage.layout
    return not layout.has_mtp or layout.num_chunks > 1 or not getattr(stage, "mtp_moves_live", True)


def _cap_bytes(config: DynmoConfig) -> Optional[float]:
    cap = config.rebalance.memory_cap_gb
    return cap * 1e9 if cap > 0 else None


def _memory_record(profile: PipelineProfile, stage: StageHandle, cap: Optional[float],
                   plan) -> Optional[dict]:
    """The event's `memory`: the cap, each stage's (interleaved: each rank's, `per:
    rank`) calibration (measured peak vs the model's bytes for what it held, at the
    micro-batches of the moment) and the calibrated bytes of the layouts before and
    after the plan (model + overhead at the stage's peak micro-batches: what is checked
    against the cap). None when the profile does not fit the layout (no calibration
    exists)."""
    try:
        _, calibration = memory_calibration(profile, stage.layout.num_stages, stage.num_microbatches)
    except ProblemError:
        return None
    record = {"cap_bytes": cap, **calibration.to_dict(), "microbatches": stage.num_microbatches,
              "peak_microbatches": stage.peak_microbatches}
    pp = len(calibration.stages)
    if profile.num_chunks > 1:  # the calibration is per rank: fold the virtual stages
        record["per"] = "rank"
    if plan is not None:
        if plan.stage_memory_before is not None:
            record["calibrated_before"] = calibration.calibrated(
                _per_rank(plan.stage_memory_before, pp))
        record["calibrated_after"] = calibration.calibrated(_per_rank(plan.stage_memory_after, pp))
    return record


def _memory_hint(reason: str, memory: Optional[dict]) -> str:
    """A layout kept under calibrated caps says so (the numbers are in the event)."""
    if memory and memory["cap_bytes"] and any(s["overhead_bytes"] for s in memory["stages"]) \
            and reason.startswith(("no feasible plan", "already balanced")):
        return reason + " (each stage's cap less its measured memory overhead: see the event's memory)"
    return reason


def _per_rank(stage_bytes: list, pp: int) -> list:
    """Per-virtual-stage bytes summed onto ranks (virtual stage s runs on rank s % pp);
    unchanged for plain 1F1B, where stages are ranks."""
    return [sum(stage_bytes[r::pp]) for r in range(pp)]
