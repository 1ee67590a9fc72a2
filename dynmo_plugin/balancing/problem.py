"""The balancing problem: what each layer costs and weighs, what each stage can hold.

`BalanceProblem` is validated once, here, so that every balancer can trust it. Costs
are per-layer seconds (forward + backward of one micro-batch, from the profiler) or
parameter counts when balancing "by params"; memory and move bytes are per layer;
capacity and extras are per stage (extras: embedding on the first stage, output layer
and loss on the last).

Floating-point policy (used by every balancer, the metrics and the tests): a load is
computed as ``extras_cost[s] + (prefix[j] - prefix[i])`` over prefix sums of the
costs, and "load <= T" means ``load <= T + load_tol`` with
``load_tol = REL_TOL * (sum(costs) + sum(extras_cost))``; memory the same way with
``mem_tol``. Optimality claims hold up to this tolerance.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import numpy as np

from dynmo_plugin.errors import UserError
from dynmo_plugin.layout import Layout

__all__ = ["BalanceProblem", "ProblemError", "InfeasibleError", "REL_TOL"]

REL_TOL = 1e-9
# Tie-break keys pack (bytes, layers) into one int64; keep clear of overflow.
_MAX_KEY = 2**62


class ProblemError(UserError):
    """The balancing inputs are malformed (wrong lengths, negative or non-finite values)."""


class InfeasibleError(UserError):
    """No layout satisfies the constraints (memory caps, non-empty stages): no plan."""


def _vector(name: str, values: Sequence[float] | None, length: int, what: str) -> tuple[float, ...] | None:
    if values is None:
        return None
    try:
        out = tuple(map(float, values))
    except (TypeError, ValueError) as e:
        raise ProblemError(f"{name} must be a list of numbers, got {values!r}") from e
    if len(out) != length:
        raise ProblemError(f"{name} has {len(out)} entries but there are {length} {what}; "
                           f"give one value per {what[:-1]}")
    if out and all(map(math.isfinite, out)) and min(out) >= 0:
        return out
    bad = [(i, v) for i, v in enumerate(out) if not math.isfinite(v) or v < 0]
    if bad:
        i, v = bad[0]
        raise ProblemError(f"{name}[{i}] = {v}: values must be finite and >= 0 "
                           f"({len(bad)} bad value(s))")
    return out


@dataclass(frozen=True, kw_only=True)
class BalanceProblem:
    """Inputs of one balancing decision.

    Attributes:
        costs: per-layer cost (seconds per micro-batch, or parameter count), layer 1 first.
        num_stages: pipeline-parallel size.
        memory: per-layer bytes (params + grads + optimizer state + activations);
            None = memory is not constrained.
        move_bytes: bytes that move if the layer migrates; default `memory`, else 0.
            Rounded to whole bytes for the tie-break.
        capacity: per-stage memory capacity in bytes; a scalar applies to every stage;
            None = unlimited.
        extras_cost / extras_memory: per-stage fixed cost / bytes (embedding on the
            first stage, output layer + loss on the last); default 0.
        current: the layout running now (moves and "before" numbers refer to it).
        allow_empty_stages: whether a stage may hold zero decoder layers (Megatron
            accepts empty stages in `pipeline_model_parallel_layout`).
        num_microbatches: micro-batches per iteration, for the predicted 1F1B time.
        param_counts: per-layer parameter counts, the weights of the `parameters`
            baseline (DeepSpeed's static 'parameters' method); optional.
        rebuild_bytes / extras_rebuild_bytes: per-layer / per-stage bytes a migration
            allocates anew for what a stage holds afterwards while the old state still
            lives (the rebuilt gradient buffer); with the received layers they make the
            migration's transient peak, which the gate checks against `capacity`.
        memory_overhead: per-stage bytes a stage holds in training beyond its modelled
            extras and layers (the memory calibration, `balancing.memory`: allocator
            transients, the head's logits); counted against the capacity in every
            steady-state check (`capacity_arr` = capacity - overhead), not in the
            migration's transient peak, which happens between iterations. Default 0.
    Raises:
        ProblemError: malformed inputs (the message names the value and the fix).
        InfeasibleError: a stage's fixed extras alone exceed its capacity.
    """

    costs: Sequence[float]
    num_stages: int
    memory: Sequence[float] | None = None
    move_bytes: Sequence[float] | None = None
    capacity: float | Sequence[float] | None = None
    extras_cost: Sequence[float] | None = None
    extras_memory: Sequence[float] | None = None
    current: Layout | None = None
    allow_empty_stages: bool = False
    num_microbatches: int = 1
    param_counts: Sequence[float] | None = None
    rebuild_bytes: Sequence[float] | None = None
    extras_rebuild_bytes: Sequence[float] | None = None
    memory_overhead: Sequence[float] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.num_stages, bool) or not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ProblemError(f"num_stages must be a positive integer, got {self.num_stages!r}")
        costs = _vector("costs", self.costs, len(self.costs) if self.costs is not None else 0, "layers")
        if not costs:
            raise ProblemError("costs is empty: give one cost per decoder layer")
        n, p = len(costs), self.num_stages
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        set_("costs", costs)
        set_("memory", _vector("memory", self.memory, n, "layers"))
        set_("move_bytes", _vector("move_bytes", self.move_bytes, n, "layers"))
        set_("param_counts", _vector("param_counts", self.param_counts, n, "layers"))
        set_("rebuild_bytes", _vector("rebuild_bytes", self.rebuild_bytes, n, "layers"))
        set_("extras_rebuild_bytes", _vector("extras_rebuild_bytes", self.extras_rebuild_bytes, p,
                                             "stages"))
        set_("extras_cost", _vector("extras_cost", self.extras_cost, p, "stages"))
        set_("extras_memory", _vector("extras_memory", self.extras_memory, p, "stages"))
        set_("memory_overhead", _vector("memory_overhead", self.memory_overhead, p, "stages"))
        set_("capacity", self._checked_capacity())
        if n < p and not self.allow_empty_stages:
            raise ProblemError(f"{n} layers cannot fill {p} stages without empty stages; "
                               "allow empty stages (--allow-empty-stages) or use fewer stages")
        if isinstance(self.num_microbatches, bool) or not isinstance(self.num_microbatches, int) \
                or self.num_microbatches < 1:
            raise ProblemError(f"num_microbatches must be a positive integer, got {self.num_microbatches!r}")
        self._check_current()
        self._check_extras_fit()
        if int(self.move_key.sum()) >= _MAX_KEY:
            raise ProblemError("move_bytes total is too large for the tie-break (> 4 PB); "
                               "give move_bytes in a coarser unit")

    # ---- validation helpers ---------------------------------------------------------
    def _checked_capacity(self) -> tuple[float, ...] | None:
        cap = self.capacity
        if cap is None:
            return None
        if isinstance(cap, (int, float)) and not isinstance(cap, bool):
            cap = [cap] * self.num_stages
        out = tuple(float(c) for c in cap) if not isinstance(cap, str) else None
        if out is None or len(out) != self.num_stages or any(not (c > 0) for c in out):
            raise ProblemError(f"capacity must be a positive number of bytes or one per stage "
                               f"({self.num_stages}), got {self.capacity!r}")
        return out

    def _check_current(self) -> None:
        cur = self.current
        if cur is None:
            return
        if not isinstance(cur, Layout):
            raise ProblemError(f"current must be a Layout (Layout.parse('Ett|ttL')), got {cur!r}")
        if cur.num_stages != self.num_stages or cur.num_layers != self.num_layers:
            raise ProblemError(f"current layout {cur} has {cur.num_stages} stages / {cur.num_layers} "
                               f"layers but the problem has {self.num_stages} / {self.num_layers}")

    def _check_extras_fit(self) -> None:
        for s, (em, cap) in enumerate(zip(self.extras_memory_arr, self.capacity_arr)):
            if em > cap + self.mem_tol:
                over = self.memory_overhead[s] if self.memory_overhead is not None else 0.0
                extra = f" plus a measured overhead of {over:.4g}" if over else ""
                raise InfeasibleError(f"stage {s}: fixed extras need {em:.4g} bytes{extra} but its "
                                      f"capacity is {cap + over:.4g}; raise the capacity")

    # ---- derived views (numpy, cached) --------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.costs)

    @cached_property
    def cost_arr(self) -> np.ndarray:
        return np.asarray(self.costs, dtype=float)

    @cached_property
    def cost_prefix(self) -> np.ndarray:
        """prefix[i] = sum of costs of layers 0..i-1 (0-based), length n+1."""
        return np.concatenate(([0.0], np.cumsum(self.cost_arr)))

    @cached_property
    def memory_arr(self) -> np.ndarray:
        return np.zeros(self.num_layers) if self.memory is None else np.asarray(self.memory, dtype=float)

    @cached_property
    def memory_prefix(self) -> np.ndarray:
        return np.concatenate(([0.0], np.cumsum(self.memory_arr)))

    @cached_property
    def move_bytes_arr(self) -> np.ndarray:
        src = self.move_bytes if self.move_bytes is not None else self.memory
        return np.zeros(self.num_layers) if src is None else np.asarray(src, dtype=float)

    @cached_property
    def move_key(self) -> np.ndarray:
        """Per-layer int64 key: whole bytes * (n+1) + 1, so sums order by (bytes, layers)."""
        return np.rint(self.move_bytes_arr).astype(np.int64) * (self.num_layers + 1) + 1

    @cached_property
    def rebuild_prefix(self) -> np.ndarray:
        rb = self.rebuild_bytes
        return np.concatenate(([0.0], np.cumsum(np.zeros(self.num_layers) if rb is None else rb)))

    @cached_property
    def extras_rebuild_arr(self) -> np.ndarray:
        er = self.extras_rebuild_bytes
        return np.zeros(self.num_stages) if er is None else np.asarray(er, dtype=float)

    @cached_property
    def extras_cost_arr(self) -> np.ndarray:
        ec = self.extras_cost
        return np.zeros(self.num_stages) if ec is None else np.asarray(ec, dtype=float)

    @cached_property
    def extras_memory_arr(self) -> np.ndarray:
        em = self.extras_memory
        return np.zeros(self.num_stages) if em is None else np.asarray(em, dtype=float)

    @cached_property
    def capacity_arr(self) -> np.ndarray:
        """Per-stage bytes the extras and layers may use: capacity - memory_overhead."""
        cap = self.capacity
        if cap is None:
            return np.full(self.num_stages, np.inf)
        over = self.memory_overhead
        return np.asarray(cap, dtype=float) - (0.0 if over is None else np.asarray(over, dtype=float))

    @cached_property
    def load_tol(self) -> float:
        return REL_TOL * float(self.cost_prefix[-1] + self.extras_cost_arr.sum())

    @cached_property
    def mem_tol(self) -> float:
        return REL_TOL * float(self.memory_prefix[-1] + self.extras_memory_arr.sum())

    @property
    def min_layers_per_stage(self) -> int:
        return 0 if self.allow_empty_stages else 1
