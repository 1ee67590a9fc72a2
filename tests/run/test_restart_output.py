"""A fresh run into an --output that holds another run's files (issue 36, small lies): it
overwrote report.json and left the old summary.md and plots beside it, describing
another run. Now they move to <output>/earlier-N/ with one line; nothing is overwritten.
Real torchrun runs through the test launcher (tests/launch.py: the workers start with
their imports done); what a fresh torchrun adds, its flag check before any worker, has
its own tests (tests/run/test_day_one.py)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from launch import torchrun
from test_day_one import TINY, _env


def test_a_fresh_run_moves_an_earlier_runs_files_aside(tmp_path):
    out = tmp_path / "run"
    first = torchrun(1, [*TINY, "--train-iters", "1", "--seed", "1"], out, check=False)
    assert first.returncode == 0, first.stderr[-3000:]
    dynmo = Path(sys.executable).with_name("dynmo")
    assert subprocess.run([str(dynmo), "report", str(out)], env=_env(), capture_output=True,
                          timeout=300).returncode == 0
    old = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert {"report.json", "summary.md", "training.png"} <= set(old)
    second = torchrun(1, [*TINY, "--train-iters", "2", "--seed", "2"], out, check=False)
    assert second.returncode == 0, second.stderr[-3000:]
    moved = [x for x in second.stderr.splitlines() if "held an earlier run's files" in x]
    assert len(moved) == 1 and str(out / "earlier-1") in moved[0], second.stderr[-3000:]
    assert not (out / "summary.md").exists() and not (out / "training.png").exists()
    assert {p.name: p.read_bytes() for p in (out / "earlier-1").iterdir()} == old  # all of it, intact
    assert len(json.loads((out / "report.json").read_text())["iterations"]) == 2
