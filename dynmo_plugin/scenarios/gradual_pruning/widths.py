"""Which neurons and heads structured pruning keeps, at widths the GPU runs fast.

One global magnitude threshold leaves each layer an arbitrary number of neurons above
it (e.g. 2703 of 8192); a bf16 GEMM at such a width falls to slow kernels (on an H200
an FFN at width 2703 ran 1.956x the dense 8192-wide FFN, at 2688 or 2816 0.49x:
../shared/notes/h200-acceptance-1.md). So, as width-pruned models do (Minitron), the
global ranking decides how many neurons each layer deserves, and each layer then keeps
its highest-scoring neurons at that count rounded to the nearest `multiple`
(`shapes.round_nearest`; the full width always allowed). Heads are whole already; their
count is rounded up where head_dim alone would leave a projection width that is no
multiple of 8.

torch only; no process group, no Megatron.
"""
from __future__ import annotations

import math

import torch

from dynmo_plugin.scenarios.shapes import round_nearest, round_up

__all__ = ["GEMM_MULTIPLE", "aligned_width", "keep_top", "kept_head_count"]

# A bf16 GEMM's fast kernels need every dimension a multiple of 8 elements (16 bytes).
GEMM_MULTIPLE = 8


def aligned_width(above: int, multiple: int, full: int, current: int) -> int:
    """Neurons a layer keeps: `above` (how many score at or above the global threshold)
    rounded to the nearest `multiple`, at least one multiple, at most `full` (the width
    the layer was built with) and never more than the `current` kept width (a round
    only prunes: a neuron pruned before stays pruned)."""
    return min(current, round_nearest(above, multiple, full))


def keep_top(score: torch.Tensor, kept: torch.Tensor, width: int) -> torch.Tensor:
    """Bool [n]: the `width` highest `score`s among the `kept` entries (ties: the lower
    index first); pruned entries are never chosen again."""
    ranked = score.float().masked_fill(~kept, -math.inf)
    order = torch.argsort(ranked, descending=True, stable=True)[:width]
    return torch.zeros_like(kept).index_fill_(0, order, True) & kept


def kept_head_count(full_heads: int, current: int, fraction: float, head_dim: int) -> int:
    """Heads a layer keeps when `fraction` of its `full_heads` go: full - floor(fraction *
    full), rounded up to a count whose projection width (count * head_dim) is a multiple
    of 8 (the full count always allowed), at least one head, at most `current`."""
    multiple = GEMM_MULTIPLE // math.gcd(head_dim, GEMM_MULTIPLE)
    want = max(1, full_heads - int(fraction * full_heads))
    return min(current, round_up(want, multiple, full_heads))
