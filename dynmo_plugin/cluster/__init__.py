"""Releasing GPUs to the cluster scheduler after a repack onto fewer ranks.

    from dynmo_plugin.cluster import release, ReleaseRequest
    outcome = release(cfg.cluster, ReleaseRequest(keep=2, current=4, released_ranks=(8, ..., 15),
                                                  reason="repack 4->2 stages at iteration 40"))

Strategies (`cluster.strategy` in the YAML): none (log only), statefulset-scale,
job-parallelism, delete-pods, patch-pod-resources (rejected by real Kubernetes: 422;
the fallback runs). See docs/cluster.md. This wing imports neither torch nor megatron,
and `kubernetes` only inside the functions that call the API.
"""
from dynmo_plugin.cluster.release import STRATEGIES, release
from dynmo_plugin.cluster.request import OUTCOMES, ReleaseOutcome, ReleaseRequest, exit_status
from dynmo_plugin.cluster.target import Target, resolve_target

__all__ = ["release", "ReleaseRequest", "ReleaseOutcome", "STRATEGIES", "OUTCOMES", "exit_status",
           "Target", "resolve_target"]
