"""`dynmo report`: PNGs and Markdown from hand-built report.json files."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dynmo_plugin.cli import main
from dynmo_plugin.errors import UserError
from dynmo_plugin.reporting import load_report, render_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _iterations(n):
    return [{"iteration": i, "loss": 10.0 - 0.1 * i, "time_s": 0.2 if i < 5 else 0.15}
            for i in range(1, n + 1)]


FULL = {
    "config": {"model": {"num_layers": 8}}, "world": {"pp": 2, "tp": 1, "dp": 1},
    "initial_layout": "Etttt|ttttL", "layout": "Ettttt|tttL",
    "iterations": _iterations(10),
    "events": [
        {"iteration": 3, "kind": "profile", "trigger": "every 3"},
        {"iteration": 5, "kind": "rebalance", "trigger": "pruning", "applied": True,
         "layout_before": "Etttt|ttttL", "layout_after": "Ettttt|tttL",
         "stage_loads_before": [0.05, 0.09], "stage_loads_after": [0.07, 0.071],
         "imbalance_before": 0.57, "imbalance_after": 0.01,
         "moves": [{"layer": 5, "src": 1, "dst": 0, "bytes": 1024}],
         "predicted_iter_s_before": 0.2, "predicted_iter_s_after": 0.15,
         "measured_iter_s_before": 0.21, "measured_iter_s_after": 0.16,
         "overhead_s": {"profiling": 0.01, "decision": 0.001, "migration": 0.02}},
        {"iteration": 8, "kind": "repack", "stage_loads_before": [0.07, 0.02]},
    ],
    "gpus": [{"iteration": 1, "gpus": 2}, {"iteration": 8, "gpus": 1}],
}


def _write(tmp_path, data):
    (tmp_path / "report.json").write_text(json.dumps(data))
    return tmp_path


def test_full_report_gives_all_plots_and_summary(tmp_path):
    written = render_report(_write(tmp_path, FULL))
    names = sorted(p.name for p in written)
    assert names == ["gpus.png", "stage_loads.png", "summary.md", "training.png"]
    for p in written:
        if p.suffix == ".png":
            assert p.read_bytes()[:8] == PNG_MAGIC and p.stat().st_size > 1000
    md = (tmp_path / "summary.md").read_text()
    assert "`Etttt|ttttL` → `Ettttt|tttL`" in md
    assert "| 5 | rebalance | pruning | yes |" in md
    assert "GPUs in use: 2 → 1" in md and "![training](training.png)" in md


def test_report_without_events_plots_loss_and_time_only(tmp_path):
    data = {"world": {"pp": 2}, "iterations": _iterations(4)}
    names = sorted(p.name for p in render_report(_write(tmp_path, data)))
    assert names == ["summary.md", "training.png"]
    assert "events: 0" in (tmp_path / "summary.md").read_text()


def test_missing_and_odd_fields_are_tolerated(tmp_path):
    data = {"iterations": [{"iteration": 1}, {"iteration": 2, "loss": "nan", "time_s": None}, "junk"],
            "events": [{"kind": "rebalance", "stage_loads_after": [1, "x"]}, {}, 3]}
    report = load_report(_write(tmp_path, data))
    assert report.iterations == [1, 2] and report.losses == [None, None]
    assert [e.kind for e in report.events] == ["rebalance", "event"]
    assert report.events[0].loads_after is None
    assert {p.name for p in render_report(tmp_path)} == {"summary.md", "training.png"}


def test_bad_run_dirs_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="no run report"):
        load_report(tmp_path)
    (tmp_path / "report.json").write_text("[1, 2]")
    with pytest.raises(UserError, match="JSON object"):
        load_report(tmp_path)


def test_cli_writes_into_out_dir_and_exits_2_on_missing_report(tmp_path):
    run_dir = _write(tmp_path / "run", FULL) if (tmp_path / "run").mkdir() is None else None
    out = tmp_path / "out"
    ok = subprocess.run([sys.executable, "-m", "dynmo_plugin.cli", "report", str(run_dir),
                         "--out", str(out)], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert (out / "summary.md").exists() and (out / "stage_loads.png").exists()
    bad = subprocess.run([sys.executable, "-m", "dynmo_plugin.cli", "report", str(tmp_path / "nope")],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "no run report" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


def _cli_report(run_dir, capsys):
    """`dynmo report RUN_DIR` in process: (exit code, stdout, stderr)."""
    code = main(["report", str(run_dir)])
    out, err = capsys.readouterr()
    return code, out, err


def test_non_utf8_report_exits_2(tmp_path, capsys):
    (tmp_path / "report.json").write_bytes(b"\xff\xfe{}")
    code, _, err = _cli_report(tmp_path, capsys)
    assert code == 2 and "not UTF-8" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("data, message", [
    ({}, "holds no iterations ('iterations' is missing)"),
    ({"iterations": "notalist"}, "'iterations' must be a list of records, got a string"),
    ({"iterations": []}, "holds no iterations"),
    ({"iterations": [{"loss": 1.0}, "junk"]}, "holds no iterations"),
    ({"iterations": _iterations(3), "events": {"kind": "rebalance"}}, "'events' must be a list"),
])
def test_report_without_iterations_exits_2(tmp_path, capsys, data, message):
    code, out, err = _cli_report(_write(tmp_path, data), capsys)
    assert code == 2 and message in err and len(err.splitlines()) == 1, err
    assert out == "" and not (tmp_path / "summary.md").exists()


@pytest.mark.parametrize("patch, message", [
    ({"time_s": -0.2}, "iteration 3 (iterations[2]) has time_s = -0.2"),
    ({"time_s": float("nan")}, "iteration 3 (iterations[2]) has time_s = NaN"),
    ({"time_s": float("inf")}, "iteration 3 (iterations[2]) has time_s = Infinity"),
    ({"time_s": True}, "iteration 3 (iterations[2]) has time_s = true"),
    ({"iteration": -3}, "iterations[2] has iteration = -3"),
])
def test_corrupt_iteration_numbers_exit_2_naming_field_and_iteration(tmp_path, capsys, patch, message):
    data = {"iterations": _iterations(5)}
    data["iterations"][2].update(patch)
    code, _, err = _cli_report(_write(tmp_path, data), capsys)
    assert code == 2 and message in err and "corrupt" in err and len(err.splitlines()) == 1, err


def test_negative_event_times_exit_2(tmp_path, capsys):
    data = {"iterations": _iterations(5), "events": [
        {"iteration": 2, "kind": "rebalance", "stage_loads_before": [0.1, -0.3]}]}
    code, _, err = _cli_report(_write(tmp_path, data), capsys)
    assert code == 2 and "events[0] (iteration 2) has stage_loads_before = -0.3" in err, err


def test_nan_loss_of_a_diverged_run_is_left_out_not_an_error(tmp_path, caplog):
    data = {"iterations": _iterations(4)}
    data["iterations"][3]["loss"] = float("nan")
    report = load_report(_write(tmp_path, data))
    assert report.losses[3] is None and report.times[3] == 0.2
    assert "left out 1 loss value" in caplog.text


def test_dollar_signs_in_event_kinds_are_not_mathtext(tmp_path):
    data = {"iterations": _iterations(4), "events": [
        {"iteration": 2, "kind": "$\\frac$", "stage_loads_before": [1, 2]}]}
    names = sorted(p.name for p in render_report(_write(tmp_path, data)))
    assert names == ["stage_loads.png", "summary.md", "training.png"]


def test_dynamism_events_are_marked_with_their_scenario(tmp_path):
    data = {"world": {"pp": 2}, "initial_layout": "Etttt|ttttL", "iterations": _iterations(12),
            "events": [{"kind": "dynamism", "scenario": "gradual_pruning", "iteration": 4,
                        "detail": {"target": 0.5}},
                       {"kind": "rebalance", "iteration": 5, "trigger": "event:gradual_pruning@4",
                        "applied": True, "layout_before": "Etttt|ttttL", "layout_after": "Ettttt|tttL"}]}
    report = load_report(_write(tmp_path, data))
    assert [e.label for e in report.events] == ["dynamism: gradual_pruning", "rebalance"]
    render_report(tmp_path)
    summary = (tmp_path / "summary.md").read_text()
    assert "dynamism: gradual_pruning" in summary and "event:gradual_pruning@4" in summary
