"""Repacks keep their promise: an applied repack never simulates slower than
`max_slowdown` allows, whatever the objective (issue 29).

The simulated campaigns go through the live decision path (`sim.planner.decide`) and
judge the result with the simulator's own iteration model (`sim.iteration`, the 1F1B
order of `sim.schedule`, p2p transfers, the DP all-reduce): the same numbers
`dynmo simulate` reports for each rebalance point.
"""
from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dynmo_plugin.balancing import RepackCriteria
from dynmo_plugin.balancing.problem import REL_TOL
from dynmo_plugin.balancing.repack import RepackPlan, plan_repack
from dynmo_plugin.layout import Layout
from dynmo_plugin.sim.campaign import CampaignConfig, run_campaign
from dynmo_plugin.sim.cost import Link
from dynmo_plugin.sim.gpt import GPTShape, Hardware, LayerLoad, layer_costs
from dynmo_plugin.sim.planner import build_problem
from dynmo_plugin.scenarios import make_trajectory

SCENARIOS = ("pruning", "freezing", "moe", "mod", "early_exit", "sparse_attention")


def _broken(result, limit: float) -> list[str]:
    """Applied repacks whose simulated iteration after exceeds limit x before."""
    return [f"{e.iteration}: {e.layout_before} -> {e.layout_after} {e.iter_s_before:.5g} -> "
            f"{e.iter_s_after:.5g} s" for e in result.events
            if e.applied and e.kind == "repack"
            and e.iter_s_after > limit * e.iter_s_before * (1 + REL_TOL)]


def test_the_issues_example_repack_is_no_longer_slower():
    """`dynmo simulate --scenario gradual_pruning --layers 16 --dp 8 --pp 8 --repack`: iteration
    7000 repacked 4 -> 3 stages and simulated 0.3688 -> 0.3836 s (p2p and the larger
    all-reduce on 3 stages were left out of the estimate)."""
    cfg = CampaignConfig(scenario=make_trajectory("pruning", num_layers=16), dp=8, pp=8,
                         repack=True, baselines=("static",))
    result = run_campaign(cfg)
    assert [e.iteration for e in result.events if e.applied and e.kind == "repack"] == [3000]
    assert _broken(result, 1.0) == []


@st.composite
def campaigns(draw) -> CampaignConfig:
    layers = draw(st.integers(4, 24))
    pp = draw(st.integers(2, min(8, layers)))
    hw = Hardware(p2p=Link(latency_s=draw(st.sampled_from([5e-6, 1e-4])),
                          bandwidth_Bps=draw(st.sampled_from([2.5e9, 25e9]))))
    criteria = RepackCriteria(objective=draw(st.sampled_from(["min_stages", "throughput_per_gpu"])),
                              max_slowdown=draw(st.sampled_from([1.0, 1.05, 1.25])),
                              rebuild_s=draw(st.sampled_from([0.0, 10.0])))
    return CampaignConfig(
        scenario=make_trajectory(draw(st.sampled_from(SCENARIOS)), num_layers=layers,
                               seed=draw(st.integers(0, 3))),
        dp=draw(st.sampled_from([1, 4, 8])), pp=pp, iterations=draw(st.sampled_from([2000, 10000])),
        repack=True, repack_criteria=criteria, baselines=("static",), hw=hw,
        rebalance_every=draw(st.sampled_from([None, 500])), seed=draw(st.integers(0, 3)),
        noise_sigma=draw(st.sampled_from([0.0, 0.05])))


@given(cfg=campaigns())
@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
def test_an_applied_repack_never_simulates_slower_than_allowed(cfg):
    result = run_campaign(cfg)
    assert _broken(result, cfg.repack_criteria.max_slowdown) == []


def test_throughput_per_gpu_is_bounded_by_max_slowdown():
    """Freezing 64 layers on pp 8 (issue 29: 0.34x tokens/s on 12.7 of 64 GPUs): the
    per-GPU objective now keeps tokens/s within max_slowdown at every repack."""
    criteria = RepackCriteria(objective="throughput_per_gpu")
    cfg = CampaignConfig(scenario=make_trajectory("freezing", num_layers=64), dp=8, pp=8,
                         repack=True, repack_criteria=criteria, baselines=("static",))
    result = run_campaign(cfg)
    assert any(e.applied and e.kind == "repack" for e in result.events)
    assert _broken(result, 1.0) == []
    assert result.dynmo.tokens_per_s >= 0.95 * result.static.tokens_per_s


def test_the_plan_prints_tokens_per_s_and_per_gpu_hour():
    shape = GPTShape(num_layers=16)
    hw = Hardware()
    load = LayerLoad.dense(16)
    problem = build_problem(costs=layer_costs(shape, hw, load), load=load, shape=shape, hw=hw,
                            current=Layout.uniform(16, 8), num_microbatches=32)
    plan = plan_repack(problem, RepackCriteria(max_slowdown=1.5))
    assert plan.apply and plan.tokens_per_iteration == 32 * 2 * 2048
    before, after = plan.tokens_per_s(False), plan.tokens_per_s(True)
    assert before == plan.tokens_per_iteration / plan.predicted_iter_s_before
    assert plan.tokens_per_gpu_hour(True) == after * 3600 / plan.stages_after
    text = str(plan)
    assert f"predicted tokens/s per replica {before:,.0f} -> {after:,.0f}" in text
    assert f"tokens per GPU-hour {plan.tokens_per_gpu_hour(False):,.0f} -> " in text
    d = json.loads(json.dumps(plan.to_dict()))
    assert d["tokens_per_gpu_hour_after"] == plan.tokens_per_gpu_hour(True)
    assert RepackPlan.from_dict(d) == plan
