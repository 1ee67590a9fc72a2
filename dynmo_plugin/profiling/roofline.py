"""A roofline estimate of one layer's forward + backward on a GPU, from a CPU trace.

`OpTrace` records every aten op of a forward + backward (on the fake device at a real
shape, nothing computed). This module prices that record on a GPU:

* **GPU time** = sum over the kernels of max(FLOPs / rate, bytes / bandwidth) + a fixed
  floor per kernel. The rate is the measured bf16 GEMM rate times an achieved fraction
  (matmuls), a lower fraction for fused attention, and a slower one still for a bf16
  matmul with a dimension that is not a multiple of 8 (cuBLAS falls to kernels without
  16-byte vector loads). Every other kernel is priced by its bytes (elementwise,
  softmax, norms, copies, gathers are all memory-bound at these sizes).
* **Host time** = kernels x a per-launch cost (Python, Megatron's module code, autograd
  and the dispatcher per op, fitted to a host-bound layer).
* A layer's step costs max(GPU, host) when nothing else overlaps it.

The free constants are fitted (`fit`) to the measured rows in CALIBRATION and kept in
`H200_CONSTANTS`; `scripts/roofline.py --calibrate` reprints predicted vs measured.
Limits: no overlap of host and device inside a layer beyond the max, no L2 reuse, no
wave quantisation, no clock behaviour; one GEMM rate for every size. docs/roofline.md.

Pure: no torch import (it reads OpRecord-like objects), no torch.distributed, no Megatron.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterable, Protocol, Sequence

__all__ = ["Hardware", "Constants", "Estimate", "CalibrationRow", "H200", "H100", "H200_CONSTANTS",
           "CALIBRATION", "CALIBRATION_MAX_ERROR", "CALIBRATION_GPU_MAX_ERROR", "estimate", "alignment_factor", "predict_row",
           "calibration_errors", "fit", "measured"]


class Op(Protocol):
    """What the estimate reads of an `op_trace.OpRecord`."""

    name: str
    inputs: tuple
    flops: int
    bytes: int
    kernel: bool
    causal: bool

    @property
    def is_matmul(self) -> bool: ...

    def leading_dims(self) -> list[int]: ...

    @property
    def is_attention(self) -> bool: ...


@dataclass(frozen=True)
class Hardware:
    """One GPU's measured ceilings (KINDS.md in /work/.library/device, measured here)."""

    name: str
    matmul_flops: float   # bf16 8192^3 matrix product on random data, FLOP/s
    hbm_bytes: float      # device-to-device copy, bytes read + written per second


# H200: 788 TFLOP/s (8192^3 bf16, random data) and 4.3 TB/s copy, both runtimes, 2026-10-28
# and 2026-11-04. H100 80GB: 798 TFLOP/s and ~3.0 TB/s copy, 2026-11-13.
H200 = Hardware("H200", 788e12, 4.3e12)
H100 = Hardware("H100", 798e12, 3.0e12)


@dataclass(frozen=True)
class Constants:
    """The fitted constants (see `fit` and docs/roofline.md for their sources)."""

    matmul_efficiency: float      # fraction of Hardware.matmul_flops a layer's GEMMs reach
    attention_efficiency: float   # fraction a fused (flash) attention kernel reaches
    bandwidth_efficiency: float   # fraction of Hardware.hbm_bytes a memory-bound kernel reaches
    kernel_floor_s: float         # per kernel on the device: launch gap, ramp, tail
    attention_floor_s: float      # per fused attention kernel (fwd or bwd) on top of its FLOPs
    misaligned_even: float        # rate factor: a bf16 matmul dimension even, not a multiple of 8
    misaligned_odd: float         # rate factor: an odd matmul dimension
    host_per_kernel_s: float      # host cost per launched kernel
    host_per_pass_s: float        # host cost per pass (forward, backward) of a Megatron layer:
                                  # its module code, hooks and autograd bookkeeping

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"roofline constant {name}={value!r}: must be a finite number >= 0")
        for name in ("matmul_efficiency", "attention_efficiency", "bandwidth_efficiency",
                     "misaligned_even", "misaligned_odd"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"roofline constant {name}={getattr(self, name)}: must be in (0, 1]")


