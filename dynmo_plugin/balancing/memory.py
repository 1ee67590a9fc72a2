"""Memory calibration: the balancer's memory model corrected by what each stage measured.

The model (`controller.problem_from_profile`) counts per stage the extras' state
(embedding, output layer: params + grads + optimizer state) and, per layer, its state
plus its activations times the deepest 1F1B warm-up (p micro-batches, because a layer
may move to stage 0). A stage holds more than that: allocator transients (on an H100
`max_memory_allocated` sat 0.9-1.0 GiB, 11-12%, above the sum), the head's logits and
loss buffers, padded gradient buffers. The profile measures each stage's peak
(`StageProfile.peak_bytes`: allocator peak on CUDA, accounted bytes on CPU), so per stage

    overhead_s = max(0, peak_s - modelled_s)

where modelled_s is the model's bytes for the layers stage s held when it was measured.
A candidate layout fits if, on every stage, modelled bytes + overhead_s <= cap: the
overhead goes into `BalanceProblem.memory_overhead`, which every solver subtracts from
the capacity (`capacity_arr`).

Why an additive overhead and not the ratio peak / modelled: what the model misses is
mostly per stage, not per layer — the head's logits, one operator's workspace at a time,
communication buffers — so it does not grow with the layers a stage receives. A ratio
would charge a stage receiving layers for more copies of its head's logits (in
tests/megatron/test_memory_calibration.py the last stage measures 1.46x its model; scaled by
that, no layer could move onto it under the test's cap, yet with one more layer it
held 32.5 of the 34.5 MB allowed). The ratio is still recorded (`factor`) to compare
stages and machines. Calibration never lowers the model: a stage
measured below its model (a later stage holds fewer micro-batches than the model
counts) keeps overhead 0. The overhead is measured under one layout; after a migration
the next profile measures the new one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from dynmo_plugin.balancing.problem import ProblemError

__all__ = ["StageCalibration", "MemoryCalibration", "calibrate", "modelled_stage_bytes"]


@dataclass(frozen=True)
class StageCalibration:
    """One stage: its measured peak against the model's bytes for what it held."""

    stage: int
    measured_bytes: float   # peak over the profile window (0: not measured)
    modelled_bytes: float   # the model's bytes for the layers and extras it held then
    source: str             # "measured" (CUDA allocator), "accounted" (CPU) or "none"

    @property
    def overhead_bytes(self) -> float:
        """What the stage holds beyond the model, counted against its cap (>= 0)."""
        return max(0.0, self.measured_bytes - self.modelled_bytes)

    @property
    def factor(self) -> float:
        """measured / modelled (1.0 when either is 0): for the record only."""
        if self.measured_bytes <= 0 or self.modelled_bytes <= 0:
            return 1.0
        return self.measured_bytes / self.modelled_bytes

    def calibrated(self, modelled: float) -> float:
        return modelled + self.overhead_bytes


@dataclass(frozen=True)
class MemoryCalibration:
    """Per-stage calibration of one profile (stage 0 first)."""

    stages: tuple[StageCalibration, ...]

    @property
    def overhead(self) -> list[float]:
        """Per-stage bytes for `BalanceProblem.memory_overhead`."""
        return [s.overhead_bytes for s in self.stages]

    def calibrated(self, modelled: Sequence[float]) -> list[float]:
        """Per-stage calibrated bytes of a layout whose modelled bytes are `modelled`."""
        return [c.calibrated(m) for c, m in zip(self.stages, modelled)]

    def to_dict(self) -> dict:
        """The report's record (bytes; factor = measured / modelled)."""
        return {"stages": [{"stage": s.stage, "measured_bytes": s.measured_bytes,
                            "modelled_bytes": s.modelled_bytes, "source": s.source,
                            "factor": s.factor, "overhead_bytes": s.overhead_bytes}
                           for s in self.stages]}


def modelled_stage_bytes(layer_bytes: Sequence[float], layer_stages: Sequence[int],
                         extras_bytes: Sequence[float]) -> list[float]:
    """The model's bytes per stage for the layout the layers were measured under:
    extras_bytes[s] + the modelled bytes of the layers whose stage is s."""
    out = [float(x) for x in extras_bytes]
    for nbytes, stage in zip(layer_bytes, layer_stages):
        if not 0 <= stage < len(out):
            raise ProblemError(f"a layer was profiled on stage {stage} but the profile has "
                               f"{len(out)} stages; profile again under the current layout")
        out[stage] += float(nbytes)
    return out


def calibrate(measured: Sequence[float], modelled: Sequence[float],
              sources: Sequence[str]) -> MemoryCalibration:
    """Per-stage calibration from measured peaks and the model's bytes of the same layout.
    A peak of 0 means "not measured" (source "none"): no overhead."""
    if not len(measured) == len(modelled) == len(sources):
        raise ProblemError(f"{len(measured)} measured peaks, {len(modelled)} modelled sums and "
                         f"{len(sources)} sources: give one of each per stage")
    return MemoryCalibration(tuple(
        StageCalibration(s, float(p), float(m), src if p > 0 else "none")
        for s, (p, m, src) in enumerate(zip(measured, modelled, sources))))
