"""Packing documents into the micro-batches of one global batch (pure: no torch, no megatron).

Every packer follows the contract of Megatron-LM's newer `BasePackingScheduler`:
`get_groups_and_subsamples(sample_id_seqlens) -> groups`, where `sample_id_seqlens` is
a list of (sample id, length) and `groups[mb][dp_rank]` lists the sample ids of
micro-batch `mb` on data-parallel rank `dp_rank`; so a packer here can slot into
Megatron-LM's data path later. Our packers fill a fixed number of micro-batches
(`num_microbatches` per DP rank, at most `max_seqlen` positions each) and leave out
what does not fit: `leftover` (ids, in offered order) is what the caller offers again
next iteration, so nothing is ever dropped.

* `SequentialPacker`: Megatron-style next-fit in the offered order; DP rank r gets a
  contiguous run of micro-batches, as a global batch is split by Megatron's sampler.
* `WlbPacker` (WLB-LLM, Wang et al. 2025): heaviest predicted *workload* first into
  the lightest micro-batch (over all DP x micro-batch bins) that still has room.
* `AdaptiveBatcher` (AdaptiveLoad, unpacked): each micro-batch holds B(S) documents of
  one length bucket S, each padded to S (dense [B, S] rows, shapes differ between
  micro-batches); B(S) comes from the fitted cost model (cost_model.adaptive_batch_sizes).
* `OutlierQueues`: WLB-LLM's multi-level FIFO outlier delay, applied before packing
  by the stream (dynmo_plugin.data.stream): a document at or above a level's length
  threshold waits in that level's queue until the queue holds one document per bin
  (then all are released together and spread one per bin) or until it has waited
  `max_delay` iterations. Its state is plain data (`state_dict`).
"""
from __future__ import annotations

from collections import deque
from typing import Callable, Sequence

from dynmo_plugin.data.cost_model import CostModel, adaptive_batch_sizes, sequence_cost

__all__ = ["SequentialPacker", "WlbPacker", "AdaptiveBatcher", "OutlierQueues", "PACKERS",
           "length_buckets"]

PACKERS = ("sequential", "wlb")

Groups = list[list[list[int]]]


class _Packer:
    def __init__(self, max_seqlen: int, dp_size: int, num_microbatches: int):
        if max_seqlen < 1 or dp_size < 1 or num_microbatches < 1:
            raise ValueError(f"max_seqlen ({max_seqlen}), dp_size ({dp_size}) and "
                             f"num_microbatches ({num_microbatches}) must be positive")
        self.max_seqlen, self.dp_size, self.num_microbatches = max_seqlen, dp_size, num_microbatches
        self.leftover: list[int] = []

    @property
    def num_bins(self) -> int:
        return self.dp_size * self.num_microbatches

    def _check(self, sample_id_seqlens: Sequence[tuple[int, int]]) -> None:
        too_long = [(i, n) for i, n in sample_id_seqlens if n > self.max_seqlen or n < 1]
        if too_long:
            raise ValueError(f"samples {too_long[:3]} do not fit a micro-batch of "
                             f"{self.max_seqlen} positions; cut them first (DocumentStream does)")

    def _groups(self, bins: list[list[int]], bin_of: Callable[[int, int], int]) -> Groups:
        return [[bins[bin_of(mb, r)] for r in range(self.dp_size)]
                for mb in range(self.num_microbatches)]


class SequentialPacker(_Packer):
    """Next-fit in the offered order: a sample that does not fit closes the micro-batch."""

    def get_groups_and_subsamples(self, sample_id_seqlens: Sequence[tuple[int, int]]) -> Groups:
        self._check(sample_id_seqlens)
        bins: list[list[int]] = [[] for _ in range(self.num_bins)]
        b, used, self.leftover = 0, 0, []
        for k, (sid, n) in enumerate(sample_id_seqlens):
            if used + n > self.max_seqlen:
                b, used = b + 1, 0
            if b == self.num_bins:
                self.leftover = [s for s, _ in sample_id_seqlens[k:]]
                break
            bins[b].append(sid)
            used += n
        M = self.num_microbatches
        return self._groups(bins, lambda mb, r: r * M + mb)


