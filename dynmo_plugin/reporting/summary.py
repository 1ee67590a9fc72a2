"""Short Markdown summary of a run report."""
from __future__ import annotations

from pathlib import Path
from statistics import median

from dynmo_plugin.reporting.model import Event, Report

__all__ = ["markdown_summary"]


def _fmt(value: float | None, spec: str = ".3f", unit: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{unit}"


def _pair(a: float | None, b: float | None, spec: str = ".3f", unit: str = "") -> str:
    return f"{_fmt(a, spec, unit)} → {_fmt(b, spec, unit)}"


def _cell(text: str) -> str:
    """A table cell: `|` escaped (GitHub's tables split on it even inside backticks, and
    every layout holds one), line breaks flattened."""
    return text.replace("|", "\\|").replace("\n", " ")


def _measured(report: Report, e: Event) -> str:
    """Iteration time before → after; for a repack the steady state around it (the repack
    iteration and the slow first one after it left out: they are not the new speed)."""
    if e.kind == "repack" and e.iteration is not None:
        before, after = report.steady_times(e.iteration)
        if before is not None or after is not None:
            return _pair(before, after, ".4f", " s") + " (steady)"
    return _pair(e.measured_before, e.measured_after, ".4f", " s")


def _layouts(e: Event) -> str:
    if e.kind == "profile" and e.planned_layout:  # nothing moves: the layout the profile asks for
        return f"`{e.layout_before}` (exact: `{e.planned_layout}`)"
    if e.applied is False and e.planned_layout and e.planned_layout != e.layout_before:
        return f"`{e.layout_before}` (considered `{e.planned_layout}`)"
    return f"`{e.layout_before}` → `{e.layout_after}`" if e.layout_before or e.layout_after else "–"


def _event_row(report: Report, e: Event) -> str:
    layouts = _layouts(e)
    overhead = sum(e.overhead_s.values()) if e.overhead_s else None
    applied = "–" if e.applied is None else ("yes" if e.applied else "no")
    if e.kind == "profile" and e.planned_layout:
        applied = "profile only"
    imbalance = _pair(e.imbalance_before, e.imbalance_after, ".2f")
    if e.kind == "repack" and e.imbalance_before is None and e.stages_before and e.stages_after:
        imbalance = f"{e.stages_before} → {e.stages_after} stages"
    cells = [str(e.iteration) if e.iteration is not None else "–", e.label, e.trigger or "–",
             applied, layouts, imbalance, _measured(report, e), str(e.num_moves),
             _fmt(overhead, ".3f", " s")]
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def _time_lines(report: Report) -> list[str]:
    times = [t for t in report.times if t is not None]
    if not times:
        return ["- iteration time: not recorded"]
    k = max(1, len(times) // 10)
    count = str(len(report.iterations))
    if not report.complete:
        count += f" of {report.train_iters} (did not finish)" if report.train_iters else " (did not finish)"
    if report.repeated:
        count += (f"; resumed from a checkpoint, {report.repeated} iteration(s) of the stopped "
                  "run ran again and are left out")
    lines = [f"- iterations: {count}; median iteration time "
             f"{median(times):.4f} s (first {k}: {median(times[:k]):.4f} s, last {k}: "
             f"{median(times[-k:]):.4f} s)"]
    losses = [v for v in report.losses if v is not None]
    if losses:
        lines.append(f"- loss: {losses[0]:.4f} → {losses[-1]:.4f}")
    return lines


def _decisions(report: Report) -> list[str]:
    """Every decision, applied or not: what was considered and why it went so (the reason
    names the flag that changes it), and any repack weighed and not applied."""
    lines = []
    for e in report.events:
        if e.kind not in ("rebalance", "repack", "profile") or not (e.reason or e.repack_reason):
            continue
        verdict = {True: "applied", False: "not applied", None: ""}[e.applied]
        if e.kind == "profile":
            verdict = "not applied (profile only)" if e.planned_layout else ""
        considered = f" `{e.layout_before}` → `{e.planned_layout}`" if e.planned_layout else ""
        if e.planned_layout and e.planned_layout == e.layout_before:
            considered = f" (`{e.layout_before}` is already the best split)"
        what = f"{e.kind}{considered}{', ' + verdict if verdict else ''}"
        text = f"- iteration {e.iteration} ({e.trigger or '–'}): {what}"
        if e.reason:
            text += f": {e.reason}"
        if e.repack_reason:
            text += f"; repack considered, not applied: {e.repack_reason}"
        lines.append(text.replace("\n", " "))
    return ["", "## Decisions", "", *lines] if lines else []


def markdown_summary(report: Report, plots: list[Path]) -> str:
    """The summary text; `plots` are linked relative to the report's directory."""
    world = ", ".join(f"{k}={v}" for k, v in report.world.items()) or "unknown"
    out = [f"# Run report: {report.path.parent.name or report.path.parent}", "",
           f"- world: {world}",
           f"- layout: `{report.initial_layout or '–'}` → `{report.layout or '–'}`"]
    out += _time_lines(report)
    if report.gpus:
        counts = [g for _, g in report.gpus]
        out.append(f"- GPUs in use: {counts[0]} → {counts[-1]} (min {min(counts)})")
    rebalances = [e for e in report.events if e.kind == "rebalance"]
    applied = [e for e in rebalances if e.applied]
    repacks = [e for e in report.events if e.kind == "repack"]
    out.append(f"- events: {len(report.events)} ({len(rebalances)} rebalance, {len(applied)} applied"
               + (f"; {len(repacks)} repack" if repacks else "") + ")")
    total = {}
    for e in report.events:
        for k, v in e.overhead_s.items():
            total[k] = total.get(k, 0.0) + v
    if total:
        out.append("- plugin overhead: " + ", ".join(f"{k} {v:.3f} s" for k, v in total.items()))
    if report.events:
        out += ["", "| iteration | kind | trigger | applied | layout | imbalance | measured iter time "
                "| moves | overhead |", "|---|---|---|---|---|---|---|---|---|"]
        out += [_event_row(report, e) for e in report.events]
    out += _decisions(report)
    mtp = [(e.iteration, e.mtp) for e in report.events if e.mtp]
    if mtp:
        out += ["", "## MTP block (profiled as one unit)", ""]
        out += [f"- iteration {it}: {line}" for it, line in mtp]
    if plots:
        out += ["", "## Plots", ""]
        out += [f"![{p.stem}]({p.name})" for p in plots]
    return "\n".join(out) + "\n"
