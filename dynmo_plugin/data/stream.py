"""Packed micro-batches of documents, iteration by iteration, identical on every rank.

`PackedDocuments` draws pieces from a `DocumentStream`, lets the outlier queues hold
back long ones (WLB-LLM), packs the rest with a packer from dynmo_plugin.data.packing
into DP x micro-batch bins of `max_seqlen` positions, and builds this rank's
micro-batches in the THD layout Megatron's packed attention reads: one row of
`max_seqlen` positions per micro-batch, documents back to back, padding at the end
(`loss_mask` 0, outside every document), positions restarting at each document, and
`cu_seqlens` (int32, the document boundaries; padding not included) for per-document
causal attention.

Per iteration the stream offers the packer: documents released by the outlier queues,
documents left over last iteration, then new pieces in stream order until the offered
positions reach the global batch's capacity (DP x micro-batches x max_seqlen). What a
packer leaves out is offered again next iteration; nothing is dropped. Plans are pure
functions of (seed, configuration, the cost model in force, iteration), computed in
iteration order and cached. The cost model (data.cost_model) is what WLB packing and the
redistribution balance: a prior (length^p) until a fitted one is set
(`set_cost_model`, from data.calibration at the start of a run); it applies to the
iterations planned after it is set. `state_dict` is the whole state as plain data
(position, carry-over, outlier queues, cost model): a checkpoint stores it and a
resumed run loads it (dynmo_plugin.session); without it, a resume replays the plans
before its first iteration (packing only, no tokens read), which restores the queues
exactly only while the cost model is the prior.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Optional

import numpy as np
import torch

from dynmo_plugin.data.cost_model import CostModel, PowerCost, model_from_dict, model_to_dict
from dynmo_plugin.data.documents import DocumentStream, Piece
from dynmo_plugin.data.packing import AdaptiveBatcher, OutlierQueues, WlbPacker
from dynmo_plugin.data.redistribute import plan_redistribution

__all__ = ["PackedDocuments", "IterationPlan"]


@dataclass
class IterationPlan:
    groups: list[list[list[int]]]          # [mb][dp rank] -> piece ids
    pieces: dict[int, Piece]               # every piece placed this iteration
    pulled: list[int]                      # ids newly drawn from the stream
    leftover: list[int]                    # offered, not placed (offered again next time)
    queued: list[int]                      # held in the outlier queues after this iteration
    packing_s: float = 0.0                 # wall seconds spent planning this iteration
    lengths: list[list[list[int]]] = field(default_factory=list)  # like groups, lengths
    moves: list = field(default_factory=list)  # redistribution: (id, mb, src rank, dst rank)
    mix: tuple = (0, 0, 0.0)  # over all micro-batches: (count, sum of positions, sum of l^2)


class PackedDocuments:
    """Micro-batches of packed documents; `micro_batches` matches SyntheticTokens'."""

    def __init__(self, stream: DocumentStream, packer, max_seqlen: int, dp_size: int,
                 num_microbatches: int, outliers: Optional[OutlierQueues] = None,
                 redistribute: bool = False, cost_model: Optional[CostModel] = None):
        """`redistribute`: after packing, move whole documents between DP replicas to even
        their predicted workload (data.redistribute); `cost_model`: the prior (default
        PowerCost(2))."""
        self.stream, self.packer, self.outliers = stream, packer, outliers
        self.redistribute = redistribute
        self.cost_model: CostModel = PowerCost() if cost_model is None else cost_model
        self.set_cost_model(self.cost_model)
        self.max_seqlen, self.dp_size, self.num_microbatches = max_seqlen, dp_size, num_microbatches
        self.cursor = 0
        self.carry: list[int] = []
        self.plans: dict[int, IterationPlan] = {}
        self._planned = 0
        self.mix_history: dict[int, tuple] = {}   # iteration -> IterationPlan.mix (last 64)
        self.mix_total = [0, 0, 0.0]              # the same, summed over the run
        self.layer_models: dict[int, CostModel] = {}  # fitted per layer (data.calibration)

    def set_cost_model(self, model: CostModel) -> None:
        """Balance the iterations planned from now on by `model` (WLB packing and the DP
        redistribution both use its `doc_workload`)."""
        self.cost_model = model
        if isinstance(self.packer, WlbPacker):
            self.packer.workload = model.doc_workload
        elif isinstance(self.packer, AdaptiveBatcher):
            self.packer.use(model)

    def _mix(self, lengths) -> tuple:
        shapes = [self.cost_shape(x) for mb in lengths for x in mb]
        return (len(shapes), sum(t for _, t in shapes),
                float(sum(n * n for ls, _ in shapes for n in ls)))

    def mix(self, first: int, last: int) -> tuple:
        """(micro-batches, positions, sum of squared lengths) of iterations first..last,
        as far as they are remembered (the last 64 planned)."""
        rows = [self.mix_history[i] for i in range(first, last + 1) if i in self.mix_history]
        return tuple(sum(col) for col in zip(*rows)) if rows else (0, 0, 0.0)

    @property
    def adaptive(self) -> bool:
        """Unpacked micro-batches of B(S) padded rows (AdaptiveLoad), not one packed row."""
        return isinstance(self.packer, AdaptiveBatcher)

    def cost_shape(self, lengths: list[int]) -> tuple[list[int], int]:
        """(lengths, positions) a micro-batch of these documents costs as: packed, the
        documents in one row of max_seqlen; adaptive, B rows of the bucket's length S,
        each attending over all S (padding included)."""
        if not self.adaptive:
            return list(lengths), self.max_seqlen
        S = self.packer.bucket(max(lengths, default=1))
        rows = max(len(lengths), 1)
        return [S] * rows, S * rows

    @property
    def capacity(self) -> int:
        """Positions offered per iteration: every bin's worth (rows of max_seqlen, or
        adaptive micro-batches of up to mem_tokens)."""
        per_bin = self.packer.mem_tokens if self.adaptive else self.max_seqlen
        return self.dp_size * self.num_microbatches * per_bin

    # ---- planning ---------------------------------------------------------------------------
    def plan(self, iteration: int) -> IterationPlan:
        """The packing of iteration `iteration` (1-based), planning earlier ones first."""
        while self._planned < iteration:
            self._planned += 1
            self.plans[self._planned] = self._plan_next()
            self.plans.pop(self._planned - 8, None)
        if iteration not in self.plans:
            raise ValueError(f"iteration {iteration} was planned and forgotten; plans are kept "
                             "for the last 8 iterations only")
        return self.plans[iteration]

    def _plan_next(self) -> IterationPlan:
        start = time.perf_counter()
        piece = self.stream.piece
        released = self.outliers.release() if self.outliers else []
        offered = [(s, n) for s, n in released] + [(s, piece(s).length) for s in self.carry]
        first = {s for s, _ in offered}
        pulled, total = [], sum(n for _, n in offered)
        while total < self.capacity:
            p = piece(self.cursor)
            self.cursor += 1
            pulled.append(p.id)
            if self.outliers is not None and self.outliers.admit(p.id, p.length):
                continue
            offered.append((p.id, p.length))
            total += p.length
        if isinstance(self.packer, WlbPacker):
            groups = self.packer.get_groups_and_subsamples(offered, first=first)
        else:
            groups = self.packer.get_groups_and_subsamples(offered)
        self.carry = list(self.packer.leftover)
        moves = []
        if self.redistribute and self.dp_size > 1:
            groups, moves = plan_redistribution(groups, {s: piece(s).length for mb in groups
                                                         for ids in mb for s in ids},
                                                self.cost_model.doc_workload, self.max_seqlen)
        if self.outliers is not None:
            self.outliers.tick()
        pieces = {s: piece(s) for mb in groups for ids in mb for s in ids}
        plan = IterationPlan(groups, pieces, pulled, list(self.carry),
                             self.outliers.pending() if self.outliers else [])
        plan.lengths = [[[pieces[s].length for s in ids] for ids in mb] for mb in groups]
        plan.moves = moves
        plan.mix = self._mix(plan.lengths)
        self.mix_history[self._planned] = plan.mix  # _planned: the iteration being planned
        self.mix_history.pop(self._planned - 64, None)
        self.mix_total = [a + b for a, b in zip(self.mix_total, plan.mix)]
        plan.packing_s = time.perf_counter() - start
        return plan

    # ---- micro-batches ----------------------------------------------------------------------
    def micro_batches(self, iteration: int, dp_rank: int, dp_size: int,
                      device: torch.device | str = "cpu") -> Iterator[dict]:
        """This replica's packed micro-batches of iteration `iteration`."""
        if dp_size != self.dp_size:
            raise ValueError(f"the stream was built for DP={self.dp_size}, asked for DP={dp_size}")
        plan = self.plan(iteration)
        for mb in plan.groups:
            yield self.build([plan.pieces[s] for s in mb[dp_rank]], device)

    def build(self, pieces: list[Piece], device: torch.device | str = "cpu") -> dict:
        """One micro-batch of `pieces`: THD, padded to max_seqlen positions; or, adaptive,
        one row per piece padded to its bucket's length."""
        if self.adaptive:
            return self._build_rows(pieces, device)
        L = self.max_seqlen
        tokens = np.zeros(L + 1, dtype=np.int64)
        positions = np.zeros(L, dtype=np.int64)
        lengths = [p.length for p in pieces]
        at = 0
        labels = np.zeros(L, dtype=np.int64)
        for p in pieces:
            t = self.stream.tokens(p)
            tokens[at:at + p.length] = t[:-1]
            labels[at:at + p.length] = t[1:]
            positions[at:at + p.length] = np.arange(p.length)
            at += p.length
        loss_mask = np.zeros(L, dtype=np.float32)
        loss_mask[:at] = 1.0
        cu, padded = _boundaries(lengths, L)
        as_t = torch.from_numpy
        return {
            "tokens": as_t(tokens[:L])[None].to(device),
            "labels": as_t(labels)[None].to(device),
            "position_ids": as_t(positions)[None].to(device),
            "attention_mask": None,
            "loss_mask": as_t(loss_mask)[None].to(device),
            "cu_seqlens": as_t(cu).to(device),
            "cu_seqlens_padded": as_t(padded).to(device),
            "max_seqlen": max(lengths, default=0),
            "lengths": lengths,
        }

    def _build_rows(self, pieces: list[Piece], device) -> dict:
        """[B, S] rows, one document each from position 0, padding at the end (loss_mask
        0); causal attention within a row is attention within its document. No pieces:
        one padding row of the smallest bucket (loss 0)."""
        S = self.packer.bucket(max((p.length for p in pieces), default=1))
        B = max(len(pieces), 1)
        tokens = np.zeros((B, S), dtype=np.int64)
        labels = np.zeros((B, S), dtype=np.int64)
        loss_mask = np.zeros((B, S), dtype=np.float32)
        for row, p in enumerate(pieces):
            t = self.stream.tokens(p)
            tokens[row, :p.length], labels[row, :p.length] = t[:-1], t[1:]
            loss_mask[row, :p.length] = 1.0
        causal = torch.triu(torch.ones(S, S, dtype=torch.bool), 1)[None, None]
        as_t = torch.from_numpy
        return {"tokens": as_t(tokens).to(device), "labels": as_t(labels).to(device),
                "position_ids": torch.arange(S).expand(B, S).to(device),
                "attention_mask": causal.to(device), "loss_mask": as_t(loss_mask).to(device),
                "lengths": [p.length for p in pieces]}

    # ---- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Plain data (JSON): where the stream is, what is carried over, the outlier
        queues and the cost model in force; the same on every rank."""
        return {"kind": "packed", "planned": self._planned, "cursor": self.cursor,
                "carry": list(self.carry),
                "outliers": self.outliers.state_dict() if self.outliers else None,
                "cost_model": model_to_dict(self.cost_model), "mix_total": list(self.mix_total),
                "layer_models": {str(k): model_to_dict(m) for k, m in self.layer_models.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Continue after the iteration `state` was taken at (its plans are not kept:
        planning resumes with the next iteration).

        Raises:
            ValueError: the state is not a packed stream's, or its outlier levels differ
                from this stream's.
        """
        if state.get("kind") != "packed":
            raise ValueError(f"data state of kind {state.get('kind')!r} cannot resume packed "
                             "documents; train with the data options the checkpoint was saved with")
        if (self.outliers is None) != (state["outliers"] is None):
            raise ValueError("the checkpoint's data state and this run disagree on outlier "
                             "queues (--data-outlier-thresholds); use the saved setting")
        self._planned, self.cursor, self.carry = state["planned"], state["cursor"], list(state["carry"])
        self.plans.clear()
        if self.outliers is not None:
            self.outliers.load_state_dict(state["outliers"])
        self.set_cost_model(model_from_dict(state["cost_model"]))
        self.mix_total = list(state.get("mix_total", [0, 0, 0.0]))
        self.layer_models = {int(k): model_from_dict(m)
                             for k, m in state.get("layer_models", {}).items()}


def _boundaries(lengths: list[int], row: int) -> tuple[np.ndarray, np.ndarray]:
    """(cu_seqlens, cu_seqlens_padded) of documents of `lengths` packed from position 0
    of a row of `row` positions. The padded boundaries end at `row`: the trailing
    padding belongs to the last document (as padding, not as tokens), so a THD kernel
    (TE's fused attention) covers every position and none is left uninitialised to
    carry NaN into the loss through a 0 x NaN product. A row with no document is one
    empty document padded to the row."""
    cu = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int32)
    if len(cu) == 1:
        cu = np.zeros(2, dtype=np.int32)
    padded = cu.copy()
    padded[-1] = row
    return cu, padded
