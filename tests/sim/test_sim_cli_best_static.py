"""`dynmo simulate` flags of issue 38: --start-best-static, --freed, --hardware h200-gpu."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BASE = ["simulate", "--scenario", "freezing", "--layers", "16", "--dp", "2", "--pp", "4",
        "--iterations", "6000"]


def _run(*extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dynmo_plugin.cli", *BASE, *extra],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_grow_from_the_best_static_choice_in_json():
    r = _run("--repack", "--repack-max-slowdown", "1.05", "--freed", "grow", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert {"best_static", "best_static_per_gpu"} <= set(out["baselines"])
    assert out["static_choices"]["best_static"].startswith("grown_")
    grown = [e for e in out["events"] if e["kind"] == "repack" and e["applied"]]
    assert [(e["layout_after"], e["dp_after"]) for e in grown] == [("Etttttttttttt|ttttL", 4)]
    assert out["gpus_avg"] == 8.0


def test_bad_freed_and_unmeasured_gpu_model_are_one_line_exit_2():
    r = _run("--freed", "keep")
    assert r.returncode == 2 and "freed must be one of release, grow, auto" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = _run("--hardware", "h200-gpu", "--hidden", "2048")
    assert r.returncode == 2 and "'h200-gpu': not measured" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