class WlbPacker(_Packer):
    """Greedy by workload: heaviest first into the lightest bin with room for it.

    `workload(length) -> float` is a document's predicted cost (e.g. the quadratic part
    of a fitted cost model when micro-batches are padded to a fixed shape). Samples
    listed in `first` (ids) are placed before the rest, heaviest first among them:
    documents carried over or released from an outlier queue, so none waits forever.
    """

    def __init__(self, max_seqlen: int, dp_size: int, num_microbatches: int,
                 workload: Callable[[int], float]):
        super().__init__(max_seqlen, dp_size, num_microbatches)
        self.workload = workload
        self.bin_workload: list[float] = []

    def get_groups_and_subsamples(self, sample_id_seqlens: Sequence[tuple[int, int]],
                                  first: frozenset | set = frozenset()) -> Groups:
        self._check(sample_id_seqlens)
        order = sorted(range(len(sample_id_seqlens)), key=lambda k: (
            sample_id_seqlens[k][0] not in first, -self.workload(sample_id_seqlens[k][1]), k))
        bins: list[list[int]] = [[] for _ in range(self.num_bins)]
        load, room = [0.0] * self.num_bins, [self.max_seqlen] * self.num_bins
        placed = set()
        for k in order:
            sid, n = sample_id_seqlens[k]
            fits = [b for b in range(self.num_bins) if room[b] >= n]
            if not fits:
                continue
            b = min(fits, key=lambda i: (load[i], i))
            bins[b].append(sid)
            load[b] += self.workload(n)
            room[b] -= n
            placed.add(k)
        self.leftover = [sample_id_seqlens[k][0] for k in range(len(sample_id_seqlens))
                         if k not in placed]
        self.bin_workload = load
        M = self.num_microbatches
        return self._groups(bins, lambda mb, r: r * M + mb)


def length_buckets(max_seqlen: int, count: int = 4, smallest: int = 8) -> list[int]:
    """Bucket lengths max_seqlen, max_seqlen/2, ... (`count` of them, none below
    `smallest`), ascending: a document goes to the smallest bucket that holds it."""
    out = [max_seqlen >> j for j in range(count) if (max_seqlen >> j) >= smallest]
    return sorted(set(out)) or [max_seqlen]


class AdaptiveBatcher(_Packer):
    """AdaptiveLoad: micro-batches of `batch_sizes[S]` documents of bucket S.

    Documents join their bucket's open batch in offered order; a batch that reaches its
    size is complete. Once DP x micro-batches batches are complete the rest is left over;
    if the offer runs out first, the fullest open batches fill the remaining bins. The
    batches are dealt to DP ranks heaviest first (`cost(S) x documents`) onto the rank
    with the least so far, so replicas carry similar predicted work.
    """

    def __init__(self, max_seqlen: int, dp_size: int, num_microbatches: int,
                 buckets: Sequence[int], mem_tokens: int, model: CostModel):
        """`mem_tokens` (M_mem): positions one micro-batch may hold; `model`: the cost
        model B(S) follows (`use` replaces it)."""
        super().__init__(max_seqlen, dp_size, num_microbatches)
        if sorted(buckets) != list(buckets) or buckets[-1] != max_seqlen:
            raise ValueError(f"buckets {list(buckets)} must ascend to max_seqlen ({max_seqlen})")
        if mem_tokens < max_seqlen:
            raise ValueError(f"mem_tokens ({mem_tokens}) must hold one row of {max_seqlen}")
        self.buckets, self.mem_tokens = list(buckets), mem_tokens
        self.use(model)

    def use(self, model: CostModel) -> None:
        """Batch sizes and replica dealing from `model` (for batches formed from now on)."""
        self.batch_sizes = adaptive_batch_sizes(model, self.buckets, self.mem_tokens,
                                                self.max_seqlen)
        self.cost = lambda S: sequence_cost(model, S)

    def bucket(self, length: int) -> int:
        return next(b for b in self.buckets if b >= length)

    def get_groups_and_subsamples(self, sample_id_seqlens: Sequence[tuple[int, int]]) -> Groups:
        self._check(sample_id_seqlens)
        open_: dict[int, list[int]] = {}
        full: list[tuple[int, list[int]]] = []
        for sid, n in sample_id_seqlens:
            S = self.bucket(n)
            open_.setdefault(S, []).append(sid)
            if len(open_[S]) >= self.batch_sizes[S]:
                full.append((S, open_.pop(S)))
                if len(full) == self.num_bins:
                    break
        partial = sorted(open_.items(), key=lambda kv: (-len(kv[1]), -kv[0]))
        full += partial[:self.num_bins - len(full)]
        placed = {s for _, ids in full for s in ids}
        self.leftover = [s for s, _ in sample_id_seqlens if s not in placed]
        bins: list[list[list[int]]] = [[] for _ in range(self.dp_size)]
        load = [0.0] * self.dp_size
        for S, ids in sorted(full, key=lambda b: (-self.cost(b[0]) * len(b[1]), b[1][0])):
            r = min((r for r in range(self.dp_size) if len(bins[r]) < self.num_microbatches),
                    key=lambda r: (load[r], r))
            bins[r].append(ids)
            load[r] += self.cost(S) * len(ids)
        for r in range(self.dp_size):
            bins[r] += [[] for _ in range(self.num_microbatches - len(bins[r]))]
        return [[bins[r][mb] for r in range(self.dp_size)] for mb in range(self.num_microbatches)]


