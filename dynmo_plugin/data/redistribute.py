"""KnapFormer-style redistribution of whole documents across data-parallel replicas (pure).

After packing, DP replicas can still differ in predicted workload (a rank-local loader
packs only its own documents; a packer that balances micro-batches may leave replica
totals apart). `plan_redistribution` moves whole documents from the heaviest replica
to the lightest, keeping each document's micro-batch index (every replica keeps the
same number of micro-batches) and the `max_seqlen` cap, greedily, while a move lowers
the heavier of the two. The same plan is computed on every rank from the same lengths.
The data itself moves with dynmo_plugin.data.route (one autograd all_to_all_single)
where only the source rank holds it; the launcher's documents are reproducible on
every rank, so it applies the plan by building the moved documents locally.
"""
from __future__ import annotations

from typing import Callable

__all__ = ["plan_redistribution", "replica_workloads"]


def replica_workloads(groups, length: dict, workload: Callable[[int], float]) -> list[float]:
    """Predicted workload per DP replica: the sum over its micro-batches' documents."""
    dp = len(groups[0]) if groups else 0
    return [sum(workload(length[s]) for mb in groups for s in mb[r]) for r in range(dp)]


def plan_redistribution(groups, length: dict, workload: Callable[[int], float], max_seqlen: int,
                        max_moves: int = 1000):
    """(new groups, moves [(id, mb, src, dst)]): whole documents moved between replicas
    until no move lowers the heaviest of the pair."""
    groups = [[list(ids) for ids in mb] for mb in groups]
    moves = []
    for _ in range(max_moves):
        loads = replica_workloads(groups, length, workload)
        h = max(range(len(loads)), key=lambda r: (loads[r], -r))
        lo = min(range(len(loads)), key=lambda r: (loads[r], r))
        gap = loads[h] - loads[lo]
        best = None
        for m, mb in enumerate(groups):
            room = max_seqlen - sum(length[s] for s in mb[lo])
            for s in mb[h]:
                w = workload(length[s])
                if length[s] <= room and 0 < w < gap:
                    score = abs(gap / 2 - w)
                    if best is None or score < best[0]:
                        best = (score, s, m)
        if best is None:
            break
        _, s, m = best
        groups[m][h].remove(s)
        groups[m][lo].append(s)
        moves.append((s, m, h, lo))
    return groups, moves
