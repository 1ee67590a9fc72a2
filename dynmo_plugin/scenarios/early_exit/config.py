"""The settings of early exit: YAML section `dynamism.early_exit`, flags `--dynmo-early-exit-*`.

Pure: the standard library and the config's field helpers.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from dynmo_plugin.config.fields import fraction, multiple_of_8, non_negative, opt, positive

__all__ = ["EarlyExitConfig"]


@dataclass(kw_only=True)
class EarlyExitConfig:
    """CALM-style token early exit with a small exit head per layer."""

    threshold: float = field(default=0.9, metadata=opt(
        "confidence at which a token stops being processed", "--dynmo-early-exit-threshold", fraction))
    start: int = field(default=4, metadata=opt("iteration from which tokens may exit",
                                                "--dynmo-early-exit-start", positive))
    interval: int = field(default=4, metadata=opt(
        "iterations between exit-fraction reports (events)", "--dynmo-early-exit-interval", positive))
    loss_weight: float = field(default=0.1, metadata=opt(
        "weight of the exit heads' loss in the training loss", "--dynmo-early-exit-loss-weight",
        non_negative))
    min_layer: int = field(default=1, metadata=opt("first layer after which a token may exit",
                                                    "--dynmo-early-exit-min-layer", positive))
    token_multiple: int = field(default=64, metadata=opt(
        "a layer gathers its active tokens into a count rounded up to a multiple of this "
        "(padded with exited tokens whose outputs are discarded; the full sequence always "
        "allowed), so its GEMMs and attention run the GPU's fast kernels",
        "--dynmo-early-exit-token-multiple", multiple_of_8))
