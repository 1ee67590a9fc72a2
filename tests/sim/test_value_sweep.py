"""scripts/value_sweep.py --quick: the sweep's rows are exactly what `dynmo simulate
--json` reports for the same campaign (DynMo from the best static choice), no DynMo
variant falls below the bar it starts from by more than its overheads, and a GPU model
no GPU has measured gives no number."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import value_sweep  # noqa: E402


@pytest.fixture(scope="module")
def sweep() -> dict:
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "value_sweep.py"), "--quick", "--json",
                        "--jobs", "1"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_quick_sweep_rows_and_summary(sweep):
    rows = sweep["rows"]
    assert [(r["scenario"], r["layers"], r["pp"]) for r in rows] == [
        ("gradual_pruning", 16, 8), ("gradual_pruning", 32, 8), ("layer_freezing", 16, 8),
        ("layer_freezing", 32, 8)]
    s = sweep["summary"]
    assert s["campaigns"] == 4 and s["repacks_slower_than_allowed"] == 0
    assert s["moonshot"]["best"].startswith("FLOP ")
    for r in rows:
        assert r["best_over_static"] >= 1.0 and r["per_gpu_bar_gpuh_over_best"] >= 1.0 - 1e-12
        for f in value_sweep.FREED:  # started on the bar: at most the overheads below it
            assert r[f"{f}_tokens_s"] >= 0.98
            assert r[f"{f}_gpus_avg"] <= 64 + 1e-9
        assert r["grow_gpus_avg"] == pytest.approx(64.0)  # grow keeps every GPU


def test_a_row_is_what_dynmo_simulate_prints(sweep):
    row = sweep["rows"][3]  # freezing 32/8
    r = subprocess.run([sys.executable, "-m", "dynmo_plugin.cli", "simulate", "--scenario", "freezing",
                        "--layers", "32", "--dp", "8", "--pp", "8", "--iterations", "3000", "--json",
                        "--repack", "--start-best-static", "--freed", "release"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert row["release_tokens_s"] == out["speedup_over"]["best_static"]
    assert row["release_gpuh"] == pytest.approx(out["speedup_per_gpu_over"]["best_static"], rel=1e-12)
    assert row["best_static"] == out["static_choices"]["best_static"]


def test_unmeasured_gpu_models_give_no_campaign():
    models = {"h200-gpu": {"status": "not measured", "reason": "no run yet"},
              "h100-gpu": {"status": "measured", "measured_scenarios": ["layer_freezing"],
                           "refused": {"early_exit": {"why": "row failed its check"}},
                           "shapes": [{"hidden": 2048, "seq": 2048, "micro_batch": 2}]}}
    points, missing = value_sweep.grid(False, models)
    hws = {p[0] for p in points}
    assert hws == {"a100-flops", "h100-gpu"} and len(points) == 36 + 6
    assert all(p[1] == "layer_freezing" and p[5][1] == "2048" for p in points if p[0] == "h100-gpu")
    assert "H200-gpu: not measured (no run yet)" in missing
    assert "H100-gpu exit: not measured (row failed its check)" in missing
