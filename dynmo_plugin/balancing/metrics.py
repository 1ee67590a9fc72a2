"""Pure helpers that score a layout: stage loads, memory, imbalance, predicted time.

Loads use the same formula as the solvers (``extras + (prefix[j] - prefix[i])``) so a
plan's reported bottleneck is exactly what the solver compared against.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from dynmo_plugin.balancing.problem import BalanceProblem
from dynmo_plugin.layout import Layout

__all__ = ["stage_loads", "stage_memory", "rank_memory", "moved_layers", "migration_peak_memory",
           "repack_rebuild_extras", "repack_rebuild_memory", "imbalance",
           "predicted_iteration_s", "memory_violations", "empty_stages", "feasibility_problems"]


def _segments(layout: Layout) -> tuple[np.ndarray, np.ndarray]:
    b = np.asarray(layout.boundaries)
    return b[:-1], b[1:]


def stage_loads(problem: BalanceProblem, layout: Layout) -> list[float]:
    """Per-stage load: extras cost + the stage's layer costs."""
    lo, hi = _segments(layout)
    pre = problem.cost_prefix
    loads = problem.extras_cost_arr + (pre[hi] - pre[lo])
    if layout.mtp_stage is not None:
        loads[layout.mtp_stage] += problem.mtp_cost
    return loads.tolist()


def stage_memory(problem: BalanceProblem, layout: Layout) -> list[float]:
    """Per-stage bytes: extras memory + the stage's layer memory."""
    lo, hi = _segments(layout)
    pre = problem.memory_prefix
    memory = problem.extras_memory_arr + (pre[hi] - pre[lo])
    if layout.mtp_stage is not None:
        memory[layout.mtp_stage] += problem.mtp_memory
    return memory.tolist()


def rank_memory(problem: BalanceProblem, layout: Layout) -> list[float]:
    """Per-rank bytes: the sum of the rank's (virtual) stages; = stage_memory when not
    interleaved. Memory caps apply to these."""
    return problem.per_rank(stage_memory(problem, layout)).tolist()


def moved_layers(before: Layout, after: Layout) -> list[tuple[int, int, int]]:
    """(layer, src stage, dst stage) for each layer `after` places elsewhere: the same
    list as `before.moved_layers(after)`, from the boundaries in O(p + moved)."""
    a, b = before.boundaries, after.boundaries
    if a[-1] != b[-1]:
        return before.moved_layers(after)  # raises LayoutError with the message
    out: list[tuple[int, int, int]] = []
    s = t = x = 0
    while x < a[-1]:
        while a[s + 1] <= x:
            s += 1
        while b[t + 1] <= x:
            t += 1
        y = min(a[s + 1], b[t + 1])
        if s != t:
            out.extend((layer, s, t) for layer in range(x + 1, y + 1))
        x = y
    return out


def migration_peak_memory(problem: BalanceProblem, before: Layout, after: Layout, *,
                          moved: list[tuple[int, int, int]] | None = None,
                          memory_before: list[float] | None = None) -> list[float]:
    """Per-rank bytes while a migration from `before` to `after` is prepared (a rank is
    a stage when not interleaved).

    Migration is atomic: until every rank agrees, the old state stays live beside the
    new — the stage's memory before, plus each incoming layer twice (the receive buffer
    and the built layer with its optimizer state), plus what is rebuilt for the stage's
    new contents (gradient buffers). Outgoing layers are freed only after the commit.
    A rank that sends or receives also holds the checksum's transient once
    (`problem.transfer_transient_bytes`).
    `moved` (`moved_layers(before, after)`) and `memory_before` (`stage_memory(problem,
    before)`) may be passed when the caller has them. A layer that changes chunk but not
    rank (interleaved) is not received: it moves without a copy.
    """
    incoming = [0.0] * problem.num_stages
    move_bytes, rank = problem.move_bytes_arr, problem.stage_rank
    transferring: set[int] = set()  # ranks that send or receive (checksum transients)
    for layer, src, dst in moved_layers(before, after) if moved is None else moved:
        if rank[src] != rank[dst]:
            incoming[dst] += float(move_bytes[layer - 1])
            transferring.update((int(rank[src]), int(rank[dst])))
    if before.has_mtp and after.has_mtp and before.mtp_moved(after):
        incoming[after.mtp_stage] += problem.mtp_move_bytes_value  # the MTP block, received
        transferring.update((int(rank[before.mtp_stage]), int(rank[after.mtp_stage])))
    lo, hi = _segments(after)
    rebuilt = problem.extras_rebuild_arr + (problem.rebuild_prefix[hi] - problem.rebuild_prefix[lo])
    if memory_before is None:
        memory_before = stage_memory(problem, before)
    peak = [m + 2 * i + r for m, i, r in zip(memory_before, incoming, rebuilt.tolist())]
    if problem.num_chunks > 1:
        peak = problem.per_rank(peak).tolist()
    return [m + (problem.transfer_transient_bytes if r in transferring else 0.0)
            for r, m in enumerate(peak)]


def repack_rebuild_extras(problem: BalanceProblem, shrunk: BalanceProblem) -> np.ndarray:
    """Per surviving rank (0..K-1 of `shrunk`'s K), the part of `repack_rebuild_memory`
    that does not depend on the split: its old stages' extras (`problem`'s, per rank)
    + its new stages' (`shrunk`'s) + on rank K-1 the received head (`problem`'s last
    extras), when K < P."""
    k = shrunk.num_ranks
    fixed = problem.per_rank(problem.extras_memory_arr)[:k] + shrunk.per_rank(shrunk.extras_memory_arr)
    if k < problem.num_ranks:  # the head was handed over (K = P moves no head)
        fixed[k - 1] += float(problem.extras_memory_arr[-1])
    return fixed


