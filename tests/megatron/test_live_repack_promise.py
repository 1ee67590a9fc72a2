"""Live repacks keep their promise as simulated ones do (issue 29).

The live controller (`DynMo._decide`) prices repack candidates with the simulator's
iteration (`controller.repack_iteration_model` -> `sim.problem_model`: the 1F1B order,
p2p transfers, the DP all-reduce), not the flow-shop formula, which leaves out that
fewer stages all-reduce more gradient bytes each. The problem is live-shaped: profile
records as the controller gathers them, a stand-in only for the trainer's layout,
micro-batches, DP size and Megatron args (the shape of the hidden state it sends).
"""
from __future__ import annotations

import functools
import types

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynmo_plugin.balancing import GateConfig
from dynmo_plugin.balancing.decide import decide
from dynmo_plugin.balancing.problem import REL_TOL
from dynmo_plugin.balancing.repack import RepackCriteria, flow_shop_model, shrink_problem
from dynmo_plugin.config import DynmoConfig, RebalanceConfig, RepackConfig
from dynmo_plugin.controller import DynMo, problem_from_profile, repack_iteration_model
from dynmo_plugin.layout import Layout
from dynmo_plugin.profiling.records import LayerProfile, PipelineProfile, StageProfile
from dynmo_plugin.sim.problem_model import FORWARD_SHARE, problem_costs
from dynmo_plugin.sim.cost import Link

MB = 100_000_000
M, DP, BANDWIDTH = 8, 8, 1e9
CURRENT = Layout.parse("Ett|tt|tt|ttL")
CONFIG = DynmoConfig(enabled=True, rebalance=RebalanceConfig(balancer="exact"),
                     repack=RepackConfig(enabled=True))


def _profile() -> PipelineProfile:
    """8 cheap layers of 100 MB of gradients each, 2 per stage, and a heavy output layer
    on the last stage (as configs/demo.yaml's 8k vocabulary): the flow-shop formula sees
    the head's stage as the bottleneck whatever the other stages hold, so packing six
    layers onto stage 0 looks free, while stage 0's all-reduce triples."""
    layers = [LayerProfile(layer=n, stage=(n - 1) // 2, fwd_s=0.01, bwd_s=0.02, param_bytes=MB,
                           grad_bytes=MB, optim_bytes=2 * MB, act_bytes=10**6)
              for n in range(1, 9)]
    stages = [StageProfile(stage=s, extra_s=0.5 if s == 3 else 0.0, wait_s=0.0, peak_bytes=0)
              for s in range(4)]
    return PipelineProfile(layers, stages)


def _trainer():
    args = types.SimpleNamespace(seq_length=512, micro_batch_size=1, hidden_size=256,
                                 bf16=False, fp16=False)
    return types.SimpleNamespace(layout=CURRENT, num_microbatches=M, peak_microbatches=M,
                                 dims=types.SimpleNamespace(dp=DP), args=args)


def _live_decide():
    me = types.SimpleNamespace(trainer=_trainer(), config=CONFIG, bandwidth=BANDWIDTH,
                               _repacker=object())
    me._repack_criteria = functools.partial(DynMo._repack_criteria, me)
    return DynMo._decide(me, _profile(), "event:test")


def test_a_repack_the_flow_shop_formula_approves_but_the_iteration_is_slower_is_refused():
    problem = problem_from_profile(_profile(), CURRENT, CONFIG, M)
    rb = CONFIG.rebalance
    gate = GateConfig(iterations_until_next_event=rb.expected_event_gap,
                      bandwidth_bytes_per_s=BANDWIDTH, margin=rb.margin,
                      min_relative_gain=rb.min_gain)
    criteria = RepackCriteria.from_config(CONFIG.repack)
    old = decide(problem, "exact", gate, criteria)  # the old live estimate
    assert old.action == "repack" and old.repack.stages_after == 2
    after = old.repack.layout_after
    assert flow_shop_model(shrink_problem(problem, 2), after) <= flow_shop_model(problem, CURRENT)

    model = repack_iteration_model(_trainer(), BANDWIDTH)
    slower = model(shrink_problem(problem, 2), after) / model(problem, CURRENT)
    assert slower > criteria.max_slowdown * 1.05  # the all-reduce on 6 layers' gradients

    live = _live_decide()
    assert live.repack is not None and not live.repack.apply
    assert live.plan is None or live.plan.layout.num_stages == 4
    refused = {c.stages: c for c in live.repack.candidates}[2]
    assert not refused.fits and "too slow" in refused.reason
    assert refused.predicted_iter_s == pytest.approx(model(shrink_problem(problem, 2), after))


