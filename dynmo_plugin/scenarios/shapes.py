"""Sizes the GPU runs fast: a scheme's chosen widths, capacities and chunk lengths,
rounded to a multiple of a granularity.

A bf16 GEMM whose dimensions are not multiples of 8 falls to slow kernels: on an H200 an
FFN at width 2703 (what one global pruning threshold leaves) ran 1.956x the dense
8192-wide FFN, the nearest multiples of 8 or 128 0.48-0.49x
(../shared/notes/h200-acceptance-1.md). Every size a scheme chooses goes through one of
these, and the event reports the size actually used.
"""
from __future__ import annotations

import math

__all__ = ["round_nearest", "round_up"]


def _check(multiple: int, hi: int) -> None:
    if multiple < 1 or hi < 0:
        raise ValueError(f"granularity {multiple} must be >= 1 and the limit {hi} >= 0")


def round_up(n: float, multiple: int, hi: int) -> int:
    """The smallest multiple of `multiple` >= n, at most `hi` (which may itself be no
    multiple: the full, unreduced size is always allowed)."""
    _check(multiple, hi)
    return min(hi, multiple * math.ceil(max(n, 0) / multiple))


def round_nearest(n: float, multiple: int, hi: int, lo: int | None = None) -> int:
    """The multiple of `multiple` nearest n (ties up), within [lo, hi]; `lo` defaults to
    one granule (a layer never reduced to nothing), `hi` is the full size."""
    _check(multiple, hi)
    lo = min(hi, multiple if lo is None else lo)
    return max(lo, min(hi, multiple * math.floor(n / multiple + 0.5)))
