"""Python's cyclic garbage collector, held off while a profiling window measures.

A generation-2 collection walks every object the collector tracks, and the allocation
count decides which iteration it lands in, not the program. In grow_check's ranks
(configs/grow_check.yaml; about 420k tracked objects after the grow) one took 190-260 ms
of CPU, a third of an iteration. Inside a window it lands in whatever span or rest
of the step is running: profiled every 9 iterations, that run's window at iteration 18
measured one forward of layer 8 at 258.6 ms against about 10 ms for its other
micro-batches; in another run the stage's summed spans (`profiled_s`) read 529.6 ms on
one replica against 265.5 ms on the other (2026-11-28, this CPU). A layer's median
over its micro-batches hides one such span; a stage's sums, its extras over few
micro-batches and the rest of the step (one sample per window iteration) do not. The
window's own hooks and samples allocate too, which brings a collection closer.

So a window turns the collector off from its start to its close. What it would have
collected waits for the first collection after: outside the window, in an iteration
the run measures like any other (the prediction's `measured_s` is a median of those).
A collector already off (Megatron-LM's `--manual-gc`) stays off.
"""
from __future__ import annotations

import gc

__all__ = ["CollectorPause"]


class CollectorPause:
    """Turns the cyclic collector off now; `release()` turns it back on if it was on.
    Reference counting still frees everything not in a cycle: autograd graphs, and a
    migration's moved-away layers, retired DDP and old optimizer (checked with the
    collector off on a 2-rank `Ett|ttL -> Et|tttL` move: all freed before any collection)."""

    def __init__(self) -> None:
        self._resume = gc.isenabled()
        gc.disable()

    def release(self) -> None:
        """Idempotent: a cancelled window releases once, a closed one too."""
        if self._resume:
            self._resume = False
            gc.enable()
