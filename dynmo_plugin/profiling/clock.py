"""Time sources for profiling, chosen by device.

An interval is `begin()` ... `mark()`, read with `seconds(start, end)` after `resolve()`.

On CPU a mark is the calling thread's CPU time: with one thread per rank it is far less
noisy than wall time on a shared machine (CV 0.03-0.07 vs up to 1.0 measured here), and
backward of CPU tensors runs on the caller's thread, so autograd hooks see the same
clock. `begin()` is `mark()`: nothing is queued, nothing to drain.

On GPU a mark is a recorded CUDA event, and `begin()` first synchronizes the device
(PipeDream's profiler does the same). Without it an event pair measured the host's lag
as much as the layer: when the host runs ahead, a layer's start event waits in the
queue behind earlier layers and the interval holds only GPU work; when the queue runs
dry (start of the forward pass, small kernels) it holds the host's launch gaps. Which
of the two a layer got depended on where it sat: identical layers measured 1.3-2.2x
apart on an H200 (docs/profiling.md). With the queue drained at every start the
interval is the same thing for every layer: from an idle GPU to the end of that
layer's kernels, i.e. its GPU time when the GPU is the bottleneck, its launch time when
the host is. Each mark also keeps the host's `perf_counter`, so a profile holds the
host's time to launch the layer beside it (`host_seconds`), and the thread's CPU time
(`host_cpu_seconds`: the launch work without the time the thread waited). These clocks are only used
inside profiling windows: outside them nothing syncs.

The host timeline (`now()`, `occupied(start, end)`): what a span took of the thread's
time, its drain included, so that the time of an iteration that no span holds (the
schedule, data, the loss's reduction, gradient clipping: the stage's `rest_s`,
megatron/profiling/profiler.py) is the iteration's `now()` difference less the spans'
occupancy. On CPU that timeline is the thread's CPU time, on CUDA the host's wall time.
Every clock also counts the host seconds it spent draining the device (`drained_s`, 0
on CPU), so drains outside any span (the schedule timers' own) are not the step's rest.
"""
from __future__ import annotations

import time
from typing import Any, NamedTuple, Protocol

import torch

__all__ = ["Clock", "CpuThreadClock", "CudaEventClock", "CudaMark", "WallClock",
           "SyncedWallClock", "clock_for", "comm_clock_for"]


class Clock(Protocol):
    name: str
    drained_s: float  # host seconds spent in synchronize so far (grows; 0 on CPU)

    def begin(self) -> Any: ...

    def mark(self) -> Any: ...

    def resolve(self) -> None: ...

    def seconds(self, start: Any, end: Any) -> float: ...

    def host_seconds(self, start: Any, end: Any) -> float: ...

    def host_cpu_seconds(self, start: Any, end: Any) -> float: ...

    def now(self) -> float: ...

    def occupied(self, start: Any, end: Any) -> float: ...


class CpuThreadClock:
    """`time.thread_time()`: CPU seconds of this thread (host and device time coincide)."""

    name = "cpu_thread_time"
    drained_s = 0.0

    def mark(self) -> float:
        return time.thread_time()

    def begin(self) -> float:
        return self.mark()

    def resolve(self) -> None:
        pass

    def seconds(self, start: float, end: float) -> float:
        return end - start

    def host_seconds(self, start: float, end: float) -> float:
        return end - start

    def host_cpu_seconds(self, start: float, end: float) -> float:
        return end - start

    def now(self) -> float:
        return self.mark()

    def occupied(self, start: float, end: float) -> float:
        return end - start


class WallClock(CpuThreadClock):
    """Wall time: the only clock that sees a thread blocked in communication."""

    name = "wall"

    def mark(self) -> float:
        return time.perf_counter()


class SyncedWallClock(WallClock):
    """Wall time with the device drained at both ends (for communication on CUDA).

    An unbatched NCCL `wait()` returns before the transfer ends (it only makes the
    compute stream wait), and a batched exchange's `synchronize` also waits for the
    compute queued before it: a plain wall clock reads the first as ~0 and folds queued
    compute into the second. Synchronizing before the start drains the compute; after
    the end it waits for the transfer itself. So the interval is what the host is
    blocked by communication once the compute before it has finished."""

    name = "wall_synced"

    def __init__(self, cuda: Any = None):
        self.cuda = cuda if cuda is not None else torch.cuda
        self.drained_s = 0.0

    def mark(self) -> float:
        since = time.perf_counter()
        self.cuda.synchronize()
        now = time.perf_counter()
        self.drained_s += now - since
        return now


class CudaMark(NamedTuple):
    event: Any          # torch.cuda.Event, recorded on the current stream
    host: float         # time.perf_counter() when it was recorded
    cpu: float = 0.0    # time.thread_time() then: the recording thread's CPU time
    since: float = 0.0  # perf_counter() before begin()'s drain; `host` for a plain mark


class CudaEventClock:
    """CUDA events on the current stream, read after one synchronize per iteration;
    `begin()` drains the device first (module docstring).

    `cuda` is the `torch.cuda` module; tests on CPU pass a stand-in that records the
    order of calls (tests/megatron/test_profiling_clock.py)."""

    name = "cuda_event"

    def __init__(self, cuda: Any = None):
        self.cuda = cuda if cuda is not None else torch.cuda
        self.drained_s = 0.0

    def mark(self) -> CudaMark:
        event = self.cuda.Event(enable_timing=True)
        event.record()
        host = time.perf_counter()
        return CudaMark(event, host, time.thread_time(), host)

    def begin(self) -> CudaMark:
        since = time.perf_counter()
        self.cuda.synchronize()
        mark = self.mark()._replace(since=since)
        self.drained_s += mark.host - since
        return mark

    def resolve(self) -> None:
        since = time.perf_counter()
        self.cuda.synchronize()
        self.drained_s += time.perf_counter() - since

    def seconds(self, start: CudaMark, end: CudaMark) -> float:
        return start.event.elapsed_time(end.event) / 1e3

    def host_seconds(self, start: CudaMark, end: CudaMark) -> float:
        return end.host - start.host

    def host_cpu_seconds(self, start: CudaMark, end: CudaMark) -> float:
        """The thread's CPU time between the marks: the host's own launch work, without
        the time it waited (for the GIL held by a DataLoader's pin-memory thread, for the
        OS): both marks of a span are taken on the same thread (forward: the training
        thread; backward: autograd's device thread)."""
        return end.cpu - start.cpu

    def now(self) -> float:
        return time.perf_counter()

    def occupied(self, start: CudaMark, end: CudaMark) -> float:
        """The host's wall time from before the span's drain to its end mark."""
        return end.host - start.since


def clock_for(device: torch.device) -> Clock:
    return CudaEventClock() if device.type == "cuda" else CpuThreadClock()


def comm_clock_for(clock: Clock) -> Clock:
    """The clock for communication beside `clock`: wall time (a blocked thread uses no
    CPU time); on CUDA with the device drained at both ends (`SyncedWallClock`)."""
    return SyncedWallClock(clock.cuda) if isinstance(clock, CudaEventClock) else WallClock()
