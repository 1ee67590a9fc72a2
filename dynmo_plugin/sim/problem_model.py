"""The simulator's iteration model on a balancing problem: what a live repack is judged by.

The simulated campaigns price repack candidates with their own iteration
(`sim.iteration.simulate_iteration`: the 1F1B order, p2p transfers on the critical path,
the data-parallel all-reduce after the flush). A live run has no `GPTShape`; it has a
`BalanceProblem` built from its profile (`balancing.profile_problem`). This module turns
that problem and a candidate layout into the same `PipelineCosts` and runs the same
`simulate_iteration`, so the live repack decision and the simulator share one model:

* per (virtual) stage: the layers' profiled cost (fwd + bwd per micro-batch) plus the
  stage's extras (embedding, output layer + loss), split 1 : 2 into forward and backward
  (the profile problem keeps only their sum; the split moves only which ops wait, the
  bottleneck's pace is the sum);
* p2p: `act_bytes` per micro-batch between neighbouring ranks (the hidden state a stage
  sends, s x b x h x element size) over `p2p`;
* gradients all-reduced over `dp` ranks on `dp_link`: per rank, the `rebuild_bytes`
  (gradient buffers) of its layers plus its stages' `extras_rebuild_bytes`. Fewer stages
  hold more gradient bytes each, so the all-reduce grows as a repack shrinks the pipeline:
  the flow-shop formula (`balancing.repack.flow_shop_model`) leaves this out.

Pure: numpy and the pure wings.
"""
from __future__ import annotations

import numpy as np

from dynmo_plugin.balancing.problem import BalanceProblem
from dynmo_plugin.balancing.repack_throughput import IterationModel
from dynmo_plugin.errors import UserError
from dynmo_plugin.layout import Layout
from dynmo_plugin.sim.cost import Link, PipelineCosts
from dynmo_plugin.sim.iteration import simulate_iteration

__all__ = ["FORWARD_SHARE", "live_iteration_model", "problem_costs", "problem_iteration_model"]

FORWARD_SHARE = 1.0 / 3.0
"""Forward's share of a profiled fwd + bwd cost (backward ~ 2 x forward)."""


def _stage_sums(values: np.ndarray, layout: Layout) -> np.ndarray:
    b = layout.boundaries
    return np.array([float(values[b[s]:b[s + 1]].sum()) for s in range(layout.num_stages)])


def problem_costs(problem: BalanceProblem, layout: Layout, *, act_bytes: float, p2p: Link,
                  dp: int, dp_link: Link) -> PipelineCosts:
    """`PipelineCosts` of `layout` on `problem` (`problem.num_stages` == the layout's
    (virtual) stages; module docstring says what each part is).

    Raises:
        UserError: the layout does not fit the problem.
    """
    if layout.num_stages != problem.num_stages or layout.num_layers != problem.num_layers:
        raise UserError(f"layout {layout} has {layout.num_stages} stages and {layout.num_layers} "
                        f"layers; the problem {problem.num_stages} and {problem.num_layers}")
    cost = _stage_sums(problem.cost_arr, layout) + problem.extras_cost_arr
    rb = np.diff(problem.rebuild_prefix)
    grads = problem.per_rank(_stage_sums(rb, layout) + problem.extras_rebuild_arr)
    return PipelineCosts(fwd_s=cost * FORWARD_SHARE, bwd_s=cost * (1 - FORWARD_SHARE),
                         num_microbatches=problem.num_microbatches,
                         num_chunks=layout.num_chunks, act_bytes=act_bytes, p2p=p2p,
                         dp=dp, grad_bytes=grads, dp_link=dp_link)


def problem_iteration_model(*, act_bytes: float, p2p: Link, dp: int,
                            dp_link: Link | None = None) -> IterationModel:
    """An `IterationModel` for `balancing.repack.plan_repack` (and `balancing.decide`):
    the simulated iteration of each candidate (`dp_link` defaults to `p2p`)."""
    link = p2p if dp_link is None else dp_link

    def model(problem: BalanceProblem, layout: Layout) -> float:
        costs = problem_costs(problem, layout, act_bytes=act_bytes, p2p=p2p, dp=dp, dp_link=link)
        return simulate_iteration(costs).iteration_s

    return model


def live_iteration_model(model: object, *, dp: int, bandwidth_Bps: float) -> IterationModel:
    """The model a live run decides repacks with (`controller.repack_iteration_model`)
    and `dynmo plan --from-run` recommends with: `model` holds Megatron's model settings
    (the run's args, or its report's `config.model` as an object): the hidden state sent
    per micro-batch is seq_length x micro_batch_size x hidden_size x element size (2 for
    bf16/fp16, else 4); both links at `bandwidth_Bps` (the measured migration bandwidth,
    else --dynmo-bandwidth-gbps), no latency."""
    element = 2 if getattr(model, "bf16", False) or getattr(model, "fp16", False) else 4
    hidden = float(model.seq_length * model.micro_batch_size * model.hidden_size * element)
    return problem_iteration_model(act_bytes=hidden, p2p=Link(bandwidth_Bps=bandwidth_Bps), dp=dp)
