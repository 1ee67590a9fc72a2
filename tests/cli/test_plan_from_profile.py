"""`dynmo plan --from-profile FILE`: the Megatron-LM layout from a recorded profile alone.

The profile is what the live controller records (`PipelineProfile.to_dict()`, as a
report's events hold it); the recommendation must be the layout the live controller's
start decision (`DynMo._decide`, trigger "start", exact solver, gate off) picks for it.
"""
from __future__ import annotations

import functools
import json
import subprocess
import sys
import types
from pathlib import Path

from dynmo_plugin.config import DynmoConfig, RebalanceConfig
from dynmo_plugin.controller import DynMo
from dynmo_plugin.layout import Layout
from dynmo_plugin.profiling.records import LayerProfile, PipelineProfile, StageProfile

ROOT = Path(__file__).resolve().parents[2]
M = 8


def _profile() -> PipelineProfile:
    """configs/demo.yaml's shape: 8 layers on 2 stages (4|4), the last stage also runs a
    heavy output layer (8k vocabulary)."""
    layers = [LayerProfile(layer=n, stage=(n - 1) // 4, fwd_s=0.01, bwd_s=0.02, param_bytes=10**5,
                           grad_bytes=10**5, optim_bytes=2 * 10**5, act_bytes=10**4)
              for n in range(1, 9)]
    stages = [StageProfile(stage=s, extra_s=[0.005, 0.06][s], wait_s=0.0, peak_bytes=0,
                           num_microbatches=M) for s in range(2)]
    return PipelineProfile(layers, stages)


def _live_start_layout() -> Layout:
    config = DynmoConfig(enabled=True, rebalance=RebalanceConfig(balancer="uniform", min_gain=0.0))
    me = types.SimpleNamespace(trainer=types.SimpleNamespace(layout=Layout((4, 4)), num_microbatches=M,
                                                             peak_microbatches=M, args=types.SimpleNamespace()),
                               config=config, bandwidth=1e9, _repacker=None)
    me._repack_criteria = functools.partial(DynMo._repack_criteria, me)
    decision = DynMo._decide(me, _profile(), "start")
    assert decision.apply, decision.reason
    return decision.plan.layout


def _plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dynmo_plugin.cli", "plan", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_from_profile_recommends_the_live_start_layout(tmp_path):
    live = _live_start_layout()
    assert live != Layout((4, 4))
    bare = tmp_path / "profile.json"
    bare.write_text(json.dumps(_profile().to_dict()))
    event = tmp_path / "event.json"  # a report event, as `--from-run` reads them
    event.write_text(json.dumps({"kind": "rebalance", "trigger": "start", "profile": _profile().to_dict()}))
    for path in (bare, event):
        r = _plan("--from-profile", str(path), "--json")
        assert r.returncode == 0, r.stderr
        rec = json.loads(r.stdout)
        assert rec["pipeline_model_parallel_layout"] == live.to_megatron()
        assert (rec["pipeline_model_parallel_size"], rec["layout_profiled"]) == (2, "Etttt|ttttL")
        assert rec["num_microbatches"] == M
    r = _plan("--from-profile", str(bare))
    assert f"--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout '{live.to_megatron()}'" in r.stdout


def test_from_profile_bad_input_is_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"layers": []}))
    cases = [("--from-profile", str(tmp_path / "missing.json")), ("--from-profile", str(bad)),
             ("--from-profile", str(bad), "--from-run", str(tmp_path))]
    for args in cases:
        r = _plan(*args)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)
    listed = tmp_path / "list.json"  # a list of costs: it said "AttributeError: 'list' object ..."
    listed.write_text(json.dumps([1.0, 2.0]))
    r = _plan("--from-profile", str(listed))
    assert r.returncode == 2 and r.stderr.strip().endswith(
        "holds a JSON list, not a profile; give a profile ({\"layers\": [...], \"stages\": [...]}), a profile "
        "event or a run's report.json"), r.stderr


def test_from_run_checks_the_cap_at_the_micro_batches_the_run_peaks_at(tmp_path):
    """A start event profiled at 1 micro-batch of an eventual 4 (a ramping batch), with a
    cap: `--from-run` keeps 3|1, as the live controller did, because at 4 micro-batches
    2|2 holds 3050 bytes on the last stage (over the cap of 3000) though 2950 at 1
    (tests/megatron/test_memory_calibration.py has the same profile live)."""
    from dynmo_plugin.cli._from_run import recommend
    layers = [LayerProfile(layer=n, stage=0 if n < 4 else 1, fwd_s=1.0 if n < 4 else 0.3,
                           bwd_s=2.0 if n < 4 else 0.7, param_bytes=100, grad_bytes=100,
                           optim_bytes=200, act_bytes=50) for n in range(1, 5)]
    stages = [StageProfile(stage=s, extra_s=0.0, wait_s=0.0, peak_bytes=2500, extra_bytes=1000,
                           peak_source="accounted", num_microbatches=1) for s in range(2)]
    event = {"kind": "rebalance", "trigger": "start", "iteration": 2, "layout_before": "Ettt|tL",
             "profile": PipelineProfile(layers, stages).to_dict(), "plan": {"num_microbatches": 1}}
    report = {"config": {"model": {"global_batch_size": 4, "micro_batch_size": 1},
                         "dynmo": {"rebalance": {"memory_cap_gb": 3000e-9, "allow_empty_stages": False,
                                                 "bandwidth_gbps": 1.0}, "repack": {"enabled": False}}},
              "world": {"dp": 1}, "events": [event]}
    layouts = []
    for peak in (4, 1):
        event["memory"] = {"microbatches": 1, "peak_microbatches": peak}
        (tmp_path / "report.json").write_text(json.dumps(report))
        layouts.append(recommend(str(tmp_path))["pipeline_model_parallel_layout"])
    assert layouts == [Layout.parse("Ettt|tL", None, 4).to_megatron(), Layout.parse("Ett|ttL", None, 4).to_megatron()]
