"""The packed-document stream a run's `DataConfig` asks for (same on every rank)."""
from __future__ import annotations

from dynmo_plugin.data.cost_model import PowerCost
from dynmo_plugin.data.documents import DocumentStream, LognormalDocuments
from dynmo_plugin.data.packing import (AdaptiveBatcher, OutlierQueues, SequentialPacker,
                                       WlbPacker, length_buckets)
from dynmo_plugin.data.stream import PackedDocuments

__all__ = ["build_packed_documents", "document_source"]


def document_source(data, seed: int, vocab_size: int, max_length: int):
    """The documents: Megatron's indexed dataset at `data.path`, or lognormal lengths."""
    if data.path:
        from dynmo_plugin.megatron.data.indexed import IndexedDocuments
        return IndexedDocuments(data.path)
    return LognormalDocuments(seed=seed, vocab_size=vocab_size, median=data.lognormal_median,
                              sigma=data.lognormal_sigma, max_length=max_length)


def build_packed_documents(data, seed: int, vocab_size: int, seq_length: int, dp_size: int,
                           num_microbatches: int) -> PackedDocuments:
    """`data` (config.DataConfig): documents cut to `seq_length` positions, packed by
    `data.packer` into `dp_size` x `num_microbatches` rows of `seq_length`, or with
    `data.batching` adaptive batched per length bucket (AdaptiveLoad)."""
    source = document_source(data, seed, vocab_size, seq_length)
    stream = DocumentStream(source, seed, seq_length)
    prior = PowerCost(data.cost_exponent)  # until data.calibration sets a fitted model
    if data.batching == "adaptive":
        mem = data.mem_tokens or 4 * seq_length
        packer = AdaptiveBatcher(seq_length, dp_size, num_microbatches,
                                 length_buckets(seq_length), mem, prior)
    elif data.packer == "wlb":
        packer = WlbPacker(seq_length, dp_size, num_microbatches, prior.doc_workload)
    else:
        packer = SequentialPacker(seq_length, dp_size, num_microbatches)
    thresholds = data.thresholds()
    outliers = (OutlierQueues(thresholds, dp_size * num_microbatches, data.outlier_max_delay)
                if thresholds else None)
    return PackedDocuments(stream, packer, seq_length, dp_size, num_microbatches, outliers,
                           redistribute=data.redistribute, cost_model=prior)
