"""`release(cfg, request)`: hand the retired ranks' GPUs back to the cluster, never raising.

Called on the leader rank after the retiring ranks have exited (the caller's
guarantee). The configured strategy runs first; if the server rejects it (a 4xx, e.g.
patch-pod-resources' 422), the fallback runs. An unreachable or overloaded API gives
outcome "failed" after the bounded retries: training goes on, the GPUs stay allocated
until the job ends, and the report says why. The Event and annotation are recorded
after any answer of the server (`record`), and their failures only reported.
"""
from __future__ import annotations

import logging
import time
from typing import Mapping

from dynmo_plugin.cluster.api import Api, Op, Rejected, Unreachable, connect
from dynmo_plugin.cluster.record import record
from dynmo_plugin.cluster.request import ReleaseOutcome, ReleaseRequest
from dynmo_plugin.cluster.strategies import STRATEGY_FUNCTIONS, Step, workload_ref
from dynmo_plugin.cluster.target import Target, resolve_target

__all__ = ["release", "STRATEGIES"]

log = logging.getLogger(__name__)

STRATEGIES = ("none", *STRATEGY_FUNCTIONS)


def release(cfg, request: ReleaseRequest, *, env: Mapping[str, str] | None = None) -> ReleaseOutcome:
    """Release the replicas above `request.keep` as `cfg` (a config.ClusterConfig) says.

    Never raises for configuration, API or network problems: the outcome says what
    happened. env: where POD_NAME/POD_NAMESPACE are read (default os.environ).

    Raises:
        ValueError: `cfg.strategy` or `cfg.fallback` is not a strategy (a caller's bug;
            ClusterConfig validates them).
    """
    for key in ("strategy", "fallback"):
        if getattr(cfg, key) not in STRATEGIES:
            raise ValueError(f"cluster.{key}={getattr(cfg, key)!r}: expected one of {', '.join(STRATEGIES)}")
    start = time.monotonic()
    target = resolve_target(cfg.namespace, cfg.name, env)
    out = ReleaseOutcome(strategy=cfg.strategy, outcome="logged", replicas_before=request.current,
                         namespace=target.namespace, name=target.name,
                         released_ranks=request.released_ranks)
    if request.current and request.keep >= request.current:
        out.message = (f"keep={request.keep} >= current={request.current}: nothing to release"
                       + (" (the freed ranks fill no whole replica)" if request.released_ranks else ""))
    elif cfg.strategy == "none":
        out.message = "strategy none: released ranks only logged; no Kubernetes API call"
    elif target.problem:
        out.outcome, out.message = "failed", f"cannot tell what to release: {target.problem}"
    else:
        _release_through_api(cfg, request, target, out)
    out.elapsed_s = time.monotonic() - start
    level = logging.INFO if out.outcome in ("released", "logged") else logging.WARNING
    ranks = f"ranks {list(request.released_ranks)}: " if request.released_ranks else ""
    log.log(level, "cluster release: %s%s", ranks, out)
    return out


def _release_through_api(cfg, request: ReleaseRequest, target: Target, out: ReleaseOutcome) -> None:
    """Connect, run the strategy (and its fallback), record; fills `out` in place."""
    try:
        client = connect(cfg.kubeconfig)
    except Exception as e:  # ConfigException, OSError, YAML/JSON errors: no usable config
        out.outcome = "failed"
        out.message = f"no usable Kubernetes configuration ({cfg.kubeconfig or 'in-cluster/$KUBECONFIG'}): {e}"
        return
    api = Api(client, retries=cfg.retries, backoff_s=cfg.backoff_s, timeout_s=cfg.timeout_s)
    try:
        out.server_version = _server_version(api)
        step = _run(api, cfg, request, target, out)
        out.outcome, out.message = step.outcome, step.message
        out.replicas_before, out.replicas_after = step.replicas_before, step.replicas_after
        summary = {"strategy": out.strategy, "outcome": out.outcome, "message": out.message,
                   "reason": request.reason, "released_ranks": request.released_ranks,
                   "fell_back_from": out.fell_back_from, "replicas_before": out.replicas_before,
                   "replicas_after": out.replicas_after}
        out.recorded = record(api, step.record_on or workload_ref(out.strategy, target), summary)
    except Unreachable as e:
        out.outcome, out.message = "failed", f"Kubernetes API unusable: {e}"
        out.recorded = dict.fromkeys(("event", "annotation"), "skipped: the API did not answer")
    except Exception as e:  # an answer the client cannot read: still no reason to stop training
        log.exception("cluster release: unexpected error")
        out.outcome = "failed"
        out.message = f"unexpected error reading the Kubernetes API's answer: {type(e).__name__}: {e}"
        out.recorded = dict.fromkeys(("event", "annotation"), "skipped: unexpected error")
    finally:
        out.status_codes, out.attempts = list(api.status_codes), api.attempts
        client.close()


def _run(api: Api, cfg, request: ReleaseRequest, target: Target, out: ReleaseOutcome) -> Step:
    """The strategy, then the fallback if the server rejected the first; sets
    out.strategy and out.fell_back_from to say which produced the final step. Fallback
    none means no fallback: the rejection is the outcome."""
    step = _attempt(cfg.strategy, api, target, request)
    if step.outcome != "rejected" or cfg.fallback in ("none", cfg.strategy):
        return step
    first = step.message
    out.fell_back_from, out.strategy = cfg.strategy, cfg.fallback
    log.warning("cluster release: %s rejected (%s); falling back to %s", cfg.strategy, first, cfg.fallback)
    step = _attempt(cfg.fallback, api, target, request)
    step.message = f"{cfg.strategy} rejected: {first}; fallback {cfg.fallback}: {step.message}"
    return step


def _attempt(strategy: str, api: Api, target: Target, request: ReleaseRequest) -> Step:
    try:
        return STRATEGY_FUNCTIONS[strategy](api, target, request)
    except Rejected as e:
        return Step("rejected", str(e), request.current, None, workload_ref(strategy, target))


def _server_version(api: Api) -> str | None:
    """The server's version ("v1.20.2"), for the outcome and messages; None if the
    credentials may not read it (the release does not depend on it)."""
    from kubernetes import client

    try:
        info = api.call(Op("get", "/version", "", "server version"), client.VersionApi(api.client).get_code)
    except Rejected:
        return None
    return str(info.git_version)
