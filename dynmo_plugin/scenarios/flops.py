"""The FLOP-based work model: what a scenario's work model falls back to when its timed
calibration fails (a kernel that refuses a dtype, an out-of-memory in the scratch layer,
a clock that cannot resolve a tiny layer).

Forward matmul FLOPs of a GPT decoder layer per token (Narayanan et al., SC'21, as
dynmo_plugin.sim.gpt prices layers, here with the run's own FFN width): attention
projections 8 h^2, MLP 4 h f (6 h f gated), attention core 4 h per key it attends.
Backward costs twice the forward. Seconds are FLOPs at a nominal `NOMINAL_FLOPS`: the
scenarios' work models are only ever compared between layers and over time, so the
rate cancels; the event's detail says the model came from FLOPs (`source: flops`).
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DecoderFlops", "NOMINAL_FLOPS", "FLOP_FALLBACK"]

NOMINAL_FLOPS = 1e12
FLOP_FALLBACK = "the FLOP-based work model"  # what events name as the fallback


@dataclass(frozen=True)
class DecoderFlops:
    """Per-token forward FLOPs of one decoder layer of this run's shape."""

    hidden: int
    ffn_hidden: int
    gated: bool = False

    @classmethod
    def from_config(cls, config, ffn_hidden: int = 0) -> "DecoderFlops":
        """From Megatron's TransformerConfig (`ffn_hidden` overrides its FFN width)."""
        return cls(config.hidden_size, ffn_hidden or config.ffn_hidden_size,
                   bool(config.gated_linear_unit))

    def mlp(self) -> float:
        return (6 if self.gated else 4) * self.hidden * self.ffn_hidden

    def linear(self) -> float:
        """Everything that scales with the tokens a layer processes: projections, MLP."""
        return 8 * self.hidden ** 2 + self.mlp()

    def attention(self, keys: float) -> float:
        """The attention core of one query over `keys` keys (scores and values)."""
        return 4 * self.hidden * keys

    @staticmethod
    def seconds(forward_flops: float) -> float:
        """Forward + backward seconds at the nominal rate."""
        return 3 * forward_flops / NOMINAL_FLOPS
