"""The human-readable form of a RepackPlan: header, current pipeline, tokens/s, the
candidate table, the moves, the decision.

Below the plan: `RepackPlan.__str__` calls `render_repack`, so this module reads the plan
by its attributes (`balancing.repack_plan.RepackPlan`) and does not import its type (that
would be a circle).
"""
from __future__ import annotations

from typing import Any

from dynmo_plugin.balancing.render import human_bytes
from dynmo_plugin.balancing.repack_throughput import per_gpu

__all__ = ["ratio_text", "render_repack"]


def ratio_text(a: float, b: float) -> str:
    return f"x{a / b:.3f}" if b > 0 else "x-"


def _fmt(value: float | None, spec: str = ".4g") -> str:
    return "-" if value is None else format(value, spec)


def _tokens_line(plan: Any) -> str:
    """Predicted tokens/s (one pipeline replica) and tokens per GPU-hour, before -> after."""
    if plan.tokens_per_iteration is None:
        return "tokens/s and tokens per GPU-hour: unknown (give the tokens per iteration)"
    rate = [plan.tokens_per_s(a) for a in (False, True)]
    hour = [plan.tokens_per_gpu_hour(a) for a in (False, True)]
    return (f"predicted tokens/s per replica {_fmt(rate[0], ',.0f')} -> {_fmt(rate[1], ',.0f')}; "
            f"tokens per GPU-hour {_fmt(hour[0], ',.0f')} -> {_fmt(hour[1], ',.0f')}")


def render_repack(plan: Any) -> str:
    """Header, candidate table, moves, decision."""
    if plan.apply:
        head = (f"repack ({plan.method}): {plan.stages_before} -> {plan.stages_after} stages, "
                f"releases stage(s) {plan.released_stages}: {plan.layout_before} -> "
                f"{plan.layout_after} (via {plan.intermediate_layout()})")
    else:
        head = f"repack ({plan.method}): keep {plan.stages_before} stages ({plan.layout_before})"
    now = plan.predicted_iter_s_before
    # costs are seconds where the caller knows the tokens per iteration (a live run, the
    # simulator, `dynmo plan --tokens-per-iteration`); a costs file's are unitless
    unit = " s" if plan.tokens_per_iteration is not None else ""
    lines = [head, f"current: {plan.stages_before} stages, predicted iteration {now:.4g}{unit}, "
                   f"tokens/s/GPU (rel) {_fmt(per_gpu(now, plan.stages_before))}",
             _tokens_line(plan)]
    if plan.candidates:
        lines.append(f"{'stages':>6}  {'iter' + unit:>10}  {'vs now':>7}  {'tok/s/GPU':>10}  "
                     f"{'fits':<4}  layout / reason")
    for c in plan.candidates:
        vs = "-" if c.predicted_iter_s is None else ratio_text(c.predicted_iter_s, now)
        layout = "" if c.layout is None else f"{c.layout}  "
        lines.append(f"{c.stages:>6}  {_fmt(c.predicted_iter_s):>10}  {vs:>7}  "
                     f"{_fmt(c.tokens_per_gpu_s_rel):>10}  {'yes' if c.fits else 'no':<4}  "
                     f"{layout}{c.reason}")
    if plan.moves:
        lines.append(f"moves: {len(plan.moves)} layer(s), {human_bytes(plan.bytes_moved)}")
        lines += [f"  layer {m.layer}: stage {m.src} -> {m.dst} ({human_bytes(m.bytes)})"
                  for m in plan.moves]
    lines.append(f"decision: {'REPACK' if plan.apply else 'keep'} - {plan.reason}  "
                 f"[{plan.solve_seconds * 1e3:.1f} ms]")
    return "\n".join(lines)
