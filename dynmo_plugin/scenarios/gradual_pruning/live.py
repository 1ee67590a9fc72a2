"""Gradual global magnitude pruning as a live scenario (Zhu & Gupta 2017; DynMo Alg. 1).

At iterations t0, t0+dt, ..., t0+n*dt (after the optimizer step) the target sparsity
S_t follows the cubic schedule (`pruning.cubic_sparsity`). A round:

1. every rank counts its decoder linear weights; one all-gather on the control plane
   gives the global count `total` (data-parallel replicas hold identical weights, so
   only dp_rank 0 counts; tensor-parallel shards all count);
2. every counted rank computes its local top-k magnitudes, k = num_to_keep(total, S_t),
   and sends them to global rank 0 (pipeline rank 0) point to point: the length
   first, then the values (sizes differ per stage);
3. rank 0 computes the global threshold tau and `ControlPlane.decide` broadcasts it,
   so every rank masks with the same tau;
4. each rank: mask &= |w| >= tau; weights, DDP main_grad and the fp32 master copy
   (if any) zeroed off the mask; Adam's exp_avg / exp_avg_sq zeroed there too, so a
   pruned weight cannot come back. Masks are buffers of the layers' linears
   (`dynmo_plugin.scenarios.gradual_pruning.layer`), so migrations carry them.

The round returns a `DynamismEvent` with per-layer sparsity, the target, tau and the
layers whose linears now run the CSR kernel; the controller profiles and rebalances.

`granularity: structured` runs the same algorithm over FFN neurons instead of weights:
a neuron's score is the L2 norm of everything attached to it (its fc1 row and bias
entry, its fc2 column), the target is the fraction of neurons removed, and the kept
neurons are gathered into smaller dense GEMMs (`NeuronPrunable*` linears). The global
threshold says how many neurons each layer deserves; the layer keeps its top-scoring
neurons at that count rounded to the nearest `pruning.width_multiple` (default 128,
`widths.aligned_width`): a bf16 GEMM at an arbitrary width (2703) ran 4x slower on an
H200 than at the nearest multiple of 8 (issue 33). The event reports the widths used
(`ffn_width`, and `attention_heads` with head pruning). With
`structured: physical` (the default) each round then rebuilds the pruned layers with
the kept neurons only (`LayerMigrator.rebuild(reshape=...)`, the machinery a migration
uses): weights, gradients, DDP buffers, fp32 masters and Adam moments shrink, and the
kept rows / columns of every one of them are carried over exactly. A rebuild that
fails leaves the layers masked (same values, full size) and is retried next round.

`pruning.heads` (opt-in, structured only) removes whole attention heads the same way
(Minitron-style width pruning): on the same cubic schedule from 0 to `heads`, each layer
drops floor(fraction * its heads) heads, the lowest by the L2 norm of their qkv rows
(q, k, v and biases) and proj columns (fewer where head_dim is no multiple of 8, so the
kept width stays one: `widths.kept_head_count`). Heads are ranked per layer, not globally, so every
layer keeps at least one head (fraction < 1) and no rank needs another's scores. Standard
multi-head attention only: grouped-query attention (a k/v pair shared by several heads)
and gated attention output are refused.

Control-plane payloads (the candidates sent to rank 0) are CPU tensors: the control
group is gloo, and weights on a GPU give candidates on the GPU.
"""
from __future__ import annotations

import logging
import time
from typing import Optional

import torch
import torch.distributed as dist

from dynmo_plugin.config import ConfigError
from dynmo_plugin.scenarios.base import DynamismEvent, Scenario
from dynmo_plugin.scenarios.gradual_pruning.kernels import (apply_mask_, cubic_sparsity, global_threshold,
                                           is_pruning_step, local_candidates, magnitude_mask,
                                           mask_grad_, num_to_keep, zero_adam_state_)
from dynmo_plugin.scenarios.gradual_pruning.widths import aligned_width, keep_top, kept_head_count

__all__ = ["GradualPruning"]

logger = logging.getLogger(__name__)


