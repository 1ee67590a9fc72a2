"""A stand-in for Megatron's `config.timers` during a profiling window.

Megatron's schedules already call `config.timers('forward-compute', 2).start()/stop()`
and p2p calls `timers('forward-recv', 2)`; the tap answers those calls, forwarding
each to the user's own `Timers` (if any, so Megatron's timer log is unchanged) while
recording intervals with the profiler's clock: compute sections in the device clock
(CPU time / CUDA events, each interval opened with `clock.begin()`: on CUDA the queue is
drained first), communication in wall time (a blocked thread uses no CPU time). On CUDA
the wall clock drains the device at both ends of a communication interval
(`profiling.clock.SyncedWallClock`): `wait_s` is then the time the host is blocked by the
transfer itself once the compute queued before it has finished — neither ~0 (an
unbatched NCCL `wait()` does not block the host) nor compute folded in (a batched
exchange's synchronize waits for it). Outside a window `config.timers` is left exactly
as the user set it.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any

from dynmo_plugin.profiling.clock import Clock, comm_clock_for

__all__ = ["TimerTap", "COMPUTE_TIMERS", "is_p2p"]

COMPUTE_TIMERS = ("forward-compute", "backward-compute")


def is_p2p(name: str) -> bool:
    """A pipeline send or receive timer ('forward-recv', 'backward-send-forward-recv',
    ...): on CUDA its interval is the host blocked on the peer, a wait, not the step's
    own work."""
    return "recv" in name or "send" in name


class _TapTimer:
    """One timer name; `drains` collects the host seconds its own marks spent draining
    the device outside its interval (the start's, and the stop's where the interval is
    not a wait the profile subtracts whole: not a send or receive)."""

    def __init__(self, name: str, clock: Clock, inner, sink: list, drains: list):
        self.name, self._clock, self._inner, self._sink, self._drains = name, clock, inner, sink, drains
        self._start = None

    def start(self, barrier: bool = False) -> None:
        if self._inner is not None:
            self._inner.start(barrier=barrier)
        before = self._clock.drained_s
        self._start = self._clock.begin()
        self._drains.append(self._clock.drained_s - before)

    def stop(self, barrier: bool = False) -> None:
        before = self._clock.drained_s
        self._sink.append((self._start, self._clock.mark()))
        if not is_p2p(self.name):
            self._drains.append(self._clock.drained_s - before)
        if self._inner is not None:
            self._inner.stop(barrier=barrier)

    def elapsed(self, reset: bool = True, barrier: bool = False) -> float:
        return self._inner.elapsed(reset=reset, barrier=barrier) if self._inner is not None else 0.0

    def reset(self) -> None:
        if self._inner is not None:
            self._inner.reset()


class TimerTap:
    """Callable like `megatron.core.timers.Timers`; records what the schedule times."""

    def __init__(self, inner, clock: Clock):
        self.inner, self.clock, self.wall = inner, clock, comm_clock_for(clock)
        self._intervals: dict[str, list] = defaultdict(list)
        self._drains: list[float] = []
        self._timers: dict[str, _TapTimer] = {}

    def __call__(self, name: str, log_level: int | None = None) -> _TapTimer:
        if name not in self._timers:
            inner = self.inner(name, log_level=log_level) if self.inner is not None else None
            clock = self.clock if name in COMPUTE_TIMERS else self.wall
            self._timers[name] = _TapTimer(name, clock, inner, self._intervals[name], self._drains)
        return self._timers[name]

    def __getattr__(self, attr: str) -> Any:  # log(), write(), ... of the user's Timers
        if self.inner is None:
            raise AttributeError(attr)
        return getattr(self.inner, attr)

    def discard(self) -> None:
        """Forget what was timed since the last take (outside the steps a window times)."""
        for spans in self._intervals.values():
            spans.clear()
        self._drains.clear()

    def take_drains(self) -> float:
        """Host seconds the timers' own marks drained the device outside their
        intervals since the last call (0 on CPU): the step's time, not its rest."""
        seconds = sum(self._drains)
        self._drains.clear()
        return seconds

    def take_totals(self) -> dict[str, float]:
        """Seconds per timer name since the last call (call after clock.resolve())."""
        totals = {}
        for name, spans in self._intervals.items():
            clock = self._timers[name]._clock
            totals[name] = sum(clock.seconds(a, b) for a, b in spans)
            spans.clear()
        return totals

    def publish(self, values: dict[str, float], log_level: int = 2) -> None:
        """Show plugin measurements (e.g. 'dynmo/layer-07/fwd') in Megatron's timer log."""
        if self.inner is None:
            return
        for name, seconds in values.items():
            timer = self.inner(name, log_level=log_level)
            if hasattr(timer, "set_elapsed"):  # not a DummyTimer (above --timing-log-level)
                timer.set_elapsed(seconds)
