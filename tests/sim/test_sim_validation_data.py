"""scripts/validate_sim.py: reading report.json and the shared-core schedule model.

Pure tests (no launcher run): the report parsing picks the right iterations and costs,
and the processor-sharing model reduces to the dedicated simulator when every rank
has a core, and keeps one core always busy when all ranks share it.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from dynmo_plugin.sim import Link, PipelineCosts, simulate_iteration

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "validate_sim.py"


@pytest.fixture(scope="module")
def vs():
    spec = importlib.util.spec_from_file_location("validate_sim", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["validate_sim"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("validate_sim", None)


def _costs(**kw) -> PipelineCosts:
    base = dict(fwd_s=[0.010, 0.020, 0.015, 0.010], bwd_s=[0.020, 0.030, 0.020, 0.025],
                num_microbatches=8, tail_s=[0.001, 0.002, 0.001, 0.003])
    base.update(kw)
    return PipelineCosts(**base)


@pytest.mark.parametrize("link", [Link(), Link(latency_s=1e-3, bandwidth_Bps=1e8)])
def test_shared_equals_dedicated_with_a_core_per_rank(vs, link):
    costs = _costs(p2p=link, act_bytes=1e5)
    dedicated = simulate_iteration(costs)
    shared = vs.simulate_shared(costs, cores=4)
    assert shared.iteration_s == pytest.approx(dedicated.iteration_s, rel=1e-12)
    assert shared.pipeline_s == pytest.approx(dedicated.pipeline_s, rel=1e-12)
    np.testing.assert_allclose(shared.blocked_s, vs.blocked_before_last_op(dedicated), atol=1e-12)


def test_one_core_is_never_idle(vs):
    costs = _costs()
    work = 8 * (np.sum(costs.fwd_s[:, 0]) + np.sum(costs.bwd_s[:, 0]))
    shared = vs.simulate_shared(costs, cores=1)
    # the tails run concurrently with other ranks' ops, so the core stays busy to the end
    assert shared.iteration_s == pytest.approx(work + np.sum(costs.tail_s), rel=1e-12)


def test_fewer_cores_never_faster(vs):
    costs = _costs()
    times = [vs.simulate_shared(costs, cores=c).iteration_s for c in (4, 3, 2, 1)]
    assert times == sorted(times)


def _report() -> dict:
    layers = [{"layer": i + 1, "stage": i // 2, "fwd_s": 0.01, "bwd_s": 0.02,
               "param_bytes": 400, "grad_bytes": 400, "optim_bytes": 800, "act_bytes": 0}
              for i in range(4)]
    stages = [{"stage": s, "extra_s": 0.003 * (s + 1), "wait_s": 0.1, "peak_bytes": 0,
               "extra_bytes": 1600, "compute_s": 0.5, "profiled_s": 0.5, "num_microbatches": 8,
               "clock": "cpu_thread_time"} for s in range(2)]
    event = {"kind": "profile", "profile": {"layers": layers, "stages": stages}}
    return {
        "config": {"dynmo": {"profiling": {"every": 4, "window": 2}}},
        "iterations": [{"iteration": i, "time_s": float(i), "dynmo_s": 0.5} for i in range(1, 14)],
        "events": [dict(event, iteration=5, window=[4, 5]), dict(event, iteration=9, window=[8, 9])],
    }


def test_measured_steps_skip_warmup_windows_and_unclosed_window(vs):
    steps = vs.measured_steps(_report(), warmup=2)
    # 4-5 and 8-9 profiled; a window opens at 12 and never closes (13 iterations)
    assert steps == [2.5, 5.5, 6.5, 9.5, 10.5]


def _ended_inside_a_window() -> dict:
    """As a run since DynMo.finish: the window opened at 12 is recorded as cancelled."""
    report = _report()
    report["events"].append({"kind": "profile", "iteration": 13, "window": [12, 13], "profile": None,
                             "cancelled": "the run ended inside the window"})
    return report


def test_a_window_the_run_ended_inside_is_not_measured_and_has_no_costs(vs):
    assert vs.measured_steps(_ended_inside_a_window(), warmup=2) == [2.5, 5.5, 6.5, 9.5, 10.5]
    assert vs.stage_costs(_ended_inside_a_window(), pp=2, warmup=2) == vs.stage_costs(_report(), pp=2, warmup=2)


def test_stage_costs_split_extras_in_layer_ratio(vs):
    sc = vs.stage_costs(_report(), pp=2, warmup=2)
    assert sc.num_microbatches == 8 and sc.profile_events == 2
    assert sc.fwd_s == pytest.approx([0.02 + 0.001, 0.02 + 0.002])
    assert sc.bwd_s == pytest.approx([0.04 + 0.002, 0.04 + 0.004])
    assert sc.param_counts == [[100, 100, 100], [100, 100, 100]]
    # compute_s 0.5 s over 8 micro-batches, split 1:2 like the layers
    assert sc.timer_fwd_s == pytest.approx([0.5 / 24] * 2)
    assert sc.timer_bwd_s == pytest.approx([1.0 / 24] * 2)


def test_background_load_slows_the_shared_pipeline(vs):
    costs = _costs()
    alone = vs.simulate_shared(costs, cores=2).iteration_s
    assert vs.simulate_shared(costs, cores=2, background=0.5).iteration_s > alone
    # one rank on one core next to one other runnable thread: half the core, twice the time
    single = PipelineCosts(fwd_s=[0.01], bwd_s=[0.02], num_microbatches=4, tail_s=[0.005])
    one = vs.simulate_shared(single, cores=1).iteration_s
    assert one == pytest.approx(4 * 0.03 + 0.005)
    assert vs.simulate_shared(single, cores=1, background=1).iteration_s == pytest.approx(2 * one)


def _scenario_report() -> dict:
    """4 layers on 2 stages, layer 1 three times as costly; a rebalance at iteration 4
    moves layer 2 to stage 1 (Et|tttL balances 3 vs 1+1+1)."""
    layers = [{"layer": i + 1, "stage": i // 2, "fwd_s": c / 3, "bwd_s": 2 * c / 3, "param_bytes": 4,
               "grad_bytes": 4, "optim_bytes": 8, "act_bytes": 0}
              for i, c in enumerate([0.03, 0.01, 0.01, 0.01])]
    stages = [{"stage": s, "extra_s": 0.0, "wait_s": 0.0, "peak_bytes": 0, "num_microbatches": 8}
              for s in range(2)]
    profile = {"layers": layers, "stages": stages}
    return {"config": {"model": {"seq_length": 16, "micro_batch_size": 1, "hidden_size": 8}},
            "initial_layout": "Ett|ttL",
            "iterations": [{"iteration": i, "time_s": 1.0} for i in range(1, 9)],
            "events": [{"kind": "rebalance", "iteration": 4, "applied": True, "profile": profile,
                        "layout_before": "Ett|ttL", "layout_after": "Et|tttL"}]}


def test_scenario_replay_uses_the_layout_in_force_each_iteration(vs):
    import argparse
    report, a = _scenario_report(), argparse.Namespace(cores=2)
    assert [(it, str(lay)) for it, lay in vs._layouts(report)] == [(0, "Ett|ttL"), (5, "Et|tttL")]
    static = vs.predicted_phase_s(report, 5, True, a)
    dynmo = vs.predicted_phase_s(report, 5, False, a)
    # iterations 5-8 on the balanced split: 3 vs 3 units per micro-batch, against 4 vs 2
    assert static / dynmo == pytest.approx(4 / 3, rel=0.1)
    assert vs.predicted_phase_s(report, 2, False, a) > dynmo  # 2-4 still ran the old split
