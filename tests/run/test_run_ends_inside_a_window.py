"""A run that ends inside a profiling window ends the window with it (DynMo.finish).

A window opened fewer than `--dynmo-profile-window` iterations before the last, or left
open by a step that raised, never reaches its close. Its hooks, its CUDA profiler and its
collector pause (dynmo_plugin/profiling/collector.py) must still end with the run: after
train() Megatron-LM evaluates and saves, and scripts/gpu_check_worker.py trains again in
the same process, both of which would otherwise run with the garbage collector off.

Two real 2-rank gloo runs of the launcher's `run`, in the same processes: one whose
last window is cut by --train-iters, one whose step raises inside the window (the
raise is a test-only fault: a real failed step cannot be produced on demand)."""
from __future__ import annotations

import gc
import json
import os

from launch import free_port, spawn

FLAGS = ["--num-layers", "4", "--hidden-size", "16", "--num-attention-heads", "2",
         "--seq-length", "8", "--micro-batch-size", "1", "--global-batch-size", "2",
         "--vocab-size", "256", "--pipeline-model-parallel-size", "2", "--train-iters", "4",
         "--dynmo", "--dynmo-profile-every", "3", "--dynmo-profile-window", "3"]


class _StepFails(Exception):
    pass


def _fail_in_the_window(trainer) -> None:
    """Test-only fault: iteration 4's step raises on every rank (inside the window that
    opened at 3), before any communication, so no rank waits on the other."""
    step = trainer.train_step

    def train_step(iteration):
        if iteration == 4:
            raise _StepFails("test-only: a step that fails inside a window")
        return step(iteration)
    trainer.train_step = train_step


def _rank(rank: int, ports: tuple, out: str) -> None:
    from dynmo_plugin.megatron.training.machine import load_run_config
    from dynmo_plugin.train import build_parser, run
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[0]), RANK=str(rank),
                      WORLD_SIZE="2")
    seen = {"enabled_before": gc.isenabled()}
    args = build_parser().parse_args(FLAGS + ["--output", os.path.join(out, "ended")])
    report = run(load_run_config(args, world_size=2))
    seen["after_end"] = gc.isenabled()
    seen["events"] = [e for e in report["events"] if e.get("kind") == "profile"]
    os.environ["MASTER_PORT"] = str(ports[1])
    args = build_parser().parse_args(FLAGS + ["--output", os.path.join(out, "failed")])
    try:
        run(load_run_config(args, world_size=2), on_start=_fail_in_the_window)
        seen["raised"] = False
    except _StepFails:
        seen["raised"] = True
    seen["after_failure"] = gc.isenabled()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(seen, fh)


def test_a_run_that_ends_inside_a_window_turns_the_collector_back_on(tmp_path):
    spawn(_rank, ((free_port(), free_port()), str(tmp_path)), nprocs=2)  # a rendezvous per run
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen["enabled_before"]
        assert seen["after_end"], "the window cut by --train-iters left the collector off"
        assert seen["raised"]
        assert seen["after_failure"], "the window a failed step left open kept the collector off"
        cut = [e for e in seen["events"] if e.get("cancelled")]
        assert [(e["window"], e["cancelled"]) for e in cut] == [([3, 4], "the run ended inside the window")]
