"""`dynmo report` shows the profiled MTP block (report.json's profile events carry it)."""
import json

from dynmo_plugin.reporting import render_report

MTP = {"layer": 1, "stage": 2, "fwd_s": 0.002, "bwd_s": 0.003, "param_bytes": 400_000,
       "grad_bytes": 400_000, "optim_bytes": 800_000, "act_bytes": 250_000}


def test_the_summary_names_the_mtp_block_where_a_profile_holds_it(tmp_path):
    report = {"config": {}, "world": {"pp": 4}, "initial_layout": "Ett|tt|ttm|L", "layout": "Ett|tt|ttm|L",
              "iterations": [{"iteration": i, "loss": 9.0, "time_s": 0.1} for i in (1, 2, 3)],
              "events": [{"iteration": 3, "kind": "profile", "trigger": "every 3",
                          "profile": {"layers": [], "stages": [], "mtp": MTP}},
                         {"iteration": 2, "kind": "profile", "profile": {"layers": [], "stages": []}}]}
    (tmp_path / "report.json").write_text(json.dumps(report))
    render_report(tmp_path)
    md = (tmp_path / "summary.md").read_text()
    assert "## MTP block (profiled as one unit)" in md
    assert ("- iteration 3: 1 layer(s) on stage 2: 5.000 ms fwd+bwd per micro-batch, 1.60 MB "
            "state, 0.25 MB activations per micro-batch") in md
    assert "- iteration 2:" not in md  # the profile without MTP adds no line
