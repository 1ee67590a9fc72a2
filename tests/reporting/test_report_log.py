"""The run report's log (report.jsonl) and summary (report.json): what a finished and a
crashed run leave, and that `dynmo report` reads both."""
from __future__ import annotations

import json

import pytest

from dynmo_plugin.errors import UserError
from dynmo_plugin.report import LOG_NAME, RunReport, read_report, replay_log
from dynmo_plugin.reporting import load_report, render_report


def _report(tmp_path, **kw) -> RunReport:
    world = {"pp": 2, "tp": 1, "dp": 1, "world_size": 2,
             "history": [{"iteration": 0, "pp": 2, "tp": 1, "dp": 1, "world_size": 2}]}
    return RunReport(path=str(tmp_path / "report.json"), config={"model": {"num_layers": 4}},
                     world=world, initial_layout="Ett|ttL", **kw)


def _run(report: RunReport, iterations: int) -> dict:
    """A run with a rebalance at 3 whose measured time arrives at 5, and a repack at 6."""
    rebalance = {"iteration": 3, "kind": "rebalance", "applied": True, "layout_before": "Ett|ttL",
                 "layout_after": "Ettt|tL", "moves": [{"layer": 3, "src": 1, "dst": 0, "bytes": 64}],
                 "measured_iter_s_after": None}
    for it in range(1, iterations + 1):
        report.add_iteration(it, 10.0 - 0.1 * it, 0.2, dynmo_s=0.01)
        if it == 3:
            report.layout = "Ettt|tL"
            report.add_event(rebalance)
        if it == 5:
            rebalance["measured_iter_s_after"] = 0.15
            report.update_event(rebalance)
        if it == 6:
            report.world["history"].append({"iteration": 6, "pp": 1, "tp": 1, "dp": 1, "world_size": 1})
            report.layout = "EttttL"
            report.add_event({"iteration": 6, "kind": "rebalance", "repack": {"applied": True}})
    return rebalance


def test_finished_run_summary_is_complete_and_equals_the_log(tmp_path):
    report = _report(tmp_path)
    _run(report, 8)
    report.close()
    summary = json.loads((tmp_path / "report.json").read_text())
    assert summary.pop("complete") is True
    assert summary == report.to_dict()
    assert replay_log(tmp_path / LOG_NAME) == {**summary, "complete": False}
    assert read_report(tmp_path)["complete"] is True


def test_crashed_run_is_read_from_the_log(tmp_path):
    """No close(): the summary is the one written at the start; `dynmo report` and
    read_report replay the log, with the late measurement, layout and repack in it."""
    report = _report(tmp_path)
    _run(report, 8)
    stale = json.loads((tmp_path / "report.json").read_text())
    assert stale["complete"] is False and stale["iterations"] == []
    raw = read_report(tmp_path)
    assert raw == {**report.to_dict(), "complete": False}
    assert raw["events"][0]["measured_iter_s_after"] == 0.15
    assert raw["layout"] == "EttttL" and raw["gpus"] == [{"iteration": 0, "gpus": 2},
                                                         {"iteration": 6, "gpus": 1},
                                                         {"iteration": 8, "gpus": 1}]
    loaded = load_report(tmp_path)
    assert loaded.iterations == list(range(1, 9)) and loaded.layout == "EttttL"
    assert [e.kind for e in loaded.events] == ["rebalance", "repack"]
    assert loaded.events[0].measured_after == 0.15
    names = {p.name for p in render_report(tmp_path)}
    assert {"summary.md", "training.png", "gpus.png"} <= names


def test_a_line_cut_short_by_a_kill_is_dropped_a_corrupt_one_is_an_error(tmp_path):
    report = _report(tmp_path)
    _run(report, 4)
    log = tmp_path / LOG_NAME
    text = log.read_text()
    log.write_text(text + '{"kind": "iteration", "rec')
    assert load_report(tmp_path).iterations == [1, 2, 3, 4]
    lines = text.splitlines()
    lines[2] = "{not json"
    log.write_text("\n".join(lines) + "\n")
    with pytest.raises(UserError, match="line 3 is not JSON"):
        load_report(tmp_path)
    log.write_text('{"kind": "iteration", "record": {"iteration": 1}}\n')
    with pytest.raises(UserError, match="header"):
        load_report(tmp_path)


def test_a_new_run_replaces_the_previous_runs_files(tmp_path):
    first = _report(tmp_path)
    _run(first, 8)
    first.close()
    second = _report(tmp_path)
    second.add_iteration(1, 9.0, 0.3)  # ... and crashes
    assert load_report(tmp_path).iterations == [1]
    assert read_report(tmp_path)["events"] == []


def test_summary_rewrites_are_logarithmic_in_run_length(tmp_path, monkeypatch):
    """The writing cost per iteration stays flat: appends only, and the summary is
    rewritten after the log doubles (at least snapshot_every lines apart)."""
    report = _report(tmp_path, snapshot_every=16)
    writes = []
    real = RunReport.write

    def counting(self, complete=False):
        writes.append(self._lines)
        real(self, complete)
    monkeypatch.setattr(RunReport, "write", counting)
    for it in range(1, 2001):
        report.add_iteration(it, 1.0, 0.1)
    assert writes == [16, 32, 64, 128, 256, 512, 1024, 2048][:len(writes)] and len(writes) == 7
    assert json.loads((tmp_path / "report.json").read_text())["iterations"][-1]["iteration"] == 1023
    assert len(read_report(tmp_path)["iterations"]) == 2000


def test_other_ranks_write_nothing(tmp_path):
    report = _report(tmp_path, enabled=False)
    _run(report, 4)
    report.close()
    assert list(tmp_path.iterdir()) == []
    assert len(report.to_dict()["iterations"]) == 4
