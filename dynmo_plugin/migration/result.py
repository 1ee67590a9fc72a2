"""What one migration did (or why it was abandoned), for the report."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

__all__ = ["MigrationResult", "MigrationError"]


class MigrationError(RuntimeError):
    """A migration failed on some rank; every rank kept the old layout."""


@dataclass
class MigrationResult:
    applied: bool
    layout_before: str
    layout_after: str          # == layout_before when not applied
    moves: list[dict] = field(default_factory=list)  # layer, src, dst, bytes
    bytes_moved: int = 0
    transfer_s: float = 0.0    # batched p2p after the header all-gather (max over ranks)
    total_s: float = 0.0       # pack + exchange + verify + commit (max over ranks)
    error: Optional[str] = None
    phase_s: dict[str, float] = field(default_factory=dict)  # seconds per phase (max over ranks)
    peak_extra_bytes: int = 0  # most memory held beside the old state before commit (max over ranks)
    peak_source: str = ""      # "measured" (CUDA allocator) or "accounted" (sum of new allocations)
    staging_pool_bytes: int = 0  # receive buffers kept for the next migration (max over ranks)

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return self.bytes_moved / self.transfer_s if self.transfer_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {**asdict(self), "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s}
