"""`dynmo report` tells the truth (issue 28): tables that hold layouts, refused
rebalances unlike applied ones, repacks with steady-state times, partial runs named."""
from __future__ import annotations

import json
import logging
import re

import markdown

from dynmo_plugin.reporting import load_report, render_report
from dynmo_plugin.reporting.plots import _load_events, event_style


def _iterations(n, times=None):
    return [{"iteration": i, "loss": 5.0 - 0.1 * i, "time_s": (times or {}).get(i, 0.25)}
            for i in range(1, n + 1)]


def _rebalance(it, applied):
    return {"iteration": it, "kind": "rebalance", "trigger": "interval", "applied": applied,
            "layout_before": "Ett|ttL", "layout_after": "Ettt|tL" if applied else "Ett|ttL",
            "stage_loads_before": [0.1, 0.2], "stage_loads_after": [0.15, 0.15]}


REPACK = {"iteration": 6, "kind": "rebalance", "trigger": "forced", "applied": True,
          "layout_before": "Et|t|t|tL", "layout_after": "Ett|ttL",
          "repack": {"applied": True, "stages_before": 4, "stages_after": 2}}


def _write(tmp_path, **doc):
    doc = {"config": {"model": {"train_iters": 12}}, "world": {"pp": 2}, "initial_layout": "Ett|ttL",
           "layout": "Ett|ttL", "events": [], "gpus": [], "complete": True, **doc}
    (tmp_path / "report.json").write_text(json.dumps(doc))
    return tmp_path


def _gfm_cells(row: str) -> list[str]:
    """Cells of a GitHub-flavoured table row: split at every `|` not escaped by a
    backslash, code spans included (GFM splits rows before it parses inlines)."""
    return re.split(r"(?<!\\)\|", row.strip().strip("|"))


def test_table_rows_keep_their_columns_with_layouts_holding_pipes(tmp_path):
    render_report(_write(tmp_path, iterations=_iterations(12),
                         events=[_rebalance(4, True), _rebalance(8, False), REPACK]))
    md = (tmp_path / "summary.md").read_text()
    rows = [x for x in md.splitlines() if x.startswith("|")]
    header = len(_gfm_cells(rows[0]))
    assert header == 9 and len(rows) == 5
    assert all(len(_gfm_cells(r)) == header for r in rows), rows
    html = markdown.markdown(md, extensions=["tables"])
    assert all(r.count("<td>") == header for r in html.split("<tr>")[2:])


def test_refused_rebalances_are_drawn_unlike_applied_ones(tmp_path):
    report = load_report(_write(tmp_path, iterations=_iterations(12),
                                events=[_rebalance(4, True), _rebalance(8, False)]))
    applied, refused = (event_style(e) for e in report.events)
    assert applied[1:3] != refused[1:3] and applied[0] != refused[0]
    assert "not applied" in refused[0]


def test_repack_is_drawn_with_steady_state_times(tmp_path):
    """The repack iteration (6) and the first one after it (7) are slow; the steady
    times around them are 0.25 s and 0.125 s."""
    times = {i: 0.25 for i in range(1, 6)} | {6: 2.0, 7: 0.6} | {i: 0.125 for i in range(8, 13)}
    render_report(_write(tmp_path, iterations=_iterations(12, times), events=[REPACK],
                         gpus=[{"iteration": 0, "gpus": 4}, {"iteration": 6, "gpus": 2}]))
    report = load_report(tmp_path)
    assert [e.kind for e in _load_events(report)] == ["repack"]
    assert report.steady_times(6) == (0.25, 0.125)
    md = (tmp_path / "summary.md").read_text()
    row = next(x for x in md.splitlines() if x.startswith("| 6 |"))
    assert "0.2500 s → 0.1250 s (steady)" in row and "4 → 2 stages" in row and "– → –" not in row
    assert (tmp_path / "gpus.png").exists() and (tmp_path / "stage_loads.png").exists()


def test_gpus_plot_only_when_a_repack_changed_the_count(tmp_path):
    written = render_report(_write(tmp_path, iterations=_iterations(12),
                                   gpus=[{"iteration": 0, "gpus": 2}, {"iteration": 12, "gpus": 2}]))
    assert "gpus.png" not in [p.name for p in written]


def test_partial_run_says_it_did_not_finish(tmp_path):
    render_report(_write(tmp_path, iterations=_iterations(8), complete=False))
    assert "- iterations: 8 of 12 (did not finish);" in (tmp_path / "summary.md").read_text()


def test_repeated_iterations_of_a_resumed_run_are_left_out(tmp_path):
    first = [{**r, "repeated": True} if r["iteration"] > 4 else r for r in _iterations(6)]
    second = [{**r, "segment": 1} for r in _iterations(12)[4:]]
    render_report(_write(tmp_path, iterations=first + second,
                         events=[{"iteration": 4, "kind": "resume", "repeated": [5, 6]}]))
    report = load_report(tmp_path)
    assert report.iterations == list(range(1, 13)) and report.repeated == 2
    assert "2 iteration(s) of the stopped run ran again" in (tmp_path / "summary.md").read_text()


def test_only_a_log_the_message_does_not_name_a_missing_summary(tmp_path, caplog):
    lines = [{"kind": "header", "config": {}, "world": {"pp": 1}, "initial_layout": "EtL"},
             {"kind": "iteration", "record": {"iteration": 1, "loss": 1.0, "time_s": 0.1}}]
    (tmp_path / "report.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    with caplog.at_level(logging.WARNING):
        load_report(tmp_path)
    assert "is not the final report" not in caplog.text
    assert "no report.json yet" in caplog.text


def test_figures_integer_ticks_legend_clear_of_bars_refused_lines_differ(tmp_path):
    """Drawn figures, inspected: iteration ticks are whole numbers on a short run, the
    stage-load legend overlaps no bar, and the refused rebalance's line is not the
    applied one's."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    from dynmo_plugin.reporting.plots import gpus_figure, stage_loads_figure, training_figure

    report = load_report(_write(tmp_path, iterations=_iterations(3),
                                events=[_rebalance(2, True), _rebalance(3, False)],
                                gpus=[{"iteration": 0, "gpus": 2}, {"iteration": 2, "gpus": 1}]))
    for fig in (training_figure(report), gpus_figure(report)):
        fig.canvas.draw()
        ax = fig.axes[-1]
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks
        if fig.axes[0].get_legend() is not None:
            lines = {(ln.get_color(), ln.get_linestyle()) for ln in fig.axes[0].get_lines()[1:]}
            assert len(lines) == 2, lines  # applied and refused: two different looks
        plt.close(fig)
    full = {**_rebalance(2, True), "stage_loads_before": [0.2, 0.2], "stage_loads_after": [0.2, 0.2]}
    fig = stage_loads_figure(load_report(_write(tmp_path, iterations=_iterations(3), events=[full])))
    fig.canvas.draw()  # bars as tall as the panel: the legend needs the headroom
    for ax in fig.axes:
        legend = ax.get_legend()
        if legend is None:
            continue
        box = legend.get_window_extent()
        bars = [p.get_window_extent() for p in ax.patches if isinstance(p, Rectangle)]
        assert bars and not any(box.overlaps(b) for b in bars)
    plt.close(fig)
