"""What a run leaves of Python's cyclic garbage collector, and when it collects.

A run that ends inside a profiling window ends the window with it (DynMo.finish): a
window opened fewer than `--dynmo-profile-window` iterations before the last, or left
open by a step that raised, never reaches its close, and its collector pause
(dynmo_plugin/profiling/collector.py) must still end with the run: after train()
Megatron-LM evaluates and saves, and scripts/gpu_check_worker.py trains again in the
same process, both of which would otherwise run with the collector off.

--manual-gc (Megatron-LM's): the collector off for the run, windows included, and
collections only every --manual-gc-interval iterations, between steps.

Real 2-rank gloo runs of the launcher's `run`, one after another in the same processes:
one whose last window is cut by --train-iters, two whose step raises inside the window
(in its first iteration, and in its second; the raise is a test-only fault: a real
failed step cannot be produced on demand), one with --manual-gc --manual-gc-interval 2."""
from __future__ import annotations

import gc
import json
import os

import pytest
from launch import free_port, spawn

FLAGS = ["--num-layers", "4", "--hidden-size", "16", "--num-attention-heads", "2",
         "--seq-length", "8", "--micro-batch-size", "1", "--global-batch-size", "2",
         "--vocab-size", "256", "--pipeline-model-parallel-size", "2", "--train-iters", "4",
         "--dynmo", "--dynmo-profile-every", "3", "--dynmo-profile-window", "3"]


class _StepFails(Exception):
    pass


def _fail_at(at: int):
    """on_start, a test-only fault: iteration `at`'s step raises on every rank (inside the
    window that opened at 3), before any communication, so no rank waits on the other."""
    def on_start(trainer) -> None:
        step = trainer.train_step

        def train_step(iteration):
            if iteration == at:
                raise _StepFails("test-only: a step that fails inside a window")
            return step(iteration)
        trainer.train_step = train_step
    return on_start


def _watch_the_collector(seen: dict):
    """on_start: from here on, when every full collection ran ("after N": between steps,
    the last step done N; "in N": inside step N), and whether the collector was on during
    each step."""
    now = {"where": "after 0"}

    def on_gc(phase, info):
        if phase == "start" and info["generation"] == 2:
            seen["collections"].append(now["where"])

    def on_start(trainer):
        step = trainer.train_step
        seen["collections"], seen["enabled_in_steps"] = [], []
        gc.callbacks.append(on_gc)

        def train_step(iteration):
            now["where"] = f"in {iteration}"
            seen["enabled_in_steps"].append(gc.isenabled())
            try:
                return step(iteration)
            finally:
                now["where"] = f"after {iteration}"
        trainer.train_step = train_step
    return on_start, on_gc


def _run(out: str, name: str, port: int, extra=(), **kw):
    from dynmo_plugin.megatron.training.machine import load_run_config
    from dynmo_plugin.train import build_parser, run
    os.environ["MASTER_PORT"] = str(port)
    args = build_parser().parse_args([*FLAGS, *extra, "--output", os.path.join(out, name)])
    return run(load_run_config(args, world_size=2), **kw)


def _rank(rank: int, ports: tuple, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), WORLD_SIZE="2")
    seen = {"enabled_before": gc.isenabled()}
    report = _run(out, "ended", ports[0])
    seen["after_end"] = gc.isenabled()
    seen["events"] = [e for e in report["events"] if e.get("kind") == "profile"]
    for at, port in ((3, ports[1]), (4, ports[2])):
        try:
            _run(out, f"failed_at_{at}", port, on_start=_fail_at(at))
            seen[f"raised_at_{at}"] = False
        except _StepFails:
            seen[f"raised_at_{at}"] = True
        seen[f"after_failure_at_{at}"] = gc.isenabled()
    on_start, on_gc = _watch_the_collector(seen)
    # a 1-iteration window at 3 that closes: step 4 runs after it with the collector still off
    _run(out, "manual", ports[3], ["--manual-gc", "--manual-gc-interval", "2", "--dynmo-profile-window", "1"],
         on_start=on_start)
    gc.callbacks.remove(on_gc)
    seen["after_manual"] = gc.isenabled()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(seen, fh)


def _ports(n: int) -> tuple:
    """A rendezvous port per run, all different."""
    ports: set = set()
    while len(ports) < n:
        ports.add(free_port())
    return tuple(ports)


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    out = tmp_path_factory.mktemp("collector")
    spawn(_rank, (_ports(4), str(out)), nprocs=2)
    return out


@pytest.fixture(scope="module")
def seen(out) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def _windows(run_dir) -> list:
    from dynmo_plugin.report import read_report  # the log replayed where the run failed
    return [(e["window"], e.get("cancelled")) for e in read_report(run_dir)["events"] if e["kind"] == "profile"]


def test_a_run_that_ends_inside_a_window_turns_the_collector_back_on(seen, out):
    for s in seen:
        assert s["enabled_before"]
        assert s["after_end"], "the window cut by --train-iters left the collector off"
        assert s["raised_at_3"] and s["raised_at_4"]
        assert s["after_failure_at_3"] and s["after_failure_at_4"], \
            "the window a failed step left open kept the collector off"
        cut = [e for e in s["events"] if e.get("cancelled")]
        assert [(e["window"], e["cancelled"]) for e in cut] == [([3, 4], "the run ended inside the window")]
    # a step that failed after one window iteration: that one is in the report, cancelled;
    # one that failed in the window's first: it measured nothing, no event
    assert _windows(out / "failed_at_4") == [([3, 3], "the run ended inside the window")]
    assert _windows(out / "failed_at_3") == []


def test_manual_gc_collects_between_steps_every_interval_and_only_then(seen, out):
    """Four iterations, interval 2: full collections after steps 2 and 4 and nowhere
    else, the collector off in every step, in the window at 3 and after its close, and on
    again after the run."""
    for s in seen:
        assert s["enabled_in_steps"] == [False] * 4
        assert s["collections"] == ["after 2", "after 4"]
        assert s["after_manual"]
    assert _windows(out / "manual") == [([3, 3], None)]  # the window closed, with a profile
