"""Fault injection for migration — TEST-ONLY, a named fake.

Some failures cannot be produced on demand (a receiver crashing mid-migration, bits
flipped on the wire). A `FaultInjector` passed explicitly to the migrator produces
them at a chosen point so tests can prove that every rank then keeps the old layout.
Nothing in the product creates one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["FaultInjector", "InjectedFault", "FAULT_KINDS"]

FAULT_KINDS = ("receiver_exception", "corrupt_buffer")


class InjectedFault(RuntimeError):
    """Raised by a FaultInjector; never by real code."""


@dataclass
class FaultInjector:
    kind: str              # one of FAULT_KINDS
    stage: int             # the receiving stage that fails
    migration_index: int = 0  # which migration of the run (0 = the first)
    _seen: int = 0

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ValueError(f"fault kind must be one of {FAULT_KINDS}, got {self.kind!r}")

    def on_received(self, stage: int, received: dict[int, list[torch.Tensor]]) -> None:
        """Called on every rank after its buffers arrived, before verification."""
        armed = self._seen == self.migration_index
        self._seen += 1
        if not armed or stage != self.stage or not received:
            return
        if self.kind == "receiver_exception":
            raise InjectedFault(f"injected receiver failure on stage {stage}")
        first = next(iter(received.values()))[0]
        first.view(torch.uint8)[0] ^= 0xFF  # flip one byte on the wire