# Fitted by `fit` over CALIBRATION (scripts/roofline.py --fit prints the fit): the pure
# layers scripts/layer_probe.py measured on an H200 (kernel busy time and host enqueue
# time, separately) and the kernel probes; the misalignment factors from the FFN width
# probe alone (2703 and 2730 against 2688/2736).
H200_CONSTANTS = Constants(
    matmul_efficiency=0.95, attention_efficiency=0.85, bandwidth_efficiency=0.75,
    kernel_floor_s=6e-6, attention_floor_s=200e-6, misaligned_even=0.3, misaligned_odd=0.16,
    host_per_kernel_s=35e-6, host_per_pass_s=1.75e-3)


@dataclass(frozen=True)
class Estimate:
    """What a traced forward + backward costs: device and host seconds, and what they count."""

    gpu_s: float
    host_s: float
    kernels: int
    flops: int
    bytes: int
    matmul_s: float       # the part of gpu_s spent in matmuls and fused attention
    misaligned: int       # matmuls charged a misaligned rate

    @property
    def bound_s(self) -> float:
        """The layer's time on a GPU: the slower of device and host (no overlap modelled)."""
        return max(self.gpu_s, self.host_s)

    @property
    def bound(self) -> str:
        return "gpu" if self.gpu_s >= self.host_s else "host"


def alignment_factor(op: Op, c: Constants) -> float:
    """The rate factor of a bf16 matmul: 1 where every operand's and the result's leading
    dimension (row pitch) is a multiple of 8 elements (16 bytes), `misaligned_even` where
    some is even but not a multiple of 8, `misaligned_odd` where some is odd. Without
    recorded strides, every operand's two inner dimensions stand in (stricter: a row
    count such as tokens is no pitch). A pitch of 1 (a matrix-vector product, e.g. a
    router's one logit) runs a GEMV kernel, memory-bound either way: not misaligned."""
    lds = op.leading_dims() if getattr(op, "strides", ()) else None
    dims = [d for d in (lds if lds else [d for shape in op.inputs for d in tuple(shape)[-2:]])
            if d != 1]
    if all(d % 8 == 0 for d in dims):
        return 1.0
    return c.misaligned_even if all(d % 2 == 0 for d in dims) else c.misaligned_odd


def _kernel_s(op: Op, hw: Hardware, c: Constants) -> tuple[float, bool]:
    """(device seconds of one kernel, whether it was charged a misaligned rate)."""
    memory = op.bytes / (hw.hbm_bytes * c.bandwidth_efficiency)
    if op.is_attention:
        flops = op.flops / 2 if op.causal else op.flops   # flash skips the masked blocks
        compute = flops / (hw.matmul_flops * c.attention_efficiency) + c.attention_floor_s
        return max(compute, memory) + c.kernel_floor_s, False
    if op.is_matmul and op.flops:
        factor = alignment_factor(op, c)
        rate = hw.matmul_flops * c.matmul_efficiency * factor
        return max(op.flops / rate, memory) + c.kernel_floor_s, factor < 1
    return memory + c.kernel_floor_s, False


def estimate(ops: Iterable[Op], hw: Hardware = H200, c: Constants = H200_CONSTANTS,
             passes: int = 2) -> Estimate:
    """GPU and host time of the ops (an OpTrace's `ops`) on `hw` with constants `c`;
    `passes`: 2 for a forward + backward, 1 for a forward alone."""
    gpu, host, matmul = 0.0, passes * c.host_per_pass_s, 0.0
    kernels = flops = nbytes = misaligned = 0
    for op in ops:
        if not op.kernel:
            continue
        seconds, slow = _kernel_s(op, hw, c)
        gpu += seconds
        host += c.host_per_kernel_s
        if op.is_matmul or op.is_attention:
            matmul += seconds
        kernels += 1
        flops += op.flops
        nbytes += op.bytes
        misaligned += slow
    return Estimate(gpu, host, kernels, flops, nbytes, matmul, misaligned)