def repack_rebuild_memory(problem: BalanceProblem, shrunk: BalanceProblem,
                          layout: Layout) -> list[float]:
    """Per surviving rank (0..K-1), the bytes held at the peak of a live repack's
    rebuild onto `layout` (K ranks; `shrunk` = `repack.shrink_problem(problem, K)`,
    `problem` the P-rank problem before).

    After the shrink each survivor builds its stage for `layout` while the state it
    captured before the shrink is still alive (megatron/migration/repack.py `_rebuild`): the old
    stage of the intermediate layout (`layout.padded(P)`: the same layers) keeps its
    parameters and optimizer state, which the captured state references (the gathered
    copy with the distributed optimizer), and the new stage allocates its parameters,
    gradient buffer and optimizer state. So a rank holds

        old: its intermediate stage's extras (`problem`) + its layers' state
        new: its new stage's extras (`shrunk`: the embedding on rank 0, the head on
             rank K-1) + the same layers' state
        + on rank K-1 the head received from the old last stage (`problem`'s last
          extras): the head is held twice, the received copy and the built one.

    A layer's state is its `move_bytes` (params + grads + optimizer state: what a
    migration moves); the extras' is `extras_memory` (the same, for the embedding and
    head). The old gradients are counted: with the distributed optimizer the old
    gradient buffer stays referenced until the session rebinds; without it the
    rebuild drops it first, so this overstates that case by the layers' gradient bytes
    (`rebuild_bytes`), conservatively (the problem does not say which optimizer runs).
    Not counted: activations (the rebuild runs between iterations, when none are held)
    and, with the distributed optimizer, the gathered full optimizer state beyond the
    shard the profile counts (the problem has no data-parallel size). Retiring ranks
    hold nothing after they leave and are not listed. Interleaved: per rank, its
    chunks summed (a rank keeps its chunks, `Layout.padded`). So rank r holds
    `repack_rebuild_extras(...)[r]` + 2 x its layers' state.
    """
    lo, hi = _segments(layout)
    pre = np.concatenate(([0.0], np.cumsum(problem.move_bytes_arr)))
    layers = shrunk.per_rank(pre[hi] - pre[lo])  # rank r's layers: the same before and after
    return (repack_rebuild_extras(problem, shrunk) + 2 * layers).tolist()


def imbalance(loads: Sequence[float]) -> float:
    """DynMo eq. 2: (max - min) / mean; 0 for an all-zero pipeline."""
    arr = np.asarray(loads, dtype=float)
    mean = float(arr.mean()) if arr.size else 0.0
    return 0.0 if mean <= 0 else float((arr.max() - arr.min()) / mean)


def predicted_iteration_s(loads: Sequence[float], num_microbatches: int,
                          num_chunks: int = 1) -> float:
    """Predicted 1F1B iteration time: sum(loads) + (m - 1) * max(loads).

    Identical micro-batches through a p-stage flow shop: the first micro-batch crosses
    every stage (fill + drain = sum of stage loads), each further one leaves at the
    bottleneck's pace. Tighter than (m + p - 1) * max when stages differ; equal when
    balanced. Communication is not modelled.

    Interleaved (`loads` per virtual stage, v = `num_chunks` > 1): the busiest rank's
    work, m * max over ranks of its chunks' sum, plus Megatron's interleaved bubble
    (p - 1) * max(loads), i.e. (p - 1) / (v m) of the ideal time when balanced.
    """
    arr = np.asarray(loads, dtype=float)
    if num_chunks == 1:
        return float(arr.sum() + (num_microbatches - 1) * arr.max())
    pp = arr.size // num_chunks
    per_rank = arr.reshape(num_chunks, pp).sum(axis=0)
    return float(num_microbatches * per_rank.max() + (pp - 1) * arr.max())


def memory_violations(problem: BalanceProblem, layout: Layout) -> list[tuple[int, float, float]]:
    """(rank, bytes, capacity) for each pipeline rank over its capacity (beyond mem_tol);
    a rank is a stage when not interleaved, else the sum of its chunks."""
    mem = rank_memory(problem, layout)
    cap = problem.rank_capacity_arr
    return [(r, m, float(cap[r])) for r, m in enumerate(mem) if m > cap[r] + problem.mem_tol]


def empty_stages(problem: BalanceProblem, layout: Layout) -> list[int]:
    """Stages without layers, when the problem forbids them (else []). A stage holding
    only MTP layers is not empty; the stages after a standalone MTP block must be
    (Megatron's rule), so they are not listed."""
    if problem.allow_empty_stages:
        return []
    mtp = layout.mtp_stage
    return [s for s, c in enumerate(layout.counts)
            if c == 0 and (mtp is None or s < mtp)]


def feasibility_problems(problem: BalanceProblem, layout: Layout) -> list[str]:
    """Human-readable reasons `layout` is not allowed; [] when it is."""
    where = "stage" if problem.num_chunks == 1 else "rank"
    out = [f"{where} {s} needs {m:.4g} bytes > capacity {c:.4g}"
           for s, m, c in memory_violations(problem, layout)]
    empty = empty_stages(problem, layout)
    if empty:
        out.append(f"stage(s) {empty} hold no layers but empty stages are not allowed")
    q = problem.layer_block
    split = [s for s, c in enumerate(layout.counts) if c % q]
    if split:
        out.append(f"stage(s) {split} hold a layer count that is not a multiple of {q} "
                   "(layer_block: Megatron's uniform recompute steps that many layers at a time)")
    return out
