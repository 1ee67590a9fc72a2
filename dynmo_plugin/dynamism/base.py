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

Rules: a scenario walks the rank's decoder layers as `runtime.trainer.layers` (every
model chunk of an interleaved pipeline, in layer order; `trainer.model` is chunk 0 alone),
read afresh after a layout change; it keeps per-layer state IN the layer (buffers,
parameters, requires_grad), so a migration moves it with the layer; and every decision that
leads to a collective or differs by rank is taken once with `runtime.control.decide`
(see dynmo_plugin/consensus.py) — a scenario that decides per rank hangs the job.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

__all__ = ["DynamismEvent", "Runtime", "Scenario"]


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

    def after_layout_change(self) -> None:
        """This stage's layer objects changed (a migration): re-find what was cached."""
