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

Interleaved pipelines (`num_chunks` = v > 1): `num_stages` counts virtual stages
(pp * v, in layer order; virtual stage s runs on rank s % pp, see `layout`), costs and
extras are per virtual stage; the contiguous solvers' min-max objective is over
virtual stages (every chunk is one step of the pipeline), and the exact solver then
lowers the interleaved iteration the gate predicts (`exact`, `interleaved`). Memory
is a property of the rank: `capacity` is per rank and caps the SUM of the rank's
chunks; `capacity_arr` (per virtual stage) is the rank's whole capacity, the relaxation
the contiguous solvers work with, and `metrics.memory_violations` checks the per-rank
sums.
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
            None = unlimited. Interleaved (`num_chunks` > 1): per RANK (pp values), the
            cap on the sum of the rank's chunks.
        extras_cost / extras_memory: per-stage fixed cost / bytes (embedding on the
            first stage, output layer + loss on the last; from a profile also the
            extras' share of the optimizer step, `profile_problem.step_shares`);
            default 0.
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
        memory_overhead: per-stage (interleaved: per-rank) bytes a stage holds in training
            beyond its modelled extras and layers (the memory calibration, `balancing.memory`: allocator
            transients, the head's logits); counted against the capacity in every
            steady-state check (`capacity_arr` = capacity - overhead), not in the
            migration's transient peak, which happens between iterations. Default 0.
        num_chunks: virtual stages per pipeline rank (Megatron's
            --num-virtual-stages-per-pipeline-rank); `num_stages` must be a multiple.
        transfer_transient_bytes: device bytes a rank allocates beside a layer buffer it
            sends or receives while checksumming it (`migration.wire.checksum_transient_bytes`:
            bounded by the checksum's chunk, one buffer at a time), added once to the
            migration peak of each rank that sends or receives. Default 0 (CPU: the
            accounted peak has no allocator transients).
        tokens_per_iteration: tokens one pipeline replica trains per iteration
            (micro-batches x micro-batch size x sequence); optional, only to report a
            plan's predicted tokens/s and tokens per GPU-hour (costs must be seconds).
        mtp_layers: Multi-Token Prediction layers (Megatron's --mtp-num-layers), one unit
            placed after every decoder layer (`layout`); 0 = none.
        mtp_stages: the stages the block may take (None: every stage Megatron allows);
            the live controller pins it to its current stage, since live migration
            moves decoder layers only.
        mtp_cost / mtp_memory / mtp_move_bytes: the MTP block's cost, bytes and bytes
            moved with it (default `mtp_memory`), counted on the stage that holds it. Its
            losses' output-layer work stays on the last stage (Megatron computes them
            there wherever the block is): that belongs in the last stage's extras.
        layer_block: every (virtual) stage holds a multiple of this many decoder layers
            (Megatron's uniform recompute, `--recompute-method uniform
            --recompute-num-layers N`, checkpoints a stage's layers N at a time from its
            first and indexes past a count that is not a multiple); `num_layers` and the
            `current` counts must be multiples. The balancers place whole blocks
            (`blocks`). Default 1: any count.
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
    num_chunks: int = 1
    tokens_per_iteration: float | None = None
    transfer_transient_bytes: float = 0.0
    mtp_layers: int = 0
    mtp_cost: float = 0.0
    mtp_memory: float = 0.0
    mtp_move_bytes: float | None = None
    mtp_stages: Sequence[int] | None = None
    layer_block: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.num_stages, bool) or not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ProblemError(f"num_stages must be a positive integer, got {self.num_stages!r}")
        v = self.num_chunks
        if isinstance(v, bool) or not isinstance(v, int) or v < 1 or self.num_stages % v:
            raise ProblemError(f"num_chunks must be a positive integer dividing num_stages "
                               f"({self.num_stages} virtual stages), got {v!r}")
        costs = _vector("costs", self.costs, len(self.costs) if self.costs is not None else 0, "layers")
        if not costs:
            raise ProblemError("costs is empty: give one cost per decoder layer")
        n, p = len(costs), self.num_stages
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        t = self.transfer_transient_bytes
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ProblemError(f"transfer_transient_bytes must be a finite number >= 0, got {t!r}")
        set_("costs", costs)
        set_("memory", _vector("memory", self.memory, n, "layers"))
        set_("move_bytes", _vector("move_bytes", self.move_bytes, n, "layers"))
        set_("param_counts", _vector("param_counts", self.param_counts, n, "layers"))
        set_("rebuild_bytes", _vector("rebuild_bytes", self.rebuild_bytes, n, "layers"))
        set_("extras_rebuild_bytes", _vector("extras_rebuild_bytes", self.extras_rebuild_bytes, p,
                                             "stages"))
        set_("extras_cost", _vector("extras_cost", self.extras_cost, p, "stages"))
        set_("extras_memory", _vector("extras_memory", self.extras_memory, p, "stages"))
        set_("memory_overhead", _vector("memory_overhead", self.memory_overhead, self.num_ranks,
                                        "stages" if self.num_chunks == 1 else "ranks"))
        set_("capacity", self._checked_capacity())
        if n < p and not self.allow_empty_stages:
            raise ProblemError(f"{n} layers cannot fill {p} stages without empty stages; "
                               "allow empty stages (--allow-empty-stages) or use fewer stages")
        if isinstance(self.num_microbatches, bool) or not isinstance(self.num_microbatches, int) \
                or self.num_microbatches < 1:
            raise ProblemError(f"num_microbatches must be a positive integer, got {self.num_microbatches!r}")
        tpi = self.tokens_per_iteration
        if tpi is not None and (isinstance(tpi, bool) or not isinstance(tpi, (int, float))
                                or not (math.isfinite(tpi) and tpi > 0)):
            raise ProblemError(f"tokens_per_iteration must be a finite number > 0, got {tpi!r}")
        self._check_mtp()
        self._check_current()
        self._check_layer_block()
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
            cap = [cap] * self.num_ranks
        out = tuple(float(c) for c in cap) if not isinstance(cap, str) else None
        if out is None or len(out) != self.num_ranks or any(not (c > 0) for c in out):
            per = "stage" if self.num_chunks == 1 else "pipeline rank (it caps the sum of its chunks)"
            raise ProblemError(f"capacity must be a positive number of bytes or one per {per} "
                               f"({self.num_ranks}), got {self.capacity!r}")
        return out

    def _check_mtp(self) -> None:
        k = self.mtp_layers
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ProblemError(f"mtp_layers must be a non-negative integer, got {k!r}")
        for name in ("mtp_cost", "mtp_memory", "mtp_move_bytes"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value < 0:
                raise ProblemError(f"{name} must be a finite number >= 0, got {value!r}")
            if value and not k:
                raise ProblemError(f"{name} = {value} but the problem has no MTP layers; "
                                   "give mtp_layers")

        stages = self.mtp_stages
        if stages is not None:
            try:
                stages = tuple(sorted({int(s) for s in stages}))
            except (TypeError, ValueError):
                stages = ()
            if not stages or not k or any(not 0 <= s < self.num_stages for s in stages):
                raise ProblemError(f"mtp_stages must be stages of {self.num_stages} (with MTP "
                                   f"layers), got {self.mtp_stages!r}")
            object.__setattr__(self, "mtp_stages", stages)

    @property
    def mtp_move_bytes_value(self) -> float:
        """Bytes a move of the MTP block sends: `mtp_move_bytes`, else `mtp_memory`."""
        return float(self.mtp_memory if self.mtp_move_bytes is None else self.mtp_move_bytes)

    def _check_current(self) -> None:
        cur = self.current
        if cur is None:
            return
        if isinstance(cur, Layout) and cur.mtp_layers != self.mtp_layers:
            raise ProblemError(f"current layout {cur} has {cur.mtp_layers} MTP layers but the "
                               f"problem has {self.mtp_layers} (mtp_layers)")
        if not isinstance(cur, Layout):
            raise ProblemError(f"current must be a Layout (Layout.parse('Ett|ttL')), got {cur!r}")
        if cur.num_stages != self.num_stages or cur.num_layers != self.num_layers \
                or cur.num_chunks != self.num_chunks:
            raise ProblemError(f"current layout {cur} has {cur.num_stages} stages / {cur.num_layers} "
                               f"layers / {cur.num_chunks} chunks per rank but the problem has "
                               f"{self.num_stages} / {self.num_layers} / {self.num_chunks}")

    def _check_layer_block(self) -> None:
        q, n, p = self.layer_block, self.num_layers, self.num_stages
        if isinstance(q, bool) or not isinstance(q, int) or q < 1:
            raise ProblemError(f"layer_block must be a positive integer, got {q!r}")
        if n % q:
            raise ProblemError(f"{n} layers cannot be placed in blocks of {q} (layer_block, "
                               f"--recompute-num-layers {q}): give a layer count that is a multiple")
        if n // q < p and not self.allow_empty_stages:
            raise ProblemError(f"{n} layers in blocks of {q} cannot fill {p} stages without empty "
                               "stages; allow empty stages (--allow-empty-stages) or use fewer stages")
        cur = self.current
        split = [s for s, c in enumerate(cur.counts) if c % q] if cur is not None else []
        if split:
            raise ProblemError(f"current layout {cur}: stage(s) {split} hold a layer count that is "
                               f"not a multiple of layer_block {q}")

    def _check_extras_fit(self) -> None:
        extras = self.per_rank(self.extras_memory_arr)
        for r, (em, cap) in enumerate(zip(extras, self.rank_capacity_arr)):
            if em > cap + self.mem_tol:
                where = f"stage {r}" if self.num_chunks == 1 else f"rank {r}"
                over = self.memory_overhead[r] if self.memory_overhead is not None else 0.0
                extra = f" plus a measured overhead of {over:.4g}" if over else ""
                raise InfeasibleError(f"{where}: fixed extras need {em:.4g} bytes{extra} but its "
                                      f"capacity is {cap + over:.4g}; raise the capacity")

    # ---- derived views (numpy, cached) --------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.costs)

    @property
    def num_ranks(self) -> int:
        """Pipeline ranks: `num_stages` when not interleaved."""
        return self.num_stages // self.num_chunks

    @cached_property
    def stage_rank(self) -> np.ndarray:
        """Rank of each (virtual) stage: s % pp, Megatron's numbering."""
        return np.arange(self.num_stages) % self.num_ranks

    def per_rank(self, values: Sequence[float]) -> np.ndarray:
        """Per-stage values summed over each rank's chunks."""
        return np.bincount(self.stage_rank, weights=np.asarray(values, dtype=float),
                           minlength=self.num_ranks)

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
    def rank_capacity_arr(self) -> np.ndarray:
        """Per-rank (= per-stage when not interleaved) bytes the extras and layers may
        use: capacity - memory_overhead."""
        cap = self.capacity
        if cap is None:
            return np.full(self.num_ranks, np.inf)
        over = self.memory_overhead
        return np.asarray(cap, dtype=float) - (0.0 if over is None else np.asarray(over, dtype=float))

    @cached_property
    def capacity_arr(self) -> np.ndarray:
        """Per (virtual) stage: its rank's capacity_arr; interleaved, a relaxation (module doc)."""
        return self.rank_capacity_arr[self.stage_rank]

    @cached_property
    def load_tol(self) -> float:
        return REL_TOL * float(self.cost_prefix[-1] + self.extras_cost_arr.sum())

    @cached_property
    def mem_tol(self) -> float:
        return REL_TOL * float(self.memory_prefix[-1] + self.extras_memory_arr.sum())

    @property
    def min_layers_per_stage(self) -> int:
        return 0 if self.allow_empty_stages else 1
