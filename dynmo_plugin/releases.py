"""Hand released replicas back to the cluster, in the background, after the retirees left.

Only the leader (global rank 0, always a survivor) talks to the cluster API, and only
once every retiring rank has marked itself retired on torchrun's store (right before
it exits). The call runs in a thread: a slow or unreachable API server costs training
nothing (dynmo_plugin.cluster bounds its retries and never raises for API errors); its
outcome lands in the repack's report record when it arrives.
"""
from __future__ import annotations

import datetime
import logging
import math
import os
import threading

from dynmo_plugin.config import ClusterConfig

__all__ = ["Releases", "replicas", "mark_retired"]

logger = logging.getLogger(__name__)
RETIRED_KEY = "dynmo/retired/{generation}/{rank}"


def mark_retired(generation: int, rank: int, timeout_s: float) -> None:
    """A retiring rank's last word, on torchrun's store: the leader releases its replica
    only after every retiree said it (never raises: the leader then waits out its bound)."""
    from dynmo_plugin.consensus import agent_store
    try:
        agent_store(timeout_s).set(RETIRED_KEY.format(generation=generation, rank=rank), "1")
    except Exception as e:  # noqa: BLE001
        logger.warning("rank %d: could not mark itself retired on the store: %s", rank, e)


def replicas(ranks: int, per_replica: int) -> int:
    """Pods (or Job indexes) that `ranks` training ranks occupy: only whole ones can go."""
    return math.ceil(ranks / per_replica)


class Releases:
    """The leader's background cluster releases, one per repack."""

    def __init__(self, config: ClusterConfig, timeout_s: float):
        self.config, self.timeout_s = config, timeout_s
        self._threads: list[threading.Thread] = []

    def start(self, record: dict, result) -> None:
        """Release what `result` (a megatron.repack.RepackResult) freed; fills
        `record["cluster"]` (first "pending", then the outcome)."""
        per = self.config.ranks_per_replica or int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        keep = replicas(result.world_size_after, per)
        current = replicas(result.world_size_before, per)
        record["cluster"] = {"strategy": self.config.strategy, "outcome": "pending",
                             "replicas_before": current, "replicas_after": keep}
        reason = (f"dynmo repack {result.stages_before}->{result.stages_after} pipeline stages; "
                  f"ranks {result.ranks_released} released")
        thread = threading.Thread(target=self._release, name="dynmo-release", daemon=True,
                                  args=(record, result.generation, result.ranks_released,
                                        keep, current, reason))
        thread.start()
        self._threads.append(thread)

    def join(self) -> None:
        """Wait for the outstanding releases (each bounded by its own retries)."""
        for thread in self._threads:
            thread.join()

    def _release(self, record, generation, ranks, keep, current, reason) -> None:
        from dynmo_plugin.cluster import ReleaseRequest, release
        waited = self._wait_retired(generation, ranks)
        request = ReleaseRequest(keep=keep, current=current, released_ranks=tuple(ranks),
                                 reason=reason)
        try:
            outcome = release(self.config, request).to_dict()
        except Exception as e:  # noqa: BLE001 - a bug there must not kill training either
            logger.error("cluster release failed unexpectedly: %r", e)
            outcome = {"strategy": self.config.strategy, "outcome": "failed", "message": repr(e)}
        outcome["retirees_confirmed"] = waited
        record["cluster"] = outcome
        logger.info("cluster release (%s): %s", outcome.get("strategy"), outcome.get("outcome"))

    def _wait_retired(self, generation: int, ranks: list[int]) -> bool:
        from dynmo_plugin.consensus import agent_store
        keys = [RETIRED_KEY.format(generation=generation, rank=r) for r in ranks]
        try:
            agent_store(self.timeout_s).wait(keys, datetime.timedelta(seconds=self.timeout_s))
            return True
        except Exception as e:  # noqa: BLE001 - release anyway: the pods are idle or gone
            logger.warning("retiring ranks did not all confirm within %.0f s (%s); releasing "
                           "anyway", self.timeout_s, e)
            return False
