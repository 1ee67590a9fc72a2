"""The settings of gradual pruning: YAML section `dynamism.pruning`, flags `--dynmo-pruning-*`.

Pure: the standard library and the config's field helpers.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from dynmo_plugin.config.fields import below_one, fraction, multiple_of_8, one_of, opt, positive

__all__ = ["PruningConfig"]


@dataclass(kw_only=True)
class PruningConfig:
    """Gradual global magnitude pruning (Zhu & Gupta's cubic schedule)."""

    start: int = field(default=4, metadata=opt("iteration of the first pruning round (t0)",
                                                "--dynmo-pruning-start", positive))
    interval: int = field(default=4, metadata=opt("iterations between pruning rounds",
                                                   "--dynmo-pruning-interval", positive))
    rounds: int = field(default=4, metadata=opt("pruning rounds until the final sparsity",
                                                "--dynmo-pruning-rounds", positive))
    initial_sparsity: float = field(default=0.0, metadata=opt(
        "sparsity before the first round", "--dynmo-pruning-initial-sparsity", fraction))
    final_sparsity: float = field(default=0.9, metadata=opt(
        "global sparsity of decoder linear weights after the last round",
        "--dynmo-pruning-final-sparsity", below_one))
    granularity: str = field(default="unstructured", metadata=opt(
        "unstructured (CSR kernels on CPU) or structured (whole FFN neurons; what saves "
        "time on GPUs)", "--dynmo-pruning-granularity", one_of("unstructured", "structured")))
    structured: str = field(default="physical", metadata=opt(
        "structured pruning rebuilds the linears with the kept neurons only (physical: weights, "
        "gradients and optimizer state shrink) or masks them (masked: full size kept)",
        "--dynmo-pruning-structured", one_of("physical", "masked")))
    sparse_threshold: float = field(default=0.85, metadata=opt(
        "a linear switches to the CSR kernel above this sparsity (CPU crossover)",
        "--dynmo-pruning-sparse-threshold", fraction))
    heads: float = field(default=0.0, metadata=opt(
        "structured only: fraction of each layer's attention heads removed after the last round "
        "(on the sparsity's cubic schedule; 0 = heads untouched)", "--dynmo-pruning-heads",
        below_one))
    width_multiple: int = field(default=128, metadata=opt(
        "structured only: each layer's kept FFN width (per tensor-parallel shard) is rounded to "
        "the nearest multiple of this many neurons (the full width is always allowed; a layer "
        "keeps at least one multiple), so its GEMMs run the GPU's fast kernels",
        "--dynmo-pruning-width-multiple", multiple_of_8))
