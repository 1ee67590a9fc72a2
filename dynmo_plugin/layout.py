"""Pipeline layouts: which decoder layers each pipeline stage holds.

A layout is written the way Megatron-Core writes `pipeline_model_parallel_layout`
("Ett|ttL": E embedding, t decoder layer, L output layer + loss, | stage separator,
"x*n" and "(..)*n" repeats, commas cosmetic), so a plan can be handed to Megatron
unchanged. Only layouts with one virtual stage per rank, the embedding on the first
stage and the loss on the last are represented: those are the layouts a rebalancer
produces. This module is pure (no torch, no megatron) so the balancing and simulation
wings can use it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from dynmo_plugin.errors import UserError

__all__ = ["Layout", "LayoutError"]


class LayoutError(UserError):
    """A layout string or layer-count list that cannot describe the pipeline."""


_REPEAT_GROUP = re.compile(r"\(([^)]+)\)\*(\d+)")
_REPEAT_CHAR = re.compile(r"(.)\*(\d+)")


def _expand(text: str) -> str:
    text = text.replace(",", "").replace(" ", "")
    text = _REPEAT_GROUP.sub(lambda m: m.group(1) * int(m.group(2)), text)
    return _REPEAT_CHAR.sub(lambda m: m.group(1) * int(m.group(2)), text)


@dataclass(frozen=True)
class Layout:
    """Decoder-layer counts per pipeline stage, in stage order.

    Layers are numbered globally from 1, as Megatron numbers `TransformerLayer`s;
    stage s holds layers `offset(s)+1 .. offset(s)+counts[s]`.
    """

    counts: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.counts:
            raise LayoutError("a layout needs at least one pipeline stage")
        if any((not isinstance(c, int)) or c < 0 for c in self.counts):
            raise LayoutError(f"layer counts must be non-negative integers, got {list(self.counts)}")
        object.__setattr__(self, "counts", tuple(int(c) for c in self.counts))

    # ---- construction -------------------------------------------------------------
    @classmethod
    def parse(cls, text: str, num_stages: int | None = None, num_layers: int | None = None) -> "Layout":
        """Parse a Megatron layout string; check it against PP size and layer count."""
        expanded = _expand(text)
        stages = expanded.split("|")
        bad = sorted(set(expanded) - set("Et|L"))
        if bad:
            raise LayoutError(f"layout {text!r}: unsupported characters {bad}; use E, t, L and |"
                              " (MTP 'm' layers are not supported)")
        if "E" not in stages[0] or "".join(stages).count("E") != 1 or not stages[0].startswith("E"):
            raise LayoutError(f"layout {text!r}: the embedding 'E' must open the first stage, once")
        if not stages[-1].endswith("L") or "".join(stages).count("L") != 1:
            raise LayoutError(f"layout {text!r}: the loss 'L' must close the last stage, once")
        layout = cls(tuple(s.count("t") for s in stages))
        if num_stages is not None and layout.num_stages != num_stages:
            raise LayoutError(f"layout {text!r} has {layout.num_stages} stages but the pipeline "
                              f"has {num_stages} (--pipeline-model-parallel-size); virtual "
                              "pipeline layouts are not supported")
        if num_layers is not None and layout.num_layers != num_layers:
            raise LayoutError(f"layout {text!r} holds {layout.num_layers} decoder layers but "
                              f"--num-layers is {num_layers}")
        return layout

    @classmethod
    def uniform(cls, num_layers: int, num_stages: int) -> "Layout":
        """Megatron's static split; the remainder goes to the first stages."""
        if num_stages <= 0:
            raise LayoutError(f"need a positive number of stages, got {num_stages}")
        base, extra = divmod(num_layers, num_stages)
        return cls(tuple(base + (1 if s < extra else 0) for s in range(num_stages)))

    @classmethod
    def from_boundaries(cls, boundaries: Sequence[int]) -> "Layout":
        """From DeepSpeed-style boundaries [0, b1, ..., n] over 0-based layer indices."""
        b = [int(x) for x in boundaries]
        if len(b) < 2 or b[0] != 0 or any(y < x for x, y in zip(b, b[1:])):
            raise LayoutError(f"boundaries must start at 0 and never decrease, got {b}")
        return cls(tuple(y - x for x, y in zip(b, b[1:])))

    # ---- queries -----------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        return len(self.counts)

    @property
    def num_layers(self) -> int:
        return sum(self.counts)

    @property
    def boundaries(self) -> list[int]:
        out = [0]
        for c in self.counts:
            out.append(out[-1] + c)
        return out

    def offset(self, stage: int) -> int:
        """Number of decoder layers before `stage` (Megatron's layer offset)."""
        return sum(self.counts[:stage])

    def layers_of(self, stage: int) -> list[int]:
        """Global 1-based layer numbers held by `stage`."""
        start = self.offset(stage)
        return list(range(start + 1, start + self.counts[stage] + 1))

    def assignment(self) -> list[int]:
        """Stage of each layer, index 0 = layer 1."""
        return [s for s, c in enumerate(self.counts) for _ in range(c)]

    def moved_layers(self, other: "Layout") -> list[tuple[int, int, int]]:
        """(layer, src stage, dst stage) for each layer that `other` places elsewhere."""
        if other.num_layers != self.num_layers:
            raise LayoutError(f"cannot compare layouts of {self.num_layers} and {other.num_layers} layers")
        return [(i + 1, a, b) for i, (a, b) in
                enumerate(zip(self.assignment(), other.assignment())) if a != b]

    def to_megatron(self) -> str:
        """Megatron's layout string, e.g. 'Ett|ttL' (empty stages allowed: 'Et||tL')."""
        parts = ["t" * c for c in self.counts]
        parts[0] = "E" + parts[0]
        parts[-1] = parts[-1] + "L"
        return "|".join(parts)

    def __str__(self) -> str:
        return self.to_megatron()
