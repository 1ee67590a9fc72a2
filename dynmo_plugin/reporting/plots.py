"""PNG plots of a run report (matplotlib, Agg backend: no display needed)."""
from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from dynmo_plugin.reporting.model import Event, Report  # noqa: E402

__all__ = ["plot_stage_loads", "plot_training", "plot_gpus"]

_KIND_COLOURS = {"rebalance": "tab:red", "repack": "tab:purple", "profile": "tab:gray",
                 "dynamism": "tab:orange"}
_MAX_LOAD_PANELS = 12


def _plain(text: str) -> str:
    """`text` shown literally: matplotlib reads "$...$" as mathtext and raises on bad
    mathtext at save time, and event kinds come from the report file."""
    return text.replace("$", r"\$")


def _load_events(report: Report) -> list[Event]:
    return [e for e in report.events if e.loads_before or e.loads_after]


def plot_stage_loads(report: Report, path: Path) -> Path | None:
    """Grouped bars of per-stage load before/after each rebalance; None if no loads."""
    events = _load_events(report)[:_MAX_LOAD_PANELS]
    if not events:
        return None
    cols = min(3, len(events))
    rows = math.ceil(len(events) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax, event in zip(axes.flat, events):
        for offset, (label, loads, colour) in enumerate(
                (("before", event.loads_before, "tab:orange"), ("after", event.loads_after, "tab:blue"))):
            if loads:
                xs = [s + (offset - 0.5) * 0.4 for s in range(len(loads))]
                ax.bar(xs, loads, width=0.4, label=label, color=colour)
        stages = max(len(event.loads_before or []), len(event.loads_after or []))
        ax.set_xticks(range(stages))
        applied = "" if event.applied is None else (" (applied)" if event.applied else " (not applied)")
        ax.set_title(_plain(f"{event.kind} @ iter {event.iteration}{applied}"), fontsize=9)
        ax.set_xlabel("pipeline stage")
        ax.set_ylabel("load (s)")
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(events):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _mark_events(ax, events: list[Event]) -> None:
    seen: set[str] = set()
    for e in events:
        if e.iteration is None:
            continue
        label = _plain(e.label) if e.label not in seen else None
        seen.add(e.label)
        ax.axvline(e.iteration, color=_KIND_COLOURS.get(e.kind, "tab:green"),
                   ls=":" if e.kind == "dynamism" else "--", lw=1, label=label)


def plot_training(report: Report, path: Path) -> Path:
    """Iteration time and loss over training, events marked as dashed lines."""
    fig, (ax_t, ax_l) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    pts = [(i, t) for i, t in zip(report.iterations, report.times) if t is not None]
    ax_t.plot([i for i, _ in pts], [t for _, t in pts], lw=1, color="tab:blue")
    ax_t.set_ylabel("iteration time (s)")
    pts = [(i, v) for i, v in zip(report.iterations, report.losses) if v is not None]
    ax_l.plot([i for i, _ in pts], [v for _, v in pts], lw=1, color="tab:green")
    ax_l.set_ylabel("loss")
    ax_l.set_xlabel("iteration")
    for ax in (ax_t, ax_l):
        _mark_events(ax, report.events)
    if any(e.iteration is not None for e in report.events):
        ax_t.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_gpus(report: Report, path: Path) -> Path | None:
    """GPUs in use over training (repacking); None when the report has no GPU counts."""
    if not report.gpus:
        return None
    fig, ax = plt.subplots(figsize=(8, 3))
    xs, ys = zip(*sorted(report.gpus))
    ax.step(xs, ys, where="post", color="tab:purple")
    ax.set_xlabel("iteration")
    ax.set_ylabel("GPUs in use")
    ax.set_ylim(0, max(ys) * 1.15)
    _mark_events(ax, [e for e in report.events if e.kind == "repack"])
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
