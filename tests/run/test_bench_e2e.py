"""scripts/bench_e2e.py: its ideal-speedup arithmetic, and its --json contract on a real run."""
import json
import subprocess
import sys

import pytest

from launch import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import bench_e2e  # noqa: E402


def _profile(costs, extras):
    return {"layers": [{"layer": i + 1, "fwd_s": c / 3, "bwd_s": 2 * c / 3} for i, c in enumerate(costs)],
            "stages": [{"stage": s, "extra_s": e, "num_microbatches": 4} for s, e in enumerate(extras)]}


def test_ideal_speedup_weights_each_profile_by_the_iterations_it_covers():
    # Profile at 5: uniform split [1,1 | 1,1] + head 2 on stage 1 -> loads [2, 4];
    # exact [1,1,1 | 1] -> loads [3, 3]. 1F1B, 4 micro-batches: sum + 3 x max = 18 vs 15.
    # Profile at 9: costs already even with no extras: uniform is optimal (10 vs 10).
    report = {"iterations": [{"iteration": i} for i in range(1, 13)],
              "events": [{"iteration": 5, "profile": _profile([1, 1, 1, 1], [0, 2])},
                         {"iteration": 9, "profile": _profile([1, 1, 1, 1], [0, 0])}]}
    # iterations 5..8 (4) under the first profile, 9..12 (4) under the second; nothing
    # is known before the first profile, so those iterations do not count
    expected = (4 * 18 + 4 * 10) / (4 * 15 + 4 * 10)
    assert bench_e2e.ideal_speedup(report) == pytest.approx(expected)
    assert bench_e2e.ideal_speedup({"iterations": [], "events": []}) is None
    # from iteration 9 on only the second (balanced) profile counts
    assert bench_e2e.ideal_speedup(report, start=9) == pytest.approx(1.0)
    assert bench_e2e.phase_start(report) == 2
    assert bench_e2e.phase_start({"events": [{"kind": "dynamism", "iteration": 6}]}) == 7


def test_robust_throughput_ignores_a_load_burst_but_counts_every_plugin_second():
    def report(times, plugin):
        return {"config": {"model": {"global_batch_size": 4, "seq_length": 10}},
                "iterations": [{"iteration": i + 1, "time_s": t + p, "dynmo_s": p}
                               for i, (t, p) in enumerate(zip(times, plugin))]}
    quiet = bench_e2e._tokens_per_s(report([1.0] * 6, [0.0] * 6), 1)
    burst = bench_e2e._tokens_per_s(report([1.0, 1.0, 3.0, 1.0, 1.0, 1.0], [0.0] * 6), 1)
    migrated = bench_e2e._tokens_per_s(report([1.0] * 6, [0, 0, 2.0, 0, 0, 0]), 1)
    assert quiet["robust"] == burst["robust"] == 40.0 and burst["sum"] == 30.0
    assert migrated["robust"] == migrated["sum"] == 30.0 and migrated["overhead"] == 0.25


@pytest.mark.multiproc
def test_json_output_is_one_document_with_every_balancer(tmp_path):
    tiny = ["--num-layers", "4", "--hidden-size", "32", "--seq-length", "16", "--vocab-size", "256",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "5",
            "--dynmo-rebalance-interval", "2"]
    proc = subprocess.run([sys.executable, "scripts/bench_e2e.py", "--config", "configs/demo.yaml",
                           "--json", "--", *tiny], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert [r["balancer"] for r in result["runs"]] == list(bench_e2e.BALANCERS)
    for r in result["runs"]:
        assert set(r) >= {"balancer", "tokens_per_s", "speedup", "speedup_sum", "speedup_whole_run",
                          "ideal_speedup",
                          "overhead_share",
                          "losses_identical", "rebalances", "layouts"}
        assert r["tokens_per_s"] > 0 and r["losses_identical"] is True
    assert result["runs"][0]["speedup"] == 1.0
