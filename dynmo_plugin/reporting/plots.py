"""PNG plots of a run report (matplotlib, Agg backend: no display needed)."""
from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from dynmo_plugin.reporting.model import Event, Report  # noqa: E402

__all__ = ["plot_stage_loads", "plot_training", "plot_gpus", "event_style", "stage_loads_figure",
           "training_figure", "gpus_figure"]

_KIND_COLOURS = {"rebalance": "tab:red", "repack": "tab:purple", "profile": "tab:gray",
                 "dynamism": "tab:orange"}
_MAX_LOAD_PANELS = 12


def _plain(text: str) -> str:
    """`text` shown literally: matplotlib reads "$...$" as mathtext and raises on bad
    mathtext at save time, and event kinds come from the report file."""
    return text.replace("$", r"\$")


def _load_events(report: Report) -> list[Event]:
    """Events with per-stage loads, and repacks (drawn with their steady-state times
    when no profile gave loads: a forced repack has none)."""
    return [e for e in report.events if e.loads_before or e.loads_after or e.kind == "repack"]


def _bars(ax, before, after, unit_label: str, xlabels=None) -> None:
    """Before (orange) / after (blue) bars, with headroom so the legend covers none."""
    top = 0.0
    for offset, (label, values, colour) in enumerate(
            (("before", before, "tab:orange"), ("after", after, "tab:blue"))):
        if values:
            xs = [s + (offset - 0.5) * 0.4 for s in range(len(values))]
            ax.bar(xs, values, width=0.4, label=label, color=colour)
            top = max(top, max(values))
    ax.set_ylim(0, (top or 1.0) * 1.35)
    ax.set_ylabel(unit_label)
    ax.legend(fontsize=7, loc="upper center", ncol=2, frameon=False)
    if xlabels is not None:
        ax.set_xticks(range(len(xlabels)), xlabels)


def _panel(ax, report: Report, event: Event) -> None:
    applied = "" if event.applied is None else (" (applied)" if event.applied else " (not applied)")
    if event.kind == "profile" and event.planned_layout:
        applied = " (exact plan, profile only)"
    if event.loads_before or event.loads_after:
        _bars(ax, event.loads_before, event.loads_after, "load (s)")
        stages = max(len(event.loads_before or []), len(event.loads_after or []))
        ax.set_xticks(range(stages))
        ax.set_xlabel("pipeline stage")
    else:  # a repack without a profile: the steady iteration time on each side
        before, after = report.steady_times(event.iteration) if event.iteration is not None else (None, None)
        _bars(ax, [before or 0.0], [after or 0.0], "steady iteration time (s)", xlabels=[""])
        stages = f" {event.stages_before} → {event.stages_after} stages" if event.stages_before else ""
        applied = stages or applied
    ax.set_title(_plain(f"{event.kind} @ iter {event.iteration}{applied}"), fontsize=9)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_stage_loads(report: Report, path: Path) -> Path | None:
    """Grouped bars of per-stage load before/after each rebalance; None if no loads."""
    fig = stage_loads_figure(report)
    return None if fig is None else _save(fig, path)


def stage_loads_figure(report: Report):
    """The figure of `plot_stage_loads` (open: the caller saves and closes it)."""
    events = _load_events(report)[:_MAX_LOAD_PANELS]
    if not events:
        return None
    cols = min(3, len(events))
    rows = math.ceil(len(events) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax, event in zip(axes.flat, events):
        _panel(ax, report, event)
    for ax in list(axes.flat)[len(events):]:
        ax.axis("off")
    return fig


def event_style(e: Event) -> tuple[str, str, str, float]:
    """(legend label, colour, line style, line width) of an event's marker line: a
    refused rebalance (applied false) is a thin grey dotted line, not the red dashed
    line of one that moved layers."""
    if e.kind == "rebalance" and e.applied is False:
        return "rebalance (not applied)", "tab:gray", ":", 0.6
    return e.label, _KIND_COLOURS.get(e.kind, "tab:green"), ":" if e.kind == "dynamism" else "--", 1.0


def _mark_events(ax, events: list[Event]) -> None:
    seen: set[str] = set()
    for e in events:
        if e.iteration is None:
            continue
        label, colour, style, width = event_style(e)
        ax.axvline(e.iteration, color=colour, ls=style, lw=width,
                   label=_plain(label) if label not in seen else None)
        seen.add(label)


def plot_training(report: Report, path: Path) -> Path:
    """Iteration time and loss over training, events marked as dashed lines."""
    return _save(training_figure(report), path)


def training_figure(report: Report):
    """The figure of `plot_training` (open: the caller saves and closes it)."""
    fig, (ax_t, ax_l) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    pts = [(i, t) for i, t in zip(report.iterations, report.times) if t is not None]
    ax_t.plot([i for i, _ in pts], [t for _, t in pts], lw=1, color="tab:blue")
    ax_t.set_ylabel("iteration time (s)")
    pts = [(i, v) for i, v in zip(report.iterations, report.losses) if v is not None]
    ax_l.plot([i for i, _ in pts], [v for _, v in pts], lw=1, color="tab:green")
    ax_l.set_ylabel("loss")
    ax_l.set_xlabel("iteration")
    ax_l.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in (ax_t, ax_l):
        _mark_events(ax, report.events)
    if any(e.iteration is not None for e in report.events):
        ax_t.legend(fontsize=8)
    return fig


def plot_gpus(report: Report, path: Path) -> Path | None:
    """GPUs in use over training; None unless a repack changed the count."""
    fig = gpus_figure(report)
    return None if fig is None else _save(fig, path)


def gpus_figure(report: Report):
    """The figure of `plot_gpus` (open: the caller saves and closes it), or None."""
    if len({g for _, g in report.gpus}) < 2:
        return None
    fig, ax = plt.subplots(figsize=(8, 3))
    xs, ys = zip(*sorted(report.gpus))
    ax.step(xs, ys, where="post", color="tab:purple")
    ax.set_xlabel("iteration")
    ax.set_ylabel("GPUs in use")
    ax.set_ylim(0, max(ys) * 1.3)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    _mark_events(ax, [e for e in report.events if e.kind == "repack"])
    return fig
