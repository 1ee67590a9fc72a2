"""Run reports: PNG plots and a Markdown summary from a training run's report.json.

May import matplotlib (Agg backend), never torch or megatron (guard test).
"""
from __future__ import annotations

import logging
from pathlib import Path

from dynmo_plugin.errors import UserError
from dynmo_plugin.reporting.model import Event, Report, load_report

__all__ = ["render_report", "load_report", "Report", "Event"]

log = logging.getLogger(__name__)


def render_report(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write stage_loads.png, training.png, gpus.png (those that apply) and summary.md
    into `out_dir` (default: the run directory); returns the written paths."""
    from dynmo_plugin.reporting.plots import plot_gpus, plot_stage_loads, plot_training
    from dynmo_plugin.reporting.summary import markdown_summary

    report = load_report(run_dir)
    out = Path(out_dir) if out_dir is not None else report.path.parent
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create output directory {out}: {e}") from e
    plots = [p for p in (plot_stage_loads(report, out / "stage_loads.png"),
                         plot_training(report, out / "training.png"),
                         plot_gpus(report, out / "gpus.png")) if p is not None]
    summary = out / "summary.md"
    summary.write_text(markdown_summary(report, plots), encoding="utf-8")
    log.info("wrote %s", ", ".join(str(p) for p in [*plots, summary]))
    return [*plots, summary]
