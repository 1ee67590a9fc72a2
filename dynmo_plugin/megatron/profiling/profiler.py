"""A profiling window on a live stage: attach hooks, tap the timers, summarise, gather.

Python's cyclic garbage collector is off while a window is open (`profiling.collector`
says why: one collection in a span read a 10 ms layer at 258 ms).

Usage from a training loop (the controller does this):
    window = ProfileWindow(trainer)       # attaches hooks, installs the timer tap
    for it in ...:
        window.before_iteration(); trainer.train_step(it); window.after_iteration()
    profile = window.close()              # detaches; same PipelineProfile on every rank

Memory per stage (`StageProfile.peak_bytes`): on CUDA the allocator's peak over the
window's training steps (`torch.cuda.max_memory_allocated`): everything, transient buffers
included. It is read right after each optimizer step and the statistics are reset at each
iteration's end (`_DevicePeak`), so a freezing `rebuild()` between a step and the
iteration's end (megatron/migration/migrate.py resets the peak for its own measurement) neither
erases the step's peak nor adds the migration's transient buffers to the window. On CPU there is no allocator peak, so the bytes are
accounted from what the stage really holds: every parameter, gradient-buffer and
optimizer-state storage once (`static_bytes`: a padded DDP buffer counts whole), plus
the 1F1B warm-up depth times one micro-batch's activations — what autograd saves in
the decoder layers (`act_bytes`) and outside them (`extra_act_bytes`: embedding, head,
logits and loss). Transient buffers that are freed within a micro-batch are not seen
on CPU. The balancer calibrates its memory model with this peak
(`dynmo_plugin.balancing.memory`).

Interleaved pipelines (v > 1 chunks per rank, `trainer.chunks`): every chunk is probed,
each layer recorded under its virtual stage, one `StageProfile` per chunk with that
virtual stage's extras (`profiling.records` says which fields are per rank). Memory is
the rank's: the static bytes of all chunks (one optimizer), and on CPU the activations
the rank holds at the worst point of its interleaved schedule (`sim.schedule`: a
forward of chunk c adds chunk c's bytes, its backward frees them).

Which time a layer costs (issue 34; docs/profiling.md "GPU time and host time"): every
span is calibrated (the probe subtracts the span constant it measures on empty layers),
and on CUDA the kernels each layer launched are timed too (`kernels.KernelBusy`). A
stage whose layers' kernel time is at least their host time is GPU-bound: its layers
cost their kernel time (`cost_source` "gpu_kernels"), which is what bounds an iteration
when the host runs ahead. Otherwise a host-bound stage's layers on CUDA cost the host's
own launch work, the thread's CPU time (`cost_source` "host_cpu"; what the spans hold
beyond it, e.g. waiting for the GIL a DataLoader's pin-memory thread holds, is the
stage's `host_waits_s`, kept in the prediction); on CPU (one clock) the calibrated span
("span"). Every figure stays in the profile (`host_s`, `host_cpu_s`, `gpu_s`, `span_s`).

The prediction the check holds the profile to: `predicted_s`, the stage's time per
iteration from its layers, extras and optimizer step (`step_s`) as profiled, plus the
rest of the step (`rest_s`), against `measured_s`, the median iteration outside
profiling windows (given by the caller as `outside_s`; 0.0 when not given). Both are
logged for every window. The rest is measured, not inferred: the step's time on the
clock's host timeline (`before_iteration` .. `after_iteration`) less what every span
and the optimizer step took of it, drains included (`Clock.occupied`): the schedule's
own Python, the batch, the loss's reduction, zeroing and clipping the gradients,
scenario hooks. Inside pretrain_gpt.py on CPU it was 15-17 ms of a 67-70 ms step,
missing from the prediction before (0.76-0.78x). Where the GPU bounds the stage
("gpu_kernels") the host's rest overlaps the queued kernels: the rest is then the GPU's,
the kernels the training thread launched in the step outside every span (the step is a
profiler range, `rest_gpu_s`).
"""
from __future__ import annotations

import logging
import time

import torch