class GradualPruning(Scenario):
    """`dynamism.kind: gradual_pruning` (settings: `dynamism.pruning`, a PruningConfig)."""

    name = "gradual_pruning"

    def __init__(self, config) -> None:
        """Raises:
            ConfigError: an inconsistent schedule (initial above final sparsity)."""
        super().__init__(config)
        self.pruning = p = config.pruning
        self.structured = p.granularity == "structured"
        self.physical = self.structured and p.structured == "physical"
        self._reshrink = False  # layers loaded at full width that a physical run shrinks
        try:
            cubic_sparsity(p.start, p.start, p.rounds, p.interval, p.initial_sparsity,
                           p.final_sparsity)
        except ValueError as e:
            raise ConfigError(f"dynamism.pruning: {e}") from e
        self.applied = 0.0  # global sparsity target of the last round
        self.heads_applied = 0.0  # fraction of heads removed by the last round

    # ---- Scenario interface ---------------------------------------------------------------
    def layer_spec(self, spec, model_args):
        from dynmo_plugin.scenarios.gradual_pruning.layer import (head_prunable_layer_spec,
                                                    neuron_prunable_layer_spec, prunable_layer_spec)
        if self.structured and self.pruning.heads > 0:
            return head_prunable_layer_spec(neuron_prunable_layer_spec(spec))
        if self.structured:
            return neuron_prunable_layer_spec(spec)
        return prunable_layer_spec(spec, self.pruning.sparse_threshold)

    def attach(self, runtime) -> None:
        super().attach(runtime)
        if self.structured and runtime.trainer.config.gated_linear_unit:
            raise ConfigError("dynamism.pruning.granularity: structured pruning removes neurons of "
                              "non-gated MLPs only (a gated fc1 holds two rows per neuron)")
        if self.pruning.heads > 0:
            _check_head_pruning(self.structured, runtime.trainer.config)

    def state_dict(self) -> dict:
        if self.heads_applied:
            return {"applied": self.applied, "heads_applied": self.heads_applied}
        return {"applied": self.applied}

    def load_state_dict(self, state: dict) -> None:
        self.applied = state.get("applied", 0.0)
        self.heads_applied = state.get("heads_applied", 0.0)
        self._reshrink = self.physical and (self.applied > 0 or self.heads_applied > 0)  # a checkpoint holds full widths
        self.after_layout_change()  # CSR kernels for the loaded sparsity

    def after_step(self, iteration: int) -> Optional[DynamismEvent]:
        p = self.pruning
        if self._reshrink:
            self._reshrink = not self._shrink()
        if not is_pruning_step(iteration, p.start, p.rounds, p.interval):
            return None
        target = cubic_sparsity(iteration, p.start, p.rounds, p.interval, p.initial_sparsity,
                                p.final_sparsity)
        heads = (cubic_sparsity(iteration, p.start, p.rounds, p.interval, 0.0, p.heads)
                 if p.heads > 0 else 0.0)
        if target <= self.applied and heads <= self.heads_applied:  # e.g. the t0 round
            return None
        start = time.perf_counter()
        tau = None
        if heads > self.heads_applied:
            self._apply_heads(heads)
            self.heads_applied = heads
        if self.structured:
            if target > self.applied:
                scores = self._neuron_scores()
                tau = self._threshold(target, list(scores.values()))
                self._apply_structured(tau, scores)
            if self.physical and not self._shrink():
                self._reshrink = True
        else:
            tau = self._threshold(target, [m.weight for _, _, m in self._linears()])
            self._apply(tau)
        self.applied = max(target, self.applied)
        per_layer, sparse_layers, widths = self._summary()
        seconds = time.perf_counter() - start
        if self.runtime.control.rank == 0:
            logger.info("pruning round at iteration %d: target %.4f, heads %.4f, tau %s, %.2f s, "
                        "CSR layers %s", iteration, target, heads,
                        "-" if tau is None else f"{tau:.3g}", seconds, sparse_layers)
        return DynamismEvent(self.name, iteration, detail={
            "granularity": self.pruning.granularity,
            "unit": "ffn_neurons" if self.structured else "weights",
            "sparsity": per_layer, "target": target, "threshold": tau,
            "sparse_kernel_layers": sparse_layers, **widths,
            **({"width_multiple": self.pruning.width_multiple} if self.structured else {}),
            **({"heads": self.heads_applied} if self.pruning.heads > 0 else {})})

    def after_layout_change(self) -> None:
        for _, _, module in self._linears():
            module.refresh()  # CSR patterns of layers that arrived, outside profiled steps

    # ---- the round --------------------------------------------------------------------------
    def _linears(self):
        from dynmo_plugin.scenarios.gradual_pruning.layer import prunable_linears
        for layer in self.runtime.trainer.layers:
            for name, module in prunable_linears(layer):
                yield layer.layer_number, name, module

    def _counts(self) -> bool:
        """Whether this rank's weights count (one data-parallel replica does)."""
        return self.runtime.trainer.dims.dp_rank == 0

    def _threshold(self, target: float, weights: list[torch.Tensor]) -> float:
        """Algorithm 1 over `weights` (magnitudes: weights, or neuron scores): local top-k
        everywhere, gathered to rank 0 by p2p, tau decided there."""
        control = self.runtime.control
        numel = sum(w.numel() for w in weights) if self._counts() else 0
        counts = control.all_gather(numel, "pruning-count")
        total = sum(counts)
        k = num_to_keep(total, target)
        # on the CPU: the control group is gloo, the weights may be on a GPU
        mine = local_candidates(weights, k).cpu() if numel else torch.empty(0)
        received = [mine]
        # what every stage sends: neuron scores in fp32, weights in their own dtype
        dtype = torch.float32 if self.structured else self.runtime.trainer.config.params_dtype
        with control.phase("pruning-candidates"):
            if control.rank == 0:
                for src in range(1, control.world_size):
                    if counts[src] == 0:
                        continue
                    length = torch.zeros(1, dtype=torch.int64)
                    dist.recv(length, src=src, group=control.group)
                    buf = torch.empty(int(length), dtype=dtype)
                    if int(length):
                        dist.recv(buf, src=src, group=control.group)
                    received.append(buf)
            elif numel:
                dist.send(torch.tensor([mine.numel()], dtype=torch.int64), dst=0, group=control.group)
                if mine.numel():
                    dist.send(mine.contiguous(), dst=0, group=control.group)
        return control.decide(lambda: global_threshold(received, total, target), "pruning-threshold")

    @torch.no_grad()
    def _apply(self, tau: float) -> None:
        optimizer = self.runtime.trainer.optimizer
        for _, _, module in self._linears():
            w, mask = module.weight, module.weight_mask
            mask &= magnitude_mask(w, tau)
            apply_mask_(w, mask)
            mask_grad_(w, mask)
            _mask_optimizer_state(optimizer, w, mask)
            module.refresh()

    def _mlp_pairs(self):
        """(layer number, fc1, fc2) of this stage's structured-pruned MLPs."""
        from dynmo_plugin.scenarios.gradual_pruning.layer import NeuronPrunableColumnParallelLinear
        for layer in self.runtime.trainer.layers:
            fc1, fc2 = layer.mlp.linear_fc1, layer.mlp.linear_fc2
            if isinstance(fc1, NeuronPrunableColumnParallelLinear):
                yield layer.layer_number, fc1, fc2

    def _neuron_scores(self) -> dict[int, torch.Tensor]:
        return {number: neuron_scores(fc1, fc2) for number, fc1, fc2 in self._mlp_pairs()}

    def _apply_structured(self, tau: float, scores: dict[int, torch.Tensor]) -> None:
        prune_neurons([(fc1, fc2, scores[n]) for n, fc1, fc2 in self._mlp_pairs()],
                      self.runtime.trainer.optimizer, tau, self.pruning.width_multiple)

    def _apply_heads(self, fraction: float) -> None:
        from dynmo_plugin.scenarios.gradual_pruning.layer import HeadPrunableSelfAttention
        attns = [layer.self_attention for layer in self.runtime.trainer.layers
                 if isinstance(layer.self_attention, HeadPrunableSelfAttention)]
        prune_heads(attns, self.runtime.trainer.optimizer, fraction)

    def _shrink(self) -> bool:
        """Rebuild this stage's layers with their kept neurons only (collective: every
        rank, as a migration); False when the rebuild was abandoned (layers stay masked)."""
        result = self.runtime.migrator.rebuild(reshape=shrunk_tensors)
        if not result.applied:
            logger.error("structured pruning: shrinking the pruned layers was abandoned, they "
                         "stay masked at full size: %s", result.error)
        return result.applied

    def _summary(self) -> tuple[dict[int, float], list[int], dict[str, dict[int, int]]]:
        """Per-layer sparsity, CSR layers and (structured) the widths the layers run at,
        over the whole pipeline (same on every rank): kept FFN neurons and, with head
        pruning, kept heads per layer (tensor-parallel shards added up)."""
        local: dict[int, list[int]] = {}
        if self._counts() and self.structured:
            for number, fc1, fc2 in self._mlp_pairs():  # neurons: pruned, total, (no CSR), widths
                neurons = fc1.weight_mask.any(1)
                kept = int(neurons.sum())
                local[number] = [neurons.numel() - kept, neurons.numel(), 0, kept, 0]
            for layer in self.runtime.trainer.layers:
                attn = layer.self_attention
                if self.pruning.heads > 0 and layer.layer_number in local and hasattr(attn, "kept_heads"):
                    local[layer.layer_number][4] = int(attn.kept_heads().sum())
        elif self._counts():
            for number, _, m in self._linears():
                pruned_numel_sparse = local.setdefault(number, [0, 0, 0])
                pruned_numel_sparse[0] += int((~m.weight_mask).sum())
                pruned_numel_sparse[1] += m.weight_mask.numel()
                pruned_numel_sparse[2] += int(m.uses_sparse_kernel)
        merged: dict[int, list[int]] = {}
        for part in self.runtime.control.all_gather(local, "pruning-summary"):
            for number, values in part.items():  # TP shards of one layer add up
                acc = merged.setdefault(number, [0] * len(values))
                for i, v in enumerate(values):
                    acc[i] += v
        per_layer = {n: round(v[0] / v[1], 6) for n, v in sorted(merged.items())}
        widths: dict[str, dict[int, int]] = {}
        if self.structured:
            widths["ffn_width"] = {n: v[3] for n, v in sorted(merged.items())}
            if self.pruning.heads > 0:
                widths["attention_heads"] = {n: v[4] for n, v in sorted(merged.items())}
        return per_layer, sorted(n for n, v in merged.items() if v[2]), widths