def test_the_problem_model_charges_what_the_run_knows():
    """Per stage: layers + extras, split 1 : 2; per rank: its layers' gradient bytes;
    the hidden state a stage sends; the DP size."""
    problem = problem_from_profile(_profile(), CURRENT, CONFIG, M)
    costs = problem_costs(problem, CURRENT, act_bytes=512 * 256 * 4, p2p=Link(bandwidth_Bps=1e9),
                          dp=DP, dp_link=Link(bandwidth_Bps=1e9))
    total = costs.fwd_s[:, 0] + costs.bwd_s[:, 0]
    assert total.tolist() == pytest.approx([0.06, 0.06, 0.06, 0.56])
    assert costs.fwd_s[:, 0].tolist() == pytest.approx((total * FORWARD_SHARE).tolist())
    assert costs.grad_bytes.tolist() == [2 * MB] * 4
    assert (costs.act_bytes, costs.dp, costs.num_microbatches) == (512 * 256 * 4, DP, M)
    packed = problem_costs(shrink_problem(problem, 2), Layout.parse("Ettttttt|tL"), act_bytes=0,
                           p2p=Link(), dp=DP, dp_link=Link())
    assert packed.grad_bytes.tolist() == [7 * MB, MB]


@st.composite
def live_problems(draw):
    """Random profiles as the controller gathers them, on a random DP size and link."""
    pp = draw(st.integers(2, 4))
    n = draw(st.integers(pp, 10))
    counts = Layout.uniform(n, pp).counts
    stage_of = [s for s, c in enumerate(counts) for _ in range(c)]
    costs = draw(st.lists(st.floats(0.001, 0.05), min_size=n, max_size=n))
    grads = draw(st.lists(st.sampled_from([MB // 10, MB]), min_size=n, max_size=n))
    layers = [LayerProfile(layer=i + 1, stage=stage_of[i], fwd_s=c / 3, bwd_s=2 * c / 3,
                           param_bytes=g, grad_bytes=g, optim_bytes=2 * g, act_bytes=10**6)
              for i, (c, g) in enumerate(zip(costs, grads))]
    head = draw(st.floats(0.0, 0.5))
    stages = [StageProfile(stage=s, extra_s=head if s == pp - 1 else 0.0, wait_s=0.0, peak_bytes=0)
              for s in range(pp)]
    slowdown = draw(st.sampled_from([1.0, 1.1, 1.5]))
    objective = draw(st.sampled_from(["min_stages", "throughput_per_gpu"]))
    return (PipelineProfile(layers, stages), Layout(counts), draw(st.sampled_from([2, 8])),
            draw(st.sampled_from([1e8, 1e9])), slowdown, objective)


@given(case=live_problems())
@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
def test_a_live_repack_is_never_predicted_slower_than_allowed(case):
    """Whatever the live decision applies is within max_slowdown by the simulator's own
    iteration on the same problem (DP all-reduce and p2p included)."""
    profile, current, dp, bandwidth, slowdown, objective = case
    config = DynmoConfig(enabled=True, rebalance=RebalanceConfig(balancer="exact", min_gain=0.0),
                         repack=RepackConfig(enabled=True, max_slowdown=slowdown,
                                             objective=objective, rebuild_s=0.0))
    trainer = _trainer()
    trainer.layout, trainer.dims.dp = current, dp
    me = types.SimpleNamespace(trainer=trainer, config=config, bandwidth=bandwidth, _repacker=object())
    me._repack_criteria = functools.partial(DynMo._repack_criteria, me)
    choice = DynMo._decide(me, profile, "event:test")
    if choice.repack is None or not choice.repack.apply:
        return
    problem = problem_from_profile(profile, current, config, M)
    after = choice.repack.layout_after
    model = repack_iteration_model(trainer, bandwidth)
    assert model(shrink_problem(problem, after.num_stages), after) <= \
        slowdown * model(problem, current) * (1 + REL_TOL)
