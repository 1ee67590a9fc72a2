"""What a release asks for (`ReleaseRequest`) and what came of it (`ReleaseOutcome`).

Both are plain data: the training side builds a request after a repack, the release
returns an outcome that goes into the run report and the CLI's --json document as is.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ReleaseRequest", "ReleaseOutcome", "OUTCOMES", "exit_status"]

# released: the API accepted a change that frees the pods' GPUs.
# logged:   nothing was asked of the API (strategy none, or nothing left to release).
# rejected: the server answered no (4xx: 403, 404, 422, ...) to the strategy and to the
#           fallback, if one is configured; the answers are in `message`.
# failed:   the API could not be reached, or kept answering 409/429/5xx, within the retries.
OUTCOMES = ("released", "logged", "rejected", "failed")

# `dynmo cluster release` exit statuses (2 stays the CLI's bad-input status).
_EXIT = {"released": 0, "failed": 3, "rejected": 4, "logged": 5}


@dataclass(frozen=True)
class ReleaseRequest:
    """Release every replica above `keep` (pods of a StatefulSet, a Job's parallelism).

    keep: replicas to keep; survivors are always the lowest ordinals, and ordinal 0
        hosts the leader and the rendezvous store, so at least one stays.
    current: replicas before the release; 0: unknown (statefulset-scale and
        job-parallelism read the server's count, which wins anyway; the pod strategies
        need it to name the pods).
    released_ranks: global training ranks that retired, for the log, Event and annotation.
    reason: one line saying why, e.g. "repack 4->2 stages at iteration 40: ...".
    grace_period_s: delete-pods only: the pods' termination grace period; None keeps the
        pod's own. 0 force-deletes (only where no kubelet will ever confirm, as in tests).
    """

    keep: int
    current: int
    released_ranks: tuple[int, ...] = ()
    reason: str = ""
    grace_period_s: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.keep, bool) or not isinstance(self.keep, int) or self.keep < 1:
            raise ValueError(f"keep={self.keep!r}: must be an integer >= 1 (ordinal 0 hosts the "
                             "leader and the rendezvous store)")
        if isinstance(self.current, bool) or not isinstance(self.current, int) or self.current < 0:
            raise ValueError(f"current={self.current!r}: must be an integer >= 0")
        if self.grace_period_s is not None and self.grace_period_s < 0:
            raise ValueError(f"grace_period_s={self.grace_period_s!r}: must be >= 0 or None")
        object.__setattr__(self, "released_ranks", tuple(int(r) for r in self.released_ranks))


@dataclass
class ReleaseOutcome:
    """What happened, in the terms an operator reads: which strategy produced the final
    answer, every HTTP status seen (0: no connection), and the server's words for 4xx.

    recorded: {"event": ..., "annotation": ...}: what was written to the cluster about
        this release, or why not (a failure to record never changes `outcome`).
    """

    strategy: str
    outcome: str
    status_codes: list[int] = field(default_factory=list)
    attempts: int = 0
    message: str = ""
    fell_back_from: str | None = None
    replicas_before: int = 0
    replicas_after: int | None = None
    namespace: str = ""
    name: str = ""
    server_version: str | None = None
    released_ranks: tuple[int, ...] = ()
    elapsed_s: float = 0.0
    recorded: dict[str, str] = field(default_factory=dict)

    @property
    def released(self) -> bool:
        return self.outcome == "released"

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["released_ranks"] = list(self.released_ranks)
        out["elapsed_s"] = round(self.elapsed_s, 3)
        return out

    def __str__(self) -> str:
        via = f" (fell back from {self.fell_back_from})" if self.fell_back_from else ""
        after = "" if self.replicas_after is None else f" -> {self.replicas_after}"
        # replicas_before 0 with nothing after: the count was never known (no API answer)
        replicas = f" (replicas {self.replicas_before}{after})" if self.replicas_before or after else ""
        target = f" {self.namespace}/{self.name}" if self.namespace or self.name else ""
        return f"{self.strategy}{via}: {self.outcome}{target}{replicas}: {self.message}"


def exit_status(outcome: ReleaseOutcome) -> int:
    """The CLI's exit status: 0 released; 3 failed (API unreachable or busy); 4 rejected
    by the server; 5 only logged (strategy none: nothing was asked of the API)."""
    return _EXIT[outcome.outcome]
