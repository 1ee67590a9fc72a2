"""Measured cost curves: the shipped H100 profile, pricing layers by it, and profiles
built from a live run's report.json (`dynmo simulate --costs-from`)."""
from __future__ import annotations

import configparser
import json
from pathlib import Path

import numpy as np
import pytest

from dynmo_plugin.errors import UserError
from dynmo_plugin.sim.from_run import from_run
from dynmo_plugin.sim.gpt import GPTShape, Hardware, LayerLoad, flop_layer_costs, layer_costs
from dynmo_plugin.sim.measured import KNOBS, Curve, hardware, load_profile_file
from dynmo_plugin.scenarios import make_trajectory

ROOT = Path(__file__).resolve().parents[2]
PAPER = GPTShape(num_layers=4)  # hidden 1024, seq 2048, micro-batch 2


def test_h100_profile_states_its_source_and_ships_as_package_data():
    entries = load_profile_file(ROOT / "dynmo_plugin/sim/profiles/h100.json")
    assert {(e.hidden, e.micro_batch) for e in entries} == {(1024, 2), (1024, 8), (4096, 1)}
    assert all("docs/simulator.md" in e.source for e in entries)
    assert all(set(e.curves) <= set(KNOBS) for e in entries)
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    assert "profiles/*.json" in cfg["options.package_data"]["dynmo_plugin.sim"]


def test_h100_prices_layers_from_the_measured_curves():
    hw = hardware("h100", PAPER)
    m = hw.measured
    dense = layer_costs(PAPER, hw, LayerLoad.dense(4))
    np.testing.assert_allclose(dense.total_s, m.layer_s)
    assert 3 * dense.head_fwd_s == pytest.approx(5.8 * m.layer_s)
    half = LayerLoad(*(np.ones(4),) * 4, knob="tokens", knob_value=np.full(4, 0.5))
    np.testing.assert_allclose(layer_costs(PAPER, hw, half).total_s, 1.04 * m.layer_s)
    frozen = LayerLoad(*(np.ones(4),) * 3, np.array([0.0, 0.0, 1.0, 1.0]))
    c = layer_costs(PAPER, hw, frozen)
    np.testing.assert_allclose(c.fwd_s[:2], 0.27 * m.layer_s)
    np.testing.assert_allclose(c.bwd_s[:2], 0.0)
    # unstructured pruning saves nothing on the H100; the FLOP model says 90%
    pruned = make_trajectory("pruning", num_layers=4, final_sparsity=0.9).load(9000)
    np.testing.assert_allclose(layer_costs(PAPER, hw, pruned).total_s, m.layer_s)
    flops = flop_layer_costs(PAPER, Hardware(), pruned).total_s
    assert flops.max() < 0.6 * flop_layer_costs(PAPER, Hardware(), LayerLoad.dense(4)).total_s[0]


def test_a_knob_without_a_curve_falls_back_to_the_flop_ratio():
    shape = GPTShape(num_layers=4, hidden=4096, micro_batch=1)
    hw = hardware("h100", shape)
    load = make_trajectory("moe", num_layers=4).load(0)
    assert "flops ratio" in hw.measured.priced_by("expert_load")
    flop = flop_layer_costs(shape, Hardware(), load).total_s
    ratio = flop / flop_layer_costs(shape, Hardware(), LayerLoad.dense(4)).total_s
    np.testing.assert_allclose(layer_costs(shape, hw, load).total_s, ratio * hw.measured.layer_s)


@pytest.mark.parametrize("profile,shape,match", [
    ("h100", GPTShape(num_layers=2, hidden=2048, heads=16), "has no curves for hidden 2048"),
    ("tpu-v9", PAPER, "unknown hardware profile"),
])
def test_profile_errors_name_the_fix(profile, shape, match):
    with pytest.raises(UserError, match=match):
        hardware(profile, shape)


def test_curves_hold_their_end_values_and_reject_bad_points():
    c = Curve(((0.25, 0.5), (1.0, 1.0)))
    np.testing.assert_allclose(c(np.array([0.0, 0.25, 0.625, 2.0])), [0.5, 0.5, 0.75, 1.0])
    with pytest.raises(UserError, match="strictly increasing"):
        Curve(((1.0, 1.0), (0.5, 0.5)))


# ---- from a live run ------------------------------------------------------------------------
def _report(first_event: int = 5) -> dict:
    def profile(cost: float) -> dict:
        layers = [{"layer": i + 1, "stage": i // 2, "fwd_s": cost / 3, "bwd_s": 2 * cost / 3,
                   "param_bytes": 4, "grad_bytes": 4, "optim_bytes": 8, "act_bytes": 0}
                  for i in range(4)]
        stages = [{"stage": s, "extra_s": [0.01, 0.08][s], "wait_s": 0.0, "peak_bytes": 0,
                   "clock": "cpu_thread_time"} for s in range(2)]
        return {"layers": layers, "stages": stages}

    def pruned(it: int, s: float) -> dict:
        return {"kind": "dynamism", "scenario": "gradual_pruning", "iteration": it,
                "detail": {"granularity": "unstructured", "sparsity": {str(i): s for i in range(1, 5)}}}

    return {
        "config": {"model": {"hidden_size": 256, "num_attention_heads": 4, "seq_length": 128,
                             "micro_batch_size": 4, "vocab_size": 4096, "num_layers": 4},
                   "dynmo": {"dynamism": {"kind": "gradual_pruning",
                                          "pruning": {"granularity": "unstructured"}}}},
        "world": {"backend": "gloo", "pp": 2},
        "events": [{"kind": "profile", "iteration": 3, "window": [2, 3], "profile": profile(0.04)},
                   pruned(first_event, 0.5),
                   {"kind": "rebalance", "iteration": 8, "window": [7, 8], "profile": profile(0.03)},
                   pruned(9, 0.9),
                   {"kind": "rebalance", "iteration": 11, "window": [10, 11], "profile": profile(0.02)}],
    }


def test_from_run_builds_the_dense_layer_head_and_pruning_curve(tmp_path):
    (tmp_path / "report.json").write_text(json.dumps(_report()))
    run = from_run(tmp_path)
    m = run.measured
    assert (m.hidden, m.seq, m.micro_batch, m.vocab) == (256, 128, 4, 4096)
    assert m.layer_s == pytest.approx(0.04) and m.fwd_share == pytest.approx(1 / 3)
    assert m.head_layers == pytest.approx(2.0) and m.embed_layers == pytest.approx(0.25)
    assert m.curves["pruning_unstructured"].points == ((0.1, 0.5), (0.5, 0.75), (1.0, 1.0))
    assert "layer_s" not in m.notes  # the first profile came before any event
    assert run.scenario == "gradual_pruning" and run.granularity == "unstructured"
    shape = run.shape(num_layers=12)
    load = make_trajectory("pruning", num_layers=12, final_sparsity=0.9).load(9000)
    c = layer_costs(shape, run.hardware(), load)
    assert np.all(c.total_s < 0.04) and np.all(c.total_s >= 0.02)


def test_from_run_says_when_no_dense_profile_exists(tmp_path):
    report = _report(first_event=1)
    (tmp_path / "report.json").write_text(json.dumps(report))
    assert "stand in for dense ones" in from_run(tmp_path).measured.notes["layer_s"]


def test_from_run_errors_name_the_fix(tmp_path):
    with pytest.raises(UserError, match="training run's --output directory"):
        from_run(tmp_path / "missing")
    report = _report()
    report["events"] = []
    (tmp_path / "report.json").write_text(json.dumps(report))
    with pytest.raises(UserError, match="--dynmo-profile-every"):
        from_run(tmp_path)
