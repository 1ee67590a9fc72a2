"""What a profiling window measured: per layer, per stage, for the whole pipeline.

Plain data (no torch): built on each rank, reduced over data-parallel replicas by max,
gathered over the pipeline group, then read by the balancer and written to the report.

Interleaved pipelines (`PipelineProfile.num_chunks` = v > 1, pp ranks): a layer's `stage`
is its VIRTUAL stage and `stages` holds one record per virtual stage (pp * v, in layer
order; virtual stage s runs on rank s % pp as chunk s // pp). What belongs to the
virtual stage is its own (`extra_*`: the embedding on virtual stage 0, the head and loss
on the last; `in_flight`: its chunk's micro-batches in flight at once). What belongs to
the RANK — memory (`peak_bytes`, `static_bytes`: one allocator, one optimizer over all
chunks) and the schedule's times (`wait_s`, `compute_s`, `profiled_s`) — is the rank's
value, repeated on each of its virtual stages (`rank_records()` gives one per rank: never
sum these over virtual stages). With v = 1 both readings coincide and the format is the
one it always was (no `num_chunks` key).
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field, fields
from typing import Optional

__all__ = ["LayerProfile", "StageProfile", "PipelineProfile", "median", "spread", "cost_spread",
           "stage_prediction"]

# MAD x 1.4826 estimates the standard deviation of normally distributed samples.
_MAD_TO_SIGMA = 1.4826


def median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def spread(values: list[float]) -> float:
    """Relative dispersion of samples: 1.4826 x median absolute deviation / median (a
    robust coefficient of variation: one descheduled micro-batch moves it little).
    0.0 with fewer than two samples or a zero median (nothing known)."""
    mid = median(values)
    if len(values) < 2 or mid <= 0:
        return 0.0
    return _MAD_TO_SIGMA * median([abs(v - mid) for v in values]) / mid


def cost_spread(fwd: list[float], bwd: list[float]) -> float:
    """The relative dispersion of a layer's fwd+bwd cost per micro-batch. The probe keeps
    both lists in the same (iteration, micro-batch) order, so when they pair up the
    spread is that of the sums; otherwise (a layer with no backward span in some
    micro-batches) the two spreads weighted by their medians, as if fully correlated."""
    if len(fwd) == len(bwd) and bwd:
        return spread([f + b for f, b in zip(fwd, bwd)])
    total = median(fwd) + median(bwd)
    if total <= 0:
        return 0.0
    return (spread(fwd) * median(fwd) + spread(bwd) * median(bwd)) / total


@dataclass
class LayerProfile:
    """One TransformerLayer: median seconds per micro-batch (over every micro-batch of
    every window iteration), their dispersion, and exact bytes."""

    layer: int          # global 1-based layer number
    stage: int
    fwd_s: float
    bwd_s: float
    param_bytes: int
    grad_bytes: int
    optim_bytes: int
    act_bytes: int      # saved for backward, per micro-batch
    spread: float = 0.0  # relative dispersion of fwd+bwd per micro-batch (`cost_spread`)
    host_s: float = 0.0  # median host seconds between the same marks, fwd+bwd (on CUDA:
    # launching the layer; near cost_s when the step is host-bound; docs/profiling.md)
    gpu_s: float = 0.0   # median GPU kernel seconds the layer launched, fwd+bwd (CUDA only; 0: not measured)
    span_s: float = 0.0  # the calibrated span, fwd+bwd (the cost on CPU)
    host_cpu_s: float = 0.0  # the host thread's CPU time, fwd+bwd (CUDA, host-bound: the cost)

    @property
    def cost_s(self) -> float:
        return self.fwd_s + self.bwd_s

    @property
    def state_bytes(self) -> int:
        """What moves with the layer: weights, gradients, optimizer state."""
        return self.param_bytes + self.grad_bytes + self.optim_bytes


@dataclass
class StageProfile:
    """Per stage: fixed extras (embedding, head+loss) and what the schedule saw."""

    stage: int
    extra_s: float          # embedding and/or output layer + loss, fwd+bwd per micro-batch
    wait_s: float           # per iteration, blocked in pipeline p2p (wall clock)
    peak_bytes: int         # max allocated on GPU; accounted bytes on CPU (see peak_source)
    extra_bytes: int = 0    # params + grads + optimizer state of the extras
    extra_grad_bytes: int = 0  # of which gradients (rebuilt by every migration)
    compute_s: float = 0.0  # per iteration: the schedule's forward- + backward-compute timers
    profiled_s: float = 0.0  # per iteration: sum of layer costs + extras over micro-batches
    num_microbatches: int = 0
    clock: str = ""
    peak_source: str = ""   # "measured" (CUDA allocator) or "accounted" (static + in-flight activations)
    static_bytes: int = 0   # params + gradient buffers + optimizer state as held (storages once)
    extra_act_bytes: int = 0  # saved for backward outside the decoder layers, per micro-batch
    in_flight: int = 0      # micro-batches whose activations the stage holds at once (1F1B;
    # interleaved: the most of this chunk's micro-batches the rank's schedule holds at once)
    peak_in_flight: int = 0  # the same at the run's peak micro-batches (a batch ramping up;
    # 0: as in_flight)
    # which time the layers cost (megatron/profiling/profiler.py `choose_costs`): "span" (CPU),
    # "host_cpu" (CUDA, host-bound: the host's launch work) or "gpu_kernels" (GPU-bound)
    cost_source: str = ""
    span_constant_s: float = 0.0  # subtracted from every layer's span, fwd+bwd (empty spans)
    host_s: float = 0.0     # per iteration: the layers' host time
    gpu_s: float = 0.0      # per iteration: the layers' GPU kernel time (CUDA only)
    step_s: float = 0.0     # per iteration: the optimizer step
    host_waits_s: float = 0.0  # per micro-batch: the layers' spans beyond their CPU time ("host_cpu")
    # per iteration: the step's host time that no span holds (the schedule, data, loss
    # reduction, gradient clipping, scenario hooks; on CPU also blocked p2p is left out)
    rest_s: float = 0.0
    rest_gpu_s: float = 0.0  # per iteration: the kernels launched there (CUDA only)
    # per iteration: CPU seconds of the rank's other threads during the step (gloo's
    # transport, a pin-memory thread): on a CPU the ranks share, cores the ranks do not get
    # (sim.run_replay); not in predicted_s (another core's work). CPU runs only: 0 on CUDA,
    # where autograd's device thread runs the backward's launches (the stage's own time)
    threads_s: float = 0.0
    # per iteration: (layers + extras + host waits) x micro-batches + step + rest (the
    # GPU's, rest_gpu_s, where the GPU bounds the stage: "gpu_kernels")
    predicted_s: float = 0.0
    measured_s: float = 0.0   # per iteration: median outside profiling windows (0: unknown)
    # CUDA: the share of the window's kernel launches with a kernel record (kernels.kernel_coverage)
    kernel_coverage: Optional[float] = None

    @property
    def counted_rest_s(self) -> float:
        """The rest of the step the stage's time holds: the host's where the host bounds
        the stage; where the GPU does ("gpu_kernels") the host's rest runs while the
        queued kernels do, and the rest is the kernels the step launched outside its
        spans (`rest_gpu_s`)."""
        return self.rest_gpu_s if self.cost_source == "gpu_kernels" else self.rest_s


# StageProfile's labels and the number each describes (`PipelineProfile.elementwise_max`)
_LABELLED_BY = {"clock": "predicted_s", "cost_source": "predicted_s", "peak_source": "peak_bytes"}
# loads that add over the ranks rather than pace them: a replica fold keeps their mean, so
# that the mean x the ranks is the machine's total (sim.run_replay's cores taken)
_MEAN_OVER_REPLICAS = ("threads_s",)
# a share where the worst replica tells: any one losing kernel records shorts the stage
_MIN_OVER_REPLICAS = ("kernel_coverage",)


def stage_prediction(record: StageProfile, layers: list[LayerProfile], m: int) -> float:
    """The stage's time per iteration as profiled (megatron/profiling/profiler.py's
    docstring): its layers, extras and the host's waits per micro-batch, the optimizer
    step, and the rest of the step (`StageProfile.counted_rest_s`). The balancer's stage
    load is this less the rest and the host's waits, over m
    (`balancing.profile_problem.problem_from_profile`)."""
    return (m * (sum(x.cost_s for x in layers) + record.extra_s + record.host_waits_s)
            + record.step_s + record.counted_rest_s)


@dataclass
class PipelineProfile:
    layers: list[LayerProfile] = field(default_factory=list)
    stages: list[StageProfile] = field(default_factory=list)
    num_chunks: int = 1     # virtual stages per pipeline rank (module docstring)
    # The Multi-Token Prediction block as one unit (`layer` = its k MTP layers, `stage`
    # where it ran): its own hooks' time, its embedding use included; its losses'
    # output-layer work stays in the last stage's extras. None: no MTP.
    mtp: LayerProfile | None = None

    def to_dict(self) -> dict:
        out = {"layers": [asdict(x) for x in self.layers],
               "stages": [asdict(x) for x in self.stages]}
        if self.num_chunks != 1:
            out["num_chunks"] = self.num_chunks
        if self.mtp is not None:
            out["mtp"] = asdict(self.mtp)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "PipelineProfile":
        mtp = data.get("mtp")
        return cls([LayerProfile(**x) for x in data["layers"]],
                   [StageProfile(**x) for x in data["stages"]], int(data.get("num_chunks", 1)),
                   None if mtp is None else LayerProfile(**mtp))

    def dispersion(self) -> float:
        """The profile's measured noise: the layers' relative dispersions weighted by
        their costs — the relative error a stage's summed cost carries when its layers'
        errors move together (the conservative case). 0.0 when nothing was measured
        (simulated or old profiles): the gate then keeps its configured floor."""
        total = sum(x.cost_s for x in self.layers)
        if total <= 0:
            return 0.0
        return sum(x.cost_s * x.spread for x in self.layers) / total

    def rank_records(self) -> list[StageProfile]:
        """One record per pipeline rank, rank 0 first, for what is per rank (memory, the
        schedule's times): the record of the rank's chunk 0, virtual stage r = rank r."""
        return self.stages[:len(self.stages) // self.num_chunks]

    @staticmethod
    def merge(parts: list["PipelineProfile"]) -> "PipelineProfile":
        """Union of per-rank profiles: layers in global order, (virtual) stages in order."""
        chunks = {p.num_chunks for p in parts}
        if len(chunks) != 1:
            raise ValueError(f"profiles with different chunks per rank {sorted(chunks)} cannot "
                             "be merged: every rank must profile the same pipeline")
        layers = sorted((x for p in parts for x in p.layers), key=lambda x: x.layer)
        stages = sorted((x for p in parts for x in p.stages), key=lambda x: x.stage)
        mtp = next((p.mtp for p in parts if p.mtp is not None), None)
        return PipelineProfile(layers, stages, chunks.pop(), mtp)

    @staticmethod
    def elementwise_max(parts: list["PipelineProfile"]) -> "PipelineProfile":
        """Max over replicas of the same stage (data- and tensor-parallel ranks): the
        slowest sets the pace. A label goes with the number it describes (`_LABELLED_BY`):
        the clock and the cost source with the slowest replica's stage prediction, the
        peak's source with the largest peak, so that e.g. `counted_rest_s` reads the rest
        of the regime the prediction came from. The rank's other threads' CPU
        (`threads_s`) is a load the ranks add up, not a pace: its mean. The kernel
        records' coverage is the worst replica's."""
        def fold(items):
            out = {}
            for f in fields(items[0]):
                values = [getattr(x, f.name) for x in items]
                if f.name in _LABELLED_BY:
                    by = [getattr(x, _LABELLED_BY[f.name]) for x in items]
                    out[f.name] = values[by.index(max(by))]
                elif f.name in _MEAN_OVER_REPLICAS:
                    out[f.name] = sum(values) / len(values)
                elif f.name in _MIN_OVER_REPLICAS:
                    out[f.name] = min((v for v in values if v is not None), default=None)
                elif isinstance(values[0], (int, float)) and f.name not in ("layer", "stage"):
                    out[f.name] = max(values)
                else:
                    out[f.name] = values[0]
            return type(items[0])(**out)
        layers = [fold([p.layers[i] for p in parts]) for i in range(len(parts[0].layers))]
        stages = [fold([p.stages[i] for p in parts]) for i in range(len(parts[0].stages))]
        mtp = [p.mtp for p in parts if p.mtp is not None]
        return PipelineProfile(layers, stages, parts[0].num_chunks, fold(mtp) if mtp else None)
