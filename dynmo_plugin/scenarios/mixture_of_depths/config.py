"""The settings of Mixture of Depths: YAML section `dynamism.mod`, flags `--dynmo-mod-*`.

Pure: the standard library and the config's field helpers.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from dynmo_plugin.config.fields import fraction, multiple_of_8, non_negative, opt, positive

__all__ = ["ModConfig"]


@dataclass(kw_only=True)
class ModConfig:
    """Mixture of Depths (Raposo et al. 2024): top-C tokens per routed block."""

    every: int = field(default=2, metadata=opt(
        "every N-th decoder layer is routed (the paper: every other)", "--dynmo-mod-every", positive))
    capacity: float = field(default=0.5, metadata=opt(
        "fraction of tokens a routed block processes", "--dynmo-mod-capacity", fraction))
    capacity_per_layer: str = field(default="", metadata=opt(
        "per-layer capacities overriding `capacity`, e.g. '2:0.25,4:0.75'", "--dynmo-mod-capacity-per-layer"))
    final_capacity: float = field(default=0.0, metadata=opt(
        "capacity the schedule reaches (0: constant capacity)", "--dynmo-mod-final-capacity", fraction))
    start: int = field(default=4, metadata=opt("iteration of the first capacity change",
                                                "--dynmo-mod-start", positive))
    interval: int = field(default=4, metadata=opt("iterations between capacity changes",
                                                   "--dynmo-mod-interval", positive))
    rounds: int = field(default=4, metadata=opt("capacity changes until final_capacity",
                                                "--dynmo-mod-rounds", positive))
    granularity: int = field(default=64, metadata=opt(
        "a routed block's tokens per sequence (capacity x seq) are rounded to the nearest "
        "multiple of this, at least one, at most the sequence: GEMM-friendly sizes on a GPU; "
        "the events report the capacity used", "--dynmo-mod-granularity", multiple_of_8))
    predictor_loss_weight: float = field(default=0.01, metadata=opt(
        "weight of the auxiliary predictor's loss (causal top-C at sampling time)",
        "--dynmo-mod-predictor-loss-weight", non_negative))
