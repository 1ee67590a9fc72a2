"""The one small interface every dynamism scenario implements.

A scenario changes what the layers compute while training runs (pruning makes weights
sparse, freezing drops backward passes, early exit drops tokens). It owns three things:
its change to the layer spec, its per-iteration hook, and when it reports an event
(which makes the controller profile and rebalance). The controller knows nothing
about scenarios; the launcher glues them:

    spec = scenario.layer_spec(spec, model_args)     # before the stage is built
    scenario.configure_model(transformer_config)     # likewise (MoE settings, ...)
    scenario.attach(runtime)                         # after it is built
    for it in iterations:                            # every rank, same order
        scenario.before_step(it)
        trainer.train_step(it)
        event = scenario.after_step(it)              # DynamismEvent or None
        if event: dynmo.notify_event(event.name)
    scenario.after_layout_change()                   # after a migration changed the layers

Calibrations and decisions that fail (`control.decide` raises DecisionFailed on every
rank alike) never end training: `decide_or_fallback` takes the scenario's fallback (the
FLOP-based work model, or no change) and the next event the scenario reports carries
the reason and the fallback in its detail ("fallbacks"); with no event due, a
report-only event (rebalance False) is made for it.

Rules: a scenario walks the rank's decoder layers as `runtime.trainer.layers` (every
model chunk of an interleaved pipeline, in layer order; `trainer.model` is chunk 0 alone),
read afresh after a layout change; it keeps per-layer state IN the layer (buffers,
parameters, requires_grad), so a migration moves it with the layer; and every decision that
leads to a collective or differs by rank is taken once with `runtime.control.decide`
(see dynmo_plugin/consensus.py) — a scenario that decides per rank hangs the job.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Optional

__all__ = ["DynamismEvent", "Runtime", "Scenario", "current_loss_scale"]

logger = logging.getLogger(__name__)


def current_loss_scale(trainer) -> float:
    """The optimizer's loss scale now, for a scenario's own auxiliary losses: read from
    the device only with --fp16 (dynamic scaling); bf16 and fp32 train unscaled (1.0),
    so their iterations pay no host synchronisation for it."""
    cfg = trainer.config
    if not cfg.fp16 or cfg.grad_scale_func is None:
        return 1.0
    import torch
    return float(cfg.grad_scale_func(torch.ones(1, device=trainer.dims.device)))


@dataclass(frozen=True)
class DynamismEvent:
    """What changed at an iteration; recorded in report.json as kind 'dynamism'."""

    scenario: str
    iteration: int
    detail: dict = field(default_factory=dict)
    rebalance: bool = True  # ask the controller to profile and rebalance
    # The scenario's predictor of each layer's cost, {global layer number: units} (any
    # units, comparable across layers and over time; e.g. tokens an MoE layer processed).
    # With it the controller may re-estimate costs from the last timed profile instead
    # of timing a new window (cheap enough to decide every iteration). Same on every rank.
    work: Optional[dict] = None

    kind: ClassVar[str] = "dynamism"

    @property
    def name(self) -> str:
        """The trigger the following rebalance records: 'event:<scenario>@<iteration>'."""
        return f"{self.scenario}@{self.iteration}"

    def to_dict(self) -> dict[str, Any]:
        out = {"kind": self.kind, "scenario": self.scenario, "iteration": self.iteration,
               "detail": self.detail}
        if self.work is not None:
            out["work"] = {str(k): v for k, v in self.work.items()}
        return out


@dataclass
class Runtime:
    """What a scenario may use after the stage exists: the stage's trainer, the control
    plane for rank-consistent decisions, and the migrator (whose `rebuild()` remakes DDP
    and the optimizer atomically, keeping their state, when the trainable set changes)."""

    trainer: Any
    control: Any
    migrator: Any


class Scenario:
    """Base class: every hook is optional."""

    name: ClassVar[str] = "none"

    def __init__(self, config) -> None:
        self.config = config
        self.runtime: Optional[Runtime] = None
        self._fallbacks: list[dict] = []  # taken since the last event (same on every rank)

    def layer_spec(self, spec, model_args):
        """The Megatron layer spec to build with (default: unchanged); `model_args` (the
        launcher's ModelArgs) tells a layer what it needs, e.g. the vocabulary size."""
        return spec

    def configure_model(self, config) -> None:
        """Adjust Megatron's TransformerConfig before the stage is built (e.g. MoE
        settings); default: unchanged. Called again for a stage rebuilt by a repack."""

    def attach(self, runtime: Runtime) -> None:
        """Called once the stage exists, and again with the rebuilt stage after a repack."""
        self.runtime = runtime

    def state_dict(self) -> dict:
        """The scenario's own progress (not per layer), for checkpoints; plain data."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Resume from `state_dict()`'s result (after `attach`)."""

    def before_step(self, iteration: int) -> None:
        pass

    def after_step(self, iteration: int) -> Optional[DynamismEvent]:
        return None

    def rerun_started(self, iteration: int) -> None:
        """Megatron-LM runs this step's forward and backward again in place (its rerun
        state machine, --rerun-mode validate_results): what the scenario counted in the
        step so far ran once already. Default: nothing."""

    def after_layout_change(self) -> None:
        """This stage's layer objects changed (a migration): re-find what was cached."""

    # ---- failures become events, not the end of training ---------------------------------
    def decide_or_fallback(self, fn: Callable[[], Any], phase: str, fallback: Callable[[], Any],
                           what: str) -> Any:
        """`runtime.control.decide(fn, phase)`; if `fn` raised on the deciding rank, every
        rank returns `fallback()` (which must give the same value on every rank) and the
        next event records the reason and `what` the run does instead.

        Raises:
            PeerFailure: the broadcast itself failed (a peer is gone)."""
        from dynmo_plugin.errors import DecisionFailed
        try:
            return self.runtime.control.decide(fn, phase)
        except DecisionFailed as e:
            self.note_fallback(phase, str(e), what)
            return fallback()

    def note_fallback(self, phase: str, reason: str, what: str) -> None:
        """Record a failure every rank knows of, for the next event."""
        self._fallbacks.append({"phase": phase, "reason": reason, "fallback": what})
        if self.runtime.control.rank == 0:
            logger.warning("%s: %s failed (%s); training goes on with %s", self.name, phase,
                           reason, what)

    def with_fallbacks(self, iteration: int, event: Optional[DynamismEvent]) -> Optional[DynamismEvent]:
        """`event` carrying the fallbacks taken since the last event (detail "fallbacks");
        None with fallbacks pending: a report-only event for them."""
        if not self._fallbacks:
            return event
        notes, self._fallbacks = self._fallbacks, []
        if event is None:
            return DynamismEvent(self.name, iteration, {"fallbacks": notes}, rebalance=False)
        return dataclasses.replace(event, detail={**event.detail, "fallbacks": notes})

    def inject_fault(self, phase: str) -> None:
        """Test-only: let the run's FaultInjector (dynmo_plugin.faults, passed to the
        migrator; None in production) fail this calibration on its stage."""
        fault = getattr(self.runtime.migrator, "fault", None)
        if fault is not None:
            fault.on_calibration(phase, self.runtime.trainer.dims.pp_rank)