def _check_head_pruning(structured: bool, config) -> None:
    """Raises ConfigError unless head pruning can run on this model (one line each)."""
    if not structured:
        raise ConfigError("dynamism.pruning.heads: head pruning needs granularity: structured "
                          "(--dynmo-pruning-granularity structured)")
    groups = config.num_query_groups or config.num_attention_heads
    if groups != config.num_attention_heads:
        raise ConfigError(f"dynamism.pruning.heads: grouped-query attention ({groups} query groups "
                          f"for {config.num_attention_heads} heads) is not supported; set "
                          "pruning.heads: 0 or use standard multi-head attention")
    if getattr(config, "attention_output_gate", False):
        raise ConfigError("dynamism.pruning.heads: gated attention output is not supported; "
                          "set pruning.heads: 0")


def _full_width(module, per_neuron: torch.Tensor) -> torch.Tensor:
    """Per-neuron values of `module`'s present neurons at its full width (0 at the gone)."""
    if not module.physical:
        return per_neuron
    return torch.zeros(module.full_width, dtype=per_neuron.dtype,
                       device=per_neuron.device).index_copy_(0, module._present, per_neuron)


@torch.no_grad()
def neuron_scores(fc1, fc2) -> torch.Tensor:
    """Each FFN neuron's L2 norm over its fc1 row, fc1 bias entry and fc2 column, at the
    layer's full width (pruned neurons score 0: their weights are zero or gone)."""
    sq = fc1.weight.float().pow(2).sum(1) + fc2.weight.float().pow(2).sum(0)
    if fc1.bias is not None:
        sq += fc1.bias.float().pow(2)
    return _full_width(fc1, sq).sqrt()