from dynmo_plugin.megatron.migration.optim_state import state_nbytes
from dynmo_plugin.megatron.profiling.distributed_saves import DistributedSaves
from dynmo_plugin.megatron.profiling.kernels import KernelBusy
from dynmo_plugin.megatron.profiling.probe import SavedBytes, StageProbe
from dynmo_plugin.megatron.profiling.timers import COMPUTE_TIMERS, TimerTap, is_p2p
from dynmo_plugin.profiling.clock import CudaEventClock, clock_for
from dynmo_plugin.profiling.collector import CollectorPause
from dynmo_plugin.profiling.gather import gather_profile
from dynmo_plugin.profiling.records import (LayerProfile, PipelineProfile, StageProfile, cost_spread, median,
                                            stage_prediction)
from dynmo_plugin.sim.schedule import FORWARD, rank_orders

__all__ = ["ProfileWindow", "choose_costs", "prediction_line"]

logger = logging.getLogger(__name__)


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _grad_tensor(p: torch.nn.Parameter) -> torch.Tensor | None:
    """Megatron DDP keeps gradients in `main_grad` views of its contiguous buffer."""
    main = getattr(p, "main_grad", None)
    return main if main is not None else p.grad


def _grad_bytes(p: torch.nn.Parameter) -> int:
    return _nbytes(_grad_tensor(p))


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors`: a view of a contiguous buffer
    (DDP's gradient buffer, a padded parameter buffer) counts the whole buffer, once."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


class _ExtraActivations:
    """Bytes autograd saves per micro-batch outside the decoder layers (embedding, final
    norm, output layer, loss). The probe's per-layer `saved_tensors_hooks` are nested
    inside this one and take precedence (the innermost pair applies), so a layer's own
    saved tensors are never counted here. Nor is the input an activation checkpoint
    keeps, which the checkpoint saves after its layer's hooks, here: the layer counted
    it (`StageProbe.kept_inputs`; it was counted twice, +16384 bytes a layer)."""

    def __init__(self, model: torch.nn.Module, kept_inputs: set[int]):
        self._param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._kept = kept_inputs  # the probe's: checkpoints' kept inputs, its layers' bytes
        self._open: SavedBytes | None = None
        self.per_microbatch: list[int] = []
        self._handles = [model.register_forward_pre_hook(self._enter),
                         model.register_forward_hook(self._exit)]

    def _enter(self, module, args) -> None:
        if module.training:  # not an evaluation's forward (no backward keeps anything)
            self._kept.clear()  # this micro-batch's (a freed storage's address is reused)
            self._open = SavedBytes(self._param_ptrs, self._kept).__enter__()

    def _exit(self, module, args, output) -> None:
        if self._open is not None:
            self._open.__exit__(None, None, None)
            self.per_microbatch.append(self._open.nbytes)
            self._open = None

    @property
    def counting(self) -> SavedBytes | None:
        """Its counter while a training forward of its chunk runs, else None."""
        return self._open

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._open is not None:  # cancelled inside a forward
            self._open.abandon()
            self._open = None


class _DevicePeak:
    """The allocator's peak over a window's training steps, immune to peak resets by
    others between them (module docstring). `cuda` is `torch.cuda`; tests pass a
    stand-in allocator (tests/megatron/test_profiling_clock.py)."""

    def __init__(self, cuda=None):
        from torch.optim.optimizer import register_optimizer_step_post_hook
        self.cuda = cuda if cuda is not None else torch.cuda
        self.peak, self._stepped = 0, False
        self.cuda.reset_peak_memory_stats()
        # global: also fires for the optimizer a rebuild makes mid-window
        self._handle = register_optimizer_step_post_hook(self._after_step)

    def _after_step(self, optimizer, args, kwargs) -> None:
        self.peak, self._stepped = max(self.peak, int(self.cuda.max_memory_allocated())), True

    def begin_iteration(self) -> None:
        """The statistics restart at each window step: what ran between two (an
        evaluation's forwards) is not the step's."""
        self.cuda.reset_peak_memory_stats()

    def end_iteration(self) -> None:
        """Called once per window iteration: an iteration whose step was skipped (fp16
        overflow) is read here; then the statistics restart for the next step."""
        if not self._stepped:
            self.peak = max(self.peak, int(self.cuda.max_memory_allocated()))
        self._stepped = False
        self.cuda.reset_peak_memory_stats()

    def close(self) -> None:
        self._handle.remove()


class _StepTimer:
    """The optimizer step's time per iteration, a calibrated span like a layer's
    (global optimizer hooks, so a rebuilt optimizer is timed too); with a `KernelBusy`
    also a profiler range, so its kernels are not the rest of the step's."""

    def __init__(self, clock, busy=None):
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
        self.clock, self.busy, self.marks, self._start = clock, busy, [], None
        self._handles = [register_optimizer_step_pre_hook(self._pre), register_optimizer_step_post_hook(self._post)]

    def _pre(self, optimizer, args, kwargs) -> None:
        if self._start is None:
            self._start = self.clock.begin()
            if self.busy is not None:
                self.busy.open("step", 0)

    def _post(self, optimizer, args, kwargs) -> None:
        if self._start is not None:
            if self.busy is not None:
                self.busy.close("step", 0)
            self.marks.append((self._start, self.clock.mark()))
            self._start = None

    def occupied(self) -> float:
        """The steps since the last `take()` on the host timeline (`Clock.occupied`)."""
        return sum(self.clock.occupied(a, b) for a, b in self.marks)

    def take(self) -> float:
        """Seconds of the steps since the last call (after clock.resolve())."""
        seconds = sum(self.clock.seconds(a, b) for a, b in self.marks)
        self.marks.clear()
        return seconds

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


SPAN_CONSTANT_SAMPLES = 4  # empty spans per window iteration (probe.py: the span constant)


class ProfileWindow:
    """Profiles the stage (interleaved: every chunk) owned by `trainer` until `close()`.

    `clock`: the device clock (default `clock_for(device)`; tests pass a fake one).
    `outside_s`: recent iteration seconds outside windows, for the prediction check."""

    def __init__(self, trainer, clock=None, outside_s=None):
        self.trainer = trainer
        self.clock = clock if clock is not None else clock_for(trainer.dims.device)
        self.outside_s = list(outside_s or [])
        self._saved_timers = trainer.config.timers
        self.tap = TimerTap(self._saved_timers, self.clock)
        trainer.config.timers = self.tap
        self.busy = KernelBusy(enabled=trainer.dims.device.type == "cuda", collective_free=("iteration",))
        self._busy_samples: dict | None = None
        self.probes = [StageProbe(chunk, self.clock, span_constant=SPAN_CONSTANT_SAMPLES, busy=self.busy)
                       for chunk in trainer.chunks]
        self._step = _StepTimer(self.clock, self.busy)
        self._steps: list[float] = []
        for probe in self.probes:
            probe.attach()
        self.extra_acts = [_ExtraActivations(chunk, probe.kept_inputs)
                           for chunk, probe in zip(trainer.chunks, self.probes)]
        self._distributed_saves = (DistributedSaves(self._stage_counter) if any(
            getattr(getattr(c, "config", None), "distribute_saved_activations", False)
            for c in trainer.chunks) else None)
        self._compute: list[float] = []
        self._profiled: list[float] = []
        self._wait: list[float] = []
        self._rest: list[float] = []
        self._threads: list[float] = []
        self._cpu_started: tuple[float, float] | None = None  # (process, thread) CPU time
        self._started: float | None = None
        self._ended: float | None = None
        self._unbracketed = False  # said once: an iteration came without before_iteration()
        self._peak = _DevicePeak() if trainer.dims.device.type == "cuda" else None
        # last: a constructor that raised above leaves no window to release it
        self._collector = CollectorPause()  # no collection inside the window (profiling.collector)

    def _stage_counter(self) -> SavedBytes | None:
        """The counter of the chunk whose forward runs now."""
        return next((x.counting for x in self.extra_acts if x.counting is not None), None)

    def before_iteration(self) -> None:
        """The step starts now (the controller calls it right before each window step).
        On CUDA the step is also a profiler range: the kernels the training thread
        launches in it outside every span (loss, zeroing and clipping the gradients, the
        optimizer's copies around its step) are the rest of the step on the GPU. What ran
        since the last window step (Megatron-LM's evaluate(), through the same timers and
        allocator) is dropped: no step pays it."""
        self._started = self.clock.now()
        self.tap.discard()  # what the schedule timed since the last step (an evaluation)
        if self._peak is not None:
            self._peak.begin_iteration()
        if not isinstance(self.clock, CudaEventClock):  # `_take_threads`: CPU runs only
            self._cpu_started = (time.process_time(), time.thread_time())
        self.busy.open("iteration", 0)

    def step_done(self) -> None:
        """The step ended now (`DynMo.step_done`): the loop's own work until
        `after_iteration` is not the step's rest."""
        if self._ended is None:
            self._ended = self.clock.now()
            self.busy.close("iteration", 0)
            self._take_threads()

    def _take_threads(self) -> None:
        """The CPU the rank's other threads used during the step: the process's CPU time
        less the training thread's. CPU runs only (0 on CUDA): there autograd's device
        thread runs the backward's host work, the launches, which is the stage's own
        time, not another core's load, and cores are not what the ranks share."""
        if self._cpu_started is not None:
            process, thread = self._cpu_started
            self._threads.append(max(0.0, (time.process_time() - process) - (time.thread_time() - thread)))
            self._cpu_started = None

    def after_iteration(self) -> None:
        ended = self._ended if self._ended is not None else self.clock.now()
        self._ended = None
        self.busy.close("iteration", 0)
        self._take_threads()
        if self._started is None and not self._unbracketed:
            self._unbracketed = True
            logger.warning("dynmo: a window iteration without before_iteration(): the rest of "
                           "the step is not measured (0 in the prediction)")
        spans = (sum(probe.occupied_s() for probe in self.probes) + self._step.occupied()
                 + self.tap.take_drains())
        # resolves the clock first
        self._profiled.append(sum(probe.end_iteration() for probe in self.probes))
        self._steps.append(self._step.take())
        if self._peak is not None:
            self._peak.end_iteration()
        totals = self.tap.take_totals()
        self._compute.append(sum(totals.get(n, 0.0) for n in COMPUTE_TIMERS))
        self._wait.append(sum(v for n, v in totals.items() if "recv" in n))
        if self._started is not None:
            p2p = sum(v for n, v in totals.items() if is_p2p(n))
            self._rest.append(self._rest_of(ended - self._started - spans, p2p))
            self._started = None

    def _rest_of(self, outside: float, p2p: float) -> float:
        """The step's own time outside every span: on CUDA the host timeline is wall time,
        which also holds the pipeline's sends and receives (the host blocked on a peer);
        on CPU it is the thread's CPU time, which a blocked transfer does not use."""
        if isinstance(self.clock, CudaEventClock):
            outside -= p2p
        return max(0.0, outside)

    def close(self, perturb=None) -> PipelineProfile:
        """Detach everything, then gather: collective over the TP, DP and pipeline groups.

        `perturb(profile)` (test-only, dynmo_plugin.faults.ProfileNoise) alters the local
        profile before the gather."""
        self._busy_samples = self.busy.stop()
        self.cancel()
        local = self._local_profile()
        if perturb is not None:
            local = perturb(local)
        self.tap.publish({f"dynmo/layer-{x.layer:02d}/{k}": getattr(x, f"{k}_s")
                          for x in local.layers for k in ("fwd", "bwd")})
        groups = self.trainer.dims.groups
        for stage in local.stages:
            logger.info("dynmo: %s", prediction_line(stage))
        return gather_profile(local, groups.pp, groups.dp, groups.tp)

    def cancel(self) -> None:
        """Detach hooks and restore the timers without summarising (local, no collective).
        The timers and the collector come back whatever a detach raises."""
        try:
            for probe, extra_act in zip(self.probes, self.extra_acts):
                probe.detach()
                extra_act.detach()
            if self._distributed_saves is not None:
                self._distributed_saves.close()
            if self._peak is not None:
                self._peak.close()
            self._step.close()
            self.busy.stop()  # no-op after close()'s; a cancelled window's kernels are dropped
        finally:
            self.trainer.config.timers = self._saved_timers
            self._collector.release()

    # ---- summary ------------------------------------------------------------------------
    def _local_profile(self) -> PipelineProfile:
        """This rank's layers (every chunk, under its virtual stage) and one record per
        chunk; the rank's memory and times repeated on each (`profiling.records`)."""
        t = self.trainer
        rank, v = t.dims.pp_rank, len(self.probes)
        stages = [t.layout.stage_of(rank, c) if v > 1 else rank for c in range(v)]
        layers = [[self._layer_profile(probe, layer, stage) for layer in probe.layers]
                  for probe, stage in zip(self.probes, stages)]
        extras = [self._chunk_extras(chunk, probe) for chunk, probe in zip(t.chunks, self.probes)]
        extra_act = [max(x.per_microbatch, default=0) for x in self.extra_acts]
        act = [sum(x.act_bytes for x in chunk) + e for chunk, e in zip(layers, extra_act)]
        in_flight, held = self._in_flight(act, t.num_microbatches)
        peak_in_flight = (self._in_flight(act, t.peak_microbatches)[0]
                          if t.peak_microbatches != t.num_microbatches else [0] * v)
        static = self._static_bytes()
        if self._peak is not None:
            peak = self._peak.peak or int(torch.cuda.max_memory_allocated())
        else:
            peak = static + held
        rank_fields = dict(
            wait_s=median(self._wait), peak_bytes=int(peak), compute_s=median(self._compute),
            profiled_s=median(self._profiled), num_microbatches=t.num_microbatches,
            clock=self.clock.name, static_bytes=int(static),
            peak_source="measured" if t.dims.device.type == "cuda" else "accounted")
        records = [StageProfile(stage=stage, extra_s=median(probe.samples["extra"]),
                                extra_bytes=int(nbytes), extra_grad_bytes=int(grad),
                                extra_act_bytes=int(e_act), in_flight=depth, peak_in_flight=peak_depth,
                                **rank_fields)
                   for stage, probe, (nbytes, grad), e_act, depth, peak_depth
                   in zip(stages, self.probes, extras, extra_act, in_flight, peak_in_flight)]
        for record, probe, chunk in zip(records, self.probes, layers):
            self._choose_cost(record, probe, chunk)
        mtp = next((self._mtp_profile(probe, chunk, stage, records[stages.index(stage)].cost_source)
                    for chunk, probe, stage in zip(t.chunks, self.probes, stages)
                    if getattr(chunk, "mtp_process", False)), None)
        if mtp is not None:  # the block's time left the head's extras: the stage still runs it
            record = records[stages.index(mtp.stage)]
            record.predicted_s += t.num_microbatches * mtp.cost_s
        return PipelineProfile([x for chunk in layers for x in chunk], records, v, mtp)

    def _mtp_profile(self, probe: StageProbe, chunk, stage: int, cost_source: str) -> LayerProfile:
        """The MTP block as one unit: its own spans (`probe._hook_mtp`), or where the GPU
        paces the stage its kernels (its ranges hold them, so the head's extras do not),
        and the exact bytes of its parameters, gradients and optimizer state, with what
        moves with it (`_mtp_params`)."""
        spans = fwd, bwd = probe.samples["mtp/fwd"], probe.samples["mtp/bwd"]
        if cost_source == "gpu_kernels":
            busy = self._busy_samples or {}
            fwd, bwd = busy.get("mtp/fwd", []), busy.get("mtp/bwd", [])
        params = _mtp_params(chunk)
        return LayerProfile(
            layer=len(chunk.mtp.layers), stage=stage, fwd_s=median(fwd), bwd_s=median(bwd),
            spread=cost_spread(fwd, bwd), span_s=median(spans[0]) + median(spans[1]),
            param_bytes=sum(_nbytes(p) for p in params),
            grad_bytes=sum(_grad_bytes(p) for p in params),
            optim_bytes=sum(state_nbytes(self.trainer.optimizer, p) for p in params),
            act_bytes=int(median(probe.act_bytes["mtp"])))

    def _choose_cost(self, record: StageProfile, probe: StageProbe, layers: list[LayerProfile]) -> None:
        """The time each layer costs (module docstring), the span constant, and the
        stage's predicted and measured time per iteration."""
        m = self.trainer.num_microbatches
        record.span_constant_s = (median(probe.samples["constant/fwd"])
                                  + median(probe.samples["constant/bwd"]))
        busy = self._busy_samples or {}
        cpu = None
        if isinstance(self.clock, CudaEventClock):  # CPU time differs from wall time only there
            cpu = {x.layer: (median(probe.samples[f"cpu/fwd/{x.layer}"]), median(probe.samples[f"cpu/bwd/{x.layer}"]))
                   for x in layers}
        extra_gpu = sum(median(busy.get(k, [])) for k in probe.extra_keys)  # this chunk's, not the rank's
        trainable = [x.layer for x in layers if probe.samples.get(f"bwd/{x.layer}")]  # spans were timed
        if busy and trainable and not any(f"bwd/{n}" in busy for n in trainable):
            logger.warning("dynmo: stage %d: GPU kernels were attributed to forward spans only (no "
                           "backward range held a launch): the kernel clock is not trusted here",
                           record.stage)
            busy = {}
            for x in layers:  # recorded as not measured, not as half the layer
                x.gpu_s = 0.0
        choose_costs(record, layers, busy, cpu, extra_gpu, m)
        record.step_s = median(self._steps) / len(self.probes)  # one optimizer per rank
        record.rest_s = median(self._rest) / len(self.probes)
        record.rest_gpu_s = median(busy.get("iteration", [])) / len(self.probes)
        record.kernel_coverage = self.busy.coverage
        record.threads_s = median(self._threads) / len(self.probes)
        record.predicted_s = stage_prediction(record, layers, m)
        record.measured_s = median(self.outside_s) / len(self.probes)

    def _chunk_extras(self, chunk, probe) -> tuple[int, int]:
        """(bytes, gradient bytes) of the chunk's parameters outside its decoder layers:
        params + grads + optimizer state of the embedding, final norm and output layer."""
        layer_params = {id(p) for layer in probe.layers for p in layer.parameters()}
        if getattr(chunk, "mtp_process", False):  # the MTP block is its own unit
            layer_params |= {id(p) for p in _mtp_params(chunk)}
        extras = [p for p in chunk.parameters() if id(p) not in layer_params]
        grad = sum(_grad_bytes(p) for p in extras)
        return sum(_nbytes(p) + state_nbytes(self.trainer.optimizer, p) for p in extras) + grad, grad

    def _in_flight(self, chunk_act: list[int], m: int) -> tuple[list[int], int]:
        """(per chunk: the most of its micro-batches held at once, the most activation
        bytes held at once) under this rank's schedule of `m` micro-batches, one
        micro-batch of chunk c saving chunk_act[c]. 1F1B: min(pp - rank, m) micro-batches,
        its warm-up depth."""
        t = self.trainer
        pp, rank, v = t.dims.pp, t.dims.pp_rank, len(chunk_act)
        if v == 1:
            depth = min(pp - rank, m)
            return [depth], depth * chunk_act[0]
        group = getattr(t.config, "microbatch_group_size_per_vp_stage", None) or pp
        count, depth, held, peak = [0] * v, [0] * v, 0, 0
        for op in rank_orders(pp, m, v, group)[rank]:
            step = 1 if op.kind == FORWARD else -1
            count[op.chunk] += step
            held += step * chunk_act[op.chunk]
            depth[op.chunk] = max(depth[op.chunk], count[op.chunk])
            peak = max(peak, held)
        return depth, peak

    def _static_bytes(self) -> int:
        """What the stage holds between iterations: parameter and gradient storages (whole
        buffers, once) and the optimizer state of every parameter (fp32 master copies
        included, `optim_state.state_nbytes`)."""
        t = self.trainer
        params = [p for chunk in t.chunks for p in chunk.parameters()]
        return (_storage_bytes(params)
                + _storage_bytes(_grad_tensor(p) for p in params)
                + sum(state_nbytes(t.optimizer, p) for p in params))

    def _layer_profile(self, probe: StageProbe, layer, stage: int) -> LayerProfile:
        """Medians over every micro-batch of every window iteration, with their relative
        dispersion (`records.cost_spread`), which the gate's noise floor follows."""
        n, params = layer.layer_number, list(layer.parameters())
        fwd, bwd = probe.samples[f"fwd/{n}"], probe.samples[f"bwd/{n}"]
        busy = self._busy_samples or {}
        return LayerProfile(
            layer=n, stage=stage, fwd_s=median(fwd), bwd_s=median(bwd),
            spread=cost_spread(fwd, bwd), span_s=median(fwd) + median(bwd),
            gpu_s=median(busy.get(f"fwd/{n}", [])) + median(busy.get(f"bwd/{n}", [])),
            host_s=median(probe.samples[f"host/fwd/{n}"]) + median(probe.samples[f"host/bwd/{n}"]),
            param_bytes=sum(_nbytes(p) for p in params),
            grad_bytes=sum(_grad_bytes(p) for p in params),
            optim_bytes=sum(state_nbytes(self.trainer.optimizer, p) for p in params),
            act_bytes=int(median(probe.act_bytes[n])))


def choose_costs(record: StageProfile, layers: list[LayerProfile], busy: dict, cpu: dict | None,
                 extra_gpu_s: float, m: int) -> None:
    """Set each layer's fwd_s/bwd_s to the time it costs and the stage's `cost_source`:
    - GPU-bound (kernel times measured, the layers' kernel time >= their host time):
      the kernels' time ("gpu_kernels"), extras likewise;
    - host-bound on CUDA (`cpu`: layer -> (fwd, bwd) thread CPU seconds): the host's own
      launch work, its CPU time ("host_cpu"); what the spans hold beyond it (the thread
      waiting for the GIL held by a DataLoader's pin-memory thread or for the OS, the
      last kernel's tail) is the stage's, not a layer's: `host_waits_s` per micro-batch,
      kept in the prediction. Identical layers then cost alike wherever the waits fall
      (issue 34: 1.257x inside pretrain_gpt.py at the host-bound shape);
    - otherwise (CPU: one clock) the calibrated span ("span").
    `host_s`/`gpu_s` per iteration and each layer's `host_cpu_s` are recorded as well."""
    record.host_s = m * sum(x.host_s for x in layers)
    record.gpu_s = m * sum(x.gpu_s for x in layers)
    if busy and record.gpu_s > 0 and record.gpu_s >= record.host_s:
        record.cost_source = "gpu_kernels"
        for x in layers:
            x.fwd_s, x.bwd_s = median(busy.get(f"fwd/{x.layer}", [])), median(busy.get(f"bwd/{x.layer}", []))
        record.extra_s = extra_gpu_s
        return
    if cpu:
        record.cost_source = "host_cpu"
        spans = sum(x.cost_s for x in layers)
        for x in layers:
            x.fwd_s, x.bwd_s = cpu.get(x.layer, (0.0, 0.0))
            x.host_cpu_s = x.fwd_s + x.bwd_s
        record.host_waits_s = max(0.0, spans - sum(x.cost_s for x in layers))
        return
    record.cost_source = "span"


def _mtp_params(chunk) -> list:
    """The MTP block's parameters and, off the first stage, the word-embedding copy that
    exists on its rank only for it (the block's input embedding: it moves with the block,
    megatron/migration/mtp_move.py), less what the output layer shares (tied embeddings on
    the last rank: that weight stays). Counted in the stage's extras it was 17.5 of the
    17.7 MB a block move carried, so the balancer underrated both the move and the rank
    it left."""
    params = list(chunk.mtp.parameters())
    embedding = getattr(chunk, "embedding", None)
    if embedding is not None and not getattr(chunk, "pre_process", True):
        output = getattr(chunk, "output_layer", None)
        shared = {id(p) for p in output.parameters()} if output is not None else set()
        params += [p for p in embedding.parameters() if id(p) not in shared]
    return params


def prediction_line(stage: StageProfile) -> str:
    """One line per stage and window: the predicted time per iteration against the
    measured one outside windows, and which time the layers cost (docs/profiling.md)."""
    measured = (f"measured {1e3 * stage.measured_s:.1f} ms outside windows "
                f"({stage.predicted_s / stage.measured_s:.3f}x)" if stage.measured_s > 0
                else "no iteration outside windows measured yet")
    rest = f"host {1e3 * stage.rest_s:.1f} ms, GPU kernels {1e3 * stage.rest_gpu_s:.1f} ms"
    return (f"stage {stage.stage}: predicted {1e3 * stage.predicted_s:.1f} ms/iteration ({stage.num_microbatches} "
            f"micro-batches, extras {1e3 * stage.extra_s:.2f} ms, step {1e3 * stage.step_s:.1f} ms, rest of the "
            f"step: {rest}) vs {measured}; "
            f"layers cost {stage.cost_source} (host {1e3 * stage.host_s:.1f} ms, of it waits "
            f"{1e3 * stage.num_microbatches * stage.host_waits_s:.1f} ms, GPU kernels "
            f"{1e3 * stage.gpu_s:.1f} ms per iteration; span constant {1e3 * stage.span_constant_s:.3f} ms removed)")
