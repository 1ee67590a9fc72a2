"""Time sources for profiling, chosen by device.

On GPU a mark is a recorded CUDA event: no synchronize per layer, one per profiled
iteration (`resolve`). On CPU a mark is the calling thread's CPU time: with one thread
per rank it is far less noisy than wall time on a shared machine (CV 0.03-0.07 vs up
to 1.0 measured here), and backward of CPU tensors runs on the caller's thread, so
autograd hooks see the same clock.
"""
from __future__ import annotations

import time
from typing import Any, Protocol

import torch

__all__ = ["Clock", "CpuThreadClock", "CudaEventClock", "WallClock", "clock_for"]


class Clock(Protocol):
    name: str

    def mark(self) -> Any: ...

    def resolve(self) -> None: ...

    def seconds(self, start: Any, end: Any) -> float: ...


class CpuThreadClock:
    """`time.thread_time()`: CPU seconds of this thread."""

    name = "cpu_thread_time"

    def mark(self) -> float:
        return time.thread_time()

    def resolve(self) -> None:
        pass

    def seconds(self, start: float, end: float) -> float:
        return end - start


class WallClock(CpuThreadClock):
    """Wall time: the only clock that sees a thread blocked in communication."""

    name = "wall"

    def mark(self) -> float:
        return time.perf_counter()


class CudaEventClock:
    """CUDA events on the current stream, read after one synchronize per iteration."""

    name = "cuda_event"

    def mark(self) -> "torch.cuda.Event":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def resolve(self) -> None:
        torch.cuda.synchronize()

    def seconds(self, start: "torch.cuda.Event", end: "torch.cuda.Event") -> float:
        return start.elapsed_time(end) / 1e3


def clock_for(device: torch.device) -> Clock:
    return CudaEventClock() if device.type == "cuda" else CpuThreadClock()