class OutlierQueues:
    """WLB-LLM's multi-level FIFO outlier delay.

    `thresholds` (ascending lengths): a document of length >= thresholds[k] (and below
    thresholds[k+1]) is an outlier of level k. A level releases all its documents once
    it holds `num_bins` of them, else each document once it has waited `max_delay`
    iterations (FIFO: the oldest first).
    """

    def __init__(self, thresholds: Sequence[int], num_bins: int, max_delay: int):
        if list(thresholds) != sorted(set(thresholds)) or any(t < 1 for t in thresholds):
            raise ValueError(f"outlier thresholds must be ascending positive lengths, got {list(thresholds)}")
        if max_delay < 0 or num_bins < 1:
            raise ValueError(f"max_delay ({max_delay}) must be >= 0 and num_bins ({num_bins}) >= 1")
        self.thresholds, self.num_bins, self.max_delay = list(thresholds), num_bins, max_delay
        self.queues: list[deque] = [deque() for _ in self.thresholds]  # [sample id, length, age]

    def level(self, length: int) -> int:
        """The queue a document of this length waits in, or -1 (not an outlier)."""
        return max((k for k, t in enumerate(self.thresholds) if length >= t), default=-1)

    def admit(self, sid: int, length: int) -> bool:
        """Queue the document if it is an outlier (True), else leave it to the caller."""
        k = self.level(length) if self.max_delay > 0 else -1
        if k < 0:
            return False
        self.queues[k].append([sid, length, 0])
        return True

    def release(self) -> list[tuple[int, int]]:
        """(sample id, length) of the documents leaving the queues this iteration."""
        out = []
        for q in self.queues:
            if len(q) >= self.num_bins:
                out += [(s, n) for s, n, _ in q]
                q.clear()
            while q and q[0][2] >= self.max_delay:
                s, n, _ = q.popleft()
                out.append((s, n))
        return out

    def tick(self) -> None:
        """One iteration passed: every queued document has waited one more."""
        for q in self.queues:
            for entry in q:
                entry[2] += 1

    def pending(self) -> list[int]:
        return [s for q in self.queues for s, _, _ in q]

    def state_dict(self) -> dict:
        return {"thresholds": self.thresholds, "queues": [[list(e) for e in q] for q in self.queues]}

    def load_state_dict(self, state: dict) -> None:
        if state["thresholds"] != self.thresholds:
            raise ValueError(f"saved outlier thresholds {state['thresholds']} differ from the "
                             f"configured {self.thresholds}")
        self.queues = [deque([list(e) for e in q]) for q in state["queues"]]
