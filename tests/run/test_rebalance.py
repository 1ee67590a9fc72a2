"""The controller finds a balanced layout from a deliberately unbalanced start."""
import pytest

from dynmo_plugin.layout import Layout
from launch import train

pytestmark = pytest.mark.multiproc

# The gate's noise floor follows the dispersion the profile measures: ~10% idle, up to
# 25.6% at load ~9, where it refused this start's 24.5% predicted gain (1 of 4 loaded
# runs, 2026-11-28). The floor has its own tests (tests/balancing/test_gate_dispersion.py);
# here the decision is judged on the prediction alone.
FLOOR_OFF = ["--dynmo-min-gain", "0"]


def test_interval_trigger_balances_an_unbalanced_start(tmp_path):
    report = train(2, ["--num-layers", "8", "--hidden-size", "64", "--seq-length", "32",
                       "--micro-batch-size", "2", "--global-batch-size", "16", "--train-iters", "14",
                       "--pipeline-model-parallel-size", "2",
                       "--pipeline-model-parallel-layout", "Ettttttt|tL",
                       "--dynmo", "--dynmo-balancer", "exact", "--dynmo-rebalance-interval", "4",
                       "--dynmo-profile-window", "2", *FLOOR_OFF],
                   tmp_path)
    # Windows: iterations 4-5 (rebalance), 8-9, 12-13 (re-profile the new layout).
    first, second, third = [e for e in report["events"] if e["kind"] == "rebalance"]
    assert first["trigger"] == "rebalance_interval" and first["applied"]
    after = Layout.parse(first["layout_after"])
    assert all(3 <= c <= 5 for c in after.counts), after
    assert first["imbalance_after"] < first["imbalance_before"]
    assert first["plan"]["method"] == "exact"
    assert all(k in first["overhead_s"] for k in ("profiling", "decision", "migration"))
    # Later triggers re-profile; measurement noise on this shared machine may shift a
    # near-optimal split by a layer, but never back towards the unbalanced start.
    assert all(3 <= c <= 5 for c in Layout.parse(report["layout"]).counts)
    # The bottleneck stage's work falls: its share of the 8 equal layers drops from 7 to
    # at most 5 (<= 0.72x), and the next window profiles the moved layers where they now
    # run. (That its measured time falls is a timing claim: scripts/bench_start_balanced.py
    # with `-- --pipeline-model-parallel-layout "Ettttttt|tL"`.)
    assert max(after.counts) <= 5 < max(Layout.parse(first["layout_before"]).counts) == 7
    assert second["layout_before"] == first["layout_after"]
    assert [sum(x["stage"] == s for x in second["profile"]["layers"]) for s in (0, 1)] == list(after.counts)
    assert first["measured_iter_s_before"] > 0 and first["measured_iter_s_after"] > 0
