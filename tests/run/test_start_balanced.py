"""Start balanced (issue 29): with --dynmo-start-balanced-at N the run profiles iteration N
and applies the exact solver's layout for that profile; training is bit-exact with a run
that forces the same layout at the same point; `dynmo plan --from-run` prints that
layout for a Megatron-LM user. Real torchrun, gloo, PP=2."""
import json
import subprocess
import sys

import pytest

from dynmo_plugin.balancing import solve
from dynmo_plugin.balancing.profile_problem import problem_from_profile
from dynmo_plugin.config import DynmoConfig
from dynmo_plugin.layout import Layout
from dynmo_plugin.profiling.records import PipelineProfile
from launch import ROOT, assert_same_training, worker

pytestmark = pytest.mark.multiproc

MODEL = ["--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
         "--train-iters", "5", "--lr", "3e-3", "--seed", "7", "--pipeline-model-parallel-size", "2",
         "--dynmo", "--test-dump-params", "--test-heavy-layer", "2", "--test-heavy-factor", "16"]
# Layer 2 runs itself 16 times (forward and backward): stage 0 of Etttt|ttttL then carries
# ~19 layer-units against ~4 plus the head on stage 1. With a factor of 6 the head of this
# tiny model (per-op overhead, measured in thread CPU time) could weigh as much as the
# difference under load, and the start then rightly found the split "already balanced".
START = ["--dynmo-start-balanced-at", "2", "--dynmo-profile-window", "1",
         "--dynmo-min-gain", "0", "--dynmo-gate-margin", "0"]


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    out = tmp_path_factory.mktemp("start")
    return out, worker(2, MODEL + START, out)


def _start_event(report):
    events = [e for e in report["events"] if e["kind"] == "rebalance"]
    assert [e["trigger"] for e in events] == ["start"]
    return events[0]


def test_the_start_layout_is_the_exact_solvers_for_the_measured_profile(started):
    _, report = started
    event = _start_event(report)
    assert event["window"] == [2, 2] and event["layout_before"] == "Etttt|ttttL"
    assert event["applied"], event["reason"]
    problem = problem_from_profile(PipelineProfile.from_dict(event["profile"]),
                                   Layout.parse(event["layout_before"]), DynmoConfig(), 4)
    exact = solve(problem, "exact").layout
    assert event["layout_after"] == exact.to_megatron() == report["layout"]
    assert Layout.parse(event["layout_after"]).counts[0] < 4  # the heavy layer 2 sheds layers


def test_training_is_bit_exact_with_a_run_forced_to_that_layout(started, tmp_path):
    out, report = started
    layout = _start_event(report)["layout_after"]
    forced = worker(2, MODEL + ["--dynmo-forced-layouts", f"3:{layout}"], tmp_path)
    assert [e["trigger"] for e in forced["events"] if e["kind"] == "rebalance"] == ["forced"]
    assert forced["layout"] == layout
    assert_same_training(out, report, tmp_path, forced, ranks=[0, 1])


def test_plan_from_run_prints_the_layout_the_run_chose(started):
    out, report = started
    layout = _start_event(report)["layout_after"]
    r = subprocess.run([sys.executable, "-m", "dynmo_plugin.cli", "plan", "--from-run", str(out)],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout '{layout}'" in r.stdout
    assert f"the live run applied {layout} at iteration 2" in r.stdout
    r = subprocess.run([sys.executable, "-m", "dynmo_plugin.cli", "plan", "--from-run", str(out), "--json"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    rec = json.loads(r.stdout)
    assert (rec["pipeline_model_parallel_layout"], rec["pipeline_model_parallel_size"]) == (layout, 2)


def test_plan_from_run_without_a_profile_is_one_line(tmp_path):
    (tmp_path / "report.json").write_text(json.dumps({"config": {}, "world": {}, "events": [],
                                                      "iterations": []}))
    r = subprocess.run([sys.executable, "-m", "dynmo_plugin.cli", "plan", "--from-run", str(tmp_path)],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "--dynmo-start-balanced-at" in r.stderr


REPACK_START = ["--dynmo-repack", "--dynmo-repack-min-stages", "2", "--dynmo-repack-max-slowdown", "4",
                "--dynmo-repack-rebuild-s", "0"]


def test_with_repacking_the_start_also_chooses_the_pipeline_size(tmp_path):
    """PP=4 with repacking on: the start decides 4 -> 2 stages live (within max_slowdown 4),
    the released ranks leave, training matches a run forced to repack to that layout at
    the same point, and `dynmo plan --from-run` recommends pp 2 with that layout."""
    pp4 = [f if f != "2" or MODEL[i - 1] != "--pipeline-model-parallel-size" else "4"
           for i, f in enumerate(MODEL)]
    started, forced = tmp_path / "started", tmp_path / "forced"
    report = worker(4, pp4 + START + REPACK_START, started)
    event = _start_event(report)
    assert event["applied"] and event["repack"]["applied"], event["reason"]
    assert (event["repack"]["stages_before"], event["repack"]["stages_after"]) == (4, 2)
    layout = event["layout_after"]
    other = worker(4, pp4 + ["--dynmo-repack", "--dynmo-forced-layouts", f"3:{layout}"], forced)
    assert other["layout"] == report["layout"] == layout
    assert_same_training(started, report, forced, other, ranks=[0, 1])
    r = subprocess.run([sys.executable, "-m", "dynmo_plugin.cli", "plan", "--from-run", str(started)],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout '{layout}'" in r.stdout
