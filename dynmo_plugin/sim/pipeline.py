"""From per-layer costs and a layout to the inputs of one simulated iteration.

Interleaved layouts (`layout.num_chunks` > 1) are simulated with Megatron's interleaved
1F1B (`schedule.interleaved`): costs per virtual stage, gradients and memory per rank.
"""
from __future__ import annotations

import numpy as np

from dynmo_plugin.layout import Layout
from dynmo_plugin.sim.cost import PipelineCosts
from dynmo_plugin.sim.schedule import FORWARD, rank_orders
from dynmo_plugin.sim.gpt import GPTShape, Hardware, LayerCosts, LayerLoad
from dynmo_plugin.sim.iteration import IterationResult, simulate_iteration

__all__ = ["stage_costs", "simulate_layout", "stage_memory_bytes"]


def _per_stage(values: np.ndarray, layout: Layout) -> np.ndarray:
    b = layout.boundaries
    return np.array([float(values[b[s]:b[s + 1]].sum()) for s in range(layout.num_stages)])


def stage_costs(*, layout: Layout, costs: LayerCosts, load: LayerLoad, shape: GPTShape,
                hw: Hardware, dp: int, num_microbatches: int) -> PipelineCosts:
    """PipelineCosts of `layout`: layer sums per (virtual) stage, embedding on the first
    and output layer on the last stage, gradients of trainable layers all-reduced over
    `dp` per rank (the tied embedding's on the first and last rank)."""
    fwd = _per_stage(costs.fwd_s, layout)
    bwd = _per_stage(costs.bwd_s, layout)
    fwd[0] += costs.embed_fwd_s
    bwd[0] += 2 * costs.embed_fwd_s
    fwd[-1] += costs.head_fwd_s
    bwd[-1] += 2 * costs.head_fwd_s
    per_stage = _per_stage(load.trainable.astype(float) * shape.layer_params, layout)
    params = per_stage.reshape(layout.num_chunks, layout.num_ranks).sum(axis=0)
    params[0] += shape.vocab * shape.hidden
    if layout.num_ranks > 1:
        params[-1] += shape.vocab * shape.hidden
    return PipelineCosts(fwd_s=fwd, bwd_s=bwd, num_microbatches=num_microbatches,
                         num_chunks=layout.num_chunks,
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
    """Peak memory per rank under (interleaved) 1F1B: training state of its layers plus
    the activations it holds in flight, with 34 s b h bytes per layer and micro-batch
    (Korthikanti et al. 2022, flash attention, no recomputation). In flight: the most
    activation bytes held at any point of the rank's schedule (a forward of chunk c
    adds chunk c's, its backward frees them); for 1F1B that is min(pp - rank, m)
    micro-batches of the stage."""
    p, v = layout.num_ranks, layout.num_chunks
    counts = np.array(layout.counts, dtype=float).reshape(v, p)  # [chunk, rank]
    state = counts.sum(axis=0) * shape.layer_params * hw.state_bytes_per_param
    per_mb = counts * 34.0 * shape.seq * shape.micro_batch * shape.hidden
    orders = rank_orders(p, num_microbatches, v)
    acts = np.array([_peak_in_flight(orders[r], per_mb[:, r]) for r in range(p)])
    emb = np.zeros(p)
    emb[0] += shape.vocab * shape.hidden * hw.state_bytes_per_param
    emb[-1] += shape.vocab * shape.hidden * hw.state_bytes_per_param
    return state + acts + emb


def _peak_in_flight(order, chunk_bytes: np.ndarray) -> float:
    held = peak = 0.0
    for op in order:
        held += chunk_bytes[op.chunk] if op.kind == FORWARD else -chunk_bytes[op.chunk]
        peak = max(peak, held)
    return float(peak)
