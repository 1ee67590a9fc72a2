"""A byte-level tokenizer that works offline and is saved beside the data it made.

Token ids 0-255 are the UTF-8 bytes of the text, 256 is end-of-document (EOD). No
vocabulary file to download and nothing to train: any text round-trips exactly. The
model's vocabulary is padded up to a multiple of 128 like Megatron-LM's
`--make-vocab-size-divisible-by` default, so embedding shapes stay friendly.
"""
from __future__ import annotations

import json
import os
import struct

import numpy as np

__all__ = ["ByteTokenizer", "tokenizer_path", "load_tokenizer", "dataset_vocab_size", "TokenizerError"]

_FORMAT = "dynmo-byte-tokenizer/1"


class TokenizerError(ValueError):
    """A tokenizer file that is missing or not one this module wrote."""


def tokenizer_path(prefix: str) -> str:
    """Where the tokenizer of the dataset `prefix` (.bin/.idx) lives."""
    return prefix + ".tokenizer.json"


class ByteTokenizer:
    """UTF-8 bytes plus one end-of-document token."""

    eod = 256
    vocab_size = 257

    def tokenize(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def detokenize(self, ids) -> str:
        data = bytes(int(i) for i in ids if int(i) != self.eod)
        return data.decode("utf-8", errors="replace")

    def padded_vocab_size(self, divisible_by: int = 128) -> int:
        return -(-self.vocab_size // divisible_by) * divisible_by

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump({"format": _FORMAT, "type": "byte", "vocab_size": self.vocab_size,
                       "eod": self.eod}, fh)


def load_tokenizer(prefix: str) -> ByteTokenizer:
    """The tokenizer saved beside dataset `prefix`.

    Raises:
        TokenizerError: the file is missing or was written by something else.
    """
    path = tokenizer_path(prefix)
    if not os.path.isfile(path):
        raise TokenizerError(f"{path}: no tokenizer beside the dataset; make the dataset with "
                             "scripts/prepare_data.py, which saves it there")
    try:
        with open(path, encoding="utf-8") as fh:
            meta = json.load(fh)
    except (OSError, ValueError) as e:  # JSON's errors and a file not in UTF-8 are ValueErrors
        raise TokenizerError(f"{path}: cannot read the tokenizer: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
        raise TokenizerError(f"{path}: not a tokenizer written by scripts/prepare_data.py "
                             f"(expected format {_FORMAT})")
    return ByteTokenizer()


def dataset_vocab_size(prefix: str) -> int:
    """The padded vocabulary of dataset `prefix`, read once before training so the model's
    embedding fits the data (the configuration's --data-path check asks this).

    Raises:
        TokenizerError: PREFIX.bin or PREFIX.idx is missing, or the tokenizer beside them
            is missing or not one this module wrote.
    """
    missing = [x for x in (prefix + ".bin", prefix + ".idx") if not os.path.isfile(x)]
    if missing:
        raise TokenizerError(f"{', '.join(missing)} not found; give the prefix of a .bin/.idx "
                             "pair made by scripts/prepare_data.py")
    _check_index(prefix + ".idx")
    return load_tokenizer(prefix).padded_vocab_size()


# Megatron's IndexedDataset index: header, version 1, dtype code, sequence and document
# counts (megatron.core.datasets.indexed_dataset), then int32 lengths, int64 pointers
# and int64 document indices
_INDEX_HEADER, _INDEX_FIELDS = b"MMIDIDX\x00\x00", struct.Struct("<QBQQ")


def _check_index(path: str) -> None:
    """What Megatron's IndexedDataset asserts when each worker opens the index (a
    traceback per rank): its header, version and that it holds the arrays its counts
    promise. Read here once, before any worker starts."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(len(_INDEX_HEADER) + _INDEX_FIELDS.size)
        size = os.path.getsize(path)
    except OSError as e:
        raise TokenizerError(f"{path}: cannot read the dataset index: {e}") from e
    problem = None
    if len(head) < len(_INDEX_HEADER) + _INDEX_FIELDS.size or not head.startswith(_INDEX_HEADER):
        problem = "not a Megatron dataset index (bad header)"
    else:
        version, _, sequences, documents = _INDEX_FIELDS.unpack(head[len(_INDEX_HEADER):])
        if version != 1:
            problem = f"index version {version}, expected 1"
        elif size < len(head) + sequences * 12 + documents * 8:
            problem = f"truncated ({size} bytes for {sequences} sequences and {documents} documents)"
    if problem:
        raise TokenizerError(f"{path}: {problem}; make the dataset again with scripts/prepare_data.py")
