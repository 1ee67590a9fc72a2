"""The settings of sparse attention: YAML section `dynamism.sparse_attention`, flags `--dynmo-sparse-attention-*`.

Pure: the standard library and the config's field helpers.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from dynmo_plugin.config.fields import multiple_of_8, non_negative, opt, positive

__all__ = ["SparseAttentionConfig"]


@dataclass(kw_only=True)
class SparseAttentionConfig:
    """Hash-bucketed (LSH) causal attention; buckets per layer change over training."""

    buckets: int = field(default=16, metadata=opt(
        "hash buckets per layer (more buckets: sparser, cheaper attention)",
        "--dynmo-sparse-attention-buckets", positive))
    buckets_per_layer: str = field(default="", metadata=opt(
        "per-layer buckets overriding `buckets`, e.g. '1:8,2:32'", "--dynmo-sparse-attention-buckets-per-layer"))
    final_buckets: int = field(default=0, metadata=opt(
        "buckets the schedule reaches (0: constant)", "--dynmo-sparse-attention-final-buckets",
        non_negative))
    start: int = field(default=4, metadata=opt("iteration of the first density change",
                                                "--dynmo-sparse-attention-start", positive))
    interval: int = field(default=4, metadata=opt("iterations between density changes",
                                                   "--dynmo-sparse-attention-interval", positive))
    rounds: int = field(default=4, metadata=opt("density changes until final_buckets",
                                                "--dynmo-sparse-attention-rounds", positive))
    hashes: int = field(default=1, metadata=opt("hash rounds per iteration",
                                                 "--dynmo-sparse-attention-hashes", positive))
    chunk_multiple: int = field(default=64, metadata=opt(
        "tokens per attention chunk (s / buckets) are rounded up to a multiple of this "
        "(GPU-friendly tiles; more buckets than s / chunk_multiple save nothing more)",
        "--dynmo-sparse-attention-chunk-multiple", multiple_of_8))
