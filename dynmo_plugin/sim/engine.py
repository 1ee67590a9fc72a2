"""Discrete-event execution of per-rank operation orders.

Each rank runs its ops strictly in schedule order (Megatron's schedules are
sequential programs). An op starts when the rank is free and its input has arrived:

* F(i) on virtual stage v > 0 waits for F(i) of stage v-1 to finish plus the
  activation transfer;
* B(i) on virtual stage v < last waits for B(i) of stage v+1 plus the gradient
  transfer; B(i) on the last stage needs only its own F(i), which precedes it.

Sends are asynchronous (a rank does not wait for its peer to post the receive): the
usual simulator assumption; Megatron's combined send/recv calls add a little waiting on
top when neighbours are out of step. Transfers between chunks of one rank (pp = 1) are
free.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from dynmo_plugin.sim.cost import PipelineCosts
from dynmo_plugin.sim.schedule import FORWARD, Op, rank_orders

__all__ = ["ScheduledOp", "Timeline", "run_schedule"]


class ScheduledOp(NamedTuple):
    """One executed op (a NamedTuple: a campaign creates hundreds of thousands)."""

    rank: int
    op: Op
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """Every op with its start and end; `ops[r]` in rank r's execution order."""

    ops: list[list[ScheduledOp]]

    @property
    def makespan(self) -> float:
        return max((r[-1].end for r in self.ops if r), default=0.0)

    def busy(self) -> np.ndarray:
        """Compute seconds per rank."""
        return np.array([sum(o.end - o.start for o in r) for r in self.ops])

    def finish(self) -> np.ndarray:
        """When each rank finished its last op."""
        return np.array([r[-1].end if r else 0.0 for r in self.ops])


def run_schedule(costs: PipelineCosts) -> Timeline:
    """Execute Megatron's schedule for `costs`; returns the timeline."""
    p = costs.num_stages
    last = costs.num_virtual_stages - 1
    orders = rank_orders(p, costs.num_microbatches, costs.num_chunks, costs.group_size)
    transfer = costs.p2p.transfer_s(costs.act_bytes) if p > 1 else 0.0
    tables = {FORWARD: costs.fwd_s.tolist(), "B": costs.bwd_s.tolist()}  # type: ignore[union-attr]
    done: dict[tuple[str, int, int], float] = {}  # (kind, vstage, microbatch) -> end
    out: list[list[ScheduledOp]] = [[] for _ in range(p)]
    free = [0.0] * p
    nxt = [0] * p
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(p):
            order, rank_out = orders[r], out[r]
            while nxt[r] < len(order):
                op = order[nxt[r]]
                vstage = op.chunk * p + r
                # the op whose output this one consumes (module docstring)
                if op.kind == FORWARD:
                    dep = None if vstage == 0 else (FORWARD, vstage - 1)
                else:
                    dep = (FORWARD, last) if vstage == last else ("B", vstage + 1)
                ready = 0.0
                if dep is not None:
                    end = done.get((dep[0], dep[1], op.microbatch))
                    if end is None:
                        break
                    ready = end + (0.0 if dep[1] % p == r else transfer)
                start = max(free[r], ready)
                end = start + tables[op.kind][vstage][op.microbatch]
                done[(op.kind, vstage, op.microbatch)] = end
                rank_out.append(ScheduledOp(r, op, start, end))
                free[r] = end
                nxt[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # a schedule-order bug, not a user error
            raise RuntimeError(f"pipeline schedule deadlocked at {nxt}")
    return Timeline(out)
