"""Early exit (CALM, Schuster et al., NeurIPS'22; DynMo's early-exit scenario).

Every decoder layer gets a small exit head (dynmo_plugin.scenarios.early_exit.layer);
from iteration `start` on, a token whose exit-head confidence (max softmax
probability) after layer L exceeds `threshold` is not processed by layers > L. As the
model learns, confidence rises, more tokens exit early and the tail layers get
cheaper, which unbalances the pipeline. Every `interval` iterations from `start` the
scenario reports the per-layer exit fractions (gathered over all stages and replicas
on the control plane, decided once) as a DynamismEvent, and the controller profiles
and rebalances.

Per iteration, `before_step` hands the stage's layers an ExitContext: this replica's
labels (the synthetic data are a pure function of (seed, iteration, sample), so any
stage can rebuild them; the layers take them in forward-call order), the threshold,
whether exits are on yet, and the exit loss's gradient scale. The exit loss is
`loss_weight` x the mean over layers of each head's cross-entropy on the tokens that
layer processed; it is added to the objective only (the reported loss is the LM loss).
"""
from __future__ import annotations

import logging
from typing import Optional

from dynmo_plugin.scenarios.base import DynamismEvent, Runtime, Scenario, current_loss_scale

__all__ = ["EarlyExit", "exit_fractions"]

logger = logging.getLogger(__name__)


def exit_fractions(per_rank: list[dict[int, tuple]]) -> tuple[dict[int, float], dict[int, float]]:
    """{layer: (tokens seen, tokens active, confidence sum)} from every rank ->
    ({layer: fraction of tokens that exited before it}, {layer: mean exit-head confidence
    of the tokens it processed}). Replicas of a layer (DP, TP) are summed."""
    sums: dict[int, list[float]] = {}
    for stats in per_rank:
        for layer, values in stats.items():
            acc = sums.setdefault(layer, [0, 0, 0.0])
            for i, v in enumerate(values):
                acc[i] += v
    fraction = {n: round(1.0 - a / seen, 6) if seen else 0.0
                for n, (seen, a, _) in sorted(sums.items())}
    confidence = {n: round(c / a, 6) if a else 0.0 for n, (_, a, c) in sorted(sums.items())}
    return fraction, confidence


class EarlyExit(Scenario):
    """CALM-style token early exit with per-layer exit heads (see module docstring)."""

    name = "early_exit"

    def __init__(self, config) -> None:
        super().__init__(config)
        self.settings = config.early_exit
        self._context = None

    def layer_spec(self, spec, model_args):
        from dynmo_plugin.scenarios.early_exit.layer import early_exit_spec
        return early_exit_spec(spec, vocab_size=model_args.vocab_size)

    def attach(self, runtime: Runtime) -> None:
        super().attach(runtime)
        # Every stage boundary carries [s + R, b, h] (the exit flags ride in R extra rows,
        # `attach_carrier`), not Megatron's [s, b, h]: let its p2p send shapes.
        runtime.trainer.config.variable_seq_lengths = True

    def _layers(self):
        return self.runtime.trainer.layers

    def before_step(self, iteration: int) -> None:
        from dynmo_plugin.scenarios.early_exit.layer import ExitContext
        t, s = self.runtime.trainer, self.settings
        batches = t.data.micro_batches(iteration, t.dims.dp_rank, t.dims.dp, t.dims.device)
        labels, masks = [], []
        for mb in batches:
            labels.append(mb["labels"].T.contiguous())
            masks.append(mb["loss_mask"].T.contiguous())
        loss_scale = current_loss_scale(t)
        self._context = ExitContext(
            seq_length=t.args.seq_length, threshold=s.threshold, min_layer=s.min_layer,
            exits_on=iteration >= s.start, loss_weight=s.loss_weight,
            grad_scale=loss_scale / t.num_microbatches, labels=labels, loss_masks=masks,
            token_multiple=s.token_multiple)
        self._bind()

    def _bind(self) -> None:
        from dynmo_plugin.scenarios.early_exit.layer import attach_carrier
        t = self.runtime.trainer
        for chunk in t.chunks:  # idempotent; a rebuilt trainer (repack) gets new chunks
            attach_carrier(chunk, t.args.seq_length)
        for layer in self._layers():
            layer.exit_context = self._context
            layer.reset_exit_stats()

    def after_layout_change(self) -> None:
        self._bind()  # layers received in a migration start without a context

    def after_step(self, iteration: int) -> Optional[DynamismEvent]:
        return self.with_fallbacks(iteration, self._event(iteration))

    def _event(self, iteration: int) -> Optional[DynamismEvent]:
        s = self.settings
        if iteration < s.start or (iteration - s.start) % s.interval:
            return None
        control = self.runtime.control
        local = {layer.layer_number: (layer.tokens_seen, layer.tokens_active,
                                      float(layer.confidence_sum)) for layer in self._layers()}
        gathered = control.all_gather(local, "early-exit-stats")

        def summarise():
            fraction, confidence = exit_fractions(gathered)
            return {"exit_fraction": fraction, "confidence": confidence,
                    "threshold": s.threshold, "min_layer": s.min_layer}

        detail = self.decide_or_fallback(
            summarise, "early-exit-event",
            lambda: {"exit_fraction": {}, "confidence": {}, "threshold": s.threshold,
                     "min_layer": s.min_layer},
            "no exit statistics for this event (the controller times a window)")
        logger.info("early exit: iteration %d, exited before each layer %s", iteration,
                    {k: f"{v:.0%}" for k, v in detail["exit_fraction"].items()})
        return DynamismEvent(self.name, iteration, detail)
