"""The human-readable form of a Plan (a table per stage, then the moves and the gate).

Below the plan: `Plan.__str__` calls `render_plan`, so this module reads the plan by its
attributes (`balancing.plan.Plan`) and does not import its type (that would be a circle).
"""
from __future__ import annotations

from typing import Any

__all__ = ["render_plan", "human_bytes"]


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _layers(plan: Any, stage: int) -> str:
    got = plan.layout.layers_of(stage)
    return "-" if not got else f"{got[0]}-{got[-1]}" if len(got) > 1 else str(got[0])


def _arrow(before: float | None, after: float, fmt: str = "{:.4g}") -> str:
    return fmt.format(after) if before is None else f"{fmt.format(before)} -> {fmt.format(after)}"


def _stage_table(plan: Any) -> list[str]:
    rows = [f"{'stage':>5}  {'layers':<11} {'load':<24} memory"]
    for s in range(plan.layout.num_stages):
        lb = plan.stage_loads_before[s] if plan.stage_loads_before else None
        mb = plan.stage_memory_before[s] if plan.stage_memory_before else None
        mem = human_bytes(plan.stage_memory_after[s])
        if mb is not None:
            mem = f"{human_bytes(mb)} -> {mem}"
        rows.append(f"{s:>5}  {_layers(plan, s):<11} {_arrow(lb, plan.stage_loads_after[s]):<24} {mem}")
    return rows


def _summary(plan: Any) -> list[str]:
    return [
        f"bottleneck {_arrow(plan.bottleneck_before, plan.bottleneck_after)}; "
        f"imbalance {_arrow(plan.imbalance_before, plan.imbalance_after, '{:.3f}')}; "
        f"predicted 1F1B iteration ({plan.num_microbatches} micro-batches) "
        f"{_arrow(plan.predicted_iter_s_before, plan.predicted_iter_s_after)}",
    ]


def _moves(plan: Any) -> list[str]:
    if plan.before is None:
        return ["moves: no current layout given"]
    if not plan.moves:
        return ["moves: none"]
    out = [f"moves: {len(plan.moves)} layer(s), {human_bytes(plan.bytes_moved)}"]
    out += [f"  {'MTP layer' if getattr(m, 'kind', 'decoder') == 'mtp' else 'layer'} {m.layer}: "
            f"stage {m.src} -> {m.dst} ({human_bytes(m.bytes)})" for m in plan.moves]
    return out


def _mtp(plan: Any) -> list[str]:
    """Where the MTP block goes, said outright (on the last rank, or standalone)."""
    layout = plan.layout
    if not getattr(layout, "has_mtp", False):
        return []
    where = (f"standalone on stage {layout.mtp_stage} (rank {layout.mtp_rank})"
             if layout.mtp_standalone else f"on the last rank (stage {layout.mtp_stage})")
    before = plan.before
    if before is not None and before.has_mtp and before.mtp_stage != layout.mtp_stage:
        where += f", moved from stage {before.mtp_stage}"
    elif before is not None:
        where += ", where it is"
    return [f"MTP block ({layout.mtp_layers} layer(s)): {where}"]


def render_plan(plan: Any) -> str:
    layout = plan.layout.to_megatron()
    head = (f"plan ({plan.method}): {plan.before.to_megatron()} -> {layout}" if plan.before
            else f"plan ({plan.method}): {layout}")
    head += f"  [solved in {plan.solve_seconds * 1e3:.1f} ms"
    head += f", {plan.rounds} rounds]" if plan.rounds is not None else "]"
    lines = [head, *_stage_table(plan), *_summary(plan), *_mtp(plan), *_moves(plan)]
    if plan.gate is not None:
        g = plan.gate
        lines.append(f"gate: {'APPLY' if g.apply else 'skip'} - {g.reason}")
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)
