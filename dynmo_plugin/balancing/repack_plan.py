"""What a repack is asked and what it answers, as data: `RepackCriteria` (mirrors
`config.RepackConfig`), one `RepackCandidate` per stage count considered, and the
`RepackPlan` (serialisable with `to_dict`/`from_dict`, readable with `str`, whose text
is `repack_render`'s). The planners that fill them are in `balancing.repack`.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from dynmo_plugin.balancing.plan import Move
from dynmo_plugin.balancing.problem import ProblemError
from dynmo_plugin.balancing.repack_render import render_repack
from dynmo_plugin.layout import Layout

__all__ = ["OBJECTIVES", "RepackCriteria", "RepackCandidate", "RepackPlan"]

OBJECTIVES = ("min_stages", "throughput_per_gpu")


@dataclass(frozen=True, kw_only=True)
class RepackCriteria:
    """What a repack must satisfy (mirrors `config.RepackConfig`).

    Attributes:
        min_stages: never repack below this many pipeline stages.
        max_slowdown: every objective: predicted iteration time after <= this x the
            current one (1.0 = no slower, i.e. tokens/s never drops).
        objective: "min_stages" (fewest stages within max_slowdown) or
            "throughput_per_gpu" (most predicted tokens/s per GPU within max_slowdown).
        memory_margin: a stage fits if its predicted memory x (1 + margin) <= capacity.
        rebuild_s: estimated seconds to regroup and rebuild (the gate's fixed cost; it
            also covers moving the output layer, which is not a decoder layer).
    Raises:
        ProblemError: a value out of range (the message names the field).
    """

    min_stages: int = 1
    max_slowdown: float = 1.0
    objective: str = "min_stages"
    memory_margin: float = 0.1
    rebuild_s: float = 10.0

    def __post_init__(self) -> None:
        if isinstance(self.min_stages, bool) or not isinstance(self.min_stages, int) or self.min_stages < 1:
            raise ProblemError(f"min_stages must be an integer >= 1, got {self.min_stages!r}")
        if self.objective not in OBJECTIVES:
            raise ProblemError(f"objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        for name, low_ok in (("max_slowdown", False), ("memory_margin", True), ("rebuild_s", True)):
            value = getattr(self, name)
            good = isinstance(value, (int, float)) and not isinstance(value, bool) \
                and math.isfinite(value) and (value >= 0 if low_ok else value > 0)
            if not good:
                raise ProblemError(f"{name} must be a finite number {'>= 0' if low_ok else '> 0'}, "
                                   f"got {value!r}")

    @classmethod
    def from_config(cls, repack_config: Any) -> "RepackCriteria":
        """From `config.RepackConfig` (or anything with the same attributes)."""
        return cls(min_stages=repack_config.min_stages, max_slowdown=repack_config.max_slowdown,
                   objective=repack_config.objective, memory_margin=repack_config.memory_margin,
                   rebuild_s=repack_config.rebuild_s)


@dataclass
class RepackCandidate:
    """One stage count considered.

    `fits`: admissible under the criteria (memory with the margin; within max_slowdown;
    the live rebuild's peak within the caps, else `reason` starts "rebuild does not fit"). `layout`/`predicted_iter_s` are None when no
    split was computed (memory infeasible, or skipped by a lower bound; `reason` says).
    `tokens_per_gpu_s_rel`: relative tokens/s per GPU, 1 / (iteration s x stages).
    """

    stages: int
    layout: Layout | None
    predicted_iter_s: float | None
    fits: bool
    tokens_per_gpu_s_rel: float | None
    reason: str

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["layout"] = None if self.layout is None else self.layout.to_megatron()
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any], num_chunks: int = 1) -> "RepackCandidate":
        layout = None if d["layout"] is None else Layout.parse(d["layout"], num_chunks=num_chunks)
        return cls(stages=d["stages"], layout=layout, predicted_iter_s=d["predicted_iter_s"],
                   fits=d["fits"], tokens_per_gpu_s_rel=d["tokens_per_gpu_s_rel"], reason=d["reason"])


@dataclass
class RepackPlan:
    """A repack decision (data: `to_dict`/`from_dict` round-trip exactly; `str` reads).

    When `apply` is False, `stages_after == stages_before`, `layout_after ==
    layout_before`, no moves; `saving_gpu_s`/`cost_s` and `reason` still describe the
    refused option. `released_stages` are always the highest ranks.
    `tokens_per_iteration` (per pipeline replica; None = unknown) turns the predicted
    iteration times into tokens/s and tokens per GPU-hour (`tokens_per_s`,
    `tokens_per_gpu_hour`); tokens per GPU-hour do not depend on data parallelism.
    """

    method: str
    stages_before: int
    stages_after: int
    layout_before: Layout
    layout_after: Layout
    predicted_iter_s_before: float
    predicted_iter_s_after: float
    released_stages: list[int]
    moves: list[Move]
    bytes_moved: float
    candidates: list[RepackCandidate]
    apply: bool
    reason: str
    saving_gpu_s: float
    cost_s: float
    solve_seconds: float
    tokens_per_iteration: float | None = None

    def tokens_per_s(self, after: bool) -> float | None:
        """Predicted tokens/s of one pipeline replica before or after (None: unknown)."""
        it = self.predicted_iter_s_after if after else self.predicted_iter_s_before
        return None if self.tokens_per_iteration is None or not it > 0 else self.tokens_per_iteration / it

    def tokens_per_gpu_hour(self, after: bool) -> float | None:
        """Predicted tokens per GPU-hour before or after (None: unknown)."""
        rate = self.tokens_per_s(after)
        stages = self.stages_after if after else self.stages_before
        return None if rate is None else rate * 3600.0 / stages

    def intermediate_layout(self) -> Layout:
        """`layout_after` over all `stages_before` stages, the released ones empty
        (e.g. 'Ettt|ttttt||L'; interleaved: every chunk of a released rank empty, see
        `Layout.padded`): what the live migration moves to before the rebuild."""
        return self.layout_after.padded(self.stages_before)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict (what `dynmo plan --repack --json` prints)."""
        return {
            "method": self.method, "apply": self.apply, "reason": self.reason,
            "stages_before": self.stages_before, "stages_after": self.stages_after,
            "num_chunks": self.layout_before.num_chunks,
            "layout_before": self.layout_before.to_megatron(),
            "layout_after": self.layout_after.to_megatron(),
            "intermediate_layout": self.intermediate_layout().to_megatron(),
            "predicted_iter_s_before": self.predicted_iter_s_before,
            "predicted_iter_s_after": self.predicted_iter_s_after,
            "released_stages": list(self.released_stages),
            "moves": [asdict(m) for m in self.moves], "bytes_moved": self.bytes_moved,
            "candidates": [c.to_dict() for c in self.candidates],
            "saving_gpu_s": self.saving_gpu_s, "cost_s": self.cost_s,
            "solve_seconds": self.solve_seconds, "tokens_per_iteration": self.tokens_per_iteration,
            **{f"{name}_{when}": getattr(self, name)(when == "after")
               for name in ("tokens_per_s", "tokens_per_gpu_hour") for when in ("before", "after")},
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RepackPlan":
        """Inverse of `to_dict` (`intermediate_layout` is derived, not read).

        Raises:
            ProblemError: `d` is not a repack plan dict.
        """
        try:
            v = d.get("num_chunks", 1)
            return cls(
                method=d["method"], stages_before=d["stages_before"], stages_after=d["stages_after"],
                layout_before=Layout.parse(d["layout_before"], num_chunks=v),
                layout_after=Layout.parse(d["layout_after"], num_chunks=v),
                predicted_iter_s_before=d["predicted_iter_s_before"],
                predicted_iter_s_after=d["predicted_iter_s_after"],
                released_stages=list(d["released_stages"]), moves=[Move(**m) for m in d["moves"]],
                bytes_moved=d["bytes_moved"],
                candidates=[RepackCandidate.from_dict(c, v) for c in d["candidates"]],
                apply=d["apply"], reason=d["reason"], saving_gpu_s=d["saving_gpu_s"],
                cost_s=d["cost_s"], solve_seconds=d["solve_seconds"],
                tokens_per_iteration=d.get("tokens_per_iteration"))
        except (KeyError, TypeError, AttributeError) as e:
            raise ProblemError(f"not a repack plan dict ({type(e).__name__}: {e})") from e

    def __str__(self) -> str:
        return render_repack(self)
