"""One training iteration: pipeline schedule, then gradient all-reduce and optimizer.

Idleness follows the DynMo paper's Figure 1 usage: the share of GPU time inside the
pipeline flush in which a stage computes nothing (pipeline bubbles plus waiting on a
slower neighbour), `1 - sum(busy) / (pp * pipeline_s)`. The gradient all-reduce and
optimizer step come after the flush (Megatron without overlap_grad_reduce) and are
reported separately, not counted as idleness.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from dynmo_plugin.errors import UserError
from dynmo_plugin.sim.cost import PipelineCosts, ring_allreduce_s
from dynmo_plugin.sim.engine import Timeline, run_schedule

__all__ = ["IterationResult", "simulate_iteration", "with_noise"]


@dataclass(frozen=True)
class IterationResult:
    """Simulated iteration.

    iteration_s: wall time of the iteration (pipeline + all-reduce + tail, slowest rank).
    pipeline_s: time until the last backward finishes on any rank.
    busy_s / idle_s: per rank compute and non-compute seconds within `pipeline_s`.
    allreduce_s: per rank gradient all-reduce seconds.
    bubble_ratio: idleness within the pipeline flush (see module doc).
    """

    iteration_s: float
    pipeline_s: float
    busy_s: np.ndarray
    idle_s: np.ndarray
    allreduce_s: np.ndarray
    bubble_ratio: float
    timeline: Timeline

    def as_dict(self) -> dict:
        return {"iteration_s": self.iteration_s, "pipeline_s": self.pipeline_s,
                "busy_s": self.busy_s.tolist(), "idle_s": self.idle_s.tolist(),
                "allreduce_s": self.allreduce_s.tolist(), "bubble_ratio": self.bubble_ratio}


def with_noise(costs: PipelineCosts, sigma: float, seed: int) -> PipelineCosts:
    """Costs with every (stage, micro-batch) cost scaled by an independent log-normal
    factor of median 1 and shape `sigma` (kernel jitter, stragglers); seeded."""
    if sigma < 0:
        raise UserError(f"noise sigma must be >= 0, got {sigma}")
    if sigma == 0:
        return costs
    rng = np.random.default_rng(seed)
    fwd = np.asarray(costs.fwd_s) * rng.lognormal(0.0, sigma, np.shape(costs.fwd_s))
    bwd = np.asarray(costs.bwd_s) * rng.lognormal(0.0, sigma, np.shape(costs.bwd_s))
    return dataclasses.replace(costs, fwd_s=fwd, bwd_s=bwd)


def simulate_iteration(costs: PipelineCosts, *, noise_sigma: float = 0.0,
                       seed: int = 0) -> IterationResult:
    """Simulate one iteration of Megatron's (interleaved) 1F1B plus DP all-reduce."""
    timeline = run_schedule(with_noise(costs, noise_sigma, seed))
    pipeline_s = timeline.makespan
    busy = timeline.busy()
    allreduce = np.array([ring_allreduce_s(b, costs.dp, costs.dp_link)
                          for b in costs.grad_bytes])  # type: ignore[union-attr]
    end = timeline.finish() + allreduce + np.asarray(costs.tail_s)
    p = costs.num_stages
    bubble = 1.0 - float(busy.sum()) / (p * pipeline_s) if pipeline_s > 0 else 0.0
    return IterationResult(iteration_s=float(end.max()), pipeline_s=pipeline_s,
                           busy_s=busy, idle_s=pipeline_s - busy, allreduce_s=allreduce,
                           bubble_ratio=bubble, timeline=timeline)
