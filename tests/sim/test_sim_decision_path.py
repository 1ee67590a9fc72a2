"""One decision path: the simulator decides exactly as the live controller does.

For a simulated pipeline we build the profile the live profiler would report (same
per-layer costs and bytes, same stage extras), run the live controller's own
`problem_from_profile` and `DynMo._decide` on it, and compare with the simulator's
`build_problem` and `decide`: the same problem and the same decision (layout, applied,
reason), for a rebalance that pays, one below the noise floor, one that does not pay
over a short horizon, and a repack.
"""
from __future__ import annotations

import functools
import types

import numpy as np
import pytest

from dynmo_plugin.config import DynmoConfig, RebalanceConfig, RepackConfig
from dynmo_plugin.controller import DynMo, problem_from_profile
from dynmo_plugin.layout import Layout
from dynmo_plugin.profiling.records import LayerProfile, PipelineProfile, StageProfile
from dynmo_plugin.sim.decision import DecisionTimeModel
from dynmo_plugin.sim.gpt import GPTShape, Hardware, layer_costs
from dynmo_plugin.sim.planner import GateSettings, build_problem, decide, live_repack_criteria
from dynmo_plugin.sim.problem_model import live_iteration_model
from dynmo_plugin.scenarios import make_trajectory

M = 16


def _sim_problem(name, layers, pp, iteration, head=True):
    shape = GPTShape(num_layers=layers, output_layer=head)
    hw = Hardware()
    load = make_trajectory(name, num_layers=layers).load(iteration)
    current = Layout.uniform(layers, pp)
    costs = layer_costs(shape, hw, load)
    problem = build_problem(costs=costs, load=load, shape=shape, hw=hw, current=current,
                            num_microbatches=M)
    return problem, shape, hw, costs


def _live_profile(problem, shape, hw, costs) -> PipelineProfile:
    """What the live profiler would report for these layers (bytes as the sim counts them)."""
    grad = int(shape.layer_params * hw.grad_bytes_per_param)
    state = int(shape.layer_params * hw.state_bytes_per_param)
    act = int(34 * shape.seq * shape.micro_batch * shape.hidden)
    stage_of = np.repeat(np.arange(problem.num_stages), problem.current.counts)
    layers = [LayerProfile(layer=i + 1, stage=int(stage_of[i]), fwd_s=float(costs.fwd_s[i]),
                           bwd_s=float(costs.bwd_s[i]), param_bytes=shape.layer_params,
                           grad_bytes=grad, optim_bytes=state - shape.layer_params - grad,
                           act_bytes=act) for i in range(shape.num_layers)]
    stages = [StageProfile(stage=s, extra_s=problem.extras_cost_arr[s], wait_s=0.0, peak_bytes=0,
                           extra_bytes=int(problem.extras_memory_arr[s]),
                           extra_grad_bytes=int(problem.extras_rebuild_arr[s]))
              for s in range(problem.num_stages)]
    return PipelineProfile(layers, stages)


def _args(shape):
    """The Megatron args the repack's iteration model reads (the hidden state sent)."""
    return types.SimpleNamespace(seq_length=shape.seq, micro_batch_size=shape.micro_batch,
                                 hidden_size=shape.hidden, bf16=True)


def _live_decide(profile, current, config, bandwidth, shape):
    """The live controller's `_decide`, on a stand-in for its trainer (layout, micro-batches,
    DP size 1, model args)."""
    trainer = types.SimpleNamespace(layout=current, num_microbatches=M, peak_microbatches=M, args=_args(shape),
                                    dims=types.SimpleNamespace(dp=1))
    me = types.SimpleNamespace(trainer=trainer, config=config, bandwidth=bandwidth, _repacker=object())
    me._repack_criteria = functools.partial(DynMo._repack_criteria, me)
    return DynMo._decide(me, profile, "event:test")


CASES = [  # scenario, layers, pp, iteration, head, margin, min_gain, horizon, repack
    ("moe", 32, 4, 1000, True, 1.0, 0.05, 100, False),       # pays
    ("moe", 32, 4, 1000, True, 1.0, 0.60, 100, False),       # below the noise floor
    ("moe", 32, 4, 1000, True, 1e6, 0.0, 1, False),          # does not pay
    ("freezing", 16, 4, 9000, False, 1.0, 0.05, 1000, True),  # repack
]


@pytest.mark.parametrize("name,layers,pp,iteration,head,margin,min_gain,horizon,repack", CASES)
def test_simulated_decision_equals_the_live_controllers(name, layers, pp, iteration, head, margin,
                                                        min_gain, horizon, repack):
    problem, shape, hw, costs = _sim_problem(name, layers, pp, iteration, head)
    rb = RebalanceConfig(balancer="exact", margin=margin, min_gain=min_gain,
                         expected_event_gap=horizon, memory_cap_gb=hw.memory_bytes / 1e9,
                         bandwidth_gbps=hw.p2p.bandwidth_Bps / 1e9)
    config = DynmoConfig(enabled=True, rebalance=rb, repack=RepackConfig(enabled=repack))
    profile = _live_profile(problem, shape, hw, costs)
    live_problem = problem_from_profile(profile, problem.current, config, M)
    for field in ("costs", "memory", "move_bytes", "capacity", "extras_cost", "extras_memory",
                  "rebuild_bytes", "extras_rebuild_bytes", "current", "num_microbatches"):
        assert getattr(live_problem, field) == pytest.approx(getattr(problem, field)), field
    gate = GateSettings(margin=margin, min_gain=min_gain).config(horizon, rb.bandwidth_gbps * 1e9)
    model = live_iteration_model(_args(shape), dp=1, bandwidth_Bps=rb.bandwidth_gbps * 1e9)
    sim = decide(problem, "exact", gate, live_repack_criteria() if repack else None,
                 DecisionTimeModel(), model if repack else None)
    live = _live_decide(profile, problem.current, config, rb.bandwidth_gbps * 1e9, shape)
    live_layout = (live.repack.layout_after if live.repack is not None and live.repack.apply
                   else live.plan.layout if live.apply else problem.current)
    assert (sim.layout, sim.applied, sim.reason) == (live_layout, live.apply, live.reason)
    assert sim.kind == ("repack" if repack else "rebalance" if sim.applied else "none")
    expected = {0: "pays", 1: "noise floor", 2: "does not pay", 3: "pays"}[CASES.index(
        (name, layers, pp, iteration, head, margin, min_gain, horizon, repack))]
    assert expected in sim.reason
