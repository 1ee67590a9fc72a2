"""Fitting the data cost model from the profiler at the start of a packed run.

For the first `iterations` iterations, the profiler's probe (megatron.probe.StageProbe:
the hooks a profile window uses, without activation accounting) times every decoder
layer of this stage per micro-batch; each time is paired with the document lengths of
that micro-batch from the stream's plan. The samples of every rank go to rank 0, which
fits the three forms of data.cost_model on all layers' samples pooled (`fit_all`:
KnapFormer, AdaptiveLoad, token count, each with its held-out error) and KnapFormer per
layer; the form the run asked for (`--data-cost-model`) is broadcast, and every rank's
stream balances the following iterations by it (WLB packing and the DP redistribution
use the same `doc_workload`). The record (kind "data_cost_fit") goes into report.json.

Until the fit, the stream balances by its prior (length^p). A resumed run whose
checkpoint holds a fitted model (the stream's state) does not fit again.
"""
from __future__ import annotations

import logging
from typing import Optional

from dynmo_plugin.data.cost_model import (CostSample, PowerCost, fit_all, fit_knapformer,
                                          model_to_dict, samples_from_probe)

__all__ = ["CostCalibration", "fit_record"]

logger = logging.getLogger(__name__)


class CostCalibration:
    """Times iterations start+1 .. start+iterations, then fits (collective at the end)."""

    def __init__(self, form: str, iterations: int, start_iteration: int):
        self.form, self.first = form, start_iteration + 1
        self.last = start_iteration + iterations
        self.probe = None
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
        from dynmo_plugin.megatron.probe import StageProbe
        from dynmo_plugin.profiling.clock import clock_for
        self.probe = StageProbe(trainer.model, clock_for(trainer.dims.device), count_activations=False)
        self.probe.attach()

    def after_step(self, trainer, control, iteration: int) -> Optional[dict]:
        """The fit's report record after the last calibration iteration (every rank
        calls it at the same iteration), else None."""
        if self.probe is None:
            return None
        self.probe.end_iteration()
        plan = trainer.data.plan(iteration)
        self.shapes += [trainer.data.cost_shape(mb[trainer.dims.dp_rank]) for mb in plan.lengths]
        if iteration < self.last:
            return None
        probe, self.probe, self.done = self.probe, None, True
        probe.detach()
        lengths, tokens = [s for s, _ in self.shapes], [t for _, t in self.shapes]
        local = {layer.layer_number: samples_from_probe(probe.samples, layer.layer_number,
                                                        lengths, tokens)
                 for layer in probe.layers}
        gathered = control.all_gather(local, "data-cost-samples")
        hidden = trainer.args.hidden_size
        record = control.decide(lambda: fit_record(gathered, self.form, hidden, iteration),
                                "data-cost-fit")
        if record.get("model") is not None:
            from dynmo_plugin.data.cost_model import model_from_dict
            trainer.data.set_cost_model(model_from_dict(record["model"]))
        if trainer.dims.rank == 0:
            logger.info("data cost model (%s) from %d samples: %s; held-out error %s",
                        self.form, record.get("samples", 0), record.get("model"),
                        record.get("held_out_error") or record.get("error"))
        return record

    def cancel(self) -> None:
        """Stop timing without fitting (the stage was rebuilt, e.g. by a repack)."""
        if self.probe is not None:
            self.probe.detach()
        self.probe, self.done = None, True


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
            m = fit_knapformer(samples, hidden)
            layers[str(layer)] = {"k": m.k, "gamma": m.gamma}
        except ValueError as e:
            layers[str(layer)] = {"error": str(e)}
    record["per_layer_knapformer"] = layers
    return record
