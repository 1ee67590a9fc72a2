"""Hardware profiles from per-scenario cost rows (a GPU check's output) at several
shapes: `python -m dynmo_plugin.sim.profile_builder`, then `dynmo simulate --hardware
PROFILE --hidden/--micro-batch` (issue 29)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dynmo_plugin.errors import UserError
from dynmo_plugin.sim.gpt import GPTShape, LayerLoad
from dynmo_plugin.sim.measured import hardware, profile_entries
from dynmo_plugin.sim.profile_builder import build_profile

ROOT = Path(__file__).resolve().parents[2]
H2048 = {"hidden": 2048, "seq": 2048, "micro_batch": 1}
H1024 = {"hidden": 1024, "seq": 2048, "micro_batch": 2}
ROWS = [
    {"scenario": "dense", "shape": H2048, "ratio": 1.0, "layer_s": 0.004, "fwd_share": 0.3},
    {"scenario": "mod", "shape": H2048, "ratio": 0.81, "knob_value": 0.5},
    {"scenario": "mod", "shape": H2048, "ratio": 0.83, "knob_value": 0.5},  # a repeat: averaged
    {"scenario": "early_exit", "shape": H2048, "ratio": 0.6, "knob_value": 0.25},
    {"scenario": "head", "shape": H2048, "ratio": 6.0},
    {"scenario": "freezing", "shape": H2048, "ratio": 0.3},
    {"scenario": "pruning", "granularity": "structured", "shape": H2048, "ratio": 0.6, "knob_value": 0.5,
     "spread": 0.02},  # unknown keys are ignored
    {"scenario": "dense", "shape": H1024, "ratio": 1.0, "layer_s": 0.002},
    {"scenario": "sparse_attention", "shape": H1024, "ratio": 0.98, "knob_value": 0.0625},
]


def test_rows_make_one_entry_per_shape_with_curves():
    profile = build_profile(ROWS, "h200", "test rows")
    entries = {(e.hidden, e.micro_batch): e for e in profile_entries(profile)}
    big, small = entries[(2048, 1)], entries[(1024, 2)]
    assert big.layer_s == 0.004 and big.fwd_share == 0.3 and big.head_layers == 6.0
    assert big.frozen_forward_only == 0.3
    assert big.curves["tokens"].points == ((0.25, 0.6), (0.5, pytest.approx(0.82)))
    assert big.curves["pruning_structured"].points == ((0.5, 0.6),)
    assert small.curves["attention_density"].points == ((0.0625, 0.98),)
    assert "head_layers" in small.notes and "frozen_forward_only" in small.notes  # defaults said


def test_a_shape_is_priced_by_its_curve(tmp_path):
    path = tmp_path / "h200.json"
    path.write_text(json.dumps(build_profile(ROWS, "h200", "test rows")))
    shape = GPTShape(num_layers=2, hidden=2048, seq=2048, micro_batch=1)
    hw = hardware(str(path), shape)
    load = LayerLoad.dense(2)
    load = LayerLoad(load.attn_linear, load.mlp, load.attn_core, load.backward, knob="tokens",
                     knob_value=np.array([0.5, 0.25]))
    costs = hw.measured.layer_costs(shape, load)
    assert costs.total_s.tolist() == pytest.approx([0.004 * 0.82, 0.004 * 0.6])


@pytest.mark.parametrize("rows, message", [
    ([{"scenario": "mod", "shape": H2048, "ratio": 0.8, "knob_value": 0.5}], "has no 'dense' row"),
    ([{"scenario": "dense", "shape": H2048, "ratio": 1.0}], "'layer_s' must be a finite number > 0"),
    ([{"scenario": "warp", "shape": H2048, "ratio": 1.0}], "unknown scenario 'warp'"),
    ([{"scenario": "dense", "shape": [2048], "layer_s": 1.0}], "'shape' must be an object"),
    ([{"scenario": "pruning", "granularity": "2:4", "shape": H2048, "ratio": 1, "knob_value": 1}],
     "granularity must be unstructured or structured"),
])
def test_bad_rows_name_the_row_and_the_fix(rows, message):
    with pytest.raises(UserError, match=message):
        build_profile(rows, "x", "y")


def test_builder_cli_then_simulate_at_that_shape(tmp_path):
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps({"gpu": "test", "rows": ROWS}))
    out = tmp_path / "h200.json"
    r = subprocess.run([sys.executable, "-m", "dynmo_plugin.sim.profile_builder", str(rows),
                        "--name", "h200", "--out", str(out)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-m", "dynmo_plugin.cli", "simulate", "--scenario", "mod",
                        "--layers", "8", "--dp", "1", "--pp", "2", "--iterations", "2000",
                        "--hardware", str(out), "--hidden", "2048", "--micro-batch", "1", "--json"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    model = json.loads(r.stdout)["cost_model"]
    assert model["name"] == "h200" and model["priced_by"] == {"tokens": "curve"}
    assert (model["profile"]["hidden"], model["profile"]["micro_batch"]) == (2048, 1)
    bad = tmp_path / "bad.json"
    bad.write_text("[1]")
    r = subprocess.run([sys.executable, "-m", "dynmo_plugin.sim.profile_builder", str(bad),
                        "--name", "x"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "row objects" in r.stderr
