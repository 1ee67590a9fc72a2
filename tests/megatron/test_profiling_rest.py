"""The rest of the step (issue 34: a prediction the check can hold the profile to): the
step's time that no span holds is measured in the window, on the clock's host timeline,
and counted in the stage's prediction where the host bounds the stage. Inside
pretrain_gpt.py on CPU it was 15-17 ms of a 67-70 ms step the prediction missed."""
from __future__ import annotations

import statistics
import threading
import time

import pytest

import torch

from launch import in_megatron_process
from test_profiling_clock import RecordingCudaStandIn

from dynmo_plugin.config import ModelArgs
from dynmo_plugin.profiling.clock import CpuThreadClock, CudaEventClock
from dynmo_plugin.profiling.records import LayerProfile, StageProfile, stage_prediction

BURN_S = 0.04  # CPU seconds of work inside the step, outside every span


def _one_rank_trainer(args, mtp_layers: int = 0):
    """A real one-rank stage (call inside `in_megatron_process`)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    from dynmo_plugin.layout import Layout
    from dynmo_plugin.megatron.training.parallel import ParallelDims
    from dynmo_plugin.megatron.training.trainer import StageTrainer
    dims = ParallelDims(rank=0, world_size=1, tp=1, pp=1, dp=1, pp_rank=0, dp_rank=0,
                        device=torch.device("cpu"), groups=ProcessGroupCollection.use_mpu_process_groups())
    return StageTrainer(args, dims, Layout.uniform(args.num_layers, 1, mtp_layers=mtp_layers))


def _window_with(trainer, busy, clock=None):
    """A window whose kernel timer (the probes', the optimizer step's) is `busy`."""
    from dynmo_plugin.megatron.profiling.profiler import ProfileWindow
    window = ProfileWindow(trainer, clock=clock, outside_s=[0.5])
    window.busy = window._step.busy = busy
    for probe in window.probes:
        probe.busy = busy
    return window


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def _window_stage(trainer, burn: float, after_step: float = 0.0) -> StageProfile:
    from dynmo_plugin.megatron.profiling.profiler import ProfileWindow
    window = ProfileWindow(trainer, outside_s=[0.5])
    for it in (2, 3, 4):
        window.before_iteration()
        _burn(burn)  # e.g. a batch built, a loss reduced: the step's, in no span
        trainer.train_step(it)
        window.step_done()
        _burn(after_step)  # the loop's own work after the step (a scenario's hook)
        window.after_iteration()
    profile = window.close()
    (stage,) = profile.stages
    m = trainer.num_microbatches
    layers = sum(x.cost_s for x in profile.layers)
    assert stage.cost_source == "span"
    assert stage.predicted_s == pytest.approx(m * (layers + stage.extra_s) + stage.step_s + stage.rest_s)
    return stage


def _check_rest_holds_the_work_outside_spans(args):
    trainer = _one_rank_trainer(args)
    trainer.train_step(1)  # warm-up outside the windows
    outside = []
    for it in (2, 3, 4):
        start = time.thread_time()
        trainer.train_step(it)
        outside.append(time.thread_time() - start)
    plain, burnt = _window_stage(trainer, 0.0), _window_stage(trainer, BURN_S)
    after = _window_stage(trainer, 0.0, after_step=BURN_S)
    assert after.rest_s - plain.rest_s < 0.3 * BURN_S, (plain, after)  # not the step's
    # the schedule's own Python, zeroing gradients: real CPU work, but not the spans'
    # (3-5 ms of a 15-19 ms step here)
    assert 0 < plain.rest_s < 0.5 * statistics.median(outside), (outside, plain)
    assert burnt.rest_s - plain.rest_s == pytest.approx(BURN_S, abs=0.3 * BURN_S), (plain, burnt)
    # the layers and the step did not absorb it
    assert burnt.predicted_s - burnt.rest_s == pytest.approx(plain.predicted_s - plain.rest_s, rel=0.5)


def test_the_rest_of_the_step_is_measured_and_predicted():
    in_megatron_process(_check_rest_holds_the_work_outside_spans,
                        ModelArgs(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                                  micro_batch_size=2, global_batch_size=4))


def _threads_window(trainer, burn: float, step_done: bool = True, clock=None) -> StageProfile:
    """A window whose every step runs beside another thread of the rank burning `burn`
    CPU seconds (as gloo's transport thread works beside a step); without `step_done`
    the loop calls only after_iteration() (Megatron-LM's, and any loop's that does not
    call DynMo.step_done)."""
    from dynmo_plugin.megatron.profiling.profiler import ProfileWindow
    window = ProfileWindow(trainer, clock=clock, outside_s=[0.5])
    for it in (2, 3, 4):
        window.before_iteration()
        worker = threading.Thread(target=_burn, args=(burn,))
        worker.start()
        trainer.train_step(it)
        worker.join()
        if step_done:
            window.step_done()
        window.after_iteration()
    (stage,) = window.close().stages
    return stage


def _check_other_threads_are_measured(args):
    trainer = _one_rank_trainer(args)
    trainer.train_step(1)
    plain, busy = _threads_window(trainer, 0.0), _threads_window(trainer, BURN_S)
    assert plain.threads_s < 0.3 * BURN_S, plain
    assert busy.threads_s - plain.threads_s == pytest.approx(BURN_S, abs=0.3 * BURN_S), (plain, busy)
    # another core's work: not the stage's time (the shared-core replay counts it)
    assert busy.predicted_s - busy.rest_s == pytest.approx(plain.predicted_s - plain.rest_s, rel=0.5)
    # taken at after_iteration() when the loop gives no step_done()
    unended = _threads_window(trainer, BURN_S, step_done=False)
    assert unended.threads_s - plain.threads_s == pytest.approx(BURN_S, abs=0.3 * BURN_S), (plain, unended)
    # not on CUDA (a stand-in device here): autograd's device thread is the stage's own work
    assert _threads_window(trainer, BURN_S, clock=CudaEventClock(cuda=RecordingCudaStandIn())).threads_s == 0


def test_the_ranks_other_threads_cpu_is_measured_beside_the_step():
    """`threads_s`: on a CPU the ranks share, gloo's transport threads took 14-63 ms per
    rank and iteration in grow_check (4 ranks, 2 cores): cores the ranks did not get."""
    in_megatron_process(_check_other_threads_are_measured,
                        ModelArgs(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                                  micro_batch_size=2, global_batch_size=4))


class _SlowDrainCuda(RecordingCudaStandIn):
    """A fault, named as such: every drain takes `drain_s` of the host's wall time."""

    def __init__(self, drain_s: float):
        super().__init__()
        self.drain_s = drain_s

    def synchronize(self) -> None:
        time.sleep(self.drain_s)
        super().synchronize()


def test_a_span_occupies_the_host_from_before_its_drain():
    """On CUDA the host timeline is wall time: a span's drain is the window's, not the
    step's rest, so `occupied` starts before it while `host_seconds` (the layer's launch
    time) starts after it."""
    clock = CudaEventClock(cuda=_SlowDrainCuda(0.02))
    start = clock.begin()
    end = clock.mark()
    assert clock.host_seconds(start, end) < 0.01
    assert clock.occupied(start, end) >= 0.02
    plain = clock.mark()  # a mark without a drain occupies from its own time
    assert clock.occupied(plain, end) == pytest.approx(end.host - plain.host)


DRAIN_S = 0.008  # each drain on the stand-in device


def _check_drains_stay_out_of_the_rest(args):
    from dynmo_plugin.megatron.profiling.profiler import ProfileWindow
    trainer = _one_rank_trainer(args)
    trainer.train_step(1)
    cuda = _SlowDrainCuda(DRAIN_S)
    window = ProfileWindow(trainer, clock=CudaEventClock(cuda=cuda), outside_s=[0.5])
    for it in (2, 3):
        window.before_iteration()
        syncs = cuda.log.count("sync")
        start = time.perf_counter()
        trainer.train_step(it)
        step = time.perf_counter() - start
        drains = DRAIN_S * (cuda.log.count("sync") - syncs)
        window.after_iteration()
        assert drains > 0.5 * step  # the drains are most of the step here
    profile = window.close()
    (stage,) = profile.stages
    assert stage.cost_source == "host_cpu"  # the host paces a stage with no kernel times
    # the spans' drains and the schedule timers' (half of them here) stay out
    assert 0 < stage.rest_s < 0.25 * drains, (stage.rest_s, drains)
    layers, m = sum(x.cost_s for x in profile.layers), trainer.num_microbatches
    assert stage.predicted_s == pytest.approx(
        m * (layers + stage.extra_s + stage.host_waits_s) + stage.step_s + stage.rest_s)


def test_on_cuda_the_drains_before_spans_stay_out_of_the_rest():
    """The CUDA clock's path on a real stage (a stand-in device whose every drain takes
    8 ms of wall time): the rest holds the step's own host time, not the drains (the
    spans' and the schedule timers')."""
    in_megatron_process(_check_drains_stay_out_of_the_rest,
                        ModelArgs(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                                  micro_batch_size=2, global_batch_size=4))


def test_the_timer_taps_drains_are_counted_outside_its_intervals_only():
    """The schedule's timers drain too (compute: before the start; communication: at
    both ends). Those drains are the window's, not the step's rest, except a send's or
    receive's closing one: it lies inside the p2p wait, which the rest loses whole."""
    from dynmo_plugin.megatron.profiling.timers import TimerTap
    tap = TimerTap(None, CudaEventClock(cuda=_SlowDrainCuda(0.02)))
    for name in ("forward-compute", "forward-recv", "backward-send", "all-grads-sync"):
        tap(name).start()
        tap(name).stop()
    # compute start 1, recv and send starts 1 + 1 (their stops are in the p2p wait the
    # rest loses whole), grads sync start + stop 2: 5 drains of 20 ms, not 7 (140 ms)
    assert 0.1 <= tap.take_drains() < 0.13
    assert tap.take_drains() == 0.0
    cpu = TimerTap(None, CpuThreadClock())
    cpu("forward-compute").start()
    cpu("forward-compute").stop()
    assert cpu.take_drains() == 0.0


def _record(source: str) -> StageProfile:
    return StageProfile(stage=0, extra_s=0.001, wait_s=0.0, peak_bytes=0, cost_source=source,
                        step_s=0.003, host_waits_s=0.0005, rest_s=0.010, rest_gpu_s=0.002)


def test_the_rest_is_the_hosts_or_the_gpus_by_what_paces_the_stage():
    layers = [LayerProfile(layer=n, stage=0, fwd_s=0.002, bwd_s=0.004, param_bytes=0, grad_bytes=0,
                           optim_bytes=0, act_bytes=0) for n in (1, 2)]
    base = 4 * (0.012 + 0.001 + 0.0005) + 0.003
    assert stage_prediction(_record("span"), layers, 4) == pytest.approx(base + 0.010)
    assert stage_prediction(_record("host_cpu"), layers, 4) == pytest.approx(base + 0.010)
    # GPU-bound: the host's rest runs while the queued kernels do; the step's kernels
    # outside its spans count instead
    assert stage_prediction(_record("gpu_kernels"), layers, 4) == pytest.approx(base + 0.002)


class _RecordingBusy:
    """A stand-in for `kernels.KernelBusy` (no CUDA profiler on CPU), named as such: it
    logs the ranges opened and closed, in order."""

    def __init__(self):
        self.log: list[tuple[str, str]] = []
        self.coverage = None  # as KernelBusy's where no kernel launch was recorded

    def open(self, key: str, mb: int) -> None:
        self.log.append(("open", key))

    def close(self, key: str, mb: int) -> None:
        self.log.append(("close", key))

    def next_iteration(self) -> None:
        pass

    def stop(self):
        return None


def _check_the_step_is_a_range_around_its_spans(args):
    trainer = _one_rank_trainer(args)
    busy = _RecordingBusy()
    window = _window_with(trainer, busy)
    window.before_iteration()
    trainer.train_step(1)
    window.after_iteration()
    window.close()
    log = busy.log
    end = log.index(("close", "iteration"))
    assert log[0] == ("open", "iteration"), log[:3]
    assert {key for _, key in log[end + 1:]} == {"fwd/0", "bwd/0"}  # then the window's empty spans
    assert log.count(("open", "step")) == log.count(("close", "step")) == 1
    inside = log[1:end]
    assert ("open", "fwd/1") in inside and ("close", "bwd/2") in inside  # every span within it
    step = inside.index(("open", "step"))
    assert inside[step + 1] == ("close", "step")  # the optimizer's own range, nothing inside


def test_on_cuda_the_step_is_a_profiler_range_around_its_spans_and_the_optimizer_step():
    """Where kernels are timed the step's range gathers what its spans do not hold, the
    optimizer step's range keeps the step's kernels (its own span) out of the rest."""
    in_megatron_process(_check_the_step_is_a_range_around_its_spans,
                        ModelArgs(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                                  micro_batch_size=2, global_batch_size=4))


# seconds, far above any host time of these tiny layers (a loaded machine's wall clock
# included), so the stand-in's stage is GPU-bound whatever the load
KERNEL_S = {"fwd": 1.0, "bwd": 2.0, "mtp/fwd": 0.5, "mtp/bwd": 1.0, "emb_fwd": 0.1, "emb_bwd": 0.1,
            "head_fwd": 0.2, "head_bwd": 0.4, "iteration": 0.05, "step": 0.3}


class _SyntheticBusy(_RecordingBusy):
    """A stand-in for `kernels.KernelBusy` on a GPU-bound stage, named as such: every
    range it saw opened holds a fixed kernel time (KERNEL_S by span key)."""

    def stop(self):
        self.coverage = 0.995  # CUPTI lost 1 launch's kernel record in 200 (kernels.kernel_coverage)
        samples: dict[str, list[float]] = {}
        for what, key in self.log:
            if what == "open" and key not in ("fwd/0", "bwd/0"):
                samples.setdefault(key, []).append(KERNEL_S[key] if key in KERNEL_S else KERNEL_S[key.split("/")[0]])
        return samples


def _check_a_gpu_bound_mtp_stage_counts_each_kernel_once(args):
    trainer = _one_rank_trainer(args, mtp_layers=1)
    busy = _SyntheticBusy()
    window = _window_with(trainer, busy)
    window.before_iteration()
    trainer.train_step(1)
    window.after_iteration()
    log = list(busy.log)
    profile = window.close()
    (stage,), m = profile.stages, trainer.num_microbatches
    assert stage.cost_source == "gpu_kernels" and stage.kernel_coverage == 0.995  # the window's, recorded
    head = log.index(("open", "head_fwd"))
    assert log.index(("open", "mtp/fwd")) > head and log.index(("close", "mtp/fwd")) < log.index(("close", "head_fwd"))
    # the block costs its own kernels, the head's extras no longer hold them
    assert profile.mtp.fwd_s == KERNEL_S["mtp/fwd"] and profile.mtp.bwd_s == KERNEL_S["mtp/bwd"]
    extras = sum(KERNEL_S[k] for k in ("emb_fwd", "emb_bwd", "head_fwd", "head_bwd"))
    assert stage.extra_s == pytest.approx(extras) and stage.rest_gpu_s == KERNEL_S["iteration"]
    layers = args.num_layers * (KERNEL_S["fwd"] + KERNEL_S["bwd"])
    assert stage.predicted_s == pytest.approx(
        m * (layers + extras + KERNEL_S["mtp/fwd"] + KERNEL_S["mtp/bwd"]) + stage.step_s + KERNEL_S["iteration"])


def test_a_gpu_bound_stage_with_an_mtp_block_counts_each_kernel_once():
    """The block's forward runs inside the head's span: without a range of its own its
    kernels were the head's extras and the block's cost again (GPU-bound stages only)."""
    in_megatron_process(_check_a_gpu_bound_mtp_stage_counts_each_kernel_once,
                        ModelArgs(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                                  micro_batch_size=2, global_batch_size=4, mtp_num_layers=1))


class _ForwardOnlyBusy(_SyntheticBusy):
    """A fault, named as such: kernels reach forward ranges only (what keying launches by
    the profiler-stopping thread did to every backward range on a GPU)."""

    def stop(self):  # forward kernels long enough to pace the stage on their own
        return {k: [10 * x for x in v] for k, v in super().stop().items() if not k.startswith("bwd/")}


def _check_forward_only_kernels_are_not_trusted(args):
    trainer = _one_rank_trainer(args)
    costs, kernels = {}, {}
    for fault in (_SyntheticBusy, _ForwardOnlyBusy):
        window = _window_with(trainer, fault(), CudaEventClock(cuda=RecordingCudaStandIn()))
        window.before_iteration()
        trainer.train_step(1)
        window.after_iteration()
        profile = window.close()
        costs[fault.__name__] = profile.stages[0].cost_source
        kernels[fault.__name__] = [x.gpu_s for x in profile.layers] + [profile.stages[0].gpu_s]
    assert costs == {"_SyntheticBusy": "gpu_kernels", "_ForwardOnlyBusy": "host_cpu"}, costs
    # not trusted, so not recorded: the forward's kernels alone read as the layer's
    assert all(k > 0 for k in kernels["_SyntheticBusy"]) and kernels["_ForwardOnlyBusy"] == [0.0] * 3


def test_kernel_times_without_any_backward_fall_back_to_the_host():
    in_megatron_process(_check_forward_only_kernels_are_not_trusted,
                        ModelArgs(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                                  micro_batch_size=2, global_batch_size=4))


def _interleaved_rank(rank: int, port: int, args) -> None:
    """One of two ranks of PP=2 with two virtual stages each, a real interleaved step."""
    import os

    import torch.distributed as dist

    from dynmo_plugin.layout import Layout
    from dynmo_plugin.megatron.training.parallel import destroy_parallel, init_parallel
    from dynmo_plugin.megatron.training.trainer import StageTrainer
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    dims = init_parallel(args)
    try:
        trainer = StageTrainer(args, dims, Layout.uniform(args.num_layers, 4, num_chunks=2))
        window = _window_with(trainer, _SyntheticBusy())
        window.before_iteration()
        trainer.train_step(1)
        window.after_iteration()
        profile = window.close()
        extras = {s.stage: s.extra_s for s in profile.stages if s.stage % 2 == rank}
        emb, head = (KERNEL_S[f"{k}_fwd"] + KERNEL_S[f"{k}_bwd"] for k in ("emb", "head"))
        want = {0: emb, 2: 0.0} if rank == 0 else {1: 0.0, 3: head}
        assert extras == pytest.approx(want), (rank, extras)
    finally:
        if dist.is_initialized():
            destroy_parallel()


@pytest.mark.multiproc
def test_on_a_gpu_bound_interleaved_rank_each_chunk_has_only_its_own_extras():
    """Kernel ranges are named per rank (emb_fwd, head_fwd, ...), not per chunk: every
    virtual stage of a rank read the rank's embedding and output-layer kernels as its
    extras, in its cost and its predicted time (GPU-bound stages only)."""
    from launch import free_port, spawn
    args = ModelArgs(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16, micro_batch_size=1,
                     global_batch_size=4, pipeline_model_parallel_size=2, num_virtual_stages_per_pipeline_rank=2)
    spawn(_interleaved_rank, (free_port(), args), nprocs=2)
