"""The settings of layer freezing: YAML section `dynamism.freezing`, flags `--dynmo-freezing-*`.

Pure: the standard library and the config's field helpers.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from dynmo_plugin.config.fields import non_negative, opt, positive

__all__ = ["FreezingConfig"]


@dataclass(kw_only=True)
class FreezingConfig:
    """Egeria-style layer freezing by plasticity, front to back."""

    start: int = field(default=4, metadata=opt("iteration of the first plasticity check",
                                                "--dynmo-freezing-start", positive))
    interval: int = field(default=4, metadata=opt("iterations between plasticity checks",
                                                   "--dynmo-freezing-interval", positive))
    threshold: float = field(default=0.05, metadata=opt(
        "a layer whose plasticity falls below this fraction of its reference converged",
        "--dynmo-freezing-threshold", positive))
    max_layers: int = field(default=0, metadata=opt(
        "freeze at most this many layers (0 = all but the last)", "--dynmo-freezing-max-layers",
        non_negative))