# ---- calibration -------------------------------------------------------------------------------
@dataclass(frozen=True)
class CalibrationRow:
    """A measured time the estimate is fitted to. `kind` "gpu": a Megatron layer's forward
    + backward, the sum of its kernels' durations (torch.profiler, CUDA activity: the
    device's busy time); "host": the same step's host enqueue time (no synchronisation
    inside); "probe": pure torch kernels timed back to back with CUDA events (GPU time
    alone: the host runs ahead). `layer` names the trace the row is priced from (a
    layer's "gpu" and "host" rows share one); `backend`: the layers' --attention-backend;
    `kernels`: the kernels the GPU launched per step (0: not recorded)."""

    name: str
    kind: str
    measured_s: float
    source: str
    passes: int = 2
    # "plain": Megatron's own layer or pure torch (stable code); else the scheme layer's
    # code as measured: a later change to that layer moves its row
    code: str = "plain"
    layer: str = ""
    backend: str = "unfused"
    kernels: int = 0

    @property
    def trace(self) -> str:
        return self.layer or self.name


_PROBE = "shared/notes/h200-acceptance-1.md, kernel probes (H200, pure torch, bf16)"
_GPU1 = "scripts/layer_probe.py on an H200, 2026-11-27, call 1 (unfused attention)"
_GPU2 = "scripts/layer_probe.py on an H200, 2026-11-27, call 2 (--attention-backend sdpa)"
# scripts/layer_probe.py's rows: (case, GPU ms, host ms, kernels, passes, code, source)
_LAYERS = (
    ("plain h4096 s2048 mb1", 7.279, 4.693, 68, 2, "plain", _GPU1),
    ("frozen h4096 s2048 mb1", 2.723, 1.785, 25, 1, "plain", _GPU1),
    ("pruned67/128 h4096 s2048 mb1", 5.924, 5.156, 68, 2, "gradual_pruning", _GPU1),
    ("mod0.125 h4096 s2048 mb1", 0.992, 6.435, 112, 2, "mixture_of_depths", _GPU1),
    ("plain h8192 s4096 mb1", 56.328, 5.671, 84, 2, "plain", _GPU1),
    ("frozen h8192 s4096 mb1", 21.834, 3.310, 31, 1, "plain", _GPU1),
    ("pruned67/128 h8192 s4096 mb1", 45.676, 6.655, 84, 2, "gradual_pruning", _GPU1),
    ("mod0.125 h8192 s4096 mb1", 4.530, 8.988, 115, 2, "mixture_of_depths", _GPU1),
    ("lsh1 h1024 s8192 mb1", 2.383, 4.255, 47, 2, "plain", _GPU1),
    ("lsh1 h1024 s16384 mb1", 5.882, 5.136, 53, 2, "plain", _GPU1),
    ("lsh1 h1024 s32768 mb1", 17.267, 5.178, 53, 2, "plain", _GPU1),
    ("plain h4096 s4096 mb2 sdpa", 14.781, 4.457, 56, 2, "plain", _GPU2),
    ("frozen h4096 s4096 mb2 sdpa", 5.283, 2.061, 19, 1, "plain", _GPU2),
    ("pruned67/128 h4096 s4096 mb2 sdpa", 9.489, 4.415, 56, 2, "gradual_pruning", _GPU2),
    ("early_exit75 h4096 s4096 mb2 sdpa", 7.800, 6.493, 149, 2, "early_exit", _GPU2),
)
CALIBRATION: tuple[CalibrationRow, ...] = tuple(
    CalibrationRow(f"{case} {kind}", kind, ms * 1e-3, source, passes, code, case,
                   "sdpa" if case.endswith(" sdpa") else "unfused", kernels)
    for case, gpu_ms, host_ms, kernels, passes, code, source in _LAYERS
    for kind, ms in (("gpu", gpu_ms), ("host", host_ms))
) + tuple(CalibrationRow(name, "probe", ms * 1e-3, _PROBE) for name, ms in (
    ("FFN h2048 T4096 width 8192", 1.273), ("FFN h2048 T4096 width 2703", 2.490),
    ("FFN h2048 T4096 width 2730", 1.346), ("FFN h2048 T4096 width 2688", 0.628),
    ("FFN h2048 T4096 width 2736", 0.608), ("SDPA causal b1 n8 s8192 d128", 1.173),
    ("SDPA causal 16 chunks of 512", 0.453)))
