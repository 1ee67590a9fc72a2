"""Baselines-versus-DynMo runs with the real balancers, gate and repack planner."""
from __future__ import annotations

import pytest

from dynmo_plugin.balancing import RepackCriteria
from dynmo_plugin.errors import UserError
from dynmo_plugin.sim.campaign import CampaignConfig, run_campaign, run_variants
from dynmo_plugin.sim.decision import DecisionCost, DecisionTimeModel
from dynmo_plugin.sim.gpt import GPTShape
from dynmo_plugin.sim.planner import GateSettings
from dynmo_plugin.scenarios import make_trajectory


def _cfg(name="moe", layers=16, **kw):
    kw.setdefault("dp", 2)
    kw.setdefault("pp", 4)
    kw.setdefault("iterations", 3000)
    return CampaignConfig(scenario=make_trajectory(name, num_layers=layers), **kw)


def test_uniform_balancer_only_pays_profiling_overhead():
    r = run_campaign(_cfg(balancer="uniform"))
    assert r.dynmo.overhead_s["migration"] == 0.0 and not any(e.applied for e in r.events)
    assert {e.reason for e in r.events} == {"already balanced"}
    assert 0.99 < r.speedup <= 1.0
    assert r.dynmo.idleness == pytest.approx(r.static.idleness)


def test_balancing_moe_beats_static_and_cuts_idleness():
    r = run_campaign(_cfg(layers=32, balancer="exact"))
    assert r.speedup > 1.0
    assert r.dynmo.idleness < r.static.idleness
    assert [e.iteration for e in r.events] == [1000, 2000]
    d = r.as_dict()
    assert set(d) >= {"static", "dynmo", "speedup", "baselines", "speedup_over"} and "gpus_avg" not in d
    assert set(d["baselines"]) == {"static", "no_dynamism"}
    assert d["speedup_over"]["static"] == d["speedup"]
    for side in ("static", "dynmo"):
        assert {"tokens_per_s", "tokens_per_gpu_s", "idleness"} <= set(d[side])


def test_refused_plans_keep_the_layout_and_say_why():
    """A noise floor of 99% refuses every plan, as the live gate would."""
    r = run_campaign(_cfg(layers=32, gate=GateSettings(min_gain=0.99)))
    assert r.events and not any(e.applied for e in r.events)
    assert all("noise floor" in e.reason or e.reason == "already balanced" for e in r.events)
    assert all(e.layout_after == e.layout_before for e in r.events)
    assert r.dynmo.overhead_s["migration"] == 0.0


def test_black_box_mode_rebalances_every_n_iterations():
    r = run_campaign(_cfg(rebalance_every=500))
    assert [e.iteration for e in r.events] == [500, 1000, 1500, 2000, 2500]


def test_repacking_goes_through_plan_repack_and_frees_gpus():
    # 4 -> 3 stages simulates 1.4% slower here (the larger all-reduce): allowed at 1.05
    cfg = _cfg("freezing", layers=16, iterations=9000, repack=True,
               repack_criteria=RepackCriteria(max_slowdown=1.05),
               shape=GPTShape(num_layers=16, output_layer=False))
    r = run_campaign(cfg)
    repacks = [e for e in r.events if e.kind == "repack"]
    assert repacks and all(e.applied and e.overhead_s["repack"] == 10.0 for e in repacks)
    assert r.dynmo.gpus_avg < 2 * 4
    d = r.as_dict()
    assert d["gpus_avg"] == r.dynmo.gpus_avg
    assert d["speedup_per_gpu_over"]["static"] > d["speedup_over"]["static"]


@pytest.mark.parametrize("seed", [0, 7])
def test_runs_are_deterministic_with_noise(seed):
    a = run_campaign(_cfg(noise_sigma=0.05, seed=seed)).as_dict()
    b = run_campaign(_cfg(noise_sigma=0.05, seed=seed)).as_dict()
    assert a == b


