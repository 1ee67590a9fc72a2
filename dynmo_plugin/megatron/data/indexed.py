"""Megatron's indexed dataset (.bin/.idx) as a document source, and writing one.

Reading and writing go through `megatron.core.datasets.indexed_dataset` (Megatron's own
format code, imported when used), so files made here load in Megatron-LM and files
made by Megatron-LM's tools/preprocess_data.py load here. A document is the run of
sequences between two of the index's document boundaries, kept whole.
"""
from __future__ import annotations

import os
from typing import Iterable

import numpy as np

from dynmo_plugin.data.tokenizer import ByteTokenizer, load_tokenizer, tokenizer_path

__all__ = ["IndexedDocuments", "write_indexed", "DatasetError"]


class DatasetError(ValueError):
    """A --data-path that does not name a readable indexed dataset."""


def write_indexed(prefix: str, documents: Iterable[np.ndarray], tokenizer: ByteTokenizer) -> int:
    """Write `documents` (token arrays) as PREFIX.bin/.idx plus the tokenizer; returns
    the number of documents written."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    count = 0
    for doc in documents:
        doc = np.asarray(doc)
        builder.add_document(doc, [len(doc)])
        count += 1
    builder.finalize(prefix + ".idx")
    tokenizer.save(tokenizer_path(prefix))
    return count


class IndexedDocuments:
    """The documents of Megatron indexed dataset PREFIX, with their tokenizer."""

    def __init__(self, prefix: str):
        missing = [p for p in (prefix + ".bin", prefix + ".idx") if not os.path.isfile(p)]
        if missing:
            raise DatasetError(f"--data-path {prefix}: {', '.join(missing)} not found; give the "
                               "prefix of a .bin/.idx pair (make one with scripts/prepare_data.py)")
        self.tokenizer = load_tokenizer(prefix)
        self.vocab_size = self.tokenizer.padded_vocab_size()
        from megatron.core.datasets.indexed_dataset import IndexedDataset
        self.dataset = IndexedDataset(prefix, mmap=True)
        bounds = np.asarray(self.dataset.document_indices, dtype=np.int64)
        seq = np.asarray(self.dataset.sequence_lengths, dtype=np.int64)
        self._first_seq, self._last_seq = bounds[:-1], bounds[1:]
        ends = np.concatenate([[0], np.cumsum(seq)])
        self._offset = ends[bounds[:-1]]                     # token offset of each document
        self._tokens = ends[bounds[1:]] - self._offset        # tokens per document
        if len(self._tokens) == 0:
            raise DatasetError(f"--data-path {prefix}: the dataset holds no documents")

    def __len__(self) -> int:
        return len(self._tokens)

    def lengths(self) -> np.ndarray:
        return np.maximum(self._tokens - 1, 0)

    def document(self, index: int) -> np.ndarray:
        """All tokens of document `index`."""
        return self.tokens(index, 0, int(self._tokens[index]) - 1)

    def tokens(self, index: int, start: int, length: int) -> np.ndarray:
        first, last = int(self._first_seq[index]), int(self._last_seq[index])
        if last == first + 1:  # one sequence per document (scripts/prepare_data.py): a slice
            out = self.dataset.get(first, offset=start, length=length + 1)
        else:                  # e.g. sentence-split documents: join the sequences first
            out = np.concatenate([self.dataset[s] for s in range(first, last)])[start:start + length + 1]
        return np.asarray(out, dtype=np.int64)
