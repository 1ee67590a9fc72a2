"""The plan: a new layout plus everything needed to judge and execute it.

A `Plan` is data (serialisable with `to_dict`, readable with `str`): the new layout as
Megatron's `pipeline_model_parallel_layout` string, per-stage load and memory before
and after, bottleneck, imbalance (DynMo eq. 2), predicted 1F1B iteration time, the
layer moves, and the gate's verdict once `attach_gate` ran.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from dynmo_plugin.balancing import metrics
from dynmo_plugin.balancing.problem import BalanceProblem
from dynmo_plugin.balancing.render import render_plan
from dynmo_plugin.layout import Layout

__all__ = ["Move", "Plan", "Outcome", "GateVerdict", "make_plan"]


@dataclass(frozen=True)
class GateVerdict:
    """The gate's judgement of a plan (see `dynmo_plugin.balancing.gate`)."""

    apply: bool
    saving_per_iter_s: float
    total_saving_s: float
    migration_s: float
    reason: str

    @classmethod
    def from_dict(cls, data: dict) -> "GateVerdict":
        return cls(**data)


@dataclass(frozen=True)
class Outcome:
    """What a balancer function returns; `solve` turns it into a Plan."""

    layout: Layout
    notes: list[str] = field(default_factory=list)
    rounds: int | None = None


@dataclass(frozen=True)
class Move:
    """One layer migration: global 1-based layer number, source/destination (virtual)
    stage, bytes sent (0 for a move between chunks of the same rank: no communication).
    `kind` "mtp": an MTP layer (numbered 1..k among the MTP layers), which moves with its
    whole block."""

    layer: int
    src: int
    dst: int
    bytes: float
    kind: str = "decoder"


@dataclass
class Plan:
    """A balancing decision; `before` fields are None when there is no current layout."""

    method: str
    layout: Layout
    before: Layout | None
    stage_loads_before: list[float] | None
    stage_loads_after: list[float]
    stage_memory_before: list[float] | None
    stage_memory_after: list[float]
    migration_peak_memory: list[float] | None
    bottleneck_before: float | None
    bottleneck_after: float
    imbalance_before: float | None
    imbalance_after: float
    moves: list[Move]
    predicted_iter_s_before: float | None
    predicted_iter_s_after: float
    solve_seconds: float
    num_microbatches: int = 1
    rounds: int | None = None
    notes: list[str] = field(default_factory=list)
    gate: GateVerdict | None = None
    capacity: list[float] | None = None  # per-rank (= per-stage) bytes, None = unlimited

    @property
    def bytes_moved(self) -> float:
        return float(sum(m.bytes for m in self.moves))

    @property
    def boundaries(self) -> list[int]:
        return self.layout.boundaries

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict (what `dynmo plan --json` prints)."""
        return {
            "method": self.method,
            "layout": self.layout.to_megatron(),
            "layout_before": self.before.to_megatron() if self.before else None,
            "boundaries": self.boundaries,
            "num_stages": self.layout.num_stages,
            "num_chunks": self.layout.num_chunks,
            "num_layers": self.layout.num_layers,
            "stage_loads": self.stage_loads_after,
            "stage_loads_before": self.stage_loads_before,
            "stage_memory": self.stage_memory_after,
            "stage_memory_before": self.stage_memory_before,
            "migration_peak_memory": self.migration_peak_memory,
            "bottleneck": self.bottleneck_after,
            "bottleneck_before": self.bottleneck_before,
            "imbalance": self.imbalance_after,
            "imbalance_before": self.imbalance_before,
            "predicted_iter_s": self.predicted_iter_s_after,
            "predicted_iter_s_before": self.predicted_iter_s_before,
            "num_microbatches": self.num_microbatches,
            "moves": [_move_dict(m) for m in self.moves],
            "bytes_moved": self.bytes_moved,
            "solve_seconds": self.solve_seconds,
            "rounds": self.rounds,
            "notes": list(self.notes),
            "gate": asdict(self.gate) if self.gate else None,
            "capacity": self.capacity,
        }

    def __str__(self) -> str:
        return render_plan(self)


def make_plan(problem: BalanceProblem, layout: Layout, method: str, solve_seconds: float,
              rounds: int | None = None, notes: list[str] | None = None) -> Plan:
    """Score `layout` against the problem's current layout and wrap it as a Plan."""
    loads = metrics.stage_loads(problem, layout)
    before = problem.current
    m = problem.num_microbatches
    capacity = list(problem.capacity) if problem.capacity is not None else None
    plan = Plan(
        method=method, layout=layout, before=before,
        stage_loads_before=None, stage_loads_after=loads,
        stage_memory_before=None, stage_memory_after=metrics.stage_memory(problem, layout),
        migration_peak_memory=None, capacity=capacity,
        bottleneck_before=None, bottleneck_after=max(loads),
        imbalance_before=None, imbalance_after=metrics.imbalance(loads),
        moves=[], predicted_iter_s_before=None,
        predicted_iter_s_after=metrics.predicted_iteration_s(loads, m, problem.num_chunks),
        solve_seconds=solve_seconds, num_microbatches=m, rounds=rounds, notes=list(notes or []))
    if before is None:
        return plan
    loads_before = metrics.stage_loads(problem, before)
    memory_before = metrics.stage_memory(problem, before)
    moved = metrics.moved_layers(before, layout)
    move_bytes = problem.move_bytes_arr
    plan.stage_loads_before, plan.stage_memory_before = loads_before, memory_before
    rank = problem.stage_rank
    plan.moves = [Move(layer, src, dst, float(move_bytes[layer - 1]) if rank[src] != rank[dst] else 0.0)
                  for layer, src, dst in moved] + _mtp_moves(problem, before, layout)
    plan.migration_peak_memory = metrics.migration_peak_memory(
        problem, before, layout, moved=moved, memory_before=memory_before)
    plan.bottleneck_before = max(loads_before)
    plan.imbalance_before = metrics.imbalance(loads_before)
    plan.predicted_iter_s_before = metrics.predicted_iteration_s(loads_before, m, problem.num_chunks)
    return plan


def _move_dict(move: Move) -> dict[str, Any]:
    """A move as report.json writes it; "kind" only for MTP layers (decoder moves keep
    the fields they always had)."""
    out = asdict(move)
    if out["kind"] == "decoder":
        del out["kind"]
    return out


def _mtp_moves(problem: BalanceProblem, before: Layout, after: Layout) -> list[Move]:
    """One Move per MTP layer when the block changes stage (its bytes split evenly)."""
    src, dst = before.mtp_stage, after.mtp_stage
    if src is None or dst is None or src == dst:
        return []
    k = after.mtp_layers
    rank = problem.stage_rank
    each = problem.mtp_move_bytes_value / k if rank[src] != rank[dst] else 0.0
    return [Move(i, src, dst, each, kind="mtp") for i in range(1, k + 1)]
