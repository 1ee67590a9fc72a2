"""The balancing problem of a measured profile: what the live controller decides on.

Pure (no torch, no megatron): the live controller (`controller.DynMo._decide`) and
`dynmo plan --from-run` build the same problem from the same profile, so the plan a
Megatron-LM user is told to pass is the layout the live run chose.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from dynmo_plugin.balancing.memory import MemoryCalibration, calibrate, modelled_stage_bytes
from dynmo_plugin.balancing.problem import BalanceProblem, ProblemError
from dynmo_plugin.layout import Layout
from dynmo_plugin.profiling.records import PipelineProfile, StageProfile

__all__ = ["CHECKSUM_TRANSIENT_BYTES", "StepShares", "step_shares", "memory_calibration",
           "problem_from_profile"]

# What the device checksum of one migration buffer allocates beside it at most
# (migration.wire.checksum_transient_bytes of a buffer of one chunk or more: two int64
# temporaries of 2**20 words and the accumulators). A pure constant here, since this wing
# imports no torch; tests/megatron/test_nccl_safety.py holds the two equal.
CHECKSUM_TRANSIENT_BYTES = 2 * 8 * (1 << 20) + 4 * 8


def memory_calibration(profile: PipelineProfile, num_stages: int, num_microbatches: int,
                       peak_microbatches: Optional[int] = None) -> tuple[list[float], MemoryCalibration]:
    """The memory model's per-layer bytes — state + the 1F1B warm-up depth of activations
    a stage may hold (at most p micro-batches) — and its calibration by each stage's
    measured peak, against the layers that stage held when profiled
    (`balancing.memory`). The peak was measured at `num_microbatches`, the calibration
    holds at that count; the bytes returned are at `peak_microbatches` (default the
    same), the most the run will reach (a batch ramping up: `StageHandle.peak_microbatches`).

    Interleaved (`profile.num_chunks` = v > 1, `num_stages` virtual): a layer's
    activations count at the most micro-batches any chunk of any rank held at once under
    the interleaved schedule (the profile's per-chunk `in_flight`: a layer may move to any
    chunk), and the calibration is per RANK, as memory is: the rank's measured peak
    against the model's bytes summed over its chunks (`BalanceProblem.memory_overhead`
    is per rank then)."""
    v = profile.num_chunks
    if v > 1 and len(profile.stages) != num_stages:
        raise ProblemError(f"the profile has {len(profile.stages)} virtual stages but the "
                           f"layout {num_stages}; profile again under the current layout")
    measured = _layer_bytes(profile, num_stages, num_microbatches)
    modelled = modelled_stage_bytes(measured, [x.stage for x in profile.layers],
                                    [s.extra_bytes for s in profile.stages])
    ranks = profile.rank_records()
    if v > 1:  # virtual stage s runs on rank s % pp
        modelled = [sum(modelled[r::len(ranks)]) for r in range(len(ranks))]
    calibration = calibrate([s.peak_bytes for s in ranks], modelled,
                            [s.peak_source for s in ranks])
    peak = peak_microbatches or num_microbatches
    return _layer_bytes(profile, num_stages, peak, peak != num_microbatches), calibration


def _layer_bytes(profile: PipelineProfile, num_stages: int, num_microbatches: int,
                 at_peak: bool = False) -> list[float]:
    """Each layer's state + its activations times the micro-batches a stage holds at once
    at `num_microbatches` (interleaved: the most any chunk held, as profiled at the
    moment's count or, `at_peak`, as the schedule holds them at the peak's)."""
    in_flight = (min(num_stages, num_microbatches) if profile.num_chunks == 1
                 else max(_chunk_depth(s, at_peak) for s in profile.stages))
    return [x.state_bytes + in_flight * x.act_bytes for x in profile.layers]


def _chunk_depth(record: StageProfile, at_peak: bool) -> int:
    """An interleaved chunk's micro-batches in flight as profiled, or at the peak's count
    (`peak_in_flight`, recorded where the batch ramps)."""
    return (record.peak_in_flight or record.in_flight) if at_peak else record.in_flight


def _extras_bytes(profile: PipelineProfile, num_stages: int, num_microbatches: int,
                 peak_microbatches: Optional[int] = None) -> list[float]:
    """Each stage's extras (embedding, head: parameters, gradients, optimizer state) and
    what their activations add at the peak micro-batches beyond the profiled moment's
    (a batch ramping up; the moment's are in the calibrated overhead): per micro-batch
    more in flight, one more `extra_act_bytes`. 1F1B: stage s holds min(p - s, m)."""
    peak = peak_microbatches or num_microbatches
    if peak == num_microbatches:
        return [float(s.extra_bytes) for s in profile.stages]
    if profile.num_chunks == 1:
        more = [min(num_stages - s.stage, peak) - min(num_stages - s.stage, num_microbatches)
                for s in profile.stages]
    else:
        more = [_chunk_depth(s, True) - s.in_flight for s in profile.stages]
    return [float(s.extra_bytes + max(n, 0) * s.extra_act_bytes) for s, n in zip(profile.stages, more)]


@dataclass(frozen=True)
class StepShares:
    """The optimizer step spread over the m micro-batches by what it works on: per layer
    its share, per stage the extras' share (or the whole step of a rank with nothing
    trainable), per the MTP block its share. Seconds per micro-batch."""

    layers: tuple[float, ...]
    stages: tuple[float, ...]
    mtp: float = 0.0


def step_shares(profile: PipelineProfile, m: int) -> StepShares:
    """The optimizer step is elementwise over the rank's trainable parameters, so each
    layer's share moves with it: the rank's step time x the layer's gradient bytes over
    the rank's (layers, extras and MTP block). A frozen layer has no gradient and no
    share; a rank with nothing trainable keeps its whole step as its own. Interleaved,
    the rate is the rank's (the profiler splits the rank's step evenly over its chunks)."""
    ranks = len(profile.stages) // profile.num_chunks  # virtual stage s runs on rank s % ranks
    units = [*profile.layers, *([profile.mtp] if profile.mtp is not None else [])]
    grad, step = [0] * ranks, [0.0] * ranks
    for x in units:
        grad[x.stage % ranks] += x.grad_bytes
    for s in profile.stages:
        grad[s.stage % ranks] += s.extra_grad_bytes
        step[s.stage % ranks] += s.step_s
    rate = [t / g if g > 0 else 0.0 for t, g in zip(step, grad)]  # seconds per gradient byte

    def share(x) -> float:
        return rate[x.stage % ranks] * x.grad_bytes / m

    fixed = [(rate[s.stage % ranks] * s.extra_grad_bytes if rate[s.stage % ranks] > 0 else s.step_s) / m
             for s in profile.stages]
    return StepShares(tuple(share(x) for x in profile.layers), tuple(fixed),
                      share(profile.mtp) if profile.mtp is not None else 0.0)


def _mtp_fields(profile: PipelineProfile, current: Layout, num_microbatches: int,
                pin_mtp: bool, step_share: float) -> dict:
    """The MTP block's problem fields: its measured cost and state + the activations of
    the micro-batches a stage may hold (as a layer's, at `num_microbatches`); pinned to its current stage when
    `pin_mtp` (live migration moves decoder layers only)."""
    if not current.has_mtp:
        return {}
    out = {"mtp_layers": current.mtp_layers,
           "mtp_stages": (current.mtp_stage,) if pin_mtp else None}
    block = profile.mtp
    if block is not None:
        depth = min(current.num_stages, num_microbatches)
        out.update(mtp_cost=block.cost_s + step_share, mtp_memory=float(block.state_bytes + depth * block.act_bytes),
                   mtp_move_bytes=float(block.state_bytes))
    return out


def problem_from_profile(profile: PipelineProfile, current: Layout, config,
                         num_microbatches: int, pin_mtp: bool = False,
                         step_microbatches: Optional[int] = None,
                         peak_microbatches: Optional[int] = None,
                         layer_block: int = 1) -> BalanceProblem:
    """Per-layer cost = median fwd+bwd per micro-batch and the layer's share of the
    optimizer step (`step_shares`); per-stage extras = the embedding's or head's fwd+bwd
    and the extras' share of the step. The stage's prediction less what stays with the
    stage however layers move (its rest of the step, its host waits: docs/profiling.md,
    "What the balancer takes"). Memory as `memory_calibration` models and calibrates it;
    a migration rebuilds each stage's gradient buffers (`rebuild_bytes`). Interleaved:
    extras per virtual stage, memory overhead and the cap per rank (`num_chunks` from
    the current layout). `config`: a `config.DynmoConfig` (only
    `rebalance.memory_cap_gb` and `rebalance.allow_empty_stages` are read).
    `step_microbatches`: the micro-batches the profiled step is spread over (default
    `num_microbatches`; a grow with the plain optimizer keeps the step and runs fewer,
    `DynMo._freed_choice`). `peak_microbatches`: the count memory is checked at (default
    `num_microbatches`; `memory_calibration`). `layer_block`: stages hold whole blocks of
    that many layers (`config.checks.recompute_block`: Megatron's uniform recompute)."""
    p = current.num_stages
    layer_bytes, calibration = memory_calibration(profile, p, num_microbatches, peak_microbatches)
    cap = config.rebalance.memory_cap_gb
    shares = step_shares(profile, step_microbatches or num_microbatches)
    return BalanceProblem(
        costs=[x.cost_s + share for x, share in zip(profile.layers, shares.layers)],
        num_stages=p,
        memory=layer_bytes,
        move_bytes=[x.state_bytes for x in profile.layers],
        capacity=cap * 1e9 if cap > 0 else None,
        memory_overhead=calibration.overhead,
        extras_cost=[s.extra_s + fixed for s, fixed in zip(profile.stages, shares.stages)],
        extras_memory=_extras_bytes(profile, p, num_microbatches, peak_microbatches),
        current=current,
        allow_empty_stages=config.rebalance.allow_empty_stages,
        num_microbatches=num_microbatches,
        param_counts=[x.param_bytes for x in profile.layers],
        rebuild_bytes=[x.grad_bytes for x in profile.layers],
        extras_rebuild_bytes=[s.extra_grad_bytes for s in profile.stages],
        num_chunks=current.num_chunks,
        layer_block=layer_block,
        transfer_transient_bytes=(CHECKSUM_TRANSIENT_BYTES
                                  if any(s.clock == "cuda_event" for s in profile.stages) else 0.0),
        **_mtp_fields(profile, current, peak_microbatches or num_microbatches, pin_mtp, shares.mtp),
    )
