"""Receive buffers that stay allocated between migrations.

Receiving into freshly allocated host memory runs at about half of gloo's bandwidth:
every page of the new buffer faults on first touch, inside the transfer (measured:
scripts/bench_migration.py, and ../shared/notes/megatron-core-on-cpu.md). The pool keeps
one flat byte buffer, sized by the largest set of layers this rank has received, with
its pages already touched, and carves each migration's receive buffers out of it.

It holds that memory between migrations, so it gives it back when it stops paying: after
`release_after` migrations in a row that received nothing on this rank, or on `release`.
Device-neutral; the caller decides whether to keep it (on CUDA the caching allocator
already recycles device memory, which has no first-touch cost).
"""
from __future__ import annotations

from typing import Optional

import torch

from dynmo_plugin.migration.wire import Header, dtype_of

__all__ = ["StagingPool"]

_ALIGN = 64  # bytes: every view starts on a cache line (and on its dtype's boundary)


def _round_up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class StagingPool:
    def __init__(self, device: torch.device, release_after: int = 8):
        if release_after < 1:
            raise ValueError(f"release_after must be >= 1 migrations, got {release_after}")
        self.device, self.release_after = device, release_after
        self._flat: Optional[torch.Tensor] = None
        self._idle = 0
        self.grown = 0  # times the pool was (re)allocated: each one paid the page faults

    @property
    def nbytes(self) -> int:
        """Bytes held now."""
        return 0 if self._flat is None else self._flat.numel()

    def take(self, headers: list[Header]) -> dict[int, list[torch.Tensor]]:
        """{layer: receive buffers} for `headers` (the moves addressed to this rank), as
        views of the pool, valid until the next `take` or `release`. Grows the pool to
        fit (old contents are not kept); an empty `headers` counts towards release."""
        sizes = [[n * dtype_of(d).itemsize for d, n, _ in h.buffers] for h in headers]
        total = sum(_round_up(s) for layer in sizes for s in layer)
        if total == 0:
            self._idle += 1
            if self._idle >= self.release_after:
                self.release()
            return {h.layer: [] for h in headers}
        self._idle = 0
        if self.nbytes < total:
            self._flat = None  # let the old one go first: the peak is the new size, not both
            # zeros, not empty: the pages are touched here, once, not in every receive
            self._flat = torch.zeros(total, dtype=torch.uint8, device=self.device)
            self.grown += 1
        out, offset = {}, 0
        for h, layer_sizes in zip(headers, sizes):
            views = []
            for (d, n, _), size in zip(h.buffers, layer_sizes):
                views.append(self._flat[offset:offset + size].view(dtype_of(d)))
                offset += _round_up(size)
            out[h.layer] = views
        return out

    def release(self) -> None:
        self._flat, self._idle = None, 0
