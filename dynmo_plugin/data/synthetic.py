"""Deterministic synthetic token data, identical for any pipeline or data-parallel shape.

Sample k of iteration i is a function of (seed, i, k) alone: an arithmetic token
sequence with a per-sample start and stride, plus a little seeded noise, so a small
GPT can learn it (the loss visibly falls) and every stage and replica can rebuild any
micro-batch it needs without communication.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

__all__ = ["SyntheticTokens", "MicroBatch"]

MicroBatch = dict  # tokens, labels, position_ids, attention_mask, loss_mask


@dataclass(frozen=True, kw_only=True)
class SyntheticTokens:
    seed: int
    vocab_size: int
    seq_length: int
    global_batch_size: int
    micro_batch_size: int
    noise: float = 0.1

    def sample(self, iteration: int, index: int) -> torch.Tensor:
        """seq_length + 1 tokens of sample `index` of global batch `iteration`."""
        gen = torch.Generator().manual_seed(
            (self.seed * 7919 + iteration * self.global_batch_size + index) % 2**63)
        start = int(torch.randint(self.vocab_size, (1,), generator=gen))
        stride = int(torch.randint(1, 4, (1,), generator=gen))
        seq = (start + stride * torch.arange(self.seq_length + 1)) % self.vocab_size
        flip = torch.rand(self.seq_length + 1, generator=gen) < self.noise
        noise = torch.randint(self.vocab_size, (self.seq_length + 1,), generator=gen)
        return torch.where(flip, noise, seq)

    def micro_batches(self, iteration: int, dp_rank: int, dp_size: int,
                      device: torch.device | str = "cpu") -> Iterator[MicroBatch]:
        """This replica's micro-batches: a contiguous slice of the global batch."""
        per_rank = self.global_batch_size // dp_size
        first = dp_rank * per_rank
        causal = torch.triu(torch.ones(self.seq_length, self.seq_length, dtype=torch.bool), 1)
        positions = torch.arange(self.seq_length).unsqueeze(0)
        for mb in range(per_rank // self.micro_batch_size):
            idx = range(first + mb * self.micro_batch_size, first + (mb + 1) * self.micro_batch_size)
            rows = torch.stack([self.sample(iteration, k) for k in idx])
            yield {
                "tokens": rows[:, :-1].to(device),
                "labels": rows[:, 1:].to(device),
                "position_ids": positions.expand(len(idx), -1).to(device),
                "attention_mask": causal[None, None].to(device),
                "loss_mask": torch.ones(len(idx), self.seq_length, device=device),
            }

    def state_dict(self) -> dict:
        """Nothing to save: every micro-batch is a function of (seed, iteration)."""
        return {"kind": "synthetic"}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "synthetic":
            raise ValueError(f"data state of kind {state.get('kind')!r} cannot resume the "
                             "synthetic token stream; train with the data options the "
                             "checkpoint was saved with")
