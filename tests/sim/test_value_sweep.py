"""scripts/value_sweep.py --quick: the sweep's rows are exactly what `dynmo simulate
--json` reports for the same campaign, and no applied repack simulates slower than
allowed."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


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
    assert sweep["summary"]["campaigns"] == 4
    assert sweep["summary"]["repacks_slower_than_allowed"] == 0
    for r in rows:
        assert r["dynmo_over_tuned"] == pytest.approx(r["dynmo_over_static"] / r["tuned_over_static"])
        assert r["repack_tokens_s_over_static"] >= 0.95  # max_slowdown 1.0, minus the repack stall
        assert 1 <= r["packed_once_stages"] <= 8 and r["repack_stages_avg"] <= 8


def test_a_row_is_what_dynmo_simulate_prints(sweep):
    row = sweep["rows"][2]  # freezing 16/8
    r = subprocess.run([sys.executable, "-m", "dynmo_plugin.cli", "simulate", "--scenario", "freezing",
                        "--layers", "16", "--dp", "8", "--pp", "8", "--iterations", "3000", "--json"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert row["dynmo_over_static"] == out["speedup"]
    assert row["dynmo_over_tuned"] == out["speedup_over"]["static_tuned"]
    assert row["packed_once_stages"] == out["baselines"]["packed_once"]["gpus_avg"] / 8
