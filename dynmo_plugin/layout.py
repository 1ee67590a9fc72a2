"""Pipeline layouts: which decoder layers each pipeline stage holds.

A layout is written the way Megatron-Core writes `pipeline_model_parallel_layout`
("Ett|ttL": E embedding, t decoder layer, L output layer + loss, | stage separator,
"x*n" and "(..)*n" repeats, commas cosmetic), so a plan can be handed to Megatron
unchanged. Only layouts with the embedding on the first stage and the loss on the last
are represented: those are the layouts a rebalancer produces.

Multi-Token Prediction (MTP, Megatron's `--mtp-num-layers k`): "m" is one MTP layer.
The k MTP layers are one unit, in one (virtual) stage, after every decoder layer
("Ett|ttmmL", or standalone on an earlier rank: "Ett|tmm|L", the stages after it then
hold no decoder layer), in the last chunk of its rank and, with pp > 1, never on the
first rank: Megatron-Core 0.16.1's `validate_layer_layout` rules (it accepts 'm' on the
first rank where v = 1; we refuse it, as its own message for v > 1 says it should be).
Within a stage the order is E, t..., m..., L.

Interleaved (virtual) pipelines: with `num_chunks` = v model chunks per rank
(Megatron's `--num-virtual-stages-per-pipeline-rank`) the string has pp * v stages,
in layer order, and virtual stage s runs on rank `s % pp` as its chunk `s // pp`
(Megatron's numbering): "Et|tt|tt|tL" with pp = 2, v = 2 puts layers 1, 4, 5 on rank 0
(chunks 0 and 1) and layers 2, 3, 6 on rank 1. A layer that changes virtual stage but
not rank moves without communication.

This module is pure (no torch, no megatron) so the balancing and simulation wings can
use it.
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


# the most characters a layout string may expand to: far above any model's layers and
# stages, far below what a mistyped repeat count ('t*99999999999999') would allocate
_MAX_EXPANDED = 1 << 20


def _expand(text: str) -> str:
    text = text.replace(",", "").replace(" ", "")
    return _repeat(_REPEAT_CHAR, _repeat(_REPEAT_GROUP, text, text), text)


def _repeat(pattern: re.Pattern, text: str, given: str) -> str:
    """`text` with `pattern`'s repeats written out, after the length they give is known
    to stay under `_MAX_EXPANDED` (`given`: the layout as written, for the message)."""
    matches = list(pattern.finditer(text))
    long = next((m.group(2) for m in matches if len(m.group(2)) > 7), None)
    total = len(text) + sum(len(m.group(1)) * int(m.group(2)) - len(m.group(0)) for m in matches
                            if long is None)
    if long is not None or total > _MAX_EXPANDED:
        shown = "" if long is None else f" (count {long[:12]}{'...' if len(long) > 12 else ''})"
        raise LayoutError(f"layout {given[:40]!r}: its repeat counts{shown} make more than "
                          f"{_MAX_EXPANDED} layers and stages; give the counts the model has")
    return pattern.sub(lambda m: m.group(1) * int(m.group(2)), text)


@dataclass(frozen=True)
class Layout:
    """Decoder-layer counts per (virtual) pipeline stage, in stage order.

    Layers are numbered globally from 1, as Megatron numbers `TransformerLayer`s;
    stage s holds layers `offset(s)+1 .. offset(s)+counts[s]`. With `num_chunks` > 1 the
    stages are virtual: `num_stages` = pp * num_chunks, stage s on rank `rank_of(s)`.
    """

    counts: tuple[int, ...]
    num_chunks: int = 1
    mtp_layers: int = 0
    mtp_stage: int | None = None

    def __post_init__(self) -> None:
        if not self.counts:
            raise LayoutError("a layout needs at least one pipeline stage")
        if any((not isinstance(c, int)) or c < 0 for c in self.counts):
            raise LayoutError(f"layer counts must be non-negative integers, got {list(self.counts)}")
        object.__setattr__(self, "counts", tuple(int(c) for c in self.counts))
        v = self.num_chunks
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise LayoutError(f"num_chunks (virtual stages per pipeline rank) must be a positive "
                              f"integer, got {v!r}")
        if len(self.counts) % v:
            raise LayoutError(f"{len(self.counts)} stages cannot be split into {v} virtual stages "
                              f"per rank; give pp * {v} stages")
        if self.mtp_layers and self.mtp_stage is None:
            object.__setattr__(self, "mtp_stage", len(self.counts) - 1)  # Megatron's default
        check_mtp_placement(self)

    @property
    def has_mtp(self) -> bool:
        return self.mtp_layers > 0

    @property
    def mtp_rank(self) -> int | None:
        """Pipeline rank holding the MTP block, or None without MTP."""
        return None if self.mtp_stage is None else self.rank_of(self.mtp_stage)

    @property
    def mtp_standalone(self) -> bool:
        """MTP on a rank before the last (Megatron's `mtp_standalone`)."""
        return self.mtp_stage is not None and self.mtp_rank != self.num_ranks - 1

    def with_mtp(self, mtp_layers: int, mtp_stage: int | None = None) -> "Layout":
        """The same decoder counts with `mtp_layers` MTP layers on `mtp_stage` (default:
        the last stage)."""
        return Layout(self.counts, self.num_chunks, mtp_layers,
                      mtp_stage if mtp_layers else None)

    def mtp_moved(self, other: "Layout") -> bool:
        """Whether `other` puts the MTP block on another rank (a chunk change on the
        same rank moves nothing)."""
        if self.mtp_layers != other.mtp_layers:
            raise LayoutError(f"cannot compare layouts of {self.mtp_layers} and "
                              f"{other.mtp_layers} MTP layers")
        return self.has_mtp and self.mtp_rank != other.mtp_rank

    # ---- construction -------------------------------------------------------------
    @classmethod
    def parse(cls, text: str, num_stages: int | None = None, num_layers: int | None = None,
              num_chunks: int = 1, mtp_num_layers: int | None = None) -> "Layout":
        """Parse a Megatron layout string; check it against PP size (`num_stages`: pipeline
        ranks), layer count, virtual stages per rank (`num_chunks`: the string must
        have pp * num_chunks stages) and MTP layers (`mtp_num_layers`; None: not checked)."""
        stages = _expand(text).split("|")
        counts, mtp_stage, mtp_layers = _parse_stages(text, stages)
        if num_stages is not None and len(counts) != num_stages * num_chunks:
            raise LayoutError(_stage_count_message(text, len(counts), num_stages, num_chunks))
        if len(counts) % num_chunks:
            raise LayoutError(f"layout {text!r} has {len(counts)} stages, not a multiple of "
                              f"{num_chunks} (--num-virtual-stages-per-pipeline-rank)")
        if mtp_num_layers is not None and mtp_layers != mtp_num_layers:
            raise LayoutError(f"layout {text!r} holds {mtp_layers} MTP layers ('m') but "
                              f"--mtp-num-layers is {mtp_num_layers}")
        try:
            layout = cls(counts, num_chunks, mtp_layers, mtp_stage)
        except LayoutError as e:
            raise LayoutError(f"layout {text!r}: {e}") from None
        if num_layers is not None and layout.num_layers != num_layers:
            raise LayoutError(f"layout {text!r} holds {layout.num_layers} decoder layers but "
                              f"--num-layers is {num_layers}")
        return layout

    @classmethod
    def uniform(cls, num_layers: int, num_stages: int, num_chunks: int = 1,
                mtp_layers: int = 0) -> "Layout":
        """Megatron's static split over `num_stages` (virtual) stages; the remainder goes
        to the first stages; MTP layers (if any) on the last stage, as Megatron puts them
        without a custom layout."""
        if num_stages <= 0:
            raise LayoutError(f"need a positive number of stages, got {num_stages}")
        base, extra = divmod(num_layers, num_stages)
        return cls(tuple(base + (1 if s < extra else 0) for s in range(num_stages)), num_chunks,
                   mtp_layers)

    @classmethod
    def from_boundaries(cls, boundaries: Sequence[int], num_chunks: int = 1, mtp_layers: int = 0,
                        mtp_stage: int | None = None) -> "Layout":
        """From DeepSpeed-style boundaries [0, b1, ..., n] over 0-based layer indices."""
        b = [int(x) for x in boundaries]
        if len(b) < 2 or b[0] != 0 or any(y < x for x, y in zip(b, b[1:])):
            raise LayoutError(f"boundaries must start at 0 and never decrease, got {b}")
        return cls(tuple(y - x for x, y in zip(b, b[1:])), num_chunks, mtp_layers, mtp_stage)

    # ---- queries -----------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        """(Virtual) stages: pipeline ranks times `num_chunks`."""
        return len(self.counts)

    @property
    def num_ranks(self) -> int:
        """Pipeline ranks (pp)."""
        return len(self.counts) // self.num_chunks

    @property
    def interleaved(self) -> bool:
        return self.num_chunks > 1

    def rank_of(self, stage: int) -> int:
        """Pipeline rank that runs virtual stage `stage` (Megatron: s % pp)."""
        return stage % self.num_ranks

    def chunk_of(self, stage: int) -> int:
        """Model chunk of its rank that virtual stage `stage` is (Megatron: s // pp)."""
        return stage // self.num_ranks

    def stage_of(self, rank: int, chunk: int) -> int:
        """Virtual stage of `rank`'s chunk `chunk`."""
        return chunk * self.num_ranks + rank

    def rank_stages(self, rank: int) -> list[int]:
        """The virtual stages of `rank`, chunk 0 first."""
        return [self.stage_of(rank, c) for c in range(self.num_chunks)]

    def rank_layers(self, rank: int) -> list[int]:
        """Global layer numbers held by `rank` over all its chunks."""
        return [n for s in self.rank_stages(rank) for n in self.layers_of(s)]

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
        if other.num_chunks != self.num_chunks:
            raise LayoutError(f"cannot compare layouts of {self.num_chunks} and {other.num_chunks} "
                              "virtual stages per rank: their stage numbers name different ranks")
        return [(i + 1, a, b) for i, (a, b) in
                enumerate(zip(self.assignment(), other.assignment())) if a != b]

    def with_chunks(self, num_chunks: int) -> "Layout":
        """The same counts (and MTP stage) read with `num_chunks` virtual stages per rank."""
        return Layout(self.counts, num_chunks, self.mtp_layers, self.mtp_stage)

    def padded(self, num_ranks: int) -> "Layout":
        """These virtual stages on the lowest ranks of a `num_ranks`-rank pipeline, each
        higher rank's chunks empty (same `num_chunks`): what a repack migrates to before
        the higher ranks leave. Rank r < pp keeps its chunk c (virtual stage c * pp + r
        here, c * num_ranks + r there), so layer order is kept: 'Ett|ttL' (pp = 2, v = 1)
        over 3 ranks is 'Ett|tt|L'; 'Et|t|t|tL' (pp = 2, v = 2) is 'Et|t||t|t|L'."""
        pp, v = self.num_ranks, self.num_chunks
        if num_ranks < pp:
            raise LayoutError(f"cannot spread {pp} pipeline ranks over {num_ranks}")
        counts = [c for chunk in range(v)
                  for c in self.counts[chunk * pp:(chunk + 1) * pp] + (0,) * (num_ranks - pp)]
        mtp = self.mtp_stage
        if mtp is not None:
            mtp = self.chunk_of(mtp) * num_ranks + self.rank_of(mtp)
        return Layout(tuple(counts), v, self.mtp_layers, mtp)

    def to_megatron(self) -> str:
        """Megatron's layout string, e.g. 'Ett|ttL' (empty stages allowed: 'Et||tL')."""
        parts = ["t" * c for c in self.counts]
        if self.mtp_stage is not None:
            parts[self.mtp_stage] += "m" * self.mtp_layers
        parts[0] = "E" + parts[0]
        parts[-1] = parts[-1] + "L"
        return "|".join(parts)

    def __str__(self) -> str:
        return self.to_megatron()


_STAGE = re.compile(r"(E?)(t*)(m*)(L?)")


def _parse_stages(text: str, stages: list[str]) -> tuple[tuple[int, ...], int | None, int]:
    """Decoder counts, the MTP stage and MTP layer count of the expanded `stages`;
    E opens the first stage, L closes the last, each stage reads E? t* m* L?."""
    bad = sorted(set("".join(stages)) - set("Etm|L"))
    if bad:
        raise LayoutError(f"layout {text!r}: unsupported characters {bad}; use E, t, m, L and |")
    joined = "".join(stages)
    if joined.count("E") != 1 or not stages[0].startswith("E"):
        raise LayoutError(f"layout {text!r}: the embedding 'E' must open the first stage, once")
    if joined.count("L") != 1 or not stages[-1].endswith("L"):
        raise LayoutError(f"layout {text!r}: the loss 'L' must close the last stage, once")
    counts, mtp = [], []
    for s, stage in enumerate(stages):
        match = _STAGE.fullmatch(stage)
        if match is None:
            raise LayoutError(f"layout {text!r}: stage {s} is {stage!r}; within a stage MTP "
                              "layers 'm' follow every decoder layer 't' (order E, t, m, L)")
        counts.append(len(match.group(2)))
        if match.group(3):
            mtp.append(s)
    if len(mtp) > 1:
        raise LayoutError(f"layout {text!r}: MTP layers 'm' in stages {mtp}; all of them must "
                          "be in one (virtual) stage")
    return tuple(counts), (mtp[0] if mtp else None), joined.count("m")


def check_mtp_placement(layout: Layout) -> None:
    """Megatron-Core 0.16.1's MTP rules (module doc): LayoutError, one line, if broken."""
    k, s = layout.mtp_layers, layout.mtp_stage
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise LayoutError(f"mtp_layers must be a non-negative integer, got {k!r}")
    if k == 0:
        if s is not None:
            raise LayoutError(f"an MTP stage ({s}) without MTP layers; give mtp_layers >= 1")
        return
    if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < layout.num_stages:
        raise LayoutError(f"MTP stage {s!r} is not a stage of {layout.num_stages}")
    later = [t for t in range(s + 1, layout.num_stages) if layout.counts[t]]
    if later:
        raise LayoutError(f"MTP layers in stage {s} but decoder layers after them in stage "
                          f"{later[0]}; MTP layers must follow every decoder layer")
    if layout.chunk_of(s) != layout.num_chunks - 1:
        raise LayoutError(f"MTP layers in virtual stage {s}, chunk {layout.chunk_of(s)} of rank "
                          f"{layout.rank_of(s)}; they must be in the last chunk of their rank")
    if layout.num_ranks > 1 and layout.rank_of(s) == 0:
        raise LayoutError("MTP layers on the first pipeline rank; put them on the last rank or "
                          "standalone on a later one")


def _stage_count_message(text: str, found: int, pp: int, chunks: int) -> str:
    want = pp * chunks
    hint = ""
    if found % pp == 0 and found != want:
        hint = (f"; with {found // pp} virtual stages per rank it fits: give "
                f"--num-virtual-stages-per-pipeline-rank {found // pp}")
    return (f"layout {text!r} has {found} stages but the pipeline has {want} "
            f"(--pipeline-model-parallel-size {pp} x --num-virtual-stages-per-pipeline-rank "
            f"{chunks}){hint}")