@pytest.mark.parametrize("method,repack", [("exact", False), ("diffusion", False), ("exact", True)])
def test_real_planner_runs_are_identical(method, repack):
    """The real balancers' wall-clock time must not leak into simulated time."""
    kw = dict(balancer=method, repack=repack, noise_sigma=0.05, seed=7, rebalance_every=500)
    a = run_campaign(_cfg(**kw)).as_dict()
    b = run_campaign(_cfg(**kw)).as_dict()
    assert a["events"] and a["dynmo"]["overhead_s"]["decision"] > 0
    assert a == b


def test_variants_share_baselines_and_equal_separate_runs():
    cfg = _cfg(layers=32, baselines=("static", "no_dynamism", "fluid"))
    both = run_variants(cfg, {"exact": {"balancer": "exact"}, "diffusion": {"balancer": "diffusion"}})
    alone = run_campaign(_cfg(layers=32, balancer="diffusion", baselines=("static", "no_dynamism", "fluid")))
    assert both["diffusion"].as_dict() == alone.as_dict()
    assert both["exact"].baselines is both["diffusion"].baselines
    # no layer-granular split beats layers divisible at will
    assert both["exact"].speedup_over("fluid") <= 1.0
    with pytest.raises(UserError, match="change what an iteration costs"):
        run_variants(cfg, {"bad": {"dp": 4}})


def test_decision_overhead_is_the_model_not_the_clock():
    r = run_campaign(_cfg(balancer="exact", rebalance_every=500))
    per_decision = DecisionTimeModel().seconds("exact", 16, 4)
    assert r.dynmo.overhead_s["decision"] == pytest.approx(len(r.events) * per_decision, rel=1e-12)
    slow = DecisionTimeModel(costs={"exact": DecisionCost(fixed_s=2.0, per_unit_s=0.0)})
    r2 = run_campaign(_cfg(balancer="exact", rebalance_every=500, decision_time=slow))
    assert r2.dynmo.overhead_s["decision"] == 2.0 * len(r2.events)


def test_decision_model_costs_grow_with_the_problem():
    model = DecisionTimeModel()
    for method in ("exact", "partition", "diffusion"):
        assert 0 < model.seconds(method, 16, 4) < model.seconds(method, 1000, 128)
    assert model.seconds("uniform", 1000, 128) == 0.0


def test_decision_model_gaps_and_bad_constants_are_user_errors():
    with pytest.raises(UserError, match="no decision-time model for balancer 'exact'"):
        _cfg(balancer="exact", decision_time=DecisionTimeModel(costs={}))
    with pytest.raises(UserError, match="fixed_s"):
        DecisionCost(fixed_s=-1.0, per_unit_s=0.0)
    with pytest.raises(UserError, match="per_unit_s"):
        DecisionCost(fixed_s=0.0, per_unit_s=float("nan"))


@pytest.mark.parametrize("kw,match", [
    (dict(pp=32), "larger than the number of layers"),
    (dict(dp=0), "dp"),
    (dict(iterations=0), "iterations"),
    (dict(rebalance_every=0), "rebalance_every"),
    (dict(baselines=("static", "egeria")), "unknown baseline"),
    (dict(balancer="no-such-balancer"), "no decision-time model"),
])
def test_bad_campaigns_are_user_errors(kw, match):
    with pytest.raises(UserError, match=match):
        _cfg(**kw)


@pytest.mark.parametrize("kw", [dict(min_gain=1.5), dict(margin=-1.0), dict(horizon=0)])
def test_bad_gate_settings_are_user_errors(kw):
    with pytest.raises(UserError, match="gate"):
        GateSettings(**kw)


def test_speedup_over_a_baseline_not_run_is_a_user_error():
    r = run_campaign(_cfg(baselines=("static",)))
    with pytest.raises(UserError, match="static_deepspeed"):
        r.speedup_over("static_deepspeed")
