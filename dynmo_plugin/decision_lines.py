"""What a decision says to the user: a reason in the flags' words (`explain`) and the
tail of the console line an event logs (`describe`), apart from the controller that
takes the decisions."""
from __future__ import annotations

from dynmo_plugin.events import ProfileEvent

__all__ = ["explain", "describe", "repack_considered_record"]


# What the user changes to get another verdict: a reason's words -> the flags that move it.
_REASON_FLAGS = (("noise floor", "--dynmo-min-gain"),
                 ("does not pay", "--dynmo-gate-margin, --dynmo-event-gap"),
                 ("no feasible plan", "--dynmo-memory-cap-gb, --dynmo-allow-empty-stages"),
                 ("above its cap", "--dynmo-memory-cap-gb"),
                 ("balancer failed", "--dynmo-balancer"),
                 ("too slow", "--dynmo-repack-max-slowdown"),
                 ("min_stages", "--dynmo-repack-min-stages"),
                 ("rebuild", "--dynmo-repack-rebuild-s, --dynmo-repack-memory-margin"))
_NAMES = (("min_relative_gain", "--dynmo-min-gain"), ("max_slowdown", "--dynmo-repack-max-slowdown"),
          ("min_stages", "--dynmo-repack-min-stages"), ("x margin", "x --dynmo-gate-margin"))


def explain(reason: str) -> str:
    """A decision's reason in the user's words: settings named by the flag that sets them
    (`--dynmo-min-gain`, not the gate's `min_relative_gain`) and, for a refusal, which
    flags change the verdict. Applied decisions ("pays: ...") keep their numbers only."""
    if not reason or "(change:" in reason:
        return reason
    flags = [f for words, f in _REASON_FLAGS if words in reason]
    for name, flag in _NAMES:
        reason = reason.replace(name, flag)
    applied = reason.startswith("pays") or ": pays:" in reason  # a repack's: "4 -> 2 stages: pays: ..."
    return f"{reason} (change: {flags[0]})" if flags and not applied else reason


def repack_considered_record(plan, rebalance_applied: bool) -> dict:
    """A repack the decision weighed and did not apply: what was weighed, and why not."""
    why = plan.reason  # a refused plan's reason says why
    if plan.apply and not rebalance_applied:
        why = f"{plan.reason}; not applied: the rebalance it rides on was not"
    return {"stages": plan.stages_before, "candidates": [c.stages for c in plan.candidates],
            "predicted_iter_s_before": plan.predicted_iter_s_before,
            "reason": explain(why)}


def _predicted(plan) -> str:
    if plan is None or plan.predicted_iter_s_before is None or plan.imbalance_before is None:
        return ""
    return (f"predicted {plan.predicted_iter_s_before:.4g} -> {plan.predicted_iter_s_after:.4g} "
            f"s/iter, imbalance {plan.imbalance_before:.2f} -> {plan.imbalance_after:.2f}")


def describe(event) -> str:
    """The console line's tail: what was considered, the numbers, what happened and why."""
    if isinstance(event, ProfileEvent):
        if event.cancelled:
            return f": cancelled ({event.cancelled})"
        p = event.plan
        if p is None:
            return f": {event.reason}" if event.reason else ""
        loads = ", ".join(f"{x:.4g}" for x in p.stage_loads_before or [])
        return (f": stage loads {loads} s; the exact split {event.layout} -> {p.layout} "
                f"({_predicted(p)}); {event.reason}")
    tail = ""
    if event.repack_considered is not None:
        tail = f"; repack from {event.repack_considered['stages']} stages considered: " \
               f"{event.repack_considered['reason']}"
    if event.applied:
        moved = sum(m["bytes"] for m in event.moves) / 1e6
        numbers = f"; {_predicted(event.plan)}" if _predicted(event.plan) else ""
        return (f": {event.layout_before} -> {event.layout_after} "
                f"({len(event.moves)} layers, {moved:.1f} MB){numbers}; {event.reason}{tail}")
    considered = ""
    if event.plan is not None and str(event.plan.layout) == event.layout_before:
        considered = f" considered {event.plan.method}: {event.layout_before} is its best split;"
    elif event.plan is not None and event.plan.layout is not None:
        considered = (f" considered {event.plan.method} {event.layout_before} -> "
                      f"{event.plan.layout} ({_predicted(event.plan)});")
    if event.profile_source == "estimated":  # the user may trust a timed one more
        tail += ("; decided from the scenario's work model on the last timed profile, untimed "
                 "(--dynmo-profile-retime-every 0 times every event)")
    return f":{considered} kept {event.layout_before}: {event.error or event.reason}{tail}"