@torch.no_grad()
def prune_neurons(pairs, optimizer, tau: float, multiple: int) -> list[int]:
    """For each (fc1, fc2, full-width scores) of one stage: keep the neurons the global
    threshold `tau` keeps, their count rounded to the nearest `multiple` (`aligned_width`:
    the layer's top-scoring neurons at that width); returns the widths kept. Host reads
    here (the counts) happen once per round, outside any forward."""
    widths = []
    for fc1, fc2, score in pairs:
        kept = fc1.kept_neurons()
        width = aligned_width(int((kept & (score >= tau)).sum()), multiple, fc1.full_width,
                              int(kept.sum()))
        keep = keep_top(score, kept, width)
        _drop_neurons(optimizer, fc1, keep, fc2, keep)
        widths.append(width)
    return widths


@torch.no_grad()
def head_scores(attn) -> torch.Tensor:
    """[full heads]: each head's squared L2 norm over its qkv rows and biases (q, k, v) and
    its proj columns (pruned heads score 0)."""
    qkv, proj, heads = attn.linear_qkv, attn.linear_proj, attn.full_heads
    sq = _full_width(qkv, qkv.weight.float().pow(2).sum(1))
    if qkv.bias is not None:
        sq += _full_width(qkv, qkv.bias.float().pow(2))
    return sq.view(heads, -1).sum(1) + _full_width(
        proj, proj.weight.float().pow(2).sum(0)).view(heads, -1).sum(1)


