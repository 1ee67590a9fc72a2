"""Egeria-style layer freezing: converged layers stop training, front to back.

Every `interval` iterations from `start`, each stage measures the plasticity of each of
its trainable layers, the relative change of the layer's weights since the last check,

    plasticity_l(t) = ||W_l(t) - W_l(t - interval)|| / ||W_l(t - interval)||,

(over the whole layer; tensor-parallel shards are summed, replicas counted once). A
layer's first measurement is its reference; it has converged when its plasticity falls
below `threshold` x reference. Rank 0 gathers every layer's numbers on the control
plane and decides the new frozen prefix: layers 1..j freeze only if all of them have
converged (never the last layer, at most `max_layers`). Every rank then applies it:
requires_grad False on those layers and on the embedding (and on the last stage's
tied copy of the word embeddings, which would otherwise be all-reduced with a frozen
weight and drift from it), then `migrator.rebuild()` remakes DDP and the optimizer
without them: no gradient, no all-reduce, no Adam update (not even weight decay).

A frozen prefix skips its backward entirely (autograd never reaches it) but still runs
forward, so a stage holding it gets cheaper and the pipeline goes out of balance: the
event makes the controller profile (frozen layers report ~0 backward) and rebalance.

The snapshot, the reference and the prefix flag are buffers of the layer
(dynmo_plugin.scenarios.layer_freezing.layer), so a migrated layer carries them, and the decision
depends on weights alone: a run whose layers move freezes at the same iterations, with
the same losses, as a static one.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Optional

from dynmo_plugin.scenarios.base import DynamismEvent, Scenario

__all__ = ["LayerFreezing", "combine_shards", "freeze_limit", "frozen_prefix", "plasticity"]

logger = logging.getLogger(__name__)


# ---- pure helpers (no processes, no Megatron) ---------------------------------------------
def combine_shards(gathered: list[dict]) -> dict[int, tuple[float, float, float]]:
    """Per layer (diff^2, norm^2, reference) from every rank's report: data-parallel
    replicas hold the same weights (replica 0 is read), tensor-parallel ranks hold
    disjoint parts (summed in TP-rank order, so the result is the same on any run)."""
    out: dict[int, list[float]] = {}
    for part in sorted((g for g in gathered if g["dp"] == 0), key=lambda g: g["tp"]):
        for layer, (diff2, norm2, ref) in part["layers"].items():
            acc = out.setdefault(int(layer), [0.0, 0.0, ref])
            acc[0] += diff2
            acc[1] += norm2
    return {layer: (d, n, r) for layer, (d, n, r) in sorted(out.items())}


def plasticity(diff2: float, norm2: float) -> float:
    """||W - W_old|| / ||W_old|| from squared norms (0 for an all-zero old weight)."""
    return math.sqrt(diff2 / norm2) if norm2 > 0 else 0.0


def freeze_limit(num_layers: int, max_layers: int) -> int:
    """How many leading layers may freeze: never the last, at most `max_layers` (0 = no cap)."""
    limit = num_layers - 1
    return min(limit, max_layers) if max_layers > 0 else limit


def frozen_prefix(converged: dict[int, bool], frozen: int, limit: int) -> int:
    """The longest prefix 1..j (j >= frozen, j <= limit) whose layers all converged."""
    j = frozen
    while j < limit and converged.get(j + 1, False):
        j += 1
    return j


class LayerFreezing(Scenario):
    """dynamism.kind 'layer_freezing' (config: dynamism.freezing)."""

    name = "layer_freezing"

    def __init__(self, config) -> None:
        super().__init__(config)
        self.freezing = config.freezing
        self.frozen = 0             # layers 1..frozen are frozen (same on every rank)
        self._snapshotted = False
        self.history: list[dict] = []  # rank 0: {"iteration", "plasticity"} per check

    # ---- Scenario hooks ---------------------------------------------------------------------
    def layer_spec(self, spec, model_args):
        from dynmo_plugin.scenarios.layer_freezing.layer import freezable_spec
        return freezable_spec(spec)

    def state_dict(self) -> dict:
        return {"frozen": self.frozen, "snapshotted": self._snapshotted}

    def load_state_dict(self, state: dict) -> None:
        self.frozen = state.get("frozen", 0)
        self._snapshotted = state.get("snapshotted", False)

    def is_check(self, iteration: int) -> bool:
        f = self.freezing
        return iteration >= f.start and (iteration - f.start) % f.interval == 0

    def after_step(self, iteration: int) -> Optional[DynamismEvent]:
        return self.with_fallbacks(iteration, self._event(iteration))

    def _event(self, iteration: int) -> Optional[DynamismEvent]:
        t = self.runtime.trainer
        if not self.is_check(iteration) or self.frozen >= self._limit():
            return None
        if not self._snapshotted:  # the first check only sets the reference point
            self._snapshot()
            self._snapshotted = True
            return None
        control = self.runtime.control
        gathered = control.all_gather(self._measure(), "freezing-plasticity")
        decision = self.decide_or_fallback(
            lambda: self._decide(iteration, gathered), "freezing-decision",
            lambda: {"references": {}, "frozen": self.frozen}, "no freeze at this check")
        self._snapshot(decision["references"])
        new = decision["frozen"]
        if new <= self.frozen:
            return None
        start = time.perf_counter()
        result = self._freeze(new)
        apply_s = time.perf_counter() - start
        if not result.applied:
            logger.error("layer freezing: rebuild for prefix 1..%d abandoned, nothing frozen: %s",
                         new, result.error)
            return None
        newly, self.frozen = list(range(self.frozen + 1, new + 1)), new
        detail = {
            "frozen_layers": list(range(1, new + 1)),
            "newly_frozen": newly,
            "plasticity": decision["plasticity"],
            "references": decision["all_references"],
            "threshold": self.freezing.threshold,
            "rebuild": {"total_s": result.total_s, "apply_s": apply_s, "phase_s": result.phase_s},
        }
        if t.dims.rank == 0:
            logger.info("layer freezing: iteration %d froze layers %s (rebuild %.1f ms)",
                        iteration, newly, result.total_s * 1e3)
        return DynamismEvent(self.name, iteration, detail)

    # ---- measurement (local) ------------------------------------------------------------------
    def _limit(self) -> int:
        return freeze_limit(self.runtime.trainer.config.num_layers, self.freezing.max_layers)

    def _trainable_layers(self):
        return [layer for layer in self.runtime.trainer.layers if layer.layer_number > self.frozen]

    def _snapshot(self, references: dict | None = None) -> None:
        for layer in self._trainable_layers():
            layer.snapshot_()
            if references and layer.layer_number in references:
                layer.plasticity_reference.fill_(references[layer.layer_number])

    def _measure(self) -> dict:
        import torch.distributed as dist
        dims = self.runtime.trainer.dims
        tp_rank = dist.get_rank(dims.groups.tp) if dims.tp > 1 else 0

        def include(p) -> bool:  # shards on every TP rank, replicated params on TP rank 0
            return tp_rank == 0 or bool(getattr(p, "tensor_model_parallel", False))

        layers = {}
        for layer in self._trainable_layers():
            diff2, norm2 = layer.weight_change(include)
            layers[layer.layer_number] = (diff2, norm2, float(layer.plasticity_reference))
        return {"dp": dims.dp_rank, "tp": tp_rank, "layers": layers}

    # ---- decision (rank 0) ----------------------------------------------------------------
    def _decide(self, iteration: int, gathered: list[dict]) -> dict:
        combined = combine_shards(gathered)
        values = {layer: plasticity(d, n) for layer, (d, n, _) in combined.items()}
        refs = {layer: ref for layer, (_, _, ref) in combined.items()}
        new_refs = {layer: values[layer] for layer, ref in refs.items() if ref <= 0}
        threshold = self.freezing.threshold
        converged = {layer: refs[layer] > 0 and values[layer] < threshold * refs[layer]
                     for layer in values}
        new = frozen_prefix(converged, self.frozen, self._limit())
        self.history.append({"iteration": iteration, "plasticity": values})
        logger.info("layer freezing: iteration %d plasticity/reference %s", iteration,
                    " ".join(f"{layer}:{values[layer] / (refs[layer] or values[layer] or 1):.3f}"
                             for layer in values))
        return {"plasticity": values, "references": new_refs, "frozen": new,
                "all_references": {layer: refs[layer] or new_refs.get(layer, 0.0) for layer in refs}}

    # ---- apply (every rank, collective) --------------------------------------------------------
    def _freeze(self, new: int):
        t = self.runtime.trainer
        flipped, flagged = [], []
        for layer in t.layers:
            if layer.layer_number <= new and not layer.frozen:
                layer.set_frozen(True)
                flagged.append(layer)
                flipped += [p for p in layer.parameters() if p.requires_grad]
        for p in (p for chunk in t.chunks for p in _embedding_params(chunk)):
            if p.requires_grad:
                flipped.append(p)
        for p in flipped:
            p.requires_grad_(False)
        result = self.runtime.migrator.rebuild()
        if not result.applied:
            _restore(t.ddps, flipped, flagged)
            return result
        for p in (p for chunk in t.chunks for p in chunk.parameters()):
            if not p.requires_grad:  # the retired DDP's gradient view: no memory, no all-reduce
                p.grad = None
                if hasattr(p, "main_grad"):
                    del p.main_grad
        return result


def _embedding_params(model) -> list:
    """The embedding (first stage) and the tied output weight (last stage) of one model
    chunk (interleaved: chunk 0 of the first rank, the last chunk of the last rank)."""
    params = []
    if getattr(model, "pre_process", False):
        params += list(model.embedding.parameters())
    if getattr(model, "post_process", False) and model.share_embeddings_and_output_weights:
        params.append(model.shared_embedding_or_output_weight())
    return params


def _restore(ddps, params, layers) -> None:
    """Undo a freeze whose rebuild was abandoned: the old DDPs (one per model chunk) are
    live again and must hook the parameters that train again."""
    from dynmo_plugin.megatron.migration.migrate import _attach_hooks, _detach_hooks
    for p in params:
        p.requires_grad_(True)
    for layer in layers:
        layer.set_frozen(False)
    for ddp in ddps:
        _detach_hooks(ddp)
        _attach_hooks(ddp)
