"""A scenario (or --dynmo) on one pipeline stage trains as a static baseline, and says
so in one warning line (issue 28: it ran silently)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

from dynmo_plugin.megatron.training.machine import load_run_config
from dynmo_plugin.train import build_parser, nothing_to_balance

ROOT = Path(__file__).resolve().parents[2]


def _cfg(argv):
    return load_run_config(build_parser().parse_args(argv), world_size=None)


def test_warned_only_when_nothing_can_move():
    assert "nothing to balance" in nothing_to_balance(_cfg(["--dynmo-dynamism", "layer_freezing"]))
    assert "--dynmo with" in nothing_to_balance(_cfg(["--dynmo"]))
    assert nothing_to_balance(_cfg([])) is None
    assert nothing_to_balance(_cfg(["--dynmo", "--pipeline-model-parallel-size", "2"])) is None


def test_one_warning_line_under_torchrun(tmp_path):
    from launch import run_group
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = run_group([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
                      "-m", "dynmo_plugin.train", "--dynmo-dynamism", "layer_freezing",
                      "--train-iters", "1", "--num-layers", "2", "--output", str(tmp_path / "run")],
                     ROOT, env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [x for x in proc.stderr.splitlines() if x.startswith("dynmo-train: warning:")]
    assert len(warnings) == 1 and "nothing to balance" in warnings[0], proc.stderr[-3000:]
