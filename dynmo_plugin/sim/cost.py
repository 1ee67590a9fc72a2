"""Inputs of one simulated iteration: compute costs per stage, links, data parallelism.

Costs are seconds per micro-batch for each *virtual* stage (rank r's chunk c is virtual
stage `c * pp + r`, as Megatron numbers them). A cost may be one number per stage (every
micro-batch the same) or a row per stage with one entry per micro-batch (data-dependent
work such as MoE routing). Communication is alpha-beta: `latency + bytes / bandwidth`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from dynmo_plugin.errors import UserError

__all__ = ["Link", "ring_allreduce_s", "PipelineCosts"]


@dataclass(frozen=True, kw_only=True)
class Link:
    """Alpha-beta model of one point-to-point link.

    latency_s: fixed cost per message (seconds).
    bandwidth_Bps: bytes per second; `inf` makes transfers free beyond the latency.
    """

    latency_s: float = 0.0
    bandwidth_Bps: float = float("inf")

    def __post_init__(self) -> None:
        if not self.latency_s >= 0:
            raise UserError(f"link latency must be >= 0 seconds, got {self.latency_s}")
        if not self.bandwidth_Bps > 0:
            raise UserError(f"link bandwidth must be > 0 bytes/s, got {self.bandwidth_Bps}")

    def transfer_s(self, nbytes: float) -> float:
        return self.latency_s + float(nbytes) / self.bandwidth_Bps


def ring_allreduce_s(nbytes: float, dp: int, link: Link) -> float:
    """Ring all-reduce time (Patarasuk & Yuan): 2(d-1) steps of nbytes/d each.

    `2 (d-1) latency + 2 (d-1)/d * nbytes / bandwidth`; zero for d = 1 or no bytes.
    """
    if dp <= 1 or nbytes <= 0:
        return 0.0
    steps = 2 * (dp - 1)
    return steps * link.latency_s + steps / dp * float(nbytes) / link.bandwidth_Bps


def _as_stage_matrix(name: str, values: Sequence[float] | np.ndarray, stages: int,
                     microbatches: int) -> np.ndarray:
    arr = np.asarray(values, dtype=float)
    if arr.ndim == 1:
        arr = np.repeat(arr[:, None], microbatches, axis=1)
    if arr.shape != (stages, microbatches):
        raise UserError(f"{name}: expected {stages} stage costs (or {stages}x{microbatches}), "
                        f"got shape {np.asarray(values).shape}")
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise UserError(f"{name}: costs must be finite and >= 0 seconds, got {arr.tolist()}")
    return arr


@dataclass(frozen=True, kw_only=True)
class PipelineCosts:
    """Everything one iteration of a pipeline costs.

    fwd_s, bwd_s: per virtual stage (length pp * chunks), seconds per micro-batch; or
        a (stages x micro-batches) matrix.
    num_microbatches: micro-batches per iteration (Megatron's num_microbatches).
    num_chunks: model chunks per rank (virtual pipeline size); 1 = plain 1F1B.
    group_size: interleaved schedule's microbatch_group_size_per_vp_stage (default pp).
    act_bytes: bytes sent between consecutive stages per micro-batch (activation
        forward, its gradient backward).
    p2p: link between neighbouring pipeline ranks.
    dp: data-parallel size; grad_bytes: per rank, bytes all-reduced after the last
        backward (ring over `dp` on `dp_link`); tail_s: per rank, seconds after it
        (optimizer step).
    """

    fwd_s: Sequence[float] | np.ndarray
    bwd_s: Sequence[float] | np.ndarray
    num_microbatches: int
    num_chunks: int = 1
    group_size: int | None = None
    act_bytes: float = 0.0
    p2p: Link = field(default_factory=Link)
    dp: int = 1
    grad_bytes: Sequence[float] | None = None
    dp_link: Link = field(default_factory=Link)
    tail_s: Sequence[float] | None = None

    def __post_init__(self) -> None:
        if self.num_microbatches < 1:
            raise UserError(f"num_microbatches must be >= 1, got {self.num_microbatches}")
        if self.num_chunks < 1:
            raise UserError(f"num_chunks must be >= 1, got {self.num_chunks}")
        if self.dp < 1:
            raise UserError(f"data-parallel size must be >= 1, got {self.dp}")
        if self.act_bytes < 0:
            raise UserError(f"act_bytes must be >= 0, got {self.act_bytes}")
        n = len(np.asarray(self.fwd_s, dtype=float))
        if n % self.num_chunks:
            raise UserError(f"{n} virtual stages cannot be split into {self.num_chunks} chunks per rank")
        m = self.num_microbatches
        object.__setattr__(self, "fwd_s", _as_stage_matrix("fwd_s", self.fwd_s, n, m))
        object.__setattr__(self, "bwd_s", _as_stage_matrix("bwd_s", self.bwd_s, n, m))
        for name in ("grad_bytes", "tail_s"):
            value = getattr(self, name)
            arr = np.zeros(self.num_stages) if value is None else np.asarray(value, dtype=float)
            if arr.shape != (self.num_stages,) or np.any(arr < 0):
                raise UserError(f"{name}: expected {self.num_stages} non-negative values "
                                f"(one per rank), got {np.asarray(value).tolist()}")
            object.__setattr__(self, name, arr)

    @property
    def num_virtual_stages(self) -> int:
        return int(self.fwd_s.shape[0])  # type: ignore[union-attr]

    @property
    def num_stages(self) -> int:
        """Pipeline ranks (pp)."""
        return self.num_virtual_stages // self.num_chunks
