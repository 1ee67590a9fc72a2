"""`dynmo simulate` shows the baselines that say where the value lies (issue 29):
the split tuned once at the start, the pipeline packed once at the start, and the
fluid bound, in text and --json."""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from dynmo_plugin.layout import Layout
from dynmo_plugin.sim.campaign import CampaignConfig, _initial_split, _packed_once_layout, _Run, run_campaign
from dynmo_plugin.scenarios import make_trajectory


def _simulate(*args):
    return subprocess.run([sys.executable, "-m", "dynmo_plugin.cli", "simulate", *args],
                          capture_output=True, text=True, timeout=120)


ARGS = ["--scenario", "freezing", "--layers", "32", "--dp", "2", "--pp", "8", "--iterations", "4000"]


def test_json_has_static_tuned_packed_once_and_fluid():
    r = _simulate(*ARGS, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    base = out["baselines"]
    assert {"static", "static_tuned", "packed_once", "no_dynamism", "fluid"} <= set(base)
    assert set(base) == set(out["speedup_over"])
    # the fluid bound: no layer-granular split on pp stages beats it
    for name in ("static", "static_tuned"):
        assert base["fluid"]["tokens_per_s"] >= base[name]["tokens_per_s"]
    assert base["packed_once"]["gpus_avg"] < 2 * 8 and base["packed_once"]["gpus_avg"] % 2 == 0
    assert base["static_tuned"]["gpus_avg"] == base["fluid"]["gpus_avg"] == 16


def test_text_prints_every_baseline_with_tokens_per_gpu_hour():
    r = _simulate(*ARGS, "--repack")
    assert r.returncode == 0, r.stderr
    for needle in ("over the split tuned once at the start (static_tuned)", "tok/GPU-hour",
                   "static_tuned (exact, at start)", "packed_once (repack at start)",
                   "fluid bound (1/pp each)", "DynMo (repacking)"):
        assert needle in r.stdout, needle


def test_packed_once_is_the_repack_decision_on_the_initial_model():
    """Freezing starts dense: the pipeline packed at the start keeps the initial
    iteration within max_slowdown (1.0) of Megatron's split, on fewer stages; the
    tuned split has all pp stages."""
    cfg = CampaignConfig(scenario=make_trajectory("freezing", num_layers=32), dp=2, pp=8,
                         iterations=4000, baselines=("static",))
    run = _Run(cfg)
    packed, tuned = _packed_once_layout(run), _initial_split(run, "exact")
    load = cfg.scenario.load(0)
    uniform = run.simulate(Layout.uniform(32, 8), 0, load).iteration_s
    assert packed.num_stages < 8 and tuned.num_stages == 8
    assert run.simulate(packed, 0, load).iteration_s <= uniform * (1 + 1e-9)
    assert run_campaign(cfg).baselines.keys() == {"static"}  # only what was asked


def test_start_balanced_dynmo_starts_on_the_tuned_split():
    """With every later plan refused (noise floor 99%), DynMo started balanced runs the
    tuned split throughout: its time is static_tuned's plus the overheads it paid (one
    profiled iteration and the migration at the start, then each rebalance point's)."""
    from dynmo_plugin.sim.planner import GateSettings

    cfg = CampaignConfig(scenario=make_trajectory("freezing", num_layers=32), dp=2, pp=8,
                         iterations=4000, baselines=("static", "static_tuned"), start_balanced=True,
                         gate=GateSettings(min_gain=0.99))
    r = run_campaign(cfg)
    assert not any(e.applied for e in r.events)
    assert r.events[0].layout_before == _initial_split(_Run(cfg), "exact").to_megatron()
    paid = sum(r.dynmo.overhead_s.values())
    assert r.dynmo.overhead_s["migration"] > 0
    assert r.dynmo.time_s - paid == pytest.approx(r.baselines["static_tuned"].time_s, rel=1e-12)
    plain = run_campaign(replace(cfg, start_balanced=False))
    assert plain.events[0].layout_before == Layout.uniform(32, 8).to_megatron()
