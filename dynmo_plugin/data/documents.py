"""Documents of varying length, and the ordered stream of pieces a packer draws from.

A document source (`LognormalDocuments`, or `IndexedDocuments` over Megatron's
.bin/.idx format) gives each document's length and tokens. A document of D tokens
trains D - 1 positions (inputs are its tokens but the last, labels all but the first);
its *length* below is that number of positions. `DocumentStream` orders documents by
a seeded permutation per epoch and cuts any document longer than the micro-batch
(Lmax positions) into pieces of at most Lmax: documents up to Lmax stay whole, which is
what makes their attention cost quadratic in their own length. Piece `i` of the
stream is a pure function of (seed, i), so every rank rebuilds the same stream.

numpy only: no torch, no megatron.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Protocol

import numpy as np

__all__ = ["DocumentSource", "LognormalDocuments", "Piece", "DocumentStream"]


def _seed(*parts) -> int:
    key = "/".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


class DocumentSource(Protocol):
    vocab_size: int

    def __len__(self) -> int: ...

    def lengths(self) -> np.ndarray:
        """Training positions of every document (tokens - 1), int64."""

    def tokens(self, index: int, start: int, length: int) -> np.ndarray:
        """length + 1 tokens of document `index` from position `start`."""


@dataclass(frozen=True, kw_only=True)
class LognormalDocuments:
    """Synthetic documents whose lengths are lognormal: a controlled length mix.

    Lengths are round(exp(N(log median, sigma))) clipped to [min_length, max_length];
    tokens are an arithmetic sequence per document (start and stride seeded by the
    document) with a little noise, like SyntheticTokens, so a small GPT can learn them.
    """

    seed: int
    vocab_size: int
    median: float = 256.0
    sigma: float = 1.0
    min_length: int = 8
    max_length: int = 4096
    count: int = 65536
    noise: float = 0.1

    def __post_init__(self):
        rng = np.random.default_rng(_seed("lognormal", self.seed))
        raw = rng.lognormal(np.log(self.median), self.sigma, self.count)
        object.__setattr__(self, "_lengths", np.clip(np.rint(raw), self.min_length,
                                                      self.max_length).astype(np.int64))

    def __len__(self) -> int:
        return self.count

    def lengths(self) -> np.ndarray:
        return self._lengths

    def tokens(self, index: int, start: int, length: int) -> np.ndarray:
        rng = np.random.default_rng(_seed("doc", self.seed, index))
        first, stride = int(rng.integers(self.vocab_size)), int(rng.integers(1, 4))
        pos = np.arange(start, start + length + 1)
        seq = (first + stride * pos) % self.vocab_size
        noise_rng = np.random.default_rng(_seed("noise", self.seed, index, start))
        flip = noise_rng.random(length + 1) < self.noise
        return np.where(flip, noise_rng.integers(self.vocab_size, size=length + 1), seq)


@dataclass(frozen=True)
class Piece:
    """Stream position `id` (unique over epochs): `length` positions of document `doc`
    from position `start`."""

    id: int
    doc: int
    start: int
    length: int


class DocumentStream:
    """Pieces of at most `max_length` positions, documents in a seeded order per epoch."""

    def __init__(self, source: DocumentSource, seed: int, max_length: int):
        lengths = np.asarray(source.lengths(), dtype=np.int64)
        if len(lengths) == 0 or int(lengths.max()) < 1:
            raise ValueError("the document source has no document with at least 2 tokens")
        self.source, self.seed, self.max_length = source, seed, max_length
        self._lengths = lengths
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._per_epoch = int(np.sum(-(-lengths[lengths > 0] // max_length)))

    def _epoch(self, epoch: int):
        if epoch not in self._epochs:
            if len(self._epochs) > 2:
                self._epochs.pop(min(self._epochs))
            order = np.random.default_rng(_seed("order", self.seed, epoch)).permutation(
                len(self._lengths))
            order = order[self._lengths[order] > 0]
            counts = -(-self._lengths[order] // self.max_length)
            doc = np.repeat(order, counts)
            first = np.cumsum(counts) - counts
            chunk = np.arange(len(doc)) - np.repeat(first, counts)
            start = chunk * self.max_length
            length = np.minimum(self._lengths[doc] - start, self.max_length)
            self._epochs[epoch] = (doc, start, length)
        return self._epochs[epoch]

    def piece(self, i: int) -> Piece:
        epoch, k = divmod(i, self._per_epoch)
        doc, start, length = self._epoch(epoch)
        return Piece(i, int(doc[k]), int(start[k]), int(length[k]))

    def tokens(self, piece: Piece) -> np.ndarray:
        return np.asarray(self.source.tokens(piece.doc, piece.start, piece.length))
