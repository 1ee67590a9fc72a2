"""The gate: does applying a plan pay for its migration before the next event?

saving per iteration = predicted 1F1B time before - after; total saving = that x
iterations until the next expected dynamism event; migration time = fixed overhead +
bytes moved / bandwidth. Apply only if total saving > margin x migration time and
the predicted gain is at least the noise floor of the current iteration time:
profiles are measurements, and a plan that wins by less than their noise would move
layers back and forth on every trigger. The floor follows the noise the profile
measured (`PipelineProfile.dispersion()`, the cost-weighted relative dispersion of
its layers over micro-batches) times `dispersion_factor`, and never drops below
`min_relative_gain` (the fallback when nothing was measured: simulated profiles);
`min_relative_gain` 0 switches the floor off altogether.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from dynmo_plugin.balancing.plan import GateVerdict, Plan
from dynmo_plugin.errors import UserError

__all__ = ["GateConfig", "GateVerdict", "evaluate_gate", "attach_gate"]


@dataclass(frozen=True, kw_only=True)
class GateConfig:
    """Attributes:
        iterations_until_next_event: iterations the new layout will run before the next
            expected event (then the plan is recomputed anyway).
        bandwidth_bytes_per_s: measured or configured point-to-point bandwidth.
        margin: the saving must exceed margin x migration time (1.2 = 20% headroom).
        fixed_overhead_s: per-rebalance cost independent of bytes (sync, regrouping).
        min_relative_gain: smallest predicted saving worth acting on, as a fraction of
            the predicted current iteration time: the noise floor's minimum, and the
            floor itself when no dispersion was measured; 0 switches the floor off.
        measured_dispersion: the profile's relative dispersion
            (`PipelineProfile.dispersion()`; 0.0 = not measured).
        dispersion_factor: the floor is dispersion_factor x measured_dispersion where
            that is above min_relative_gain (1.0: a gain smaller than the typical
            deviation of one measurement from its median is not trusted).
    """

    iterations_until_next_event: int
    bandwidth_bytes_per_s: float
    margin: float = 1.2
    fixed_overhead_s: float = 0.0
    min_relative_gain: float = 0.0
    measured_dispersion: float = 0.0
    dispersion_factor: float = 1.0

    @property
    def noise_floor(self) -> float:
        """The smallest relative gain the gate trusts; min_relative_gain 0 switches the
        floor off, measured or not (decide on the prediction alone, as tests that force
        moves do)."""
        if self.min_relative_gain == 0:
            return 0.0
        return max(self.min_relative_gain, self.dispersion_factor * self.measured_dispersion)

    def __post_init__(self) -> None:
        if not isinstance(self.iterations_until_next_event, int) or self.iterations_until_next_event < 0:
            raise UserError("iterations_until_next_event must be an integer >= 0, got "
                            f"{self.iterations_until_next_event!r}")
        if not (self.bandwidth_bytes_per_s > 0 and math.isfinite(self.bandwidth_bytes_per_s)):
            raise UserError(f"bandwidth_bytes_per_s must be positive, got {self.bandwidth_bytes_per_s!r}")
        if not self.margin >= 0 or not self.fixed_overhead_s >= 0:
            raise UserError(f"margin ({self.margin}) and fixed_overhead_s ({self.fixed_overhead_s}) "
                            "must be >= 0")
        if not 0 <= self.min_relative_gain < 1:
            raise UserError(f"min_relative_gain must be in [0, 1), got {self.min_relative_gain!r}")
        for name in ("measured_dispersion", "dispersion_factor"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise UserError(f"{name} must be a finite number >= 0, got {value!r}")


def evaluate_gate(plan: Plan, config: GateConfig) -> GateVerdict:
    """Judge `plan` (pure; does not modify it)."""
    if plan.before is None or plan.predicted_iter_s_before is None:
        return GateVerdict(True, 0.0, 0.0, 0.0, "no current layout: initial placement, nothing migrates")
    if not plan.moves:
        return GateVerdict(False, 0.0, 0.0, 0.0, "the plan moves no layer")
    too_big = _over_capacity(plan)
    if too_big:
        return GateVerdict(False, 0.0, 0.0, 0.0, too_big)
    saving = plan.predicted_iter_s_before - plan.predicted_iter_s_after
    total = saving * config.iterations_until_next_event
    migration = config.fixed_overhead_s + plan.bytes_moved / config.bandwidth_bytes_per_s
    gain = saving / plan.predicted_iter_s_before if plan.predicted_iter_s_before > 0 else 0.0
    if saving > 0 and gain < config.noise_floor:
        return GateVerdict(False, saving, total, migration,
                           f"gain {100 * gain:.1f}% is below the noise floor "
                           f"{100 * config.noise_floor:.1f}% ({_floor_source(config)})")
    apply = saving > 0 and total > config.margin * migration
    numbers = (f"saves {saving:.4g} s/iter x {config.iterations_until_next_event} iters = "
               f"{total:.4g} s vs migration {migration:.4g} s x margin {config.margin:g}")
    return GateVerdict(apply, saving, total, migration,
                       ("pays: " if apply else "does not pay: ") + numbers)


def _floor_source(config: GateConfig) -> str:
    measured = config.dispersion_factor * config.measured_dispersion
    if measured > config.min_relative_gain:
        return (f"measured dispersion {100 * config.measured_dispersion:.1f}% x "
                f"{config.dispersion_factor:g}; min_relative_gain {100 * config.min_relative_gain:.1f}%")
    return f"min_relative_gain {100 * config.min_relative_gain:.1f}%"


def _over_capacity(plan: Plan) -> str:
    """Why the migration's transient peak does not fit ('' when it does)."""
    if plan.capacity is None or plan.migration_peak_memory is None:
        return ""
    for s, (peak, cap) in enumerate(zip(plan.migration_peak_memory, plan.capacity)):
        if peak > cap:
            where = "stage" if plan.layout.num_chunks == 1 else "rank"
            return (f"migration needs {peak / 1e9:.4g} GB on {where} {s} while old and new state "
                    f"coexist, above its cap {cap / 1e9:.4g} GB")
    return ""


def attach_gate(plan: Plan, config: GateConfig) -> Plan:
    """Evaluate the gate and store the verdict on `plan` (returned for chaining)."""
    plan.gate = evaluate_gate(plan, config)
    return plan
