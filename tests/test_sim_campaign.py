"""Static-versus-DynMo runs, with a test-double balancer and with the real ones."""
from __future__ import annotations

import numpy as np
import pytest

from dynmo_plugin.errors import UserError
from dynmo_plugin.layout import Layout
from dynmo_plugin.sim.campaign import CampaignConfig, run_campaign
from dynmo_plugin.sim.decision import DecisionCost, DecisionTimeModel
from dynmo_plugin.sim.gpt import GPTShape
from dynmo_plugin.sim.planner import PlanOutcome, PlanRequest, make_planner
from dynmo_plugin.sim.scenarios import make_scenario

# Test double for the balancers (the simulator never implements one): exact contiguous
# partition by dynamic programming, O(p n^2).
def exact_planner(req: PlanRequest) -> PlanOutcome:
    c, n, p = np.asarray(req.costs, dtype=float), len(req.costs), req.num_stages
    pre = np.concatenate([[0.0], np.cumsum(c)])
    best = np.full((p + 1, n + 1), np.inf)
    arg = np.zeros((p + 1, n + 1), dtype=int)
    best[0, 0] = 0.0
    for s in range(1, p + 1):
        for j in range(s, n + 1):
            for i in range(s - 1, j):
                v = max(best[s - 1, i], pre[j] - pre[i] + req.extras_cost[s - 1])
                if v < best[s, j]:
                    best[s, j], arg[s, j] = v, i
    cuts = [n]
    for s in range(p, 0, -1):
        cuts.append(int(arg[s, cuts[-1]]))
    return PlanOutcome(Layout.from_boundaries(cuts[::-1]), 0.001)


def _cfg(name="moe", layers=16, **kw):
    kw.setdefault("dp", 2)
    kw.setdefault("pp", 4)
    kw.setdefault("iterations", 3000)
    return CampaignConfig(scenario=make_scenario(name, num_layers=layers), **kw)


def test_uniform_balancer_only_pays_profiling_overhead():
    r = run_campaign(_cfg(balancer="uniform"))
    assert r.dynmo.overhead_s["migration"] == 0.0
    assert 0.99 < r.speedup <= 1.0
    assert r.dynmo.idleness == pytest.approx(r.static.idleness)


def test_balancing_moe_beats_static_and_cuts_idleness():
    r = run_campaign(_cfg(layers=32), exact_planner)
    assert r.speedup > 1.0
    assert r.dynmo.idleness < r.static.idleness
    assert [e.iteration for e in r.events] == [1000, 2000]
    d = r.as_dict()
    assert set(d) >= {"static", "dynmo", "speedup"} and "gpus_avg" not in d
    assert {"tokens_per_s", "idleness"} <= set(d["static"]) and {"tokens_per_s", "idleness"} <= set(d["dynmo"])


def test_black_box_mode_rebalances_every_n_iterations():
    r = run_campaign(_cfg(rebalance_every=500), exact_planner)
    assert [e.iteration for e in r.events] == [500, 1000, 1500, 2000, 2500]


def test_repacking_frees_gpus_when_work_shrinks():
    cfg = _cfg("freezing", layers=16, iterations=9000, repack=True, repack_tolerance=0.5,
               shape=GPTShape(num_layers=16, output_layer=False))
    r = run_campaign(cfg, exact_planner)
    assert r.dynmo.gpus_avg < 2 * 4
    assert r.as_dict()["gpus_avg"] == r.dynmo.gpus_avg


def test_runs_are_deterministic_with_noise():
    a = run_campaign(_cfg(noise_sigma=0.05, seed=7), exact_planner).as_dict()
    b = run_campaign(_cfg(noise_sigma=0.05, seed=7), exact_planner).as_dict()
    assert a["speedup"] == b["speedup"]


@pytest.mark.parametrize("method,repack", [("exact", False), ("diffusion", False), ("exact", True)])
def test_real_planner_runs_are_identical(method, repack):
    """The real balancers' wall-clock time must not leak into simulated time."""
    kw = dict(balancer=method, repack=repack, noise_sigma=0.05, seed=7, rebalance_every=500)
    a = run_campaign(_cfg(**kw)).as_dict()
    b = run_campaign(_cfg(**kw)).as_dict()
    assert a["events"] and a["dynmo"]["overhead_s"]["decision"] > 0
    assert a == b


def test_decision_overhead_is_the_model_not_the_clock():
    r = run_campaign(_cfg(balancer="exact", rebalance_every=500))
    per_decision = DecisionTimeModel().seconds("exact", 16, 4)
    assert r.dynmo.overhead_s["decision"] == pytest.approx(len(r.events) * per_decision, rel=1e-12)
    slow = DecisionTimeModel(costs={"exact": DecisionCost(fixed_s=2.0, per_unit_s=0.0)})
    r2 = run_campaign(_cfg(balancer="exact", rebalance_every=500, decision_time=slow))
    assert r2.dynmo.overhead_s["decision"] == 2.0 * len(r2.events)
    assert r2.dynmo.time_s - r.dynmo.time_s == pytest.approx(
        len(r.events) * (2.0 - per_decision), rel=1e-9)


def test_decision_model_costs_grow_with_the_problem():
    model = DecisionTimeModel()
    for method in ("exact", "partition", "diffusion"):
        assert 0 < model.seconds(method, 16, 4) < model.seconds(method, 1000, 128)
    assert model.seconds("uniform", 1000, 128) == 0.0


def test_decision_model_gaps_and_bad_constants_are_user_errors():
    with pytest.raises(UserError, match="no decision-time model for balancer 'exact'"):
        make_planner("exact", DecisionTimeModel(costs={}))
    with pytest.raises(UserError, match="fixed_s"):
        DecisionCost(fixed_s=-1.0, per_unit_s=0.0)
    with pytest.raises(UserError, match="per_unit_s"):
        DecisionCost(fixed_s=0.0, per_unit_s=float("nan"))


@pytest.mark.parametrize("kw,match", [
    (dict(pp=32), "larger than the number of layers"),
    (dict(dp=0), "dp"),
    (dict(iterations=0), "iterations"),
    (dict(rebalance_every=0), "rebalance_every"),
])
def test_bad_campaigns_are_user_errors(kw, match):
    with pytest.raises(UserError, match=match):
        _cfg(**kw)


def test_unknown_balancer_is_a_user_error():
    with pytest.raises(UserError):
        make_planner("no-such-balancer")
