"""Fitting the data cost model from the profiler at the start of a packed run.

For the first `iterations` iterations, the profiler's probe (megatron.probe.StageProbe:
the hooks a profile window uses, without activation accounting) times every decoder
layer of this stage (interleaved: of every model chunk of the rank) per micro-batch; each time is paired with the document lengths of
that micro-batch from the stream's plan. The samples of every rank go to rank 0, which
fits the three forms of data.cost_model on all layers' samples pooled (`fit_all`:
KnapFormer, AdaptiveLoad, token count, each with its held-out error) and KnapFormer per
layer; the form the run asked for (`--data-cost-model`) is broadcast, and every rank's
stream balances the following iterations by it (WLB packing and the DP redistribution
use the same `doc_workload`). The record (kind "data_cost_fit") goes into report.json.
The per-layer models serve the layer balancer: `mix_adjuster` scales a timed profile
from its window's length mix to the run's before the controller decides from it.

Until the fit, the stream balances by its prior (length^p). A resumed run whose
checkpoint holds a fitted model (the stream's state) does not fit again.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Optional

from dynmo_plugin.data.cost_model import (CostSample, KnapFormerCost, PowerCost, fit_all,
                                          fit_knapformer, model_from_dict, model_to_dict,
                                          samples_from_probe)

__all__ = ["CostCalibration", "fit_record", "mix_adjusted_profile", "mix_adjuster"]

logger = logging.getLogger(__name__)


class CostCalibration:
    """Times iterations start+1 .. start+iterations, then fits (collective at the end)."""

    def __init__(self, form: str, iterations: int, start_iteration: int):
        self.form, self.first = form, start_iteration + 1
        self.last = start_iteration + iterations
        self.probes: list = []  # one StageProbe per model chunk (interleaved: v of them)
        self.shapes: list[tuple[list[int], int]] = []  # per micro-batch: (lengths, positions)
        self.done = False

    @classmethod
    def for_run(cls, data, stream, start_iteration: int) -> Optional["CostCalibration"]:
        """The calibration a run with DataConfig `data` needs, or None: the prior is asked
        for, the data is not packed documents, or a checkpoint already gave a fitted model."""
        if not data.packed or data.cost_model == "power":
            return None
        if not isinstance(stream.cost_model, PowerCost):
            return None
        return cls(data.cost_model, data.cost_fit_iters, start_iteration)

    def before_step(self, trainer, iteration: int) -> None:
        if self.done or iteration != self.first:
            return
        from dynmo_plugin.megatron.profiling.probe import StageProbe
        from dynmo_plugin.profiling.clock import clock_for
        clock = clock_for(trainer.dims.device)  # every chunk's layers (interleaved: v chunks)
        self.probes = [StageProbe(chunk, clock, count_activations=False) for chunk in trainer.chunks]
        for probe in self.probes:
            probe.attach()

    def after_step(self, trainer, control, iteration: int) -> Optional[dict]:
        """The fit's report record after the last calibration iteration (every rank
        calls it at the same iteration), else None."""
        if not self.probes:
            return None
        for probe in self.probes:
            probe.end_iteration()
        plan = trainer.data.plan(iteration)
        self.shapes += [trainer.data.cost_shape(mb[trainer.dims.dp_rank]) for mb in plan.lengths]
        if iteration < self.last:
            return None
        probes, self.probes, self.done = self.probes, [], True
        for probe in probes:
            probe.detach()
        lengths, tokens = [s for s, _ in self.shapes], [t for _, t in self.shapes]
        local = {layer.layer_number: samples_from_probe(probe.samples, layer.layer_number,
                                                        lengths, tokens)
                 for probe in probes for layer in probe.layers}
        gathered = control.all_gather(local, "data-cost-samples")
        hidden = trainer.args.hidden_size
        record = control.decide(lambda: fit_record(gathered, self.form, hidden, iteration),
                                "data-cost-fit")
        if record.get("model") is not None:
            trainer.data.set_cost_model(model_from_dict(record["model"]))
            trainer.data.layer_models = {int(k): model_from_dict(v) for k, v in
                                         record["per_layer_knapformer"].items() if "form" in v}
        if trainer.dims.rank == 0:
            logger.info("data cost model (%s) from %d samples: %s; held-out error %s",
                        self.form, record.get("samples", 0), record.get("model"),
                        record.get("held_out_error") or record.get("error"))
        return record

    def cancel(self) -> None:
        """Stop timing without fitting (the stage was rebuilt, e.g. by a repack)."""
        for probe in self.probes:
            probe.detach()
        self.probes, self.done = [], True


def fit_record(gathered: list[dict[int, list[CostSample]]], form: str, hidden: int,
               iteration: int) -> dict:
    """Rank 0: the report record of a fit over every rank's samples ({layer: samples});
    a fit that fails keeps the prior and says why (never raises)."""
    per_layer: dict[int, list[CostSample]] = {}
    for rank_samples in gathered:
        for layer, samples in rank_samples.items():
            per_layer.setdefault(layer, []).extend(samples)
    pooled = [s for layer in sorted(per_layer) for s in per_layer[layer]]
    record = {"kind": "data_cost_fit", "iteration": iteration, "form": form, "samples": len(pooled)}
    try:
        fits = fit_all(pooled, hidden)
    except ValueError as e:
        return {**record, "model": None, "error": f"kept the prior: {e}"}
    record.update(model=model_to_dict(fits["models"][form]), held_out_error=fits["held_out_error"],
                  models={k: model_to_dict(m) for k, m in fits["models"].items()})
    layers = {}
    for layer, samples in sorted(per_layer.items()):
        try:
            layers[str(layer)] = model_to_dict(fit_knapformer(samples, hidden))
        except ValueError as e:
            layers[str(layer)] = {"error": str(e)}
    record["per_layer_knapformer"] = layers
    return record


# ---- the layer balancer's costs for the length mix ---------------------------------------
def _mean_cost(model: KnapFormerCost, mix: tuple) -> float:
    """KnapFormer's cost of the mean micro-batch of `mix` (count, positions, sum l^2):
    exact for the mean, the model being linear in both."""
    n, tokens, squares = mix
    d = model.hidden
    return model.k * (24 * (tokens / n) * d * d + model.gamma * 4 * d * (squares / n))


def mix_adjusted_profile(profile, layer_models: dict, window_mix: tuple, expected_mix: tuple):
    """`profile` (profiling.records.PipelineProfile, timed over a window whose micro-batches
    had `window_mix`) with each layer's time scaled to the length mix the run trains on
    (`expected_mix`: every micro-batch planned so far) by that layer's fitted KnapFormer
    model: a layer whose attention weighs more (larger gamma) moves more. Layers without a
    model, or empty mixes, keep their times."""
    if not layer_models or not window_mix[0] or not expected_mix[0]:
        return profile
    layers = []
    for x in profile.layers:
        model = layer_models.get(x.layer)
        r = _mean_cost(model, expected_mix) / _mean_cost(model, window_mix) if model else 1.0
        layers.append(dataclasses.replace(x, fwd_s=x.fwd_s * r, bwd_s=x.bwd_s * r))
    return dataclasses.replace(profile, layers=layers, stages=list(profile.stages))


def mix_adjuster(stream_of: Callable):
    """The controller's `cost_adjuster(profile, window)`: `mix_adjusted_profile` with the
    per-layer models, the window's mix and the run's mix of the stream `stream_of()`
    returns (the current trainer's: a repack rebuilds it)."""
    def adjust(profile, window):
        stream = stream_of()
        adjusted = mix_adjusted_profile(profile, stream.layer_models, stream.mix(*window),
                                        tuple(stream.mix_total))
        if adjusted is not profile:
            logger.info("layer costs scaled from window %s's length mix to the run's "
                        "(data cost model, per layer)", window)
        return adjusted
    return adjust
