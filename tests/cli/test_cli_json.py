"""Every `--json` output is exactly one JSON document on stdout (logs go to stderr).

Each command runs as a real subprocess, so a third-party library printing to stdout
(DeepSpeed's "Setting accelerator to CPU" warning on its first import) would break
`json.loads` of the whole stdout. `scripts/bench_e2e.py --json` trains twice and is
checked in tests/run/test_bench_e2e.py; `scripts/validate_sim.py --json` trains too (run
by hand). The last test is the acceptance test of `scripts/reproduce_paper.py --json`:
its tables hold every paper figure beside ours.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dynmo_plugin.sim import paper

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--layers", "8", "--dp", "1", "--pp", "2", "--iterations", "3000"]


def _stdout_document(args: list[str], ok: tuple[int, ...] = (0,)):
    r = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode in ok, r.stderr[-2000:]
    return json.loads(r.stdout)  # the whole of stdout: nothing before or after the document


def _report_dir(tmp_path: Path) -> Path:
    layers = [{"layer": i + 1, "stage": i // 2, "fwd_s": 0.01, "bwd_s": 0.02, "param_bytes": 4,
               "grad_bytes": 4, "optim_bytes": 8, "act_bytes": 0} for i in range(4)]
    stages = [{"stage": s, "extra_s": 0.01, "wait_s": 0.0, "peak_bytes": 0} for s in range(2)]
    report = {"config": {}, "iterations": [{"iteration": i, "time_s": 1.0, "loss": 5.0 - i / 10}
                                           for i in range(1, 6)],
              "events": [{"kind": "rebalance", "iteration": 3, "applied": True,
                          "layout_before": "Ett|ttL", "layout_after": "Ettt|tL",
                          "stage_loads_before": [0.1, 0.2], "stage_loads_after": [0.15, 0.15],
                          "profile": {"layers": layers, "stages": stages}}]}
    (tmp_path / "report.json").write_text(json.dumps(report))
    return tmp_path


@pytest.mark.parametrize("argv,ok", [
    (["simulate", "--scenario", "freezing", *SMALL, "--balancer", "partition", "--repack",
      "--hardware", "h100", "--deepspeed-baseline", "--json"], (0,)),
    (["plan", "--costs", "{costs}", "--stages", "2", "--method", "partition", "--json"], (0,)),
    (["plan", "--costs", "{costs}", "--current-layout", "Ett|ttL", "--repack", "--json"], (0,)),
    (["report", "{run}", "--out", "{out}", "--json"], (0,)),
    (["cluster", "release", "--strategy", "none", "--namespace", "ml", "--name", "train",
      "--keep", "1", "--current", "2", "--json"], (5,)),  # 5: only logged, by design
], ids=["simulate", "plan", "plan-repack", "report", "cluster"])
def test_each_cli_prints_one_json_document(tmp_path, argv, ok):
    costs = tmp_path / "costs.json"
    costs.write_text("[3, 1, 1, 2]")
    run = _report_dir(tmp_path)
    argv = [a.format(costs=costs, run=run, out=tmp_path / "out") for a in argv]
    doc = _stdout_document(["-m", "dynmo_plugin.cli", *argv], ok)
    assert isinstance(doc, dict) and doc


def test_reproduce_paper_json_holds_every_paper_value_beside_ours():
    doc = _stdout_document(["scripts/reproduce_paper.py", "--json", "--layers", "32",
                            "--hardware", "a100-flops"])
    assert {"paper", "figure3", "verdicts", "abstract", "overhead", "figure4", "notes"} <= set(doc)
    # the paper's figures, all of them, verbatim
    for name, (values, baseline, _) in paper.FIGURE3.items():
        got = doc["paper"]["figure3"][name]
        assert got["baseline"] == baseline
        assert {int(k): (tuple(v) if isinstance(v, list) else v) for k, v in got["values"].items()} == values
    assert doc["paper"]["abstract"] == {k: v for k, (v, _) in paper.ABSTRACT.items()}
    assert set(doc["paper"]["overhead"]) == set(paper.OVERHEAD)
    # every figure-3 value at 32 layers beside ours, with a cause
    rows = {r["row"]: r for r in doc["figure3"]}
    assert len(rows) == 8 and all(r["layers"] == 32 for r in rows.values())
    for r in rows.values():
        expected = paper.FIGURE3[r["scenario"]][0][32]
        assert (tuple(r["paper"]) if isinstance(r["paper"], list) else r["paper"]) == expected
        ours = r["ours"]["a100-flops"]
        for key in ("exact", "by_parameter", "paper_rule", "vs_same_dynamism_static", "fluid_bound",
                    "repack_per_gpu", "overhead_pct"):
            assert ours[key] >= 0, key
        assert ours["paper_rule"] == max(ours["exact"], ours["by_parameter"])
        assert r["cause"]["a100-flops"]
    assert {v["scenario"] for v in doc["verdicts"]} == set(paper.FIGURE3)
    assert {a["scenario"] for a in doc["abstract"]} == set(paper.ABSTRACT) | {"repacking"}
    for a in doc["abstract"][:-1]:
        assert a["paper"] == paper.ABSTRACT[a["scenario"]][0] and a["ours_max"]["a100-flops"] > 0
    assert {o["scenario"] for o in doc["overhead"]} == set(paper.OVERHEAD)
    (fig4,) = doc["figure4"]
    assert fig4["paper_gpus_avg"] == list(paper.FIGURE4["gpus_avg"]) and 0 < fig4["gpus_avg"] <= 8
