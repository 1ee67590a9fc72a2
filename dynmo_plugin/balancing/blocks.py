"""Balancing in blocks of layers (`BalanceProblem.layer_block` = q > 1).

Megatron's uniform recompute (`--recompute-method uniform --recompute-num-layers q`)
checkpoints each stage's layers q at a time from the stage's first, stepping q up to
the stage's count: a stage holding a count that is not a multiple of q indexes past its
last layer. So every (virtual) stage must hold whole blocks of q consecutive layers,
blocks counted from layer 1.

Rather than teach each balancer the constraint, the problem is solved with each block
as one unit (`coarsen`) and the layout read back in layers (`refine`). This is exact,
not a heuristic: layouts of whole blocks are exactly the layouts whose counts are all
multiples of q, one to one with the coarse layouts; a block's cost, bytes, moved bytes
and rebuilt bytes are its layers' sums, so every stage's load and memory, and the bytes
a move sends, are the same in both problems (moved bytes as the tie-break counts them:
whole bytes per layer). The coarse optimum, tie-break included, is the optimum among the
allowed layouts, and the plan is then scored on the problem in layers.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import numpy as np

from dynmo_plugin.balancing.problem import BalanceProblem
from dynmo_plugin.layout import Layout

__all__ = ["coarsen", "coarse_layout", "refine", "block_sums", "in_blocks"]


def block_sums(values: Optional[Sequence[float]], q: int) -> Optional[tuple[float, ...]]:
    """Per-layer values summed per block of `q` (None stays None)."""
    if values is None:
        return None
    values = [float(v) for v in values]
    return tuple(sum(values[i:i + q]) for i in range(0, len(values), q))


def coarse_layout(layout: Optional[Layout], q: int) -> Optional[Layout]:
    """`layout` with its counts in blocks (they must be multiples of q)."""
    if layout is None or q == 1:
        return layout
    return Layout(tuple(c // q for c in layout.counts), layout.num_chunks, layout.mtp_layers,
                  layout.mtp_stage)


def refine(layout: Layout, q: int) -> Layout:
    """A layout of blocks read back in layers."""
    if q == 1:
        return layout
    return Layout(tuple(c * q for c in layout.counts), layout.num_chunks, layout.mtp_layers,
                  layout.mtp_stage)


def coarsen(problem: BalanceProblem) -> BalanceProblem:
    """The problem with each block of `layer_block` layers as one layer; itself when 1."""
    q = problem.layer_block
    if q == 1:
        return problem
    return dataclasses.replace(
        problem, layer_block=1, costs=block_sums(problem.costs, q),
        memory=block_sums(problem.memory, q),
        # the tie-break's whole bytes per layer, summed (a sum rounded once could order
        # two layouts the other way: 0.55 + 0.55 rounds to 1, two rounded 0.55s to 2)
        move_bytes=block_sums(np.rint(problem.move_bytes_arr), q),
        param_counts=block_sums(problem.param_counts, q),
        rebuild_bytes=block_sums(problem.rebuild_bytes, q),
        current=coarse_layout(problem.current, q))


def in_blocks(problem: BalanceProblem, solver: Callable[[BalanceProblem], Layout]) -> Layout:
    """`solver`'s layout for the problem in blocks, read back in layers."""
    return refine(solver(coarsen(problem)), problem.layer_block)
