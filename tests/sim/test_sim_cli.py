"""`dynmo simulate` end to end, through the dispatcher, in a subprocess."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _simulate(*args):
    return subprocess.run([sys.executable, "-m", "dynmo_plugin.cli", "simulate", *args],
                          capture_output=True, text=True, timeout=120)


SMALL = ["--layers", "16", "--dp", "2", "--pp", "4", "--iterations", "3000"]


def test_json_has_static_dynmo_speedup_and_gpus_when_repacking():
    r = _simulate("--scenario", "freezing", *SMALL, "--balancer", "exact", "--repack", "--json",
                  "--no-output-layer")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    for side in ("static", "dynmo"):
        assert out[side]["tokens_per_s"] > 0 and 0 <= out[side]["idleness"] < 1
    assert out["speedup"] > 0 and 0 < out["gpus_avg"] <= 8


def test_text_output_names_the_figures():
    r = _simulate("--scenario", "moe", *SMALL, "--balancer", "uniform")
    assert r.returncode == 0, r.stderr
    for needle in ("tokens/s", "idleness", "speedup", "balancing overhead assumed",
                   "over the dense model", "live plan -> gate path", "cost model: a100-flops"):
        assert needle in r.stdout
    assert "GPUs used" not in r.stdout


def test_h100_profile_and_gate_flags_reach_the_campaign():
    r = _simulate("--scenario", "pruning", *SMALL, "--hardware", "h100", "--min-gain", "0.9",
                  "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["cost_model"]["name"] == "h100" and "docs/simulator.md" in out["cost_model"]["source"]
    assert out["cost_model"]["priced_by"]["pruning_unstructured"] == "curve"
    assert not any(e["applied"] for e in out["events"])  # a 90% noise floor refuses every plan
    assert {"static", "no_dynamism"} <= set(out["speedup_over"])


@pytest.mark.parametrize("args,needle", [
    (["--scenario", "nope", *SMALL], "unknown scenario"),
    (["--scenario", "moe", "--layers", "8", "--dp", "2", "--pp", "16"], "larger than the number of layers"),
    (["--scenario", "moe", *SMALL, "--balancer", "bogus"], "unknown balancer"),
    (["--scenario", "moe", *SMALL, "--rebalance-every", "0"], "--rebalance-every"),
    (["--scenario", "moe", "--layers", "8", "--dp", "0", "--pp", "2"], "dp"),
    (["--scenario", "moe", *SMALL, "--seed", "-1"], "--seed must be an integer >= 0"),
    (["--scenario", "moe", *SMALL, "--noise", "nan"], "--noise must be"),
    (["--scenario", "moe", *SMALL, "--noise", "inf"], "--noise must be"),
    (["--scenario", "moe", *SMALL, "--noise", "-0.1"], "--noise must be"),
    (["--scenario", "moe", *SMALL, "--microbatches", "0"], "--microbatches"),
    (["--scenario", "moe", *SMALL, "--iterations", "0"], "--iterations"),
    (["--scenario", "moe", "--layers", "0", "--dp", "1", "--pp", "1"], "--layers"),
    (["--scenario", "moe", "--layers", "8", "--dp", "1" + "0" * 310, "--pp", "2"], "--dp"),
    (["--scenario", "moe", *SMALL, "--hardware", "tpu"], "unknown hardware profile 'tpu': give one of "
     "a100-flops, h100, h100-gpu, h200-gpu or"),
    (["--scenario", "moe", *SMALL, "--min-gain", "1.5"], "--min-gain"),
    (["--scenario", "moe", *SMALL, "--event-gap", "0"], "--event-gap"),
    (["--scenario", "moe", *SMALL, "--repack-objective", "fast"], "--repack-objective"),
    (["--scenario", "pruning", *SMALL, "--pruning-granularity", "2:4"], "--pruning-granularity"),
])
def test_bad_input_exits_2_with_one_line(args, needle):
    r = _simulate(*args)
    assert r.returncode == 2
    assert needle in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_costs_from_a_run_directory(tmp_path):
    """A report.json with per-layer profiles prices the layers; the model takes its shape."""
    layers = [{"layer": i + 1, "stage": i // 2, "fwd_s": 0.01, "bwd_s": 0.02, "param_bytes": 4,
               "grad_bytes": 4, "optim_bytes": 8, "act_bytes": 0} for i in range(4)]
    stages = [{"stage": s, "extra_s": 0.01 * (s + 1), "wait_s": 0.0, "peak_bytes": 0} for s in range(2)]
    report = {"config": {"model": {"hidden_size": 256, "num_attention_heads": 4, "seq_length": 128,
                                   "micro_batch_size": 4, "vocab_size": 4096}},
              "events": [{"kind": "profile", "iteration": 3, "window": [2, 3],
                          "profile": {"layers": layers, "stages": stages}}]}
    (tmp_path / "report.json").write_text(json.dumps(report))
    r = _simulate("--scenario", "freezing", *SMALL, "--costs-from", str(tmp_path), "--json")
    assert r.returncode == 0, r.stderr
    model = json.loads(r.stdout)["cost_model"]
    assert model["name"] == f"run:{tmp_path.name}" and model["profile"]["layer_s"] == 0.03
    bad = _simulate("--scenario", "moe", *SMALL, "--costs-from", str(tmp_path / "nope"))
    assert bad.returncode == 2 and "--output directory" in bad.stderr


def test_parameters_balancer_balances_counted_parameters():
    """Freezing leaves frozen layers without counted parameters: 'parameters' moves them."""
    r = _simulate("--scenario", "freezing", *SMALL, "--iterations", "9000", "--balancer",
                  "parameters", "--json", "--min-gain", "0")
    assert r.returncode == 0, r.stderr
    assert any(e["applied"] for e in json.loads(r.stdout)["events"])

