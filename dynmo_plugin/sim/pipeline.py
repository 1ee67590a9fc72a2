"""From per-layer costs and a layout to the inputs of one simulated iteration."""
from __future__ import annotations

import numpy as np

from dynmo_plugin.layout import Layout
from dynmo_plugin.sim.cost import PipelineCosts
from dynmo_plugin.sim.gpt import GPTShape, Hardware, LayerCosts, LayerLoad
from dynmo_plugin.sim.iteration import IterationResult, simulate_iteration

__all__ = ["stage_costs", "simulate_layout", "stage_memory_bytes"]


def _per_stage(values: np.ndarray, layout: Layout) -> np.ndarray:
    b = layout.boundaries
    return np.array([float(values[b[s]:b[s + 1]].sum()) for s in range(layout.num_stages)])


def stage_costs(*, layout: Layout, costs: LayerCosts, load: LayerLoad, shape: GPTShape,
                hw: Hardware, dp: int, num_microbatches: int) -> PipelineCosts:
    """PipelineCosts of `layout`: layer sums per stage, embedding on the first and output
    layer on the last stage, gradients of trainable layers all-reduced over `dp` (the
    tied embedding's on the first and last stage)."""
    fwd = _per_stage(costs.fwd_s, layout)
    bwd = _per_stage(costs.bwd_s, layout)
    fwd[0] += costs.embed_fwd_s
    bwd[0] += 2 * costs.embed_fwd_s
    fwd[-1] += costs.head_fwd_s
    bwd[-1] += 2 * costs.head_fwd_s
    params = _per_stage(load.trainable.astype(float) * shape.layer_params, layout)
    params[0] += shape.vocab * shape.hidden
    if layout.num_stages > 1:
        params[-1] += shape.vocab * shape.hidden
    return PipelineCosts(fwd_s=fwd, bwd_s=bwd, num_microbatches=num_microbatches,
                         act_bytes=shape.act_bytes, p2p=hw.p2p, dp=dp,
                         grad_bytes=params * hw.grad_bytes_per_param, dp_link=hw.dp_link)


def simulate_layout(*, layout: Layout, costs: LayerCosts, load: LayerLoad, shape: GPTShape,
                    hw: Hardware, dp: int, num_microbatches: int, noise_sigma: float = 0.0,
                    seed: int = 0) -> IterationResult:
    pc = stage_costs(layout=layout, costs=costs, load=load, shape=shape, hw=hw, dp=dp,
                     num_microbatches=num_microbatches)
    return simulate_iteration(pc, noise_sigma=noise_sigma, seed=seed)


def stage_memory_bytes(layout: Layout, shape: GPTShape, hw: Hardware,
                       num_microbatches: int) -> np.ndarray:
    """Peak memory per stage under 1F1B: training state of its layers plus the
    activations of the micro-batches it holds in flight (pp - rank, capped at m), with
    34 s b h bytes per layer and micro-batch (Korthikanti et al. 2022, flash attention,
    no recomputation)."""
    p = layout.num_stages
    counts = np.array(layout.counts, dtype=float)
    state = counts * shape.layer_params * hw.state_bytes_per_param
    inflight = np.minimum(p - np.arange(p), num_microbatches)
    acts = counts * 34.0 * shape.seq * shape.micro_batch * shape.hidden * inflight
    emb = np.zeros(p)
    emb[0] += shape.vocab * shape.hidden * hw.state_bytes_per_param
    emb[-1] += shape.vocab * shape.hidden * hw.state_bytes_per_param
    return state + acts + emb