# The largest |predicted / measured - 1| over the "plain"-code rows of CALIBRATION with
# H200_CONSTANTS (docs/roofline.md; tests/profiling/test_roofline.py holds it).
CALIBRATION_MAX_ERROR = 0.45
# ... and of the Megatron layers' GPU rows (what a scheme's GPU ratio rests on)
CALIBRATION_GPU_MAX_ERROR = 0.16


def measured(case: str, kind: str = "gpu") -> float:
    """The seconds CALIBRATION holds for scripts/layer_probe.py's `case` ("gpu" or "host")."""
    for row in CALIBRATION:
        if row.layer == case and row.kind == kind:
            return row.measured_s
    raise KeyError(f"no {kind} calibration row for layer {case!r}")


def predict_row(row: CalibrationRow, est: Estimate, c: Constants = H200_CONSTANTS) -> float:
    """The time a row measured, as the estimate predicts it."""
    return est.host_s if row.kind == "host" else est.gpu_s


def calibration_errors(traces: dict[str, Sequence[Op]], hw: Hardware = H200,
                       c: Constants = H200_CONSTANTS) -> dict[str, float]:
    """{row name: predicted / measured - 1} for every CALIBRATION row whose trace is in
    `traces` (keyed by `CalibrationRow.trace`)."""
    out = {}
    for row in CALIBRATION:
        if row.trace in traces:
            est = estimate(traces[row.trace], hw, c, row.passes)
            out[row.name] = predict_row(row, est, c) / row.measured_s - 1
    return out


_FIT_GRID = {
    "matmul_efficiency": [0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 1.0],
    "attention_efficiency": [0.2, 0.3, 0.4, 0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 1.0],
    "bandwidth_efficiency": [0.5, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 1.0],
    "kernel_floor_s": [0.0, 1e-6, 2e-6, 3e-6, 4e-6, 6e-6, 8e-6, 12e-6, 16e-6, 20e-6, 25e-6],
    "attention_floor_s": [0.0, 50e-6, 100e-6, 150e-6, 175e-6, 200e-6, 225e-6, 250e-6, 300e-6],
    "misaligned_even": [0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5, 0.55, 0.6, 0.7],
    "misaligned_odd": [0.1, 0.12, 0.14, 0.16, 0.18, 0.2, 0.22, 0.25, 0.28, 0.32],
    "host_per_kernel_s": [5e-6, 10e-6, 15e-6, 20e-6, 25e-6, 30e-6, 35e-6, 40e-6, 45e-6, 50e-6, 60e-6,
                          70e-6, 90e-6, 110e-6],
    "host_per_pass_s": [0.0, 0.25e-3, 0.5e-3, 0.75e-3, 1.0e-3, 1.25e-3, 1.5e-3, 1.75e-3, 2.0e-3,
                        2.25e-3, 2.5e-3, 2.75e-3],
}


def fit(traces: dict[str, Sequence[Op]], hw: Hardware = H200, start: Constants = H200_CONSTANTS,
        rounds: int = 4) -> tuple[Constants, float]:
    """Coordinate descent over _FIT_GRID minimising the sum of squared log(predicted /
    measured) over the traced rows (deterministic: same traces, same constants).
    Returns (constants, their largest |predicted / measured - 1|)."""
    def loss(c: Constants) -> float:
        return sum(math.log1p(e) ** 2 for e in calibration_errors(traces, hw, c).values())
    best, best_loss = start, loss(start)
    host = [dict(host_per_kernel_s=k, host_per_pass_s=p) for k in _FIT_GRID["host_per_kernel_s"]
            for p in _FIT_GRID["host_per_pass_s"]]
    for _ in range(rounds):
        # one constant at a time, then the host's two together (they trade off)
        trials = [{name: value} for name, values in _FIT_GRID.items() for value in values] + host
        for change in trials:
            trial = replace(best, **change)
            value_loss = loss(trial)
            if value_loss < best_loss - 1e-12:
                best, best_loss = trial, value_loss
    return best, max(abs(e) for e in calibration_errors(traces, hw, best).values())
