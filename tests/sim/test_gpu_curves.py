"""GPU cost curves from gpu_check's scenario rows: only passed rows are priced, the
model carries its provenance, and a model no GPU has measured says so (issue 38)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from dynmo_plugin.errors import UserError
from dynmo_plugin.sim import gpu_curves
from dynmo_plugin.sim.gpt import GPTShape, LayerLoad
from dynmo_plugin.sim.gpu_curves import NotMeasured, gpu_cost_model, gpu_hardware, model_name

S8 = ["--num-layers", "8", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "2048",
      "--micro-batch-size", "2", "--global-batch-size", "4", "--vocab-size", "32000"]


def _costs(mod_passed=False):
    """Figures in the form gpu_check writes (scenario_costs.json "scenarios")."""
    return {
        "layer_freezing": {"ratio": 0.39, "threshold": 0.4, "passed": True, "model": S8,
                           "reference_cost_s": 0.0071},
        "early_exit": {"ratio": 0.532, "threshold": 0.6, "passed": True,
                       "model": [*S8, "--vocab-size", "16"], "reference_cost_s": 0.0097,
                       "exited_fraction": 0.95},
        "mixture_of_depths": {"ratio": 0.801, "threshold": 0.3, "passed": mod_passed, "model": S8,
                              "reference_cost_s": 0.0087},
        "gradual_pruning": {"ratio": 1.138, "threshold": 0.75, "model": S8, "reference_cost_s": 0.0069},
    }


def _model(costs):
    return gpu_cost_model(costs, name="h200-gpu", gpu="NVIDIA H200", date="2026-11-27", commit="abc123")


def test_only_passed_rows_are_priced_and_the_rest_are_refused():
    m = _model(_costs())
    assert m["status"] == "measured" and m["measured_scenarios"] == ["early_exit", "layer_freezing"]
    assert m["refused"]["mixture_of_depths"] == {"ratio": 0.801, "threshold": 0.3, "why": "row failed its check"}
    assert m["refused"]["gradual_pruning"]["why"] == "no pass verdict"
    assert (m["gpu"], m["date"], m["commit"]) == ("NVIDIA H200", "2026-11-27", "abc123")
    [entry] = m["shapes"]  # one shape: h2048 s2048 mb2 (the vocabulary is not measured)
    assert (entry["hidden"], entry["seq"], entry["micro_batch"]) == (2048, 2048, 2)
    assert entry["frozen_forward_only"] == 0.39
    assert entry["layer_s"] == pytest.approx((0.0071 + 0.0097) / 2)  # the passed rows' references
    # the failed MoD row (0.801 at 0.125) is not a point: only early exit's
    assert entry["curves"] == {"tokens": [[pytest.approx(0.05), 0.532]]}


def test_a_passed_row_is_priced_where_the_failed_one_was_not():
    m = _model(_costs(mod_passed=True))
    assert m["shapes"][0]["curves"]["tokens"] == [[pytest.approx(0.05), 0.532], [0.125, 0.801]]
    assert "mixture_of_depths" not in m["refused"]


def test_no_passed_row_is_not_measured():
    costs = {k: dict(v, passed=False) for k, v in _costs().items()}
    m = _model(costs)
    assert m["status"] == "not measured" and m["shapes"] == [] and len(m["refused"]) == 4


def test_the_shipped_models_say_not_measured():
    shape = GPTShape(num_layers=8, hidden=2048, heads=16, seq=2048, micro_batch=2)
    for name in gpu_curves.GPU_MODELS:
        with pytest.raises(NotMeasured, match="not measured"):
            gpu_hardware(name, shape)
    with pytest.raises(UserError, match="unknown GPU cost model"):
        gpu_hardware("h300-gpu", shape)


def test_a_measured_model_loads_by_name_and_prices_frozen_layers(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_curves, "_DIR", tmp_path)  # where gpu_check's output was copied
    (tmp_path / "h200-gpu.json").write_text(json.dumps(_model(_costs())))
    shape = GPTShape(num_layers=8, hidden=2048, heads=16, seq=2048, micro_batch=2, vocab=32000)
    hw = gpu_hardware("h200-gpu", shape)
    load = LayerLoad.dense(8)
    load.backward[:4] = 0.0
    load.trainable[:4] = False
    costs = hw.measured.layer_costs(shape, load)
    np.testing.assert_allclose(costs.total_s[:4], 0.39 * 0.0084)
    np.testing.assert_allclose(costs.total_s[4:], 0.0084)
    with pytest.raises(UserError, match="no entry at hidden 1024"):
        gpu_hardware("h200-gpu", GPTShape(num_layers=8))


def test_model_names():
    assert model_name("NVIDIA H200") == "h200-gpu" and model_name("NVIDIA H100 80GB HBM3") == "h100-gpu"
    with pytest.raises(UserError, match="no named GPU cost model"):
        model_name("NVIDIA A100")
