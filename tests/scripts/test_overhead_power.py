"""scripts/overhead_power.py: the plugin-overhead verdict's power table (docs/gpu.md)."""
from __future__ import annotations

import json
import subprocess
import sys

from test_gpu_check import ROOT

SCRIPT = ROOT / "scripts" / "overhead_power.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def test_the_table_is_one_json_document_and_the_pairs_rule_never_fails_no_overhead():
    proc = _run("--trials", "40", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    rows = doc["table"]
    assert {r["n_pairs"] for r in rows} == {16, 28} and len(rows) == 2 * 3 * 7
    for r in rows:
        for rule in ("rounds", "pairs"):
            assert sum(r[rule].values()) == 1.0
        if r["true"] == 1.0:
            assert r["pairs"]["fail"] == 0.0, r
        if r["true"] == 1.08 and r["sigma"] == 0.02:
            assert r["pairs"]["fail"] > 0.8, r  # a clear overhead at low noise is found
    assert doc == json.loads(_run("--trials", "40", "--json").stdout)  # seeded: the same tables
    order = {(r["effect"], r["true"], r["flip"]): r for r in doc["order"]}
    assert len(order) == 3 * 2 * 2
    # a parity effect reads as the plugin's cost when it is always first, not by turns
    assert order[("parity +0.005", 1.03, False)]["fail"] > 2 * order[("parity +0.005", 1.03, True)]["fail"]


def test_a_bad_trial_count_is_one_line_and_exit_2():
    proc = _run("--trials", "0")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == ["overhead_power.py: --trials must be at least 1 (e.g. --trials 1000)"]