@torch.no_grad()
def prune_heads(attns, optimizer, fraction: float) -> list[int]:
    """In every HeadPrunableSelfAttention of `attns`, keep the `kept_head_count` heads with
    the highest `head_scores` (heads pruned before stay pruned); returns the heads kept."""
    counts = []
    for attn in attns:
        kept = attn.kept_heads()
        count = kept_head_count(attn.full_heads, int(kept.sum()), fraction, attn.head_dim)
        keep = keep_top(head_scores(attn), kept, count)
        _drop_neurons(optimizer, attn.linear_qkv, keep.repeat_interleave(3 * attn.head_dim),
                      attn.linear_proj, keep.repeat_interleave(attn.head_dim))
        attn.sync_heads()
        counts.append(count)
    return counts


@torch.no_grad()
def _drop_neurons(optimizer, col, keep_rows: torch.Tensor, row, keep_cols: torch.Tensor) -> None:
    """Mask the neurons `keep_*` drop (full width) in a column linear (rows, its bias) and
    the row linear after it (columns); zero them in weights, grads, masters and Adam."""
    col.weight_mask &= keep_rows[:, None]
    row.weight_mask &= keep_cols[None, :]
    # masks over the neurons each weight holds (all of them unless physically pruned)
    params = [(col.weight, col.local_mask()), (row.weight, row.local_mask())]
    if col.bias is not None:
        params.append((col.bias, col.local_mask().any(1)))
    for w, mask in params:
        apply_mask_(w, mask)
        mask_grad_(w, mask)
        _mask_optimizer_state(optimizer, w, mask)
    col.refresh()
    row.refresh()


@torch.no_grad()
def _mask_optimizer_state(optimizer, w: torch.nn.Parameter, mask: torch.Tensor) -> None:
    """Zero the pruned entries of `w`'s fp32 master copy and Adam moments, for each piece
    of them this rank holds: all of `w` with a plain optimizer, this DP rank's range of
    the flattened `w` with the distributed optimizer (so the mask is flattened the same
    way the gradient buffer flattens `w`). Without it Adam's history and the masters
    drift at pruned positions (see zero_adam_state_)."""
    from dynmo_plugin.megatron.migration.optim_state import local_state_pieces
    if optimizer is None:  # a layer no optimizer holds yet (a test's, a benchmark's)
        return
    flat = mask.reshape(-1)
    for state, master, piece in local_state_pieces(optimizer, w):
        if master is not None:
            apply_mask_(master, flat[piece])
        zero_adam_state_(state, flat[piece])


@torch.no_grad()
def shrunk_tensors(layer, tensors: dict) -> Optional[dict]:
    """`LayerMigrator.rebuild`'s reshape for structured pruning: the layer's packed
    tensors (state/, grad/, optim/<param>/<key>) with only the kept neurons of each
    neuron-prunable linear (fc1 / fc2, and qkv / proj under head pruning: weight, and
    bias along axis 0; the full-width masks stay); None when nothing is left to drop."""
    from dynmo_plugin.scenarios.gradual_pruning.layer import _NeuronMasked, prunable_linears
    axes, index = {}, {}
    for name, module in prunable_linears(layer):
        if isinstance(module, _NeuronMasked):
            kept = module.shrink_index()
            if kept.numel() < module.weight.shape[module.axis]:
                index[name] = kept
                axes.update({f"{name}.{p}": module._dim(p) for p in module.neuron_params})
    if not index:
        return None
    out = {}
    for key, value in tensors.items():
        name = key.split("/")[1]
        axis = axes.get(name)
        if axis is not None and value.dim() > 0:
            value = value.index_select(axis, index[name.rsplit(".", 1)[0]].to(value.device))
        out[key] = value
    return out
