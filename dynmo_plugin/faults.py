"""Fault and noise injection — TEST-ONLY, named fakes.

Some failures cannot be produced on demand: a receiver crashing mid-migration, bits
flipped on the wire, memory running out while old and new state coexist, a peer that
hangs or dies in a given phase, TP/DP ranks whose timings differ. The objects here
produce them at a chosen point so tests can prove what the plugin then does. They are
passed explicitly (`run(..., fault=...)`); nothing in the product creates one.
"""
from __future__ import annotations

import os
import random
import signal
import threading
import time
from dataclasses import dataclass

import torch

__all__ = ["FaultInjector", "InjectedFault", "FAULT_KINDS", "ProfileNoise"]

# receiver_exception / corrupt_buffer: after buffers arrived; prepare_exception: after
# the new DDP buffers were allocated (as an out-of-memory there would); restore_exception:
# after the new optimizer exists; hang / exit: on entering `phase`; allocation_exception:
# on ONE rank (data-parallel rank 0 of `stage`) right after it allocated the buffers of
# `phase` ("pack": the gathered optimizer state, "staging": the receive buffers), as an
# out-of-memory there would: its peers must not be left waiting in a collective;
# calibration_exception: in a scenario's cost calibration on `stage`
# (dynamism.base.Scenario.inject_fault).
FAULT_KINDS = ("receiver_exception", "corrupt_buffer", "prepare_exception", "restore_exception",
               "hang", "exit", "allocation_exception", "calibration_exception")


class InjectedFault(RuntimeError):
    """Raised by a FaultInjector; never by real code."""


@dataclass
class FaultInjector:
    kind: str              # one of FAULT_KINDS
    stage: int             # the pipeline stage whose ranks fail
    migration_index: int = 0  # which migration of the run (0 = the first)
    phase: str = "transfer"   # hang / exit: the migration phase that triggers them
    _seen: int = 0

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"fault kind must be one of {FAULT_KINDS}, got {self.kind!r}")

    def begin_migration(self) -> None:
        self._armed = self._seen == self.migration_index
        self._seen += 1

    def _fires(self, stage: int, kind: str) -> bool:
        return getattr(self, "_armed", False) and stage == self.stage and self.kind == kind

    def on_phase(self, phase: str, stage: int) -> None:
        """Called by the migrator on entering each phase."""
        if not getattr(self, "_armed", False) or stage != self.stage or phase != self.phase:
            return
        if self.kind == "hang":
            # torchrun's agent ends this process once the others exit, with a SIGTERM: the
            # session's handler would only note it (the rank never reaches an iteration
            # boundary) and the agent kill it 30 s later; SIGTERM's default ends it at once
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
            time.sleep(10**6)
        if self.kind == "exit":
            os._exit(17)

    def on_received(self, stage: int, received: dict[int, list[torch.Tensor]]) -> None:
        """Called on every rank after its buffers arrived, before verification."""
        if not received:
            return
        if self._fires(stage, "receiver_exception"):
            raise InjectedFault(f"injected receiver failure on stage {stage}")
        if self._fires(stage, "corrupt_buffer"):
            first = next(iter(received.values()))[0]
            first.view(torch.uint8)[0] ^= 0xFF  # flip one byte on the wire

    def on_allocated(self, phase: str, stage: int, dp_rank: int) -> None:
        """Called after a migration phase allocated its buffers, before any collective."""
        if self._fires(stage, "allocation_exception") and phase == self.phase and dp_rank == 0:
            raise InjectedFault(f"injected out-of-memory allocating the {phase} buffers on "
                                f"stage {stage}, data-parallel rank 0")

    def on_prepared(self, stage: int) -> None:
        if self._fires(stage, "prepare_exception"):
            raise InjectedFault(f"injected out-of-memory while building new buffers on stage {stage}")

    def on_calibration(self, phase: str, stage: int) -> None:
        """Called by a scenario's cost calibration on every rank that calibrates."""
        if self.kind == "calibration_exception" and stage == self.stage:
            raise InjectedFault(f"injected failure in {phase} on stage {stage}")

    def on_restored(self, stage: int) -> None:
        if self._fires(stage, "restore_exception"):
            raise InjectedFault(f"injected failure restoring optimizer state on stage {stage}")


@dataclass
class ProfileNoise:
    """Multiplies every local layer and extras timing by (1 + sigma * N(0, 1)), drawn
    per rank and per window: what TP and DP ranks timing the same stage look like."""

    sigma: float
    seed: int = 0
    _windows: int = 0

    def perturb(self, profile, rank: int):
        rng = random.Random(hash((self.seed, rank, self._windows)))
        self._windows += 1
        factor = lambda: max(0.0, 1.0 + self.sigma * rng.gauss(0.0, 1.0))  # noqa: E731
        for x in profile.layers:
            x.fwd_s *= factor()
            x.bwd_s *= factor()
        for s in profile.stages:
            s.extra_s *= factor()
        return profile
