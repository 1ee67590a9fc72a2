"""Per-rank operation order of Megatron-Core's pipeline schedules.

The order is copied from megatron-core 0.16.1 `pipeline_parallel/schedules.py`, so the
simulator runs the same program as the real schedule:

* 1F1B (`forward_backward_pipelining_without_interleaving`): rank r runs
  `min(p - r - 1, m)` warm-up forwards, then alternates one forward and one backward,
  then drains the remaining backwards (cool-down).
* Interleaved 1F1B (`forward_backward_pipelining_with_interleaving`): each rank holds
  `v` model chunks; virtual micro-batch k maps to (micro-batch, chunk) through
  `get_schedule_table` (groups of `microbatch_group_size_per_vp_stage` micro-batches,
  chunk by chunk); warm-up is `2 (p - r - 1) + (v - 1) g` virtual micro-batches
  (`get_pp_rank_microbatches`); backward k runs chunk `v - 1 - chunk(k)`.

Pure: no torch, no megatron.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from dynmo_plugin.errors import UserError

__all__ = ["Op", "FORWARD", "BACKWARD", "one_f_one_b", "interleaved", "schedule_table",
           "rank_orders"]

FORWARD = "F"
BACKWARD = "B"


@dataclass(frozen=True)
class Op:
    """One compute step of one rank: forward or backward of `microbatch` on `chunk`."""

    kind: str
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


def one_f_one_b(num_stages: int, num_microbatches: int, rank: int) -> list[Op]:
    """Megatron's non-interleaved 1F1B order for pipeline rank `rank`."""
    warmup = min(num_stages - rank - 1, num_microbatches)
    ops = [Op(FORWARD, i) for i in range(warmup)]
    for i in range(num_microbatches - warmup):
        ops += [Op(FORWARD, warmup + i), Op(BACKWARD, i)]
    ops += [Op(BACKWARD, i) for i in range(num_microbatches - warmup, num_microbatches)]
    return ops


def schedule_table(num_microbatches: int, num_chunks: int, group_size: int) -> list[tuple[int, int]]:
    """(micro-batch, chunk) of each virtual micro-batch; Megatron's `get_schedule_table`."""
    table: list[tuple[int, int]] = []
    for lo in range(0, num_microbatches, group_size):
        hi = num_microbatches if lo + group_size >= num_microbatches else lo + group_size
        table += [(mb, c) for c in range(num_chunks) for mb in range(lo, hi)]
    return table


def interleaved(num_stages: int, num_microbatches: int, rank: int, num_chunks: int,
                group_size: int | None = None) -> list[Op]:
    """Megatron's interleaved 1F1B order for `rank` holding `num_chunks` model chunks."""
    g = num_stages if group_size is None else group_size
    if not num_stages <= g <= num_microbatches:
        raise UserError(f"interleaved schedule needs pp ({num_stages}) <= micro-batch group "
                        f"size ({g}) <= micro-batches ({num_microbatches}), as Megatron checks")
    table = schedule_table(num_microbatches, num_chunks, g)
    total = len(table)
    warmup = min(2 * (num_stages - rank - 1) + (num_chunks - 1) * g, total)

    def fwd(k: int) -> Op:
        return Op(FORWARD, table[k][0], table[k][1])

    def bwd(k: int) -> Op:
        return Op(BACKWARD, table[k][0], num_chunks - 1 - table[k][1])

    ops = [fwd(k) for k in range(warmup)]
    for k in range(total - warmup):
        ops += [fwd(k + warmup), bwd(k)]
    ops += [bwd(k) for k in range(total - warmup, total)]
    return ops


@functools.lru_cache(maxsize=64)
def rank_orders(num_stages: int, num_microbatches: int, num_chunks: int = 1,
                group_size: int | None = None) -> tuple[tuple[Op, ...], ...]:
    """Operation order of every rank; `num_chunks > 1` selects the interleaved schedule.
    Cached (a campaign asks for the same orders hundreds of times), hence tuples."""
    if num_stages < 1 or num_microbatches < 1 or num_chunks < 1:
        raise UserError(f"need pp >= 1, micro-batches >= 1 and chunks >= 1; got pp={num_stages}, "
                        f"micro-batches={num_microbatches}, chunks={num_chunks}")
    if num_chunks == 1:
        return tuple(tuple(one_f_one_b(num_stages, num_microbatches, r)) for r in range(num_stages))
    return tuple(tuple(interleaved(num_stages, num_microbatches, r, num_chunks, group_size))
                 for r in range(num_stages))
